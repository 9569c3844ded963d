"""Grad-Dot, Grad-Cos and TracIn: raw-gradient inner products.

A row scores ``<g_i^(k), g_j^(k)>`` at the row's checkpoint (or optimizer
step) ``k``; ``AttributionScore.agnostic_matrix()`` sums the rows of a sample
with unit weights (no learning-rate weighting), so one checkpoint is Grad-Dot
and several are the TracIn checkpoint ensemble. ``normalized_grad=True``
(Grad-Cos) divides by ``‖g_i‖·‖g_j‖ + 1e-8`` using whole-model norms over the
layers both sides share.

Tied weights (a shared embedding and output head) are scored per use site:
each hooked module contributes its own term and the cross-site terms are
dropped.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.gradient.ops.dot import grad_norm_sq
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.utils.cache import TensorCache

COSINE_EPS = 1e-8


class TracInAttributor(BaseInnerProductAttributor):
    """Grad-Dot / TracIn (``algorithm="TracIn"``) and Grad-Cos (``"GradCos"``).

    Identity transforms; needs raw gradients only. The instance's
    ``algorithm`` becomes ``"GradCos"`` for a call with ``normalized_grad=True``.
    """

    algorithm: ClassVar[str] = "TracIn"
    checkpoint_ensemble: ClassVar[bool] = True  # top_k_from_cache over per-checkpoint stores

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)
        self.normalized_grad = False
        self._norm_cache: weakref.WeakKeyDictionary[Gradient, tuple[tuple[str, ...], Any]] = (
            weakref.WeakKeyDictionary()
        )

    def _set_normalized(self, normalized_grad: bool) -> None:
        """Switch between Grad-Dot/TracIn and Grad-Cos for the coming call."""
        self.normalized_grad = bool(normalized_grad)
        self.algorithm = "GradCos" if self.normalized_grad else "TracIn"
        self._norm_cache = weakref.WeakKeyDictionary()

    @keywords()
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        enable_update: bool = False,
        gradient_cache_residency: str | None = None,
        attribution_granularity: str = "instance",
        normalized_grad: bool = False,
    ) -> AttributionScore:
        """Live Grad-Dot/TracIn (or Grad-Cos) scores (see ``BaseInnerProductAttributor``)."""
        self._set_normalized(normalized_grad)
        return super().attribute(
            train_dataset,
            test_dataset,
            hook_config=hook_config,
            verbose=verbose,
            loop_over_test=loop_over_test,
            enable_update=enable_update,
            gradient_cache_residency=gradient_cache_residency,
            attribution_granularity=attribution_granularity,
            normalized_grad=self.normalized_grad,
        )

    @keywords()
    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        algorithm_meta: dict[str, Any] | None = None,
        attribution_granularity: str = "instance",
        normalized_grad: bool = False,
    ) -> AttributionScore:
        """Grad-Dot/TracIn (or Grad-Cos) scores from gradient stores; no model needed."""
        self._set_normalized(normalized_grad)
        return super().attribute_from_cache(
            train_source,
            test_source,
            selected_training_steps=selected_training_steps,
            layer_name=layer_name,
            verbose=verbose,
            loop_over_test=loop_over_test,
            algorithm_meta=algorithm_meta,
            attribution_granularity=attribution_granularity,
            normalized_grad=self.normalized_grad,
        )

    # ------------------------------------------------------------------ Grad-Cos
    def _sample_norms(self, rep: Gradient, layers: tuple[str, ...]) -> torch.Tensor:
        """Whole-model per-sample norms ``(B,)`` of ``rep`` over ``layers`` (cached per rep)."""
        cached = self._norm_cache.get(rep)
        if cached is not None and cached[0] == layers:
            return cached[1]
        batch = rep.batch_size
        total = None
        for name in layers:
            sq = grad_norm_sq(rep.data[name], rep.layer_types[name]).reshape(-1)
            sq = sq.expand(batch) if sq.numel() == 1 else sq
            total = sq if total is None else total + sq
        norms = total.sqrt()
        self._norm_cache[rep] = (layers, norms)
        return norms

    def _cosine_denominator(self, train_rep: Gradient, test_rep: Gradient) -> torch.Tensor:
        """``‖g_i‖·‖g_j‖ + 1e-8`` as ``(B_tr, B_te)``."""
        layers = tuple(sorted(set(train_rep.layer_names) & set(test_rep.layer_names)))
        train_norms = self._sample_norms(train_rep, layers)
        test_norms = self._sample_norms(test_rep, layers).to(train_norms.device)
        return torch.outer(train_norms, test_norms) + COSINE_EPS

    def inner_product(
        self, train_rep: Gradient, test_rep: Gradient, *, dense_cache: TensorCache | None = None
    ) -> torch.Tensor:
        """``(B_tr, B_te)`` dot products, divided by the norms for Grad-Cos."""
        scores = super().inner_product(train_rep, test_rep, dense_cache=dense_cache)
        if not self.normalized_grad or not set(train_rep.layer_names) & set(test_rep.layer_names):
            return scores
        return scores / self._cosine_denominator(train_rep, test_rep).to(scores)

    def inner_product_per_token(self, train_rep: Gradient, test_rep: Gradient) -> torch.Tensor:
        """``(B_tr, T, B_te)`` per-token contributions; Grad-Cos uses whole-sample norms."""
        scores = super().inner_product_per_token(train_rep, test_rep)
        if not self.normalized_grad or not set(train_rep.layer_names) & set(test_rep.layer_names):
            return scores
        return scores / self._cosine_denominator(train_rep, test_rep).to(scores).unsqueeze(1)

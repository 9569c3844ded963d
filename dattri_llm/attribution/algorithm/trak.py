"""TRAK: projected gradients of the model output, ``(ΦᵀΦ + λI)⁻¹`` kernel, checkpoint ensemble.

TRAK (Park et al., 2023, "TRAK: Attributing Model Behavior at Scale") scores a
training sample ``i`` against a query ``j`` at one checkpoint as

    ``τ(i, j) = (1 − p_i) · φ_iᵀ (ΦᵀΦ + λI)⁻¹ φ_j``,

where ``φ = P ∇f`` is the (randomly projected, as captured) gradient of the
output function ``f`` — the margin ``log(p / (1 − p))`` of the correct label
or token — ``Φ`` stacks the training rows and ``1 − p_i`` is the training
sample's residual weight (the ``Q`` of the paper). Scores over ``K``
checkpoints (or independently trained models) are averaged.

The kernel is computed per hooked layer (block-diagonal over layers, as in
:class:`~dattri_llm.attribution.algorithm.lorif.LoRIFAttributor`, whose exact
full-rank preconditioner this reuses: ``(ΦᵀΦ + λI)⁻¹ = (ΦᵀΦ/N + λ/N·I)⁻¹ / N``).
With the training set sharded over ranks, ``ΦᵀΦ``, ``‖Φ‖_F²`` and ``N`` are
summed over the ranks (LoRIF's fit), so every rank builds the whole kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.lorif import LoRIFAttributor, LoRIFLayerFit
from dattri_llm.task import OutputFunc, margin_and_weights
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.attribution.scoring import ScoreResult
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource

__all__ = ["TRAKAttributor"]


class TRAKAttributor(LoRIFAttributor):
    """TRAK (``algorithm="TRAK"``): margin gradients, ``(ΦᵀΦ + λI)⁻¹``, ``1 − p`` weights.

    Gradients are captured of ``−Σ_i f_i`` (the task's ``loss_func`` and
    ``target_func`` are replaced by the output function); projection is the
    capture's (``HookManagerConfig(projection_kwargs=...)``). The ``1 − p_i``
    weights come from the same training forward. Rows of the returned score
    are per checkpoint, each already divided by ``K``: ``agnostic_matrix()``
    is the ensemble mean ``(num_train, num_test)``.

    Args:
        args: the run settings.
        task: the :class:`AttributionTask` (model and checkpoints; its
            objectives are not used).
        damping: ``λ`` added to ``ΦᵀΦ`` (a float ``> 0``); ``None`` =
            ``0.1 × ‖Φ‖_F² / D`` per layer.
        output_func: ``(model, batch) -> (f (B,), 1 − p (B,))``; default
            :func:`~dattri_llm.task.margin_and_weights` (classifiers and HF
            causal LMs, ``labels`` in the batch; per-token margins summed, the
            weight the mean of the tokens' ``1 − p``).

    Raises:
        ValueError: ``damping <= 0``; ``output_func`` not callable.
    """

    algorithm: ClassVar[str] = "TRAK"

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        damping: float | None = None,
        output_func: OutputFunc | None = None,
    ) -> None:
        super().__init__(args, task=task, rank=None, svd_rank=None, damping=damping)
        if output_func is not None and not callable(output_func):
            raise ValueError(
                f"TRAKAttributor: output_func must be callable (model, batch) -> (f, 1 - p), "
                f"got {type(output_func).__name__}; omit it to use margin_and_weights."
            )
        self.output_func: OutputFunc = output_func or margin_and_weights
        self._last_weights: torch.Tensor | None = None
        self._row_weights: list[torch.Tensor] = []
        self._ensemble_size = 1

    # ------------------------------------------------------------------ objectives
    def train_loss_fn(self) -> Callable[[nn.Module, object], torch.Tensor]:
        """``−Σ_i f_i`` of a batch; remembers the batch's ``1 − p_i`` ``(B,)``."""

        def loss(model: nn.Module, batch: object) -> torch.Tensor:
            margins, weights = self.output_func(model, batch)
            self._last_weights = weights.detach().reshape(-1).to("cpu", torch.float64)
            return -margins.sum()

        return loss

    def test_loss_fn(self) -> Callable[[nn.Module, object], torch.Tensor]:
        """``−Σ_j f_j`` of a query batch (the sign cancels against the training side)."""
        return lambda model, batch: -self.output_func(model, batch)[0].sum()

    # ------------------------------------------------------------------ kernel
    def layer_damping(self, fit: LoRIFLayerFit) -> float:
        """LoRIF's ``λ'`` for ``ΦᵀΦ/N + λ'I``: ``λ/N`` (default ``0.1 × ‖Φ‖_F²/(N·D)``)."""
        if self.damping is not None:
            return self.damping / fit.rows
        return super().layer_damping(fit)

    def precondition(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """``(ΦᵀΦ + λI)⁻¹ φ_j`` of ``(B, D)`` query rows (exact, full rank)."""
        return super().precondition(name, rows) / self.layer_fits[name].rows

    def transform_train_step(self, step: int, block: Gradient) -> Gradient:
        """Record the block's ``1 − p_i`` (from its forward) for the scoring rows."""
        weights = self._last_weights
        if weights is None or weights.numel() != block.batch_size:
            raise ValueError(
                "TRAKAttributor: no 1 - p weights for a training block of "
                f"{block.batch_size} rows; TRAK scores live gradients only (the weights come "
                "from the training forward) — use attribute(...) without a gradient store."
            )
        self._row_weights.append(weights)
        self._last_weights = None
        return block

    def score_sources(
        self,
        train_source: GradientSource,
        test_source: GradientSource,
        **options: Any,
    ) -> ScoreResult:
        """One checkpoint's rows ``φ_iᵀ(ΦᵀΦ+λI)⁻¹φ_j`` times ``(1 − p_i) / K``."""
        if getattr(self, "_score_sink", None) is not None:
            raise ValueError("TRAKAttributor does not support top_k; use attribute(...).")
        self._row_weights, self._last_weights = [], None
        scores, *rest = super().score_sources(train_source, test_source, **options)
        weights = torch.cat(self._row_weights) if self._row_weights else torch.zeros(0)
        row_tokens = rest[3]
        # A row's sample: rows are sample-major, and token rows restart at position 0 per
        # sample (a batch's token count may differ from another's).
        if row_tokens is None:
            sample_of_row = torch.arange(scores.shape[0])
        else:
            sample_of_row = torch.tensor([t == 0 for t in row_tokens], dtype=torch.long)
            sample_of_row = sample_of_row.cumsum(0) - 1
        samples = int(sample_of_row[-1]) + 1 if scores.shape[0] else 0
        if samples != weights.numel():
            raise ValueError(
                f"TRAKAttributor: score rows of {samples} training samples for "
                f"{weights.numel()} 1 - p weights; the weights and rows are out of step."
            )
        per_row = weights[sample_of_row] if scores.shape[0] else weights
        scores = scores * (per_row / self._ensemble_size).to(scores)[:, None]
        return (scores, *rest)

    # ------------------------------------------------------------------ entry points
    @keywords()
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: Any = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        gradient_cache_residency: str | None = None,
        attribution_granularity: str = "instance",
    ) -> AttributionScore:
        """TRAK scores over every task checkpoint (ensemble mean via ``agnostic_matrix()``).

        Raises:
            ValueError: ``gradient_cache_residency`` given (the ``1 − p``
                weights need the live training forward).
        """
        if gradient_cache_residency is not None:
            raise ValueError(
                "TRAKAttributor scores live gradients only (the 1 - p weights come from the "
                "training forward); pass gradient_cache_residency=None."
            )
        self._ensemble_size = self.num_checkpoints()
        try:
            return super().attribute(
                train_dataset,
                test_dataset,
                hook_config=hook_config,
                verbose=verbose,
                loop_over_test=loop_over_test,
                attribution_granularity=attribution_granularity,
            )
        finally:
            self._ensemble_size = 1

    def cache(self, train_dataset: object, test_dataset: object, **cache_kwargs: Any) -> Any:
        """Refused (``ValueError``): stores would hold no ``1 − p`` weights."""
        raise ValueError(
            "TRAKAttributor does not write gradient stores: TRAK's 1 - p weights come from the "
            "live training forward; use attribute(train_dataset, test_dataset)."
        )

    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        **attribution_kwargs: Any,
    ) -> AttributionScore:
        """Refused: stores hold no ``1 − p`` weights (``ValueError``); use :meth:`attribute`."""
        raise ValueError(
            "TRAKAttributor cannot score from gradient stores: they hold no 1 - p weights; "
            "use attribute(train_dataset, test_dataset) with the task's model."
        )

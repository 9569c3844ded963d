"""DataInf: closed-form per-layer inverse curvature for LoRA-style fine-tuning.

Per layer ``ℓ``, with ``g_i`` the per-sample gradient rows of the ``n`` training
rows (as stored, projected if captured so) and ``G = (1/n) Σ_i g_i g_iᵀ``, the
damped inverse ``(G + λI)⁻¹`` is replaced by the average of the rank-one
inverses (the order of inversion and averaging swapped, Kwon et al. 2024,
"DataInf: Efficiently Estimating Data Influence in LoRA-tuned LLMs and
Diffusion Models"), each inverted in closed form by Sherman–Morrison::

    H̃⁻¹ = (1/(nλ)) Σ_i (I − g_i g_iᵀ / (λ + ‖g_i‖²))

A query ``q`` is preconditioned once, ``q̃ = H̃⁻¹ q``, in one pass over the
training rows; a training row then scores ``Σ_ℓ g_iᵀ q̃_ℓ``. Sign: positive =
helpful, as Grad-Dot (``polarity = +1``; the paper's influence is the negative
of this score). The approximation is exact when ``n = 1``.

``λ`` per layer defaults to ``0.1 × ‖G‖_F² / (n·D)`` (0.1 × the mean squared
entry of the training rows, i.e. 0.1 × the mean eigenvalue of ``G``: the
paper's default), or a fixed ``damping``. With the training set sharded over
ranks (a sharded ``attribute``), the damping sums and each query block's
correction and ``n`` are summed over the ranks (``sum_over_shards``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.blocks import layer_rows, per_sample_layers
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource

__all__ = [
    "DataInfAttributor",
    "datainf_correction",
    "datainf_finish",
    "datainf_precondition",
]

DEFAULT_RELATIVE_DAMPING = 0.1


def datainf_precondition(
    train_rows: Iterable[torch.Tensor], query: torch.Tensor, damping: float
) -> torch.Tensor:
    """``H̃⁻¹ q`` for ``(B_te, D)`` query rows, streaming ``(B, D)`` training row blocks.

    ``H̃⁻¹ = (1/(nλ)) Σ_i (I − g_i g_iᵀ/(λ + ‖g_i‖²))`` over all ``n`` rows the
    blocks yield; accumulated in float64 and returned in ``query``'s dtype.

    Raises:
        ValueError: no training rows; ``damping <= 0``; a width other than ``D``.
    """
    correction, n = datainf_correction(train_rows, query, damping)
    return datainf_finish(query, correction, n, damping)


def datainf_correction(
    train_rows: Iterable[torch.Tensor], query: torch.Tensor, damping: float
) -> tuple[torch.Tensor, int]:
    """``(Σ_i g_i g_iᵀ q / (λ + ‖g_i‖²)`` ``(B_te, D)`` float64, ``n)`` over the blocks' rows.

    The sums :func:`datainf_precondition` needs; sums over disjoint blocks add up
    (the ranks' shards are summed before :func:`datainf_finish`).

    Raises:
        ValueError: ``damping <= 0``; a width other than ``D``.
    """
    if not damping > 0:
        raise ValueError(f"datainf_precondition: damping must be > 0, got {damping!r}.")
    q = query.to(torch.float64)
    correction = torch.zeros_like(q)
    n = 0
    for rows in train_rows:
        g = rows.to(device=q.device, dtype=torch.float64)
        if g.shape[1] != q.shape[1]:
            raise ValueError(
                f"datainf_precondition: training rows have {g.shape[1]} entries, queries "
                f"{q.shape[1]}; score stores captured with the same projection."
            )
        coeff = (g @ q.T) / (damping + g.square().sum(1, keepdim=True))  # (B, B_te)
        correction += coeff.T @ g
        n += g.shape[0]
    return correction, n


def datainf_finish(
    query: torch.Tensor, correction: torch.Tensor, n: int, damping: float
) -> torch.Tensor:
    """``(n·q − correction) / (n·λ)`` in ``query``'s dtype (``ValueError`` when ``n = 0``)."""
    if n == 0:
        raise ValueError("datainf_precondition: the training source yielded no rows.")
    q = query.to(torch.float64)
    return ((n * q - correction.to(q)) / (n * damping)).to(query.dtype)


def _check_damping(damping: object) -> float | None:
    """``None`` (the paper's relative default) or a finite float ``> 0``."""
    if damping is None:
        return None
    if isinstance(damping, bool) or not isinstance(damping, (int, float)):
        raise TypeError(f"DataInfAttributor: damping must be a float > 0 or None, got {damping!r}.")
    if not math.isfinite(damping) or damping <= 0:
        raise ValueError(
            f"DataInfAttributor: damping must be finite and > 0, got {damping!r}; pass None "
            "for 0.1 × the layer's mean squared gradient entry."
        )
    return float(damping)


class DataInfAttributor(BaseInnerProductAttributor):
    """DataInf (``algorithm="DataInf"``): per-layer closed-form inverse, positive = helpful.

    Scoring needs a reusable training source (a store, or a frozen probe): one
    pass for the default damping, then one pass per held test block to
    precondition its queries (``per_device_eval_batch_size`` queries per pass),
    then the scoring pass; ``loop_over_test=True`` is refused. Training layers
    are materialized per batch as dense ``(B, D)`` rows, so the method suits
    small (LoRA, projected) layers.

    Args:
        args: the run settings.
        task: the :class:`AttributionTask` (``None`` for cache-only use).
        damping: ``λ`` for every layer; ``None`` = 0.1 × the layer's
            ``‖G‖_F²/(n·D)``.

    Attributes:
        layer_damping: ``{layer: λ}`` of the last scoring pass.
    """

    algorithm: ClassVar[str] = "DataInf"

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        damping: float | None = None,
    ) -> None:
        super().__init__(args, task=task)
        self.damping = _check_damping(damping)
        self.layer_damping: dict[str, float] = {}
        self._train_source: GradientSource | None = None

    def checkpoints(self) -> list[int]:
        """``[0]``: a curvature method uses one checkpoint (``UserWarning`` if more)."""
        return self._first_checkpoint_only()

    def _train_rows(self, name: str) -> Iterable[torch.Tensor]:
        """Layer ``name``'s ``(B, D)`` rows of every training block (one pass)."""
        for _step, block, _ids in self._train_source:
            if name in per_sample_layers(block):
                yield layer_rows(self.transform_train_rep(block), name)

    def prepare_scoring(self, train_source: GradientSource, test_source: GradientSource) -> None:
        """Keep the training source and fix each layer's ``λ`` (one pass when relative)."""
        if not getattr(train_source, "reusable", False):
            raise ValueError(
                f"DataInfAttributor needs several passes over the training gradients but the "
                f"train source {type(train_source).__name__} is not reusable; score from a "
                "store (attribute_from_cache, or attribute(gradient_cache_residency='memory'))."
            )
        self._train_source = train_source
        local: dict[str, tuple[list[torch.Tensor], int]] = {}  # layer -> ([Σ_i g_i² (D,)], rows)
        for _step, block, _ids in train_source:
            for name in per_sample_layers(block):
                rows = layer_rows(block, name).double()
                if name not in local:
                    local[name] = ([torch.zeros(rows.shape[1], dtype=torch.float64)], 0)
                (column_sq,), count = local[name]
                column_sq += rows.square().sum(0).to(column_sq.device)
                local[name] = ([column_sq], count + rows.shape[0])
            if self.damping is not None:
                break  # only the layer names are needed
        sums = self.sum_over_shards(local, "DataInf damping sums")
        if not sums:
            raise ValueError("DataInfAttributor: the training source yielded no per-sample layer.")
        self.layer_damping = {}
        for name, ((column_sq,), rows) in sums.items():
            if self.damping is not None:
                self.layer_damping[name] = self.damping
                continue
            total, width = float(column_sq.sum()), column_sq.shape[0]
            if not total > 0:
                raise ValueError(
                    f"DataInfAttributor: layer {name!r} has all-zero training gradients; its "
                    "default damping is 0. Exclude it with layer_name or pass damping."
                )
            self.layer_damping[name] = DEFAULT_RELATIVE_DAMPING * total / (rows * width)

    def score_sources(
        self,
        train_source: GradientSource,
        test_source: GradientSource,
        *,
        loop_over_test: bool = False,
        transform_test: Callable[[Gradient], Gradient] | None = None,
        attribution_granularity: str = "instance",
    ) -> tuple:
        """The base scoring pass; ``loop_over_test`` is refused (a training pass per batch)."""
        if loop_over_test:
            raise ValueError(
                "DataInfAttributor preconditions each test block with a pass over the training "
                "gradients; loop_over_test=True would repeat it for every training batch. Use "
                "loop_over_test=False (the test side is held, preconditioned once)."
            )
        return super().score_sources(
            train_source,
            test_source,
            loop_over_test=loop_over_test,
            transform_test=transform_test,
            attribution_granularity=attribution_granularity,
        )

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """Queries preconditioned per training layer, ``H̃⁻¹ q`` as dense ``(B, D)`` rows."""
        layers = [name for name in per_sample_layers(block) if name in self.layer_damping]
        if not layers:
            return block
        return block.select_layers(layers).map_layers(
            lambda name, _value, _type: self._precondition(name, layer_rows(block, name))
        )

    def _precondition(self, name: str, query: torch.Tensor) -> torch.Tensor:
        """``H̃⁻¹ q`` of layer ``name``'s ``(B, D)`` query rows: one pass, summed over the shards."""
        damping = self.layer_damping[name]
        correction, n = datainf_correction(self._train_rows(name), query, damping)
        [(correction,), n] = self.sum_over_shards({name: ([correction], n)}, "DataInf sums")[name]
        return datainf_finish(query, correction, n, damping)

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
    ) -> AttributionScore:
        """DataInf scores from gradient stores (no model needed); ``damping`` recorded in meta."""
        return super().attribute_from_cache(
            train_source,
            test_source,
            selected_training_steps=selected_training_steps,
            layer_name=layer_name,
            verbose=verbose,
            loop_over_test=loop_over_test,
            algorithm_meta={**(algorithm_meta or {}), "damping": self.damping},
            attribution_granularity=attribution_granularity,
        )

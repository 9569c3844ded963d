"""Running dense empirical Fisher ``Σ g gᵀ`` over batches: per layer, and over ``Gradient`` blocks.

Factorized layers are materialized first; layers wider than ``max_params``
coordinates are skipped without materializing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dattri_llm.gradient.ops.kronecker_rows import floor_dtype
from dattri_llm.gradient.ops.layer_sums import (
    accumulator_layer_type,
    all_reduce_layer_accumulators,
)
from dattri_llm.gradient.ops.materialize import (
    materialize,
    materialize_factors,
    materialized_width_estimate,
)
from dattri_llm.gradient.ops.types import is_embedding

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dattri_llm.gradient.model.records import Factorized, GradientBlock

Tensor = torch.Tensor


@dataclass
class LayerFisherAccumulator:
    """Running dense empirical Fisher ``Σ g gᵀ`` of one layer over samples."""

    __module__ = "dattri_llm.gradient.ops.kronecker"  # public path, re-exported there

    total: Tensor | None = field(default=None, init=False)
    count: int = field(default=0, init=False)

    def update(
        self,
        a: Tensor,
        g: Tensor,
        layer_type: str,
        module_kwargs: dict | None = None,
        include_bias: bool = True,
    ) -> None:
        """Add the materialized per-sample gradients of one batch of factors.

        ``layer_type`` is a canonical type or its short alias (``"linear"``,
        ``"layernorm"``; see ``types.LAYER_TYPE_ALIASES``).

        Raises:
            ValueError: unknown ``layer_type`` (the message lists the accepted
                names); an embedding without ``module_kwargs["num_embeddings"]``.
            KeyError: ``module_kwargs`` without ``"has_bias"``.
        """
        fn = "LayerFisherAccumulator.update"
        layer_type = accumulator_layer_type(layer_type, module_kwargs, fn)
        if is_embedding(layer_type) and "num_embeddings" not in (module_kwargs or {}):
            raise ValueError(
                f"{fn}({layer_type}): an embedding needs module_kwargs['num_embeddings'] (the "
                "vocabulary size) to lay out its gradient; pass "
                "ops.extract_module_kwargs(module, layer_type)."
            )
        self.update_from_grad(materialize_factors(a, g, layer_type, module_kwargs, include_bias))

    def update_from_grad(self, grad: Tensor) -> None:
        """Add dense per-sample gradients ``(B, d)``."""
        m = grad.reshape(grad.shape[0], -1)
        m = m.to(floor_dtype(m))
        outer = m.T @ m
        if self.total is None:
            self.total = outer
        elif outer.shape != self.total.shape:
            raise ValueError(
                f"LayerFisherAccumulator: gradients of width {m.shape[1]} do not match the "
                f"accumulated {tuple(self.total.shape)} Fisher; feed one layer only."
            )
        else:
            self.total += outer.to(self.total)
        self.count += m.shape[0]

    def _require(self, what: str) -> None:
        if self.total is None:
            raise RuntimeError(f"LayerFisherAccumulator.{what}: nothing accumulated.")

    def partial_sums(self) -> tuple[list[Tensor], int] | None:
        """``([Σ g gᵀ], samples)``, or ``None`` before the first update."""
        return None if self.total is None else ([self.total], self.count)

    def load_sums(self, sums: list[Tensor], count: int) -> None:
        """Replace the sum by ``[Σ g gᵀ]`` over ``count`` samples (e.g. reduced ones)."""
        (self.total,), self.count = sums, int(count)

    def all_reduce(self) -> None:
        """Sum the Fisher sum and sample count across ranks (every rank must call it).

        A rank with nothing accumulated contributes zeros and receives the
        others' sum; ``RuntimeError`` (on every rank) when no rank has any.
        """
        if not all_reduce_layer_accumulators({"layer": self}, LayerFisherAccumulator):
            self._require("all_reduce")

    def result(self) -> Tensor:
        """``F = Σ g gᵀ / n`` ``(d, d)``."""
        self._require("result")
        return self.total / self.count

    def reset(self) -> None:
        """Drop the accumulated sum."""
        self.total, self.count = None, 0


class FisherAccumulator:
    """Per-layer dense empirical Fisher over :class:`Gradient` blocks.

    Layers wider than ``max_params`` coordinates are dropped and recorded in
    :attr:`skipped`.
    """

    __module__ = "dattri_llm.gradient.ops.kronecker"  # public path, re-exported there

    def __init__(self, max_params: int | None = None) -> None:
        """Start empty; ``max_params=None`` keeps every layer."""
        self.max_params = max_params
        self.layers: dict[str, LayerFisherAccumulator] = {}
        self._skipped: dict[str, int] = {}

    @property
    def skipped(self) -> dict[str, int]:
        """``{layer: param_count}`` of the layers dropped for exceeding ``max_params``."""
        return dict(self._skipped)

    def update(self, gradient: GradientBlock, layers: Iterable[str]) -> None:
        """Accumulate the named layers of a block (dense as ``(B, P)``, factorized materialized).

        Absent layers are skipped. A factorized layer's type may be a short alias
        (``"linear"``); a dense layer's label is not used.

        Raises:
            ValueError: a factorized layer of unknown type (the message lists the
                accepted names).
            KeyError: a factorized layer whose ``module_kwargs`` lack ``"has_bias"``.
        """
        for name in layers:
            if name not in gradient.data or name in self._skipped:
                continue
            value = gradient.data[name]
            layer_type = gradient.layer_types[name]
            if not isinstance(value, torch.Tensor):
                layer_type = accumulator_layer_type(
                    layer_type, value.module_kwargs, f"FisherAccumulator.update[{name!r}]"
                )
            width = _dense_width(value, layer_type)
            if self.max_params is not None and width > self.max_params:
                self._skipped[name] = width
                self.layers.pop(name, None)
                continue
            if isinstance(value, torch.Tensor):
                rows = value.sum(dim=1) if gradient.indexing.get(name) == "batch_token" else value
            else:
                rows = materialize(value, layer_type)
            self.layers.setdefault(name, LayerFisherAccumulator()).update_from_grad(rows)

    def all_reduce(self) -> None:
        """Sum every layer's Fisher across ranks on the union of their layers (every rank calls it).

        See :func:`all_reduce_layer_accumulators`.
        """
        all_reduce_layer_accumulators(self.layers, LayerFisherAccumulator)

    def result(self) -> dict[str, Tensor]:
        """``{layer: F}`` ``(P, P)``."""
        return {name: acc.result() for name, acc in self.layers.items()}


def _dense_width(value: Factorized | Tensor, layer_type: str) -> int:
    """Per-sample coordinate count of a layer payload without materializing it."""
    if isinstance(value, torch.Tensor):
        return int(value[0].numel()) if value.dim() == 2 else int(value.shape[-1])
    return int(materialized_width_estimate(value, layer_type))

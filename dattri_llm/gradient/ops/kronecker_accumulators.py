"""Running K-FAC covariance sums ``Σ a aᵀ``, ``Σ g gᵀ`` over batches, per layer and per block.

The token rows are those of :func:`kronecker_rows.kfac_rows`; the sums are
accumulated on and below the diagonal in Gram panels and read back symmetric.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dattri_llm.gradient.ops.kronecker_rows import GramRows, floor_dtype, gram_rows
from dattri_llm.gradient.ops.layer_sums import (
    accumulator_layer_type,
    all_reduce_layer_accumulators,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dattri_llm.gradient.model.records import GradientBlock

Tensor = torch.Tensor


# Gram panels: row panels of this many columns; a (d, d) sum with d above it is
# accumulated on and below the diagonal only (about half the FLOPs of a full GEMM).
GRAM_PANEL = 128


def add_gram_lower_(total: Tensor, rows: Tensor, alpha: float = 1.0) -> None:
    """``total += alpha·rowsᵀ·rows`` on and below the diagonal panels, in place.

    ``rows`` is ``(N, d)``, ``total`` ``(d, d)`` (a view is fine). Row panel
    ``i`` gets columns ``0 … end_i`` only, so entries above the diagonal panels
    are left stale: read the sum with :func:`symmetric_from_lower`.
    """
    rows = rows.to(total)
    width = rows.shape[1]
    for start in range(0, width, GRAM_PANEL):
        end = min(start + GRAM_PANEL, width)
        total[start:end, :end].addmm_(rows[:, start:end].T, rows[:, :end], alpha=alpha)


def _add_rows_to_sums_(a_sum: Tensor, g_sum: Tensor, rows: GramRows) -> None:
    """Add a batch's kept rows to the lower-triangle sums ``Σ a aᵀ`` ``(K', K')``, ``Σ g gᵀ``.

    With a ones column the body ``[:K, :K]`` gets the Gram of the ``K``
    activation columns and the last row ``[Σ aᵀ, N]`` (no ``(N, K+1)`` copy, no
    odd-width GEMM); dropped rows are subtracted.
    """
    k = rows.a.shape[1]
    add_gram_lower_(a_sum[:k, :k], rows.a)
    add_gram_lower_(g_sum, rows.g)
    if rows.dropped is not None:
        add_gram_lower_(a_sum[:k, :k], rows.dropped, alpha=-1.0)
    if rows.ones_column:
        column_sum = rows.a.sum(0, dtype=a_sum.dtype)
        if rows.dropped is not None:
            column_sum -= rows.dropped.sum(0, dtype=a_sum.dtype)
        a_sum[k, :k] += column_sum
        a_sum[k, k] += rows.kept


def symmetric_from_lower(total: Tensor) -> Tensor:
    """The symmetric matrix whose lower triangle is ``total``'s (a new tensor)."""
    return torch.tril(total) + torch.tril(total, -1).T


@dataclass
class LayerKroneckerAccumulator:
    """Running K-FAC covariance sums ``Σ a aᵀ``, ``Σ g gᵀ`` of one layer over token rows."""

    __module__ = "dattri_llm.gradient.ops.kronecker"  # public path, re-exported there

    a_sum: Tensor | None = field(default=None, init=False)
    g_sum: Tensor | None = field(default=None, init=False)
    rows: int = field(default=0, init=False)

    def update(
        self,
        a: Tensor,
        g: Tensor,
        layer_type: str,
        module_kwargs: dict | None = None,
        include_bias: bool = True,
    ) -> None:
        """Add one batch's kept token rows (rules of :func:`kfac_factors`; none kept → no-op).

        ``layer_type`` is a canonical type or its short alias (``"linear"``,
        ``"conv2d"``; see ``types.LAYER_TYPE_ALIASES``).

        Raises:
            ValueError: unknown ``layer_type`` (the message lists the accepted names).
            NotImplementedError: a norm or embedding type (no Kronecker factorization).
            KeyError: ``module_kwargs`` without ``"has_bias"``.
        """
        layer_type = accumulator_layer_type(
            layer_type, module_kwargs, "LayerKroneckerAccumulator.update"
        )
        rows = gram_rows(a, g, layer_type, module_kwargs, include_bias)
        if rows.kept == 0:
            return
        k, d = rows.a.shape[1] + rows.ones_column, rows.g.shape[1]
        if self.a_sum is None:
            dtype = floor_dtype(rows.a, rows.g)
            self.a_sum = rows.a.new_zeros(k, k, dtype=dtype)
            self.g_sum = rows.g.new_zeros(d, d, dtype=dtype)
        else:
            self._check_widths(k, d, layer_type)
        _add_rows_to_sums_(self.a_sum, self.g_sum, rows)
        self.rows += rows.kept

    def _check_widths(self, k: int, d: int, layer_type: str) -> None:
        """``ValueError`` unless a batch of widths ``(K, D)`` fits the accumulated sums."""
        if (k, k) != tuple(self.a_sum.shape) or (d, d) != tuple(self.g_sum.shape):
            raise ValueError(
                f"LayerKroneckerAccumulator({layer_type}): batch covariances "
                f"{(k, k)}/{(d, d)} differ from the accumulated "
                f"{tuple(self.a_sum.shape)}/{tuple(self.g_sum.shape)}; feed one layer only."
            )

    def _require(self, what: str) -> None:
        if self.a_sum is None:
            raise RuntimeError(
                f"LayerKroneckerAccumulator.{what}: nothing accumulated; call update() with at "
                "least one gradient-carrying row first."
            )

    def partial_sums(self) -> tuple[list[Tensor], int] | None:
        """``([Σ a aᵀ, Σ g gᵀ], rows)``, or ``None`` before the first kept row."""
        if self.a_sum is None:
            return None
        return [symmetric_from_lower(self.a_sum), symmetric_from_lower(self.g_sum)], self.rows

    def load_sums(self, sums: list[Tensor], count: int) -> None:
        """Replace the sums by ``[Σ a aᵀ, Σ g gᵀ]`` over ``count`` rows (e.g. reduced ones)."""
        (self.a_sum, self.g_sum), self.rows = sums, int(count)

    def all_reduce(self) -> None:
        """Sum the covariance sums and row count across ranks (every rank must call it).

        A rank with nothing accumulated contributes zeros and receives the
        others' sums; ``RuntimeError`` (on every rank) when no rank has any.
        """
        if not all_reduce_layer_accumulators({"layer": self}, LayerKroneckerAccumulator):
            self._require("all_reduce")

    def result(self, *, consume: bool = False) -> tuple[Tensor, Tensor]:
        """``(A, G)`` = sums / row count (new tensors); ``consume=True`` also resets."""
        self._require("result")
        a, g = symmetric_from_lower(self.a_sum), symmetric_from_lower(self.g_sum)
        a, g = a.div_(self.rows), g.div_(self.rows)
        if consume:
            self.reset()
        return a, g

    def reset(self) -> None:
        """Drop the accumulated sums."""
        self.a_sum, self.g_sum, self.rows = None, None, 0


@dataclass
class KroneckerAccumulator:
    """Per-layer K-FAC covariances over :class:`Gradient` blocks."""

    __module__ = "dattri_llm.gradient.ops.kronecker"  # public path, re-exported there

    layers: dict[str, LayerKroneckerAccumulator] = field(default_factory=dict, init=False)

    def update(self, gradient: GradientBlock, layers: Iterable[str]) -> None:
        """Accumulate the named layers of a block (types as in ``LayerKroneckerAccumulator``).

        Raises:
            KeyError: a named layer is not in the block.
            TypeError: a named layer is materialized (K-FAC needs its factors).
        """
        for name in layers:
            if name not in gradient.data:
                raise KeyError(
                    f"KroneckerAccumulator.update: layer {name!r} is not in the gradient block "
                    f"(layers: {sorted(gradient.data)}); pass only layers the block holds."
                )
            value = gradient.data[name]
            if isinstance(value, torch.Tensor):
                raise TypeError(
                    f"KroneckerAccumulator: layer {name!r} is materialized {tuple(value.shape)}; "
                    "K-FAC covariances need its factors — capture it with "
                    "capture_style='factorized' or supply covariances recorded at capture "
                    "(KroneckerCovarianceCallback)."
                )
            f = value.as_batch_first()
            acc = self.layers.setdefault(name, LayerKroneckerAccumulator())
            acc.update(
                f.activation, f.pre_activation_grad, gradient.layer_types[name], f.module_kwargs
            )

    def all_reduce(self) -> None:
        """Sum every layer across ranks on the union of the ranks' layers (every rank calls it).

        See :func:`all_reduce_layer_accumulators`: a layer this rank never saw is
        added with the global sums.
        """
        all_reduce_layer_accumulators(self.layers, LayerKroneckerAccumulator)

    def result(self, *, consume: bool = False) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer: (A, G)}`` of the layers with at least one kept row."""
        return {
            name: acc.result(consume=consume)
            for name, acc in self.layers.items()
            if acc.a_sum is not None
        }

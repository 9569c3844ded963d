"""Token rows of a K-FAC layer, shared by the K-FAC kernels and the covariance accumulator.

The preprocessed factors (``preprocess.py``) are flattened to token rows
``a'`` ``(N, K)`` and ``g'`` ``(N, D)``; the linear family drops rows whose
``g'`` is exactly zero (padding tokens), conv and conv-transpose keep every
patch row. Curvature work runs in the compute dtype, at least float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.preprocess import check_layer_type, preprocess_factors, to_3d
from dattri_llm.gradient.ops.types import (
    is_conv,
    is_conv_transpose,
    is_embedding,
    is_kfac_eligible,
    is_linear,
    is_norm,
)

Tensor = torch.Tensor


def floor_dtype(*tensors: Tensor | None) -> torch.dtype:
    """Compute dtype of curvature work: the policy's dtype, at least float32."""
    return dtypes.resolve(*tensors, minimum=torch.float32)


def check_kfac_type(layer_type: str, fn: str) -> None:
    """``NotImplementedError`` for norm/embedding types, ``ValueError`` for unknown ones."""
    if is_norm(layer_type) or is_embedding(layer_type):
        raise NotImplementedError(
            f"{fn}: layer type {layer_type!r} has no Kronecker factorization (K-FAC covers "
            "linear, conv and conv-transpose layers); use the dense Fisher (fim) instead."
        )
    check_layer_type(layer_type)
    if not is_kfac_eligible(layer_type):
        raise ValueError(
            f"{fn}: layer type must be one of the K-FAC eligible types (linear, conv, "
            f"conv-transpose), got {layer_type!r}."
        )


def _keeps_zero_rows(layer_type: str) -> bool:
    """Conv and conv-transpose keep zero-gradient patch rows; the linear family drops them."""
    return is_conv(layer_type) or is_conv_transpose(layer_type)


def preprocessed_3d(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    module_kwargs: dict | None,
    include_bias: bool,
) -> tuple[Tensor, Tensor]:
    """Preprocessed factors as ``(B, S, K)``, ``(B, S, D)`` in the curvature dtype."""
    a, g = preprocess_factors(a, g, layer_type, module_kwargs, include_bias)
    a, g = to_3d(a), to_3d(g)
    a = a.reshape(a.shape[0], -1, a.shape[-1])
    g = g.reshape(g.shape[0], -1, g.shape[-1])
    if a.shape[:2] != g.shape[:2]:
        raise ValueError(
            f"{layer_type}: preprocessed factors a {tuple(a.shape)} and g {tuple(g.shape)} "
            "disagree on the batch/token axes; capture both factors of the same layer."
        )
    dtype = floor_dtype(a, g)
    return a.to(dtype), g.to(dtype)


def kfac_rows(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
) -> tuple[Tensor, Tensor]:
    """Token rows ``(N, K)``, ``(N, D)`` the K-FAC covariances are built from.

    Preprocesses, flattens every position into a row and (linear family) drops
    rows whose ``g`` is exactly zero. ``N`` may be 0.
    """
    check_kfac_type(layer_type, "kfac_factors")
    a, g = preprocessed_3d(a, g, layer_type, module_kwargs, include_bias)
    a_rows, g_rows = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    if not _keeps_zero_rows(layer_type):
        # any nonzero (NaN included) per row; |g|.amax is several times faster than .any()
        kept = g_rows.abs().amax(dim=1) != 0  # rows are copied only when one is dropped
        if not bool(kept.all()):
            a_rows, g_rows = a_rows[kept], g_rows[kept]
    return a_rows, g_rows


def has_ones_column(layer_type: str, module_kwargs: dict | None, include_bias: bool) -> bool:
    """Whether preprocessing appends a ones (bias) column to ``a`` (linear and conv with a bias)."""
    return (
        include_bias
        and module_kwargs is not None
        and bool(module_kwargs.get("has_bias", False))
        and (is_linear(layer_type) or is_conv(layer_type))
    )


# Dropped rows are subtracted from the Gram sum of all rows while they are at most this
# share of the batch; above it they are masked out (a copy of the kept rows).
_SUBTRACT_DROPPED_SHARE = 0.25


@dataclass(frozen=True)
class GramRows:
    """One batch's rows for the K-FAC sums, without copies on the common path.

    ``a`` ``(N, K)`` and ``g`` ``(N, D)`` hold every token row; ``a`` lacks the
    ones column when ``ones_column``. ``dropped`` (few, all-finite ``a`` rows of
    exactly zero ``g``) are to be subtracted from ``Σ a aᵀ``; their ``g`` rows add
    nothing to ``Σ g gᵀ``. ``kept`` is ``N`` minus the dropped count.
    """

    a: Tensor
    g: Tensor
    ones_column: bool
    dropped: Tensor | None
    kept: int


def gram_rows(
    a: Tensor, g: Tensor, layer_type: str, module_kwargs: dict | None, include_bias: bool
) -> GramRows:
    """The rows :func:`kfac_rows` selects, for accumulation (see :class:`GramRows`)."""
    check_kfac_type(layer_type, "kfac_factors")
    ones_column = has_ones_column(layer_type, module_kwargs, include_bias)
    a, g = preprocessed_3d(a, g, layer_type, module_kwargs, include_bias and not ones_column)
    a_rows, g_rows = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    n = a_rows.shape[0]
    if _keeps_zero_rows(layer_type) or n == 0:
        return GramRows(a_rows, g_rows, ones_column, None, n)
    kept = g_rows.abs().amax(dim=1) != 0
    n_kept = int(kept.sum())
    if n_kept == n:
        return GramRows(a_rows, g_rows, ones_column, None, n)
    dropped = a_rows[~kept]
    if n - n_kept <= _SUBTRACT_DROPPED_SHARE * n and bool(torch.isfinite(dropped).all()):
        return GramRows(a_rows, g_rows, ones_column, dropped, n_kept)
    return GramRows(a_rows[kept], g_rows[kept], ones_column, None, n_kept)

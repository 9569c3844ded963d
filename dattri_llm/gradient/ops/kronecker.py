"""Kronecker-factored (K-FAC / EK-FAC) and dense Fisher kernels.

For a K-FAC-eligible layer (linear, conv, conv-transpose) the preprocessed
factors (``preprocess.py``) give token rows ``a'_s : (K,)`` and ``g'_s : (D,)``
whose per-sample gradient is ``dW_i = Σ_s g'_is a'_isᵀ``. K-FAC approximates the
layer's Fisher by ``A ⊗ G`` with the token-row covariances ``A = Σ a'a'ᵀ / N``
and ``G = Σ g'g'ᵀ / N``; ``A⁻¹`` acts on the activation index of ``dW`` and
``G⁻¹`` on the output-gradient index (``G⁻¹·dW·A⁻¹`` in the ``(D, K)`` layout of
linear/conv, ``A⁻¹·dW·G⁻¹`` in the ``(K, D)`` layout of conv-transpose).

Grouped convolutions fold the groups into the token axis with ``g'`` zero
outside the group's output channels (see ``preprocess.py``), so ``A`` mixes the
patches of every group and ``G`` is block-diagonal over groups: K-FAC of a
grouped conv is the shared-``A`` / block-diagonal-``G`` approximation.

Rows whose ``g'`` is exactly zero (padding tokens) are dropped for the linear
family; conv and conv-transpose keep every patch row. Covariances and
eigendecompositions run in at least float32; ``sym_inverse`` / ``dense_inverse``
return float32 and, as in the reference design, never refuse a singular matrix
(``check_damped_curvature`` is the check for callers that must).

The accumulators take a canonical layer type or its short alias (``"linear"``,
``"conv2d"``; ``types.LAYER_TYPE_ALIASES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.dot import cross_gram
from dattri_llm.gradient.ops.materialize import materialize, materialize_factors
from dattri_llm.gradient.ops.preprocess import check_layer_type, preprocess_factors, to_3d
from dattri_llm.gradient.ops.types import (
    is_conv,
    is_conv_transpose,
    is_embedding,
    is_kfac_eligible,
    is_linear,
    is_norm,
    resolve_layer_type,
)
from dattri_llm.utils.distributed import all_reduce_named_sums

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from dattri_llm.gradient.gradient import Factorized, Gradient

Tensor = torch.Tensor


# --------------------------------------------------------------------------- helpers


def _floor_dtype(*tensors: Tensor | None) -> torch.dtype:
    """Compute dtype of curvature work: the policy's dtype, at least float32."""
    return dtypes.resolve(*tensors, minimum=torch.float32)


def _check_kfac_type(layer_type: str, fn: str) -> None:
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


def _preprocessed_3d(
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
    dtype = _floor_dtype(a, g)
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
    _check_kfac_type(layer_type, "kfac_factors")
    a, g = _preprocessed_3d(a, g, layer_type, module_kwargs, include_bias)
    a_rows, g_rows = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    if not _keeps_zero_rows(layer_type):
        # any nonzero (NaN included) per row; |g|.amax is several times faster than .any()
        kept = g_rows.abs().amax(dim=1) != 0  # rows are copied only when one is dropped
        if not bool(kept.all()):
            a_rows, g_rows = a_rows[kept], g_rows[kept]
    return a_rows, g_rows


def _has_ones_column(layer_type: str, module_kwargs: dict | None, include_bias: bool) -> bool:
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
class _GramRows:
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


def _gram_rows(
    a: Tensor, g: Tensor, layer_type: str, module_kwargs: dict | None, include_bias: bool
) -> _GramRows:
    """The rows :func:`kfac_rows` selects, for accumulation (see :class:`_GramRows`)."""
    _check_kfac_type(layer_type, "kfac_factors")
    ones_column = _has_ones_column(layer_type, module_kwargs, include_bias)
    a, g = _preprocessed_3d(a, g, layer_type, module_kwargs, include_bias and not ones_column)
    a_rows, g_rows = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    n = a_rows.shape[0]
    if _keeps_zero_rows(layer_type) or n == 0:
        return _GramRows(a_rows, g_rows, ones_column, None, n)
    kept = g_rows.abs().amax(dim=1) != 0
    n_kept = int(kept.sum())
    if n_kept == n:
        return _GramRows(a_rows, g_rows, ones_column, None, n)
    dropped = a_rows[~kept]
    if n - n_kept <= _SUBTRACT_DROPPED_SHARE * n and bool(torch.isfinite(dropped).all()):
        return _GramRows(a_rows, g_rows, ones_column, dropped, n_kept)
    return _GramRows(a_rows[kept], g_rows[kept], ones_column, None, n_kept)


def kfac_factors(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
) -> tuple[Tensor, Tensor]:
    """K-FAC covariances ``A = a_fᵀa_f / N`` ``(K, K)`` and ``G = g_fᵀg_f / N`` ``(D, D)``.

    Rows as :func:`kfac_rows`. Norm/embedding → ``NotImplementedError``; no row
    left → ``ValueError``.
    """
    a_rows, g_rows = kfac_rows(a, g, layer_type, module_kwargs, include_bias)
    n = a_rows.shape[0]
    if n == 0:
        raise ValueError(
            f"kfac_factors({layer_type}): no token row carries a gradient (a {tuple(a.shape)}, "
            f"g {tuple(g.shape)}: every g row is zero); pass a batch with non-padding tokens."
        )
    return a_rows.T @ a_rows / n, g_rows.T @ g_rows / n


def kfac(f: Factorized, layer_type: str, include_bias: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`kfac_factors` of a ``Factorized``."""
    f = f.as_batch_first()
    return kfac_factors(
        f.activation, f.pre_activation_grad, layer_type, f.module_kwargs, include_bias
    )


def fim_factors(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
) -> Tensor:
    """Dense empirical Fisher ``MᵀM / B`` ``(d, d)`` of the materialized gradients ``M``."""
    m = materialize_factors(a, g, layer_type, module_kwargs, include_bias)
    m = m.to(_floor_dtype(m))
    return m.T @ m / m.shape[0]


def fim(f: Factorized, layer_type: str, include_bias: bool = True) -> Tensor:
    """:func:`fim_factors` of a ``Factorized``."""
    f = f.as_batch_first()
    return fim_factors(
        f.activation, f.pre_activation_grad, layer_type, f.module_kwargs, include_bias
    )


# --------------------------------------------------------------------------- damping / inverses


def mean_eigenvalue(matrix: Tensor) -> float:
    """Mean eigenvalue ``trace / size`` of a square matrix."""
    return float(torch.diagonal(matrix).sum()) / matrix.shape[-1]


def damping_for(matrix: Tensor, damping: float, relative: bool = False) -> float:
    """Absolute damping: ``damping``, or ``damping · mean_eigenvalue(matrix)`` if ``relative``."""
    return damping * mean_eigenvalue(matrix) if relative else float(damping)


def _check_square(matrix: Tensor, fn: str) -> None:
    """``ValueError`` unless ``matrix`` is a square 2-D matrix."""
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{fn}: expected a square (d, d) matrix, got {tuple(matrix.shape)}.")


def check_damped_curvature(matrix: Tensor, damping: float, fn: str) -> None:
    """``ValueError`` unless ``matrix + damping·I`` is symmetric positive definite.

    For callers of :func:`sym_inverse` / :func:`dense_inverse`, which never raise
    on a singular matrix. Fails on a non-finite damped eigenvalue of the
    symmetrised matrix, on one ≤ 0, or (``damping=0``) on one ≤ ``size·eps·max|s|``
    (round-off level counts as zero).
    """
    _check_square(matrix, fn)
    m = matrix.to(_floor_dtype(matrix))
    damped = torch.linalg.eigvalsh((m + m.T) / 2) + damping
    size = m.shape[0]
    if not size:
        return
    tol = 0.0
    if damping == 0:
        tol = size * torch.finfo(damped.dtype).eps * float(damped.abs().max())
    smallest = float(damped.min())
    if not bool(torch.isfinite(damped).all()) or smallest <= tol:
        raise ValueError(
            f"{fn}: the ({size}, {size}) curvature matrix is singular or not positive definite "
            f"(smallest damped eigenvalue {smallest:.3e} with damping={damping}); use "
            "damping > 0 (or relative_damping=True) or fit on more data."
        )


def sym_inverse(matrix: Tensor, damping: float = 0.0) -> Tensor:
    """``(M + damping·I)⁻¹`` as ``(V / (λ + damping)) @ Vᵀ`` from ``eigh(M.float())``, float32.

    ``eigh`` reads the lower triangle only. No clamping and no error: a zero
    damped eigenvalue gives ``±inf``/``nan`` entries; negative damping is
    accepted. Check with :func:`check_damped_curvature` first where a singular
    matrix is an error.

    Raises:
        ValueError: ``matrix`` is not a square 2-D matrix.
    """
    _check_square(matrix, "sym_inverse")
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix.float())
    return (eigenvectors / (eigenvalues + damping)) @ eigenvectors.T


def dense_inverse(matrix: Tensor, damping: float = 0.0) -> Tensor:
    """``(M + damping·I)⁻¹`` as ``cholesky_inverse(cholesky(M.float() + damping·I))``, float32.

    Any ``RuntimeError`` of the Cholesky path (``torch.linalg.LinAlgError`` for a
    matrix that is not positive definite included) falls back to
    :func:`sym_inverse`, so a singular matrix gives its non-finite result, no error.

    Raises:
        ValueError: ``matrix`` is not a square 2-D matrix.
    """
    _check_square(matrix, "dense_inverse")
    m = matrix.float()
    m = m + damping * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    try:
        return torch.cholesky_inverse(torch.linalg.cholesky(m))
    except RuntimeError:
        return sym_inverse(matrix, damping)


def checked_spd_inverse(matrix: Tensor, damping: float, fn: str) -> Tensor:
    """``(M + damping·I)⁻¹`` float32, refusing a damped matrix that is not positive definite.

    With ``damping > 0`` a Cholesky factorisation both checks and inverts (a
    fraction of an ``eigh``); when it fails, or undamped, :func:`check_damped_curvature`
    decides (``ValueError`` naming ``fn``) and :func:`sym_inverse` inverts.
    """
    _check_square(matrix, fn)
    if damping > 0:
        m = matrix.float()
        shifted = m + damping * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
        factor, info = torch.linalg.cholesky_ex(shifted)
        if not int(info) and bool(torch.isfinite(factor).all()):
            return torch.cholesky_inverse(factor)
    check_damped_curvature(matrix, damping, fn)
    return sym_inverse(matrix, damping)


# --------------------------------------------------------------------------- K-FAC


def _check_inverse_widths(
    a: Tensor,
    g: Tensor,
    a_inv: Tensor,
    g_inv: Tensor,
    layer_type: str,
    fn: str,
    ones_column: bool = False,
) -> None:
    """``ValueError`` unless ``A⁻¹`` is ``(K, K)`` and ``G⁻¹`` is ``(D, D)`` for these factors.

    ``ones_column``: ``a`` lacks the bias column, so ``K`` is its width plus one.
    """
    k, d = a.shape[-1] + ones_column, g.shape[-1]
    if tuple(a_inv.shape) != (k, k) or tuple(g_inv.shape) != (d, d):
        raise ValueError(
            f"{fn}({layer_type}): preprocessed factors have widths K={k} (activation) and "
            f"D={d} (output gradient) but A_inv is {tuple(a_inv.shape)} and G_inv is "
            f"{tuple(g_inv.shape)}; the covariances were fit for another layer, projection "
            "or include_bias setting — refit them on this capture."
        )


def kfac_precondition_factors(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    a_inv: Tensor,
    g_inv: Tensor,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
) -> tuple[Tensor, Tensor]:
    """Whitened final factors ``(a'·A⁻¹, g'·G⁻¹)`` ``(B, S, K)``, ``(B, S, D)``."""
    _check_kfac_type(layer_type, "kfac_precondition")
    a, g = _preprocessed_3d(a, g, layer_type, module_kwargs, include_bias)
    _check_inverse_widths(a, g, a_inv, g_inv, layer_type, "kfac_precondition")
    return a @ a_inv.to(a), g @ g_inv.to(g)


def kfac_precondition(
    f: Factorized, layer_type: str, A_inv: Tensor, G_inv: Tensor, include_bias: bool = True
) -> tuple[Tensor, Tensor]:
    """``(a'·A⁻¹, g'·G⁻¹)`` of a ``Factorized`` (float32 or wider); ``G⁻¹·dW·A⁻¹`` factorized."""
    f = f.as_batch_first()
    return kfac_precondition_factors(
        f.activation, f.pre_activation_grad, layer_type, A_inv, G_inv, f.module_kwargs,
        include_bias,
    )  # fmt: skip


def kfac_cross_factors(
    a1: Tensor,
    g1: Tensor,
    a2: Tensor,
    g2: Tensor,
    layer_type: str,
    A_inv: Tensor,
    G_inv: Tensor,
    module_kwargs1: dict | None = None,
    module_kwargs2: dict | None = None,
    include_bias: bool = True,
) -> Tensor:
    """``K[i, j] = vec(dW1_i)ᵀ(A⁻¹⊗G⁻¹)vec(dW2_j)`` ``(B1, B2)``, whitening side 1."""
    wa1, wg1 = kfac_precondition_factors(
        a1, g1, layer_type, A_inv, G_inv, module_kwargs1, include_bias
    )
    a2, g2 = _preprocessed_3d(a2, g2, layer_type, module_kwargs2, include_bias)
    return cross_gram(wa1, wg1, a2, g2, layer_type)


def kfac_cross(
    f1: Factorized,
    f2: Factorized,
    layer_type: str,
    A_inv: Tensor,
    G_inv: Tensor,
    include_bias: bool = True,
) -> Tensor:
    """:func:`kfac_cross_factors` of two ``Factorized``."""
    f1, f2 = f1.as_batch_first(), f2.as_batch_first()
    return kfac_cross_factors(
        f1.activation, f1.pre_activation_grad, f2.activation, f2.pre_activation_grad,
        layer_type, A_inv, G_inv, f1.module_kwargs, f2.module_kwargs, include_bias,
    )  # fmt: skip


def kfac_precondition_materialized(block: Tensor, A_inv: Tensor, G_inv: Tensor) -> Tensor:
    """``G⁻¹·dW·A⁻¹`` flattened ``(B, k_g·k_a)`` of dense rows laid out ``(k_g, k_a)``.

    For a conv-transpose block (layout ``(K, D)``) pass the inverses swapped.
    """
    k_g, k_a = G_inv.shape[0], A_inv.shape[0]
    rows = block.reshape(block.shape[0], -1)
    if rows.shape[1] != k_g * k_a:
        raise ValueError(
            f"kfac_precondition_materialized: dense rows {tuple(rows.shape)} cannot be viewed as "
            f"(k_g={k_g}, k_a={k_a}) from G_inv {tuple(G_inv.shape)} and A_inv "
            f"{tuple(A_inv.shape)}; the covariances belong to another layer or projection."
        )
    dtype = _floor_dtype(rows, A_inv, G_inv)
    dw = rows.to(dtype).reshape(-1, k_g, k_a)
    return (G_inv.to(dtype) @ dw @ A_inv.to(dtype)).reshape(rows.shape[0], -1)


# --------------------------------------------------------------------------- EK-FAC


def kfac_eigh(A: Tensor, G: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eigendecompositions ``(s_A, U_A, s_G, U_G)`` of the symmetrised covariances."""
    a = A.to(_floor_dtype(A))
    g = G.to(_floor_dtype(G))
    s_a, u_a = torch.linalg.eigh((a + a.T) / 2)
    s_g, u_g = torch.linalg.eigh((g + g.T) / 2)
    return s_a, u_a, s_g, u_g


def ekfac_rotation_prefers_factors(S: int, K: int, D: int) -> bool:
    """Whether rotating the factors beats rotating the materialized gradient (FLOPs per sample).

    Both routes form ``vec(U_Gᵀ·dW·U_A)`` and materialize ``S·K·D``; rotating the
    ``S`` token rows costs ``S·(K² + D²)`` (``aᵀU_A``, ``U_Gᵀg`` per token), rotating
    the ``(D, K)`` gradient ``K·D·(K + D)``. Ties go to the factors.
    """
    return S * (K * K + D * D) <= K * D * (K + D)


def ekfac_materialize_factors(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    U_A: Tensor,
    U_G: Tensor,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
) -> Tensor:
    """Eigenbasis coordinates ``vec(U_Gᵀ·dW·U_A)`` ``(B, D·K)`` (rotate factors, then materialize).

    Conv-transpose: ``vec(U_Aᵀ·dW·U_G)`` in its ``(K, D)`` layout.
    """
    rotated_a, rotated_g = ekfac_rotate_factors(
        a, g, layer_type, U_A, U_G, module_kwargs, include_bias
    )
    return materialize_factors(rotated_a, rotated_g, layer_type)


def ekfac_rotate_factors(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    U_A: Tensor,
    U_G: Tensor,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
) -> tuple[Tensor, Tensor]:
    """Token rows in the eigenbases: ``a'·U_A`` ``(B, S, K)`` and ``g'·U_G`` ``(B, S, D)``.

    Final factors (``module_kwargs=None``): materializing them gives
    :func:`ekfac_materialize_factors`'s coordinates, and per token
    ``(U_Gᵀg)ᵀ·M·(U_Aᵀa) = gᵀ·(U_G M U_Aᵀ)·a``.
    """
    _check_kfac_type(layer_type, "ekfac_materialize")
    ones_column = _has_ones_column(layer_type, module_kwargs, include_bias)
    a, g = _preprocessed_3d(a, g, layer_type, module_kwargs, include_bias and not ones_column)
    _check_inverse_widths(a, g, U_A, U_G, layer_type, "ekfac_materialize", ones_column)
    return _rotate_rows(a, U_A, ones_column), g @ U_G.to(g)


def _rotate_rows(a: Tensor, U: Tensor, ones_column: bool) -> Tensor:
    """``[a, 1]·U`` ``(B, S, K+1)`` as ``a·U[:K] + U[K]`` (no copy, no odd width); else ``a·U``."""
    U = U.to(a)
    if not ones_column:
        return a @ U
    k = a.shape[-1]
    rows = torch.addmm(U[k], a.reshape(-1, k), U[:k])
    return rows.reshape(*a.shape[:-1], k + 1)


def ekfac_materialize(
    f: Factorized | Tensor,
    layer_type: str,
    U_A: Tensor,
    U_G: Tensor,
    include_bias: bool = True,
) -> Tensor:
    """Eigenbasis coordinates of a ``Factorized`` or a dense ``(B, d)`` block.

    Dense linear/conv rows are viewed ``(d_out, d_in)`` → ``U_Gᵀ·dW·U_A``;
    conv-transpose rows ``(C_in, P)`` → ``U_Aᵀ·dW·U_G``.
    """
    if not isinstance(f, torch.Tensor):
        f = f.as_batch_first()
        return ekfac_materialize_factors(
            f.activation, f.pre_activation_grad, layer_type, U_A, U_G, f.module_kwargs,
            include_bias,
        )  # fmt: skip
    _check_kfac_type(layer_type, "ekfac_materialize")
    left, right = (U_A, U_G) if is_conv_transpose(layer_type) else (U_G, U_A)
    rows = f.reshape(f.shape[0], -1)
    if rows.shape[1] != left.shape[0] * right.shape[0]:
        raise ValueError(
            f"ekfac_materialize({layer_type}): dense rows {tuple(rows.shape)} do not match the "
            f"eigenbases U_A {tuple(U_A.shape)} and U_G {tuple(U_G.shape)}; the covariances "
            "belong to another layer or projection."
        )
    dtype = _floor_dtype(rows, U_A, U_G)
    dw = rows.to(dtype).reshape(-1, left.shape[0], right.shape[0])
    return (left.to(dtype).T @ dw @ right.to(dtype)).reshape(rows.shape[0], -1)


def ekfac_scale(M: Tensor, lam: Tensor) -> Tensor:
    """Eigen-coordinates ``M : (B, D·K)`` divided by ``lam`` (``D·K`` values), not rotated back."""
    dtype = _floor_dtype(M, lam)
    return M.to(dtype).reshape(M.shape[0], -1) / lam.to(dtype).reshape(1, -1)


def ekfac_precondition(M: Tensor, U_A: Tensor, U_G: Tensor, lam: Tensor, layer_type: str) -> Tensor:
    """Divide eigen-coordinates ``M : (B, D)`` by ``lam`` and rotate back ``(B, D)``.

    ``U_G (M/lam) U_Aᵀ`` for linear/conv, ``U_A (M/lam) U_Gᵀ`` for conv-transpose,
    flattened in the materialize layout; ``lam`` broadcasts against one row.
    """
    left, right = (U_A, U_G) if is_conv_transpose(layer_type) else (U_G, U_A)
    dtype = _floor_dtype(M, U_A, U_G, lam)
    shape = (M.shape[0], left.shape[0], right.shape[0])
    if M.reshape(M.shape[0], -1).shape[1] != shape[1] * shape[2]:
        raise ValueError(
            f"ekfac_precondition({layer_type}): rows {tuple(M.shape)} do not match U_A "
            f"{tuple(U_A.shape)} and U_G {tuple(U_G.shape)}."
        )
    scaled = M.to(dtype).reshape(shape) / lam.to(dtype).reshape(shape[1:])
    return (left.to(dtype) @ scaled @ right.to(dtype).T).reshape(M.shape[0], -1)


# --------------------------------------------------------------------------- accumulators


def _accumulator_layer_type(layer_type: str, module_kwargs: dict | None, fn: str) -> str:
    """Canonical type of ``layer_type`` (short aliases accepted); ``module_kwargs`` checked.

    Raises:
        ValueError: unknown ``layer_type``.
        KeyError: ``module_kwargs`` given without ``"has_bias"``.
    """
    layer_type = resolve_layer_type(layer_type, fn)
    if module_kwargs is not None and "has_bias" not in module_kwargs:
        raise KeyError(
            f"{fn}({layer_type}): module_kwargs {sorted(module_kwargs)} has no 'has_bias' entry; "
            "build it with ops.extract_module_kwargs(module, layer_type), or pass None for "
            "final factors."
        )
    return layer_type


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


def _add_rows_to_sums_(a_sum: Tensor, g_sum: Tensor, rows: _GramRows) -> None:
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


class _LayerSums(Protocol):
    """A per-layer accumulator whose partial sums can be reduced across ranks."""

    def partial_sums(self) -> tuple[list[Tensor], int] | None:
        """``(sums, count)`` accumulated here, ``None`` when nothing was."""

    def load_sums(self, sums: list[Tensor], count: int) -> None:
        """Replace the sums and count (by the reduced ones)."""


def all_reduce_layer_accumulators(
    layers: dict[str, _LayerSums], factory: Callable[[], _LayerSums]
) -> list[str]:
    """Sum per-layer accumulators across ranks on the union of their layers, in place.

    Ranks may hold different layers (control flow) and different row counts:
    the layer names, with the shapes of their sums, are gathered first, then
    every layer of the union is reduced (``utils.distributed.all_reduce_named_sums``);
    a rank without a layer (or with nothing accumulated in it) contributes
    zeros, and gains the layer (``factory()``) holding the global sums and
    count. Every rank must call it. Returns the reduced layer names (those
    accumulated on some rank), sorted. No-op single-process.
    """
    local = {}
    for name, acc in layers.items():
        sums = acc.partial_sums()
        if sums is not None:
            local[name] = sums
    reduced = all_reduce_named_sums(local, "K-FAC accumulator sums")
    for name, (sums, count) in reduced.items():
        if name not in layers:
            layers[name] = factory()
        layers[name].load_sums(sums, count)
    return sorted(reduced)


@dataclass
class LayerKroneckerAccumulator:
    """Running K-FAC covariance sums ``Σ a aᵀ``, ``Σ g gᵀ`` of one layer over token rows."""

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
        layer_type = _accumulator_layer_type(
            layer_type, module_kwargs, "LayerKroneckerAccumulator.update"
        )
        rows = _gram_rows(a, g, layer_type, module_kwargs, include_bias)
        if rows.kept == 0:
            return
        k, d = rows.a.shape[1] + rows.ones_column, rows.g.shape[1]
        if self.a_sum is None:
            dtype = _floor_dtype(rows.a, rows.g)
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
class LayerFisherAccumulator:
    """Running dense empirical Fisher ``Σ g gᵀ`` of one layer over samples."""

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
        layer_type = _accumulator_layer_type(layer_type, module_kwargs, fn)
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
        m = m.to(_floor_dtype(m))
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


@dataclass
class KroneckerAccumulator:
    """Per-layer K-FAC covariances over :class:`Gradient` blocks."""

    layers: dict[str, LayerKroneckerAccumulator] = field(default_factory=dict, init=False)

    def update(self, gradient: Gradient, layers: Iterable[str]) -> None:
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


class FisherAccumulator:
    """Per-layer dense empirical Fisher over :class:`Gradient` blocks.

    Layers wider than ``max_params`` coordinates are dropped and recorded in
    :attr:`skipped`.
    """

    def __init__(self, max_params: int | None = None) -> None:
        """Start empty; ``max_params=None`` keeps every layer."""
        self.max_params = max_params
        self.layers: dict[str, LayerFisherAccumulator] = {}
        self._skipped: dict[str, int] = {}

    @property
    def skipped(self) -> dict[str, int]:
        """``{layer: param_count}`` of the layers dropped for exceeding ``max_params``."""
        return dict(self._skipped)

    def update(self, gradient: Gradient, layers: Iterable[str]) -> None:
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
                layer_type = _accumulator_layer_type(
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
    # function-level: dattri_llm.gradient.gradient imports this package (import cycle)
    from dattri_llm.gradient.gradient import _materialized_width_estimate

    return int(_materialized_width_estimate(value, layer_type))

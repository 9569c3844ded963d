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

This module holds the one-batch kernels, the damped inverses and functions
``f(H)`` of a Kronecker curvature applied in its eigenbasis (SOURCE's
propagator and response). The token rows
live in ``kronecker_rows.py``; the accumulators (``kronecker_accumulators.py``,
``fisher_accumulators.py``, reduced across ranks by ``layer_sums.py``) are
re-exported here. They take a canonical layer type or its short alias
(``"linear"``, ``"conv2d"``; ``types.LAYER_TYPE_ALIASES``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dattri_llm.gradient.ops.dot import cross_gram
from dattri_llm.gradient.ops.fisher_accumulators import FisherAccumulator as FisherAccumulator
from dattri_llm.gradient.ops.fisher_accumulators import (
    LayerFisherAccumulator as LayerFisherAccumulator,
)
from dattri_llm.gradient.ops.kronecker_accumulators import (
    KroneckerAccumulator as KroneckerAccumulator,
)
from dattri_llm.gradient.ops.kronecker_accumulators import (
    LayerKroneckerAccumulator as LayerKroneckerAccumulator,
)
from dattri_llm.gradient.ops.kronecker_rows import (
    check_kfac_type,
    floor_dtype,
    has_ones_column,
    kfac_rows,
    preprocessed_3d,
)
from dattri_llm.gradient.ops.materialize import materialize_factors
from dattri_llm.gradient.ops.types import is_conv_transpose

if TYPE_CHECKING:
    from dattri_llm.gradient.model.records import Factorized

Tensor = torch.Tensor


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
    m = m.to(floor_dtype(m))
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
    m = matrix.to(floor_dtype(matrix))
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
    check_kfac_type(layer_type, "kfac_precondition")
    a, g = preprocessed_3d(a, g, layer_type, module_kwargs, include_bias)
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
    a2, g2 = preprocessed_3d(a2, g2, layer_type, module_kwargs2, include_bias)
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
    dtype = floor_dtype(rows, A_inv, G_inv)
    dw = rows.to(dtype).reshape(-1, k_g, k_a)
    return (G_inv.to(dtype) @ dw @ A_inv.to(dtype)).reshape(rows.shape[0], -1)


# --------------------------------------------------------------------------- EK-FAC


def kfac_eigh(A: Tensor, G: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eigendecompositions ``(s_A, U_A, s_G, U_G)`` of the symmetrised covariances."""
    a = A.to(floor_dtype(A))
    g = G.to(floor_dtype(G))
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
    check_kfac_type(layer_type, "ekfac_materialize")
    ones_column = has_ones_column(layer_type, module_kwargs, include_bias)
    a, g = preprocessed_3d(a, g, layer_type, module_kwargs, include_bias and not ones_column)
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
    check_kfac_type(layer_type, "ekfac_materialize")
    left, right = (U_A, U_G) if is_conv_transpose(layer_type) else (U_G, U_A)
    rows = f.reshape(f.shape[0], -1)
    if rows.shape[1] != left.shape[0] * right.shape[0]:
        raise ValueError(
            f"ekfac_materialize({layer_type}): dense rows {tuple(rows.shape)} do not match the "
            f"eigenbases U_A {tuple(U_A.shape)} and U_G {tuple(U_G.shape)}; the covariances "
            "belong to another layer or projection."
        )
    dtype = floor_dtype(rows, U_A, U_G)
    dw = rows.to(dtype).reshape(-1, left.shape[0], right.shape[0])
    return (left.to(dtype).T @ dw @ right.to(dtype)).reshape(rows.shape[0], -1)


def ekfac_scale(M: Tensor, lam: Tensor) -> Tensor:
    """Eigen-coordinates ``M : (B, D·K)`` divided by ``lam`` (``D·K`` values), not rotated back."""
    dtype = floor_dtype(M, lam)
    return M.to(dtype).reshape(M.shape[0], -1) / lam.to(dtype).reshape(1, -1)


def ekfac_precondition(M: Tensor, U_A: Tensor, U_G: Tensor, lam: Tensor, layer_type: str) -> Tensor:
    """Divide eigen-coordinates ``M : (B, D)`` by ``lam`` and rotate back ``(B, D)``.

    ``U_G (M/lam) U_Aᵀ`` for linear/conv, ``U_A (M/lam) U_Gᵀ`` for conv-transpose,
    flattened in the materialize layout; ``lam`` broadcasts against one row.
    """
    left, right, dtype, shape = _eigenbasis_layout(
        M, U_A, U_G, lam, layer_type, "ekfac_precondition"
    )
    scaled = M.to(dtype).reshape(shape) / lam.to(dtype).reshape(shape[1:])
    return (left.to(dtype) @ scaled @ right.to(dtype).T).reshape(M.shape[0], -1)


def _eigenbasis_layout(
    M: Tensor, U_A: Tensor, U_G: Tensor, values: Tensor, layer_type: str, fn: str
) -> tuple[Tensor, Tensor, torch.dtype, tuple[int, int, int]]:
    """``(left, right, dtype, (B, rows, cols))`` of eigen-coordinates ``M`` (``ValueError``)."""
    left, right = (U_A, U_G) if is_conv_transpose(layer_type) else (U_G, U_A)
    dtype = floor_dtype(M, U_A, U_G, values)
    shape = (M.shape[0], left.shape[0], right.shape[0])
    if M.reshape(M.shape[0], -1).shape[1] != shape[1] * shape[2]:
        raise ValueError(
            f"{fn}({layer_type}): rows {tuple(M.shape)} do not match U_A "
            f"{tuple(U_A.shape)} and U_G {tuple(U_G.shape)}."
        )
    return left, right, dtype, shape


# --------------------------------------------------------------------------- functions of H


def kfac_eigenvalues(s_A: Tensor, s_G: Tensor, layer_type: str) -> Tensor:
    """Eigenvalues of ``A ⊗ G`` as eigen-coordinates ``(D·K,)`` (conv-transpose ``(K·D,)``).

    ``s_A : (K,)`` and ``s_G : (D,)`` are the eigenvalues of ``A`` and ``G``
    (:func:`kfac_eigh`); entry ``(d, k)`` is ``s_G[d]·s_A[k]``, matching
    :func:`ekfac_materialize`'s coordinates.
    """
    if is_conv_transpose(layer_type):
        return torch.outer(s_A, s_G).reshape(-1)
    return torch.outer(s_G, s_A).reshape(-1)


def eigenbasis_apply(
    rows: Tensor, U_A: Tensor, U_G: Tensor, values: Tensor, layer_type: str
) -> Tensor:
    """``f(H)·vec(dW)`` of dense rows ``(B, d)`` for ``H = (U_G ⊗ U_A) diag(λ) (U_G ⊗ U_A)ᵀ``.

    ``values = f(λ)`` in the eigen-coordinate layout (``(D·K,)``, as
    :func:`kfac_eigenvalues` or EK-FAC's corrected eigenvalues): the rows are
    rotated into the Kronecker eigenbasis (:func:`ekfac_materialize`),
    multiplied by ``values`` and rotated back, ``(B, d)`` in the materialize
    layout. ``values = 1/(λ+δ)`` is EK-FAC's preconditioner.
    """
    coords = ekfac_materialize(rows, layer_type, U_A, U_G)
    left, right, dtype, shape = _eigenbasis_layout(
        coords, U_A, U_G, values, layer_type, "eigenbasis_apply"
    )
    if values.numel() != shape[1] * shape[2]:
        raise ValueError(
            f"eigenbasis_apply({layer_type}): {values.numel()} values for an eigenbasis of "
            f"{shape[1]}x{shape[2]} coordinates."
        )
    scaled = coords.to(dtype).reshape(shape) * values.to(dtype).reshape(shape[1:])
    return (left.to(dtype) @ scaled @ right.to(dtype).T).reshape(rows.shape[0], -1)


def unrolled_propagator(eigenvalues: Tensor, lr_sum: float) -> Tensor:
    """``exp(−η̄·λ)``: how a stretch of SGD with total learning rate ``η̄`` damps each direction.

    The closed form of ``Π_k (I − η_k H)`` for small steps on a quadratic with
    stationary curvature ``H`` (eigenvalues ``λ``).
    """
    return torch.exp(-lr_sum * eigenvalues)


def unrolled_response(eigenvalues: Tensor, lr_sum: float) -> Tensor:
    """``(1 − exp(−η̄·λ))/λ``: the accumulated response to a constant gradient (``η̄`` at ``λ = 0``).

    Computed as ``−expm1(−η̄λ)/λ`` (no cancellation for small ``η̄λ``), with
    ``η̄·(1 − η̄λ/2)`` where ``|η̄λ| < 1e-12`` (its series); finite for every
    real ``λ`` and bounded by ``η̄`` for ``λ ≥ 0``.
    """
    x = lr_sum * eigenvalues
    small = x.abs() < 1e-12
    safe = torch.where(small, torch.ones_like(eigenvalues), eigenvalues)
    return torch.where(small, lr_sum * (1 - x / 2), -torch.expm1(-x) / safe)

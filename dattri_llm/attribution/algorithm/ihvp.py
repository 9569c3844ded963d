"""Iterative inverse-Hessian-vector products ``(H + λI)⁻¹ b`` from a Hessian-vector product.

Both solvers take ``hvp(v) -> H v`` for a symmetric ``H`` and right-hand sides
``b`` of shape ``(D,)`` or ``(K, D)`` (``K`` independent systems solved
together, ``hvp`` applied row-wise: it receives and returns ``(K, D)``).

* :func:`conjugate_gradient`: conjugate gradients on ``(H + λI) x = b``
  (Hestenes & Stiefel 1952); converges when ``H + λI`` is positive definite,
  in at most ``D`` steps in exact arithmetic, much faster for a
  well-conditioned or low-rank ``H``.
* :func:`lissa`: the truncated Neumann series of Agarwal et al. 2017
  ("Second-Order Stochastic Optimization for Machine Learning in Linear
  Time"), as used for influence functions by Koh & Liang 2017:
  ``x_{t+1} = b + x_t − ((H + λI) x_t)/scale``, returning ``x_T/scale``; it
  converges when every eigenvalue of ``(H + λI)/scale`` lies in ``(0, 2)``
  (choose ``scale`` above the largest eigenvalue).
* :func:`direct_solve`: a dense ``torch.linalg.solve`` of the matrix built from
  ``D`` HVPs, for tiny ``D`` and as the reference of the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["conjugate_gradient", "direct_solve", "lissa"]

HVP = Callable[[torch.Tensor], torch.Tensor]


def _as_rows(b: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    """``b`` as ``(K, D)`` rows and whether it was a single ``(D,)`` vector."""
    if b.dim() == 1:
        return b.unsqueeze(0), True
    if b.dim() != 2:
        raise ValueError(f"{name}: b must be (D,) or (K, D), got shape {tuple(b.shape)}.")
    return b, False


def _check_damping(damping: float, name: str) -> float:
    if isinstance(damping, bool) or not isinstance(damping, (int, float)):
        raise TypeError(f"{name}: damping must be a float >= 0, got {damping!r}.")
    if not math.isfinite(damping) or damping < 0:
        raise ValueError(f"{name}: damping must be finite and >= 0, got {damping!r}.")
    return float(damping)


def conjugate_gradient(
    hvp: HVP,
    b: torch.Tensor,
    *,
    damping: float = 0.0,
    max_iter: int = 100,
    tol: float = 1e-10,
) -> torch.Tensor:
    """Solve ``(H + λI) x = b`` by conjugate gradients, each row of ``b`` independently.

    Args:
        hvp: ``(K, D) -> (K, D)``, ``H`` applied to each row (``H`` symmetric).
        b: ``(D,)`` or ``(K, D)`` right-hand sides.
        damping: ``λ >= 0``; ``H + λI`` must be positive definite.
        max_iter: most iterations (``D`` suffices in exact arithmetic).
        tol: stop a row once its residual norm is ``<= tol × ‖b‖``.

    Returns:
        ``x`` with the shape of ``b``.

    Raises:
        ValueError: bad shape, damping or ``max_iter``; a non-positive curvature
            ``pᵀ(H + λI)p <= 0`` (``H + λI`` is not positive definite: raise
            ``damping``).
    """
    damping = _check_damping(damping, "conjugate_gradient")
    if max_iter < 1:
        raise ValueError(f"conjugate_gradient: max_iter must be >= 1, got {max_iter!r}.")
    rhs, single = _as_rows(b, "conjugate_gradient")
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rs = (r * r).sum(1)
    stop = (tol * rhs.norm(dim=1)) ** 2
    for _ in range(max_iter):
        active = rs > stop
        if not bool(active.any()):
            break
        ap = hvp(p) + damping * p
        curvature = (p * ap).sum(1)
        if bool((curvature[active] <= 0).any()):
            raise ValueError(
                "conjugate_gradient: H + damping·I is not positive definite along a search "
                f"direction (pᵀ(H+λI)p <= 0 with damping={damping}); raise damping."
            )
        alpha = torch.where(active, rs / torch.where(active, curvature, 1.0), 0.0)
        x = x + alpha[:, None] * p
        r = r - alpha[:, None] * ap
        rs_new = (r * r).sum(1)
        beta = torch.where(active, rs_new / torch.where(active, rs, 1.0), 0.0)
        p = r + beta[:, None] * p
        rs = rs_new
    return x[0] if single else x


def lissa(
    hvp: HVP,
    b: torch.Tensor,
    *,
    damping: float = 0.0,
    scale: float = 10.0,
    depth: int = 1000,
    repeat: int = 1,
) -> torch.Tensor:
    """``(H + λI)⁻¹ b`` by the LiSSA recursion ``x ← b + x − (H + λI)x/scale``, ``x/scale``.

    With an exact ``hvp`` the ``repeat`` runs coincide; pass a stochastic
    ``hvp`` (a fresh mini-batch per call) to average ``repeat`` estimates.

    Args:
        hvp: ``(K, D) -> (K, D)``, ``H`` (or an unbiased estimate) applied per row.
        b: ``(D,)`` or ``(K, D)`` right-hand sides.
        damping: ``λ >= 0``.
        scale: ``s`` above the largest eigenvalue of ``H + λI`` (the series
            diverges otherwise); the error shrinks as ``(1 − λ_min/s)^depth``.
        depth: recursion steps per run.
        repeat: runs averaged.

    Returns:
        ``x`` with the shape of ``b``.

    Raises:
        ValueError: bad shape, damping, scale, depth or repeat; a non-finite
            iterate (the series diverged: raise ``scale``).
    """
    damping = _check_damping(damping, "lissa")
    if not scale > 0 or depth < 1 or repeat < 1:
        raise ValueError(
            f"lissa: needs scale > 0, depth >= 1 and repeat >= 1, got scale={scale!r}, "
            f"depth={depth!r}, repeat={repeat!r}."
        )
    rhs, single = _as_rows(b, "lissa")
    total = torch.zeros_like(rhs)
    for _ in range(repeat):
        x = rhs.clone()
        for _ in range(depth):
            x = rhs + x - (hvp(x) + damping * x) / scale
        if not bool(torch.isfinite(x).all()):
            raise ValueError(
                f"lissa: the series diverged (scale={scale} is below the largest eigenvalue "
                "of H + damping·I); raise scale."
            )
        total = total + x / scale
    out = total / repeat
    return out[0] if single else out


def direct_solve(hvp: HVP, b: torch.Tensor, *, damping: float = 0.0) -> torch.Tensor:
    """``torch.linalg.solve(H + λI, b)`` with ``H`` built from ``D`` HVPs of the unit vectors.

    For small ``D`` only (``D²`` memory, ``D`` HVPs). ``b``: ``(D,)`` or ``(K, D)``.
    """
    damping = _check_damping(damping, "direct_solve")
    rhs, single = _as_rows(b, "direct_solve")
    eye = torch.eye(rhs.shape[1], dtype=rhs.dtype, device=rhs.device)
    h = hvp(eye)
    matrix = (h + h.T) / 2 + damping * eye
    out = torch.linalg.solve(matrix, rhs.T).T
    return out[0] if single else out

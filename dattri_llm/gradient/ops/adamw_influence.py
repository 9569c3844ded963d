"""The AdamW-influence kernels: the per-step pieces AdamW-influence propagates with.

``adam_preconditioner``, ``adamw_influence_push``, ``adamw_influence_transition``
and ``adamw_influence_coupling`` are the per-step pieces of the AdamW-influence
backward recurrence over ``k`` coordinates and a ``p``-row summary
``W = [W_θ | W_m | W_v]`` (each ``(p, k)``). Arithmetic runs in the compute
dtype of ``ops.dtypes`` (at least float32); results are float32.

The public API lists them under ``ops/optimizer.py``, which
re-exports them; they keep that module path (``__module__``).
"""

from __future__ import annotations

import torch

from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.step import check_step

__all__ = [
    "adam_preconditioner",
    "adamw_influence_coupling",
    "adamw_influence_push",
    "adamw_influence_transition",
]

Tensor = torch.Tensor


def adam_preconditioner(
    m_hat: Tensor, v_hat: Tensor, *, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """Diagonal Adam Jacobian pieces ``(D, S)`` from bias-corrected moments.

    ``D = 1/(sqrt(v̂)+eps)`` (derivative of ``m̂/(sqrt(v̂)+eps)`` in ``m̂``) and
    ``S = m̂/(2·sqrt(v̂)·(sqrt(v̂)+eps)²)`` (minus its derivative in ``v̂``), with
    ``S = 0`` where ``v̂ = 0``. Computed in float64.

    Args:
        m_hat: ``(k,)`` (any shape) bias-corrected first moment.
        v_hat: same shape, bias-corrected second moment (``≥ 0``).
        eps: Adam's epsilon.

    Returns:
        ``(D, S)``, float32, each of ``m_hat``'s shape.
    """
    m = m_hat.to(torch.float64)
    root = v_hat.to(torch.float64).sqrt()
    d = 1.0 / (root + eps)
    s = torch.where(root > 0, m / (2.0 * root * (root + eps) ** 2), torch.zeros_like(m))
    return d.to(torch.float32), s.to(torch.float32)


def _influence_pieces(
    g_z: Tensor,
    g_t: Tensor,
    d: Tensor,
    s: Tensor,
    lr: float,
    step: float,
    beta1: float,
    beta2: float,
    fn: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(θ̇, ṁ, v̇)``, each ``(B, k)`` in the compute dtype (see ``adamw_influence_push``)."""
    t = check_step(step, fn)
    g_z, g_t, d, s = dtypes.align(g_z, g_t, d, s, minimum=torch.float32)
    m_dot = -(1.0 - beta1) * g_z
    v_dot = -2.0 * (1.0 - beta2) * g_t * g_z
    theta_dot = -lr * (d * m_dot / (1.0 - beta1**t) - s * v_dot / (1.0 - beta2**t))
    return theta_dot, m_dot, v_dot


def adamw_influence_push(
    g_z: Tensor,
    g_t: Tensor,
    d: Tensor,
    s: Tensor,
    *,
    lr: float,
    step: int,
    beta1: float = 0.9,
    beta2: float = 0.999,
) -> Tensor:
    """State perturbation ``[θ̇ | ṁ | v̇]`` of one AdamW step from up-weighting each sample.

    ``ṁ = −(1−β1)·g_z``, ``v̇ = −2(1−β2)·g_t⊙g_z``,
    ``θ̇ = −lr·(D⊙ṁ/(1−β1^step) − S⊙v̇/(1−β2^step))``.

    Args:
        g_z: ``(B, k)`` per-sample gradients.
        g_t: ``(k,)`` the batch gradient the step consumed.
        d, s: ``(k,)`` from :func:`adam_preconditioner` at this step.
        lr: the step's learning rate.
        step: the step's update index (``≥ 1``).
        beta1, beta2: AdamW's betas.

    Returns:
        ``(B, 3k)`` float32 ``[θ̇ | ṁ | v̇]``.
    """
    pieces = _influence_pieces(g_z, g_t, d, s, lr, step, beta1, beta2, "adamw_influence_push")
    return torch.cat(pieces, dim=1).to(torch.float32)


def adamw_influence_transition(
    w_theta: Tensor,
    w_m: Tensor,
    w_v: Tensor,
    d: Tensor,
    s: Tensor,
    *,
    lr: float,
    step: int,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Carry the summary ``W = [W_θ | W_m | W_v]`` back through one AdamW step.

    ``W_θ' = (1−lr·wd)·W_θ``, ``W_m' = W_θ·diag(−lr·β1/(1−β1^step)·D) + β1·W_m``,
    ``W_v' = W_θ·diag(lr·β2/(1−β2^step)·S) + β2·W_v`` (all from the input ``W_θ``).

    Args:
        w_theta, w_m, w_v: ``(p, k)`` summary blocks.
        d, s: ``(k,)`` from :func:`adam_preconditioner` at this step.
        lr: the step's learning rate.
        step: the step's update index (``≥ 1``).
        beta1, beta2: AdamW's betas.
        weight_decay: the step's (decoupled) weight decay.

    Returns:
        ``(W_θ', W_m', W_v')``, each ``(p, k)`` float32.
    """
    t = check_step(step, "adamw_influence_transition")
    w_theta, w_m, w_v, d, s = dtypes.align(w_theta, w_m, w_v, d, s, minimum=torch.float32)
    new_theta = (1.0 - lr * weight_decay) * w_theta
    new_m = w_theta * (-lr * beta1 / (1.0 - beta1**t) * d) + beta1 * w_m
    new_v = w_theta * (lr * beta2 / (1.0 - beta2**t) * s) + beta2 * w_v
    return new_theta.to(torch.float32), new_m.to(torch.float32), new_v.to(torch.float32)


def adamw_influence_coupling(
    w_theta: Tensor,
    w_m: Tensor,
    w_v: Tensor,
    g_z: Tensor,
    g_t: Tensor,
    d: Tensor,
    s: Tensor,
    *,
    lr: float,
    step: int,
    beta1: float = 0.9,
    beta2: float = 0.999,
) -> Tensor:
    """Per-sample coupling ``W_θ r_θ + W_m r_m + W_v r_v`` of one AdamW step.

    ``r_θ = (−lr(1−β1)/(1−β1^step)·D + 2lr(1−β2)/(1−β2^step)·S⊙g_t)⊙g_z``,
    ``r_m = (1−β1)·g_z``, ``r_v = 2(1−β2)·g_t⊙g_z`` — i.e. ``r = −push``, so the
    result is ``−W·adamw_influence_push(g_z, ...)`` per sample.

    Args:
        w_theta, w_m, w_v: ``(p, k)`` summary blocks.
        g_z: ``(B, k)`` per-sample gradients.
        g_t: ``(k,)`` the batch gradient the step consumed.
        d, s: ``(k,)`` from :func:`adam_preconditioner` at this step.
        lr: the step's learning rate.
        step: the step's update index (``≥ 1``).
        beta1, beta2: AdamW's betas.

    Returns:
        ``(B, p)`` float32.
    """
    pieces = _influence_pieces(g_z, g_t, d, s, lr, step, beta1, beta2, "adamw_influence_coupling")
    r = -torch.cat(pieces, dim=1)
    w = torch.cat([w_theta, w_m, w_v], dim=1).to(r.dtype)
    return (r @ w.T).to(torch.float32)


# Their public path, which the API tests compare with ``__module__``.
for _kernel in (
    adam_preconditioner,
    adamw_influence_push,
    adamw_influence_transition,
    adamw_influence_coupling,
):
    _kernel.__module__ = "dattri_llm.gradient.ops.optimizer"
del _kernel

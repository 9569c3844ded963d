"""Independent dense references for the K-FAC / EK-FAC tests.

Covariances are formed explicitly from the layer inputs / output gradients
(``F.unfold`` for convolutions), curvature operators as explicit dense
matrices (``torch.kron``), and per-sample gradients come from ``torch.func``
(``tests/reference.py`` via ``ops_helpers``). Nothing here imports dattri_llm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ops_helpers import expected_layout, reference_grads
from torch import nn


def linear_case(dtype: torch.dtype = torch.float64, seed: int = 0, batch: int = 3):
    """Tiny ``nn.Linear(5, 4)`` on ``(B, 6, 5)`` inputs; ``g = r`` with padded tail tokens zero.

    Returns ``(module, x, r, per_sample_grads (B, 4·6))`` for the loss ``Σ y⊙r``.
    """
    torch.manual_seed(seed)
    module = nn.Linear(5, 4).to(dtype)
    x = torch.randn(batch, 6, 5, dtype=dtype)
    r = torch.randn(batch, 6, 4, dtype=dtype)
    r[0, 4:] = 0  # padding: sample 0 has 4 real tokens
    r[-1, 5:] = 0
    grads = expected_layout("nn.Linear", reference_grads(module, (x,), r))
    return module, x, r, grads


def conv_case(dtype: torch.dtype = torch.float64, seed: int = 0, batch: int = 3):
    """Tiny ``nn.Conv2d(2, 3, 2, padding=1, stride=2)`` on ``(B, 2, 5, 5)``; ``g = r``."""
    torch.manual_seed(seed)
    module = nn.Conv2d(2, 3, 2, padding=1, stride=2).to(dtype)
    x = torch.randn(batch, 2, 5, 5, dtype=dtype)
    r = torch.randn(module(x).shape, dtype=dtype)
    grads = expected_layout("nn.Conv2d", reference_grads(module, (x,), r))
    return module, x, r, grads


def linear_rows(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit token rows ``([x, 1], r)`` of a linear layer, zero-gradient rows removed."""
    a = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1).reshape(-1, x.shape[-1] + 1)
    g = r.reshape(-1, r.shape[-1])
    keep = g.abs().sum(dim=1) > 0
    return a[keep], g[keep]


def conv_rows(module: nn.Conv2d, x: torch.Tensor, r: torch.Tensor):
    """Explicit im2col rows ``([patch, 1], r_position)`` of a conv layer."""
    cols = F.unfold(
        x, module.kernel_size, dilation=module.dilation, padding=module.padding,
        stride=module.stride,
    ).transpose(1, 2)  # fmt: skip
    a = torch.cat([cols, torch.ones_like(cols[..., :1])], dim=-1)
    g = r.flatten(2).transpose(1, 2)
    return a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])


def covariances(a_rows: torch.Tensor, g_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = Σ a aᵀ / N``, ``G = Σ g gᵀ / N``."""
    n = a_rows.shape[0]
    return a_rows.T @ a_rows / n, g_rows.T @ g_rows / n


def damped_inverse(m: torch.Tensor, damping: float) -> torch.Tensor:
    """``(M + λI)⁻¹`` by ``torch.linalg.inv``."""
    return torch.linalg.inv(m + damping * torch.eye(m.shape[0], dtype=m.dtype))


def kfac_operator(a_cov: torch.Tensor, g_cov: torch.Tensor, damping: float) -> torch.Tensor:
    """Dense ``(G+λI)⁻¹ ⊗ (A+λI)⁻¹`` acting on ``(D, K)`` row-major ``vec(dW)``."""
    return torch.kron(damped_inverse(g_cov, damping), damped_inverse(a_cov, damping))


def ekfac_operator(
    a_cov: torch.Tensor, g_cov: torch.Tensor, train_grads: torch.Tensor, damping: float
) -> torch.Tensor:
    """Dense ``R diag(1/(Λ+λ)) Rᵀ`` with ``R = U_G ⊗ U_A`` and ``Λ = mean_i (Rᵀ vec dW_i)²``."""
    _, u_a = torch.linalg.eigh(a_cov)
    _, u_g = torch.linalg.eigh(g_cov)
    rot = torch.kron(u_g, u_a)
    lam = ((train_grads @ rot) ** 2).mean(dim=0)
    return rot @ torch.diag(1.0 / (lam + damping)) @ rot.T

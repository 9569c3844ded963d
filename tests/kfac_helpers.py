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
from reference import per_sample_loop_grads
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


def dict_samples(data: tuple[torch.Tensor, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``(x, y)`` tensors as a list of ``{"x", "y"}`` sample dicts (an attributor dataset)."""
    return [{"x": x, "y": y} for x, y in zip(*data)]


def dict_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum-reduced squared error of a ``{"x", "y"}`` batch (per-sample gradient = ∇ℓ_i)."""
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


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


def linear_layer_io(
    model: nn.Module, layers: tuple[str, ...], loss_fn, batch: tuple
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (input, output gradient)}`` of one backward of ``loss_fn(model, batch)``.

    Plain forward hooks copy each layer's input and hook its output for the gradient.
    """
    modules = dict(model.named_modules())
    io: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str):
        def forward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0].detach().clone()
            output.register_hook(lambda g: io.__setitem__(name, (x, g.detach().clone())))

        return forward

    handles = [modules[name].register_forward_hook(hook(name)) for name in layers]
    try:
        loss_fn(model, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return io


def linear_per_sample_grads(
    model: nn.Module, layers: tuple[str, ...], loss_fn, batch: tuple
) -> dict[str, torch.Tensor]:
    """``{layer: (B, out·(in+1))}`` per-sample ``[W | b]`` of linear layers (loop of backwards)."""
    grads = per_sample_loop_grads(model, loss_fn, batch)
    return {
        name: torch.cat([grads[f"{name}.weight"], grads[f"{name}.bias"][..., None]], dim=2).flatten(
            1
        )
        for name in layers
    }


def linear_kronecker_scores(
    model: nn.Module,
    layers: tuple[str, ...],
    loss_fn,
    train: tuple,
    test: tuple,
    method: str,
    damping: float,
) -> torch.Tensor:
    """Dense ``Σ_l g_tr F_l⁻¹ g_teᵀ`` ``(n_train, n_test)`` of linear layers, K-FAC or EK-FAC.

    ``F_l`` is built explicitly from the token-row covariances of ``train``
    (one backward over the whole set) with ``torch.kron``.
    """
    io = linear_layer_io(model, layers, loss_fn, train)
    g_tr = linear_per_sample_grads(model, layers, loss_fn, train)
    g_te = linear_per_sample_grads(model, layers, loss_fn, test)
    total = torch.zeros(train[0].shape[0], test[0].shape[0], dtype=g_tr[layers[0]].dtype)
    for name in layers:
        a_cov, g_cov = covariances(*linear_rows(*io[name]))
        if method == "kfac":
            op = kfac_operator(a_cov, g_cov, damping)
        else:
            op = ekfac_operator(a_cov, g_cov, g_tr[name], damping)
        total = total + g_tr[name] @ op @ g_te[name].T
    return total


def linear_kronecker_token_scores(
    model: nn.Module,
    layers: tuple[str, ...],
    loss_fn,
    train: tuple,
    test: tuple,
    method: str,
    damping: float,
) -> torch.Tensor:
    """Per-token contributions ``(n_train, T, n_test)`` of :func:`linear_kronecker_scores`.

    Token ``t`` of train sample ``i`` contributes ``g_itᵀ·P_j·[x_it, 1]`` with
    ``P_j = F⁻¹ vec(dW_te,j)`` viewed ``(D, K+1)``; the sum over ``t`` is the score
    (loss summed over samples, so each sample's token rows are its own gradient).
    """
    io = linear_layer_io(model, layers, loss_fn, train)
    g_tr = linear_per_sample_grads(model, layers, loss_fn, train)
    g_te = linear_per_sample_grads(model, layers, loss_fn, test)
    total = 0
    for name in layers:
        x, g = io[name]
        a_cov, g_cov = covariances(*linear_rows(x, g))
        if method == "kfac":
            op = kfac_operator(a_cov, g_cov, damping)
        else:
            op = ekfac_operator(a_cov, g_cov, g_tr[name], damping)
        pre = (g_te[name] @ op).reshape(-1, g.shape[-1], x.shape[-1] + 1)  # (n_test, D, K+1)
        a = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
        total = total + torch.einsum("itd,jdk,itk->itj", g, pre, a)
    return total

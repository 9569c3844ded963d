"""Ground truth for projection tests: captured factors and reference per-sample gradients.

Reference gradients come from ``torch.func`` (``reference.per_sample_param_grads``)
and are laid out here, independently of the library, in the normative
materialize layout of ``gradient-model.md``.
"""

from __future__ import annotations

import torch
from reference import call, per_sample_param_grads
from torch import nn


def loss_weights(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Fixed per-output weights ``(1, *shape)`` for the test loss ``Σ sin(out)·R``."""
    gen = torch.Generator().manual_seed(123)
    return torch.randn(1, *shape, generator=gen).to(dtype)


def capture_factors(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, g)``: the layer input and the gradient of ``Σ_b Σ sin(out_b)·R`` w.r.t. its output."""
    out = module(x)
    weights = loss_weights(tuple(out.shape[1:]), out.dtype)
    (g,) = torch.autograd.grad((out.sin() * weights).sum(), out)
    return x.detach(), g.detach()


def reference_grads(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample parameter gradients ``{name: (B, *shape)}`` of the same loss (``vmap(grad)``)."""
    out_shape = tuple(module(x[:1]).shape[1:])
    weights = loss_weights(out_shape, x.dtype if x.is_floating_point() else torch.float32)

    def loss(mod, params, sample):
        return (call(mod, params, sample[0]).sin() * weights).sum()

    return per_sample_param_grads(module, loss, (x,))


def reference_layout(module: nn.Module, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Flatten reference gradients ``(B, d)`` in the normative materialize layout."""
    weight, bias = grads["weight"], grads.get("bias")
    batch = weight.shape[0]
    if isinstance(module, nn.Embedding):
        return weight.reshape(batch, -1)
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
        parts = [weight.reshape(batch, -1)] + ([] if bias is None else [bias.reshape(batch, -1)])
        return torch.cat(parts, dim=1)
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        c_in = weight.shape[1]
        w = weight.reshape(batch, c_in, -1)  # (B, C_in, C_out/G·Πk)
        if bias is None:
            return w.reshape(batch, -1)
        width, c_out = w.shape[2], bias.shape[1]
        full = weight.new_zeros(batch, c_in + 1, width + c_out)
        full[:, :c_in, :width] = w
        full[:, c_in, width:] = bias
        return full.reshape(batch, -1)
    w = weight.reshape(batch, weight.shape[1], -1)  # linear / conv: (B, out, in')
    if bias is not None:
        w = torch.cat([w, bias.unsqueeze(-1)], dim=-1)
    return w.reshape(batch, -1)

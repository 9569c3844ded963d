"""Private helpers for the normalization family (LayerNorm, RMSNorm, GroupNorm, InstanceNorm).

Each helper returns the normalized activation ``x̂`` laid out ``(B, S, d)``:
the weight gradient of the layer is ``Σ_s x̂_s ⊙ g_s`` with ``g`` laid out
the same way. Statistics are computed in at least float32 (as the PyTorch
kernels do) and the result is cast back to the requested dtype.
"""

from __future__ import annotations

import math

import torch


def _check_trailing_shape(x: torch.Tensor, shape: tuple[int, ...], layer_type: str) -> None:
    """Raise ``ValueError`` unless ``x`` is ``(B, *lead, *shape)``."""
    if x.ndim <= len(shape) or tuple(x.shape[x.ndim - len(shape) :]) != shape:
        raise ValueError(
            f"{layer_type}: input of shape {tuple(x.shape)} does not end in "
            f"normalized_shape {shape} after a batch axis; capture the layer input "
            "(B, [T, ...], *normalized_shape) and pass the layer's normalized_shape."
        )


def fold_positions(x: torch.Tensor, trailing: int) -> torch.Tensor:
    """``(B, *lead, *feat)`` → ``(B, Π lead, Π feat)`` with ``trailing = len(feat)``."""
    batch = x.shape[0]
    lead = math.prod(x.shape[1 : x.ndim - trailing])
    return x.reshape(batch, lead, -1)


def layer_norm_hat(
    x: torch.Tensor, normalized_shape: tuple[int, ...], eps: float, layer_type: str
) -> torch.Tensor:
    """LayerNorm's ``(x-μ)/sqrt(σ²+eps)`` (biased variance), ``(B, S, Π normalized_shape)``."""
    _check_trailing_shape(x, normalized_shape, layer_type)
    x3 = fold_positions(x, len(normalized_shape))
    xf = x3.to(torch.promote_types(x3.dtype, torch.float32))
    var, mean = torch.var_mean(xf, dim=-1, unbiased=False, keepdim=True)
    return ((xf - mean) * torch.rsqrt(var + eps)).to(x.dtype)


def rms_norm_hat(
    x: torch.Tensor, normalized_shape: tuple[int, ...], eps: float | None, layer_type: str
) -> torch.Tensor:
    """RMSNorm's ``x·rsqrt(mean(x²)+eps)``, ``(B, S, Π normalized_shape)``.

    ``eps=None`` uses the machine epsilon of the dtype the statistics are
    computed in (``x``'s dtype, at least float32), as ``torch.rms_norm`` does.
    """
    _check_trailing_shape(x, normalized_shape, layer_type)
    x3 = fold_positions(x, len(normalized_shape))
    xf = x3.to(torch.promote_types(x3.dtype, torch.float32))
    if eps is None:
        eps = torch.finfo(xf.dtype).eps
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def group_norm_hat(
    x: torch.Tensor, num_groups: int, num_channels: int, eps: float, layer_type: str
) -> torch.Tensor:
    """Per-group normalization of ``(N, C, *spatial)`` over channels+spatial, ``(N, S, C)``."""
    if x.ndim < 2 or x.shape[1] != num_channels or num_channels % num_groups:
        raise ValueError(
            f"{layer_type}: expected input (N, {num_channels}, *spatial) with "
            f"{num_channels} channels divisible into {num_groups} groups, got shape "
            f"{tuple(x.shape)}; pass the layer input and the layer's num_channels/num_groups."
        )
    n = x.shape[0]
    xf = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(n, num_groups, -1)
    var, mean = torch.var_mean(xf, dim=-1, unbiased=False, keepdim=True)
    x_hat = ((xf - mean) * torch.rsqrt(var + eps)).reshape(n, num_channels, -1)
    return x_hat.transpose(1, 2).to(x.dtype)

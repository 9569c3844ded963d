"""Preprocessing: raw captured factors ``(a, g)`` → canonical per-family factors.

Every family is reduced to batch-first factors whose per-sample weight
gradient is a sum over a token/patch axis ``S`` (see ``materialize.py``):

* **outer** (linear, conv): ``a' : (B, S, K)``, ``g' : (B, S, D)``,
  ``dW_i = Σ_s g'_is a'_isᵀ`` laid out row-major ``(D, K)``. Linear keeps its
  rank (``(B, D)`` stays 2-D; more than one position axis is folded into one);
  with a bias a ones column is appended to ``a``. Conv uses im2col:
  ``a' : (N, L, C_in·Πk [+1])``, ``g' : (N, L, C_out)``.
* **conv-transpose** (weight ``(C_in, C_out/G, *k)``): ``a' : (N, L, C_in)``
  (input positions), ``g'`` = im2col of ``g`` ``(N, L, C_out·Πk)`` with the
  layer's stride/padding/dilation, ``dW_i = Σ_s a'_isᵀ ⊗ g'_is`` laid out
  row-major ``(C_in, C_out/G·Πk)``. With a bias both gain one extra location
  and feature block: location rows are ``[a_s, 0]`` / ``[g_s, 0_{C_out}]`` and
  the extra location is ``[0, 1]`` / ``[0, Σ_spatial g]``, so the
  ``(C_in+1, C_out/G·Πk + C_out)`` result holds the weight gradient in its
  top-left block, the bias gradient in the last row's last ``C_out`` entries,
  and zeros elsewhere.
* **grouped** conv / conv-transpose (``groups = G > 1``, depthwise included):
  the group is folded into the token axis so that the generic kernels stay
  exact and produce the compact per-group layout with no cross-group entries.
  Conv: ``a' : (N, G·L, C_in/G·Πk [+1])`` (rows ``j·L + l`` hold group ``j``'s
  patches), ``g' : (N, G·L, C_out)`` (rows of group ``j`` carry only group
  ``j``'s output channels, the others are zero) → ``(C_out, C_in/G·Πk [+1])``.
  Conv-transpose: ``a' : (N, G·L, C_in)`` (rows of group ``j`` carry only group
  ``j``'s input channels), ``g' : (N, G·L, C_out/G·Πk)`` → ``(C_in,
  C_out/G·Πk)`` (+ bias block as above). Token pairs of different groups have
  a zero inner product on one side, so ghost dot products are exact too.
* **norm**: ``a' = x̂``, ``g'`` : ``(B, S, d)`` (GroupNorm/InstanceNorm:
  ``(N, spatial, C)``); with a bias ``a' = [x̂, 1]``, ``g' = [g, g]``;
  ``dγ, dβ = Σ_s a'⊙g'``.
* **embedding**: ``a'`` integer ids ``(B, T)``, ``g' : (B, T, E)`` with
  padding positions zeroed; EmbeddingBag ``(N, E)`` output gradients are
  broadcast to the bag positions (divided by the bag size for ``"mean"``).

Float tensors are processed in the compute dtype (``dtypes.resolve``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.norm import (
    fold_positions,
    group_norm_hat,
    layer_norm_hat,
    rms_norm_hat,
)
from dattri_llm.gradient.ops.types import (
    ALL_LAYER_TYPES,
    CONV_TYPES,
    EMBEDDING_TYPES,
    PARAM_GRAD_TYPES,
    is_conv,
    is_conv_transpose,
    is_embedding,
    is_linear,
    is_norm,
)

_INSTANCE_NORM_TYPES = frozenset({"nn.InstanceNorm1d", "nn.InstanceNorm2d", "nn.InstanceNorm3d"})


# --------------------------------------------------------------------------- validation


def check_layer_type(layer_type: str) -> None:
    """Raise ``ValueError`` unless ``layer_type`` is one of :data:`ALL_LAYER_TYPES`."""
    if layer_type in ALL_LAYER_TYPES:
        return
    if layer_type == PARAM_GRAD_TYPES:
        raise ValueError(
            f"Layer type {PARAM_GRAD_TYPES!r} holds batch-level parameter gradients, "
            "which have no per-sample factors to preprocess or materialize."
        )
    raise ValueError(
        f"Unknown layer type {layer_type!r}; it must be one of {sorted(ALL_LAYER_TYPES)}."
    )


def _shapes(a: torch.Tensor, g: torch.Tensor) -> str:
    return f"a {tuple(a.shape)}, g {tuple(g.shape)}"


def _check_tensors(a: object, g: object, layer_type: str) -> None:
    """Type and rank ≥ 1 checks shared by every family."""
    if not isinstance(a, torch.Tensor) or not isinstance(g, torch.Tensor):
        raise TypeError(
            f"{layer_type}: factors must be tensors, got a {type(a).__name__}, "
            f"g {type(g).__name__}."
        )
    if a.ndim == 0 or g.ndim == 0:
        raise ValueError(f"{layer_type}: factors must have a batch axis, got {_shapes(a, g)}.")


def _check_batch(a: torch.Tensor, g: torch.Tensor, layer_type: str) -> None:
    if a.shape[0] != g.shape[0]:
        raise ValueError(
            f"{layer_type}: activation and output gradient disagree on the batch size "
            f"({_shapes(a, g)}); pass both factors of the same batch, batch-first."
        )


def spatial_rank(layer_type: str) -> int:
    """Spatial rank of a conv / conv-transpose / InstanceNorm type (``"nn.Conv2d"`` → 2)."""
    return int(layer_type[-2])


def _as_tuple(value: Any, rank: int, name: str, layer_type: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * rank
    result = tuple(int(v) for v in value)
    if len(result) != rank:
        raise ValueError(
            f"{layer_type}: {name}={value!r} must be an int or a sequence of {rank} ints."
        )
    return result


def _kwarg(module_kwargs: dict, key: str, layer_type: str) -> Any:
    if key not in module_kwargs:
        raise ValueError(
            f"{layer_type}: module_kwargs lacks {key!r} (got keys {sorted(module_kwargs)}); "
            "build them with ops.extract_module_kwargs(module, layer_type) or the "
            "dattri_llm.utils.module builders."
        )
    return module_kwargs[key]


# --------------------------------------------------------------------------- module kwargs


def _module_attr(module: nn.Module, name: str, layer_type: str) -> Any:
    if not hasattr(module, name):
        raise TypeError(
            f"Module {type(module).__name__} declared as {layer_type!r} has no attribute "
            f"{name!r}; declare its true layer type or pass module_kwargs explicitly."
        )
    return getattr(module, name)


def extract_module_kwargs(module: nn.Module, layer_type: str) -> dict:
    """Hyperparameters the kernels need for ``module`` of type ``layer_type`` (picklable).

    Always ``{"has_bias": module.bias is not None}`` plus: Embedding
    ``num_embeddings, padding_idx``; EmbeddingBag ``num_embeddings, mode,
    padding_idx``; conv / conv-transpose ``kernel_size, stride, padding,
    dilation, groups``; LayerNorm / RMSNorm ``normalized_shape, eps``;
    GroupNorm ``num_groups, num_channels, eps``; InstanceNorm ``num_features,
    eps``. Raises ``NotImplementedError`` for an embedding with
    ``scale_grad_by_freq=True``, a conv whose ``padding_mode`` is not
    ``"zeros"``, or an InstanceNorm tracking running statistics.
    """
    check_layer_type(layer_type)
    kwargs: dict[str, Any] = {"has_bias": getattr(module, "bias", None) is not None}
    if is_embedding(layer_type):
        if _module_attr(module, "scale_grad_by_freq", layer_type):
            raise NotImplementedError(
                f"{layer_type} with scale_grad_by_freq=True scales gradients by batch-level "
                "token counts, so per-sample gradients are not defined; set "
                "scale_grad_by_freq=False or exclude this layer."
            )
        kwargs["num_embeddings"] = int(_module_attr(module, "num_embeddings", layer_type))
        if layer_type == "nn.EmbeddingBag":
            kwargs["mode"] = _module_attr(module, "mode", layer_type)
        kwargs["padding_idx"] = _module_attr(module, "padding_idx", layer_type)
    elif is_conv(layer_type) or is_conv_transpose(layer_type):
        mode = getattr(module, "padding_mode", "zeros")
        if mode != "zeros":
            raise NotImplementedError(
                f"{layer_type} with padding_mode={mode!r} is not supported (only 'zeros'); "
                "exclude this layer or use zero padding."
            )
        for key in ("kernel_size", "stride", "dilation"):
            kwargs[key] = tuple(_module_attr(module, key, layer_type))
        padding = _module_attr(module, "padding", layer_type)
        kwargs["padding"] = padding if isinstance(padding, str) else tuple(padding)
        kwargs["groups"] = int(getattr(module, "groups", 1))
    elif layer_type in ("nn.LayerNorm", "nn.RMSNorm"):
        kwargs["normalized_shape"] = tuple(_module_attr(module, "normalized_shape", layer_type))
        kwargs["eps"] = _module_attr(module, "eps", layer_type)
    elif layer_type == "nn.GroupNorm":
        for key in ("num_groups", "num_channels", "eps"):
            kwargs[key] = _module_attr(module, key, layer_type)
    elif layer_type in _INSTANCE_NORM_TYPES:
        if getattr(module, "track_running_stats", False):
            raise NotImplementedError(
                f"{layer_type} with track_running_stats=True normalizes with running "
                "statistics in eval mode, which the captured factors do not carry; use "
                "track_running_stats=False or exclude this layer."
            )
        for key in ("num_features", "eps"):
            kwargs[key] = _module_attr(module, key, layer_type)
    return kwargs


# --------------------------------------------------------------------------- helpers


def to_3d(x: torch.Tensor) -> torch.Tensor:
    """``(B, D)`` → ``(B, 1, D)``; other ranks unchanged."""
    return x.unsqueeze(1) if x.ndim == 2 else x


def _append_ones(x: torch.Tensor) -> torch.Tensor:
    """Append a ones column on the last axis: ``(..., K)`` → ``(..., K+1)``."""
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)


def _group_rows(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(N, L, C)`` → ``(N, G·L, C)``: rows ``j·L + l`` keep only group ``j``'s channels."""
    n, length, channels = x.shape
    eye = torch.eye(groups, dtype=x.dtype, device=x.device).reshape(1, groups, 1, groups, 1)
    blocks = x.reshape(n, 1, length, groups, channels // groups) * eye
    return blocks.reshape(n, groups * length, channels)


def _groups_to_rows(cols: torch.Tensor, groups: int) -> torch.Tensor:
    """``(N, L, G·W)`` (group-major features) → ``(N, G·L, W)`` (row ``j·L + l``)."""
    n, length, width = cols.shape
    per_group = cols.reshape(n, length, groups, width // groups).transpose(1, 2)
    return per_group.reshape(n, groups * length, width // groups)


def _padding_pairs(
    padding: Any, kernel: tuple[int, ...], dilation: tuple[int, ...], layer_type: str
) -> tuple[tuple[int, int], ...]:
    """Per-axis ``(left, right)`` zero padding, resolving ``"same"`` / ``"valid"``."""
    if padding == "valid":
        return tuple((0, 0) for _ in kernel)
    if padding == "same":
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return tuple((t // 2, t - t // 2) for t in totals)
    if isinstance(padding, str):
        raise ValueError(
            f"{layer_type}: padding={padding!r} is not supported; use 'same', 'valid' or ints."
        )
    return tuple((p, p) for p in _as_tuple(padding, len(kernel), "padding", layer_type))


def _im2col(
    x: torch.Tensor,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    pads: tuple[tuple[int, int], ...],
    dilation: tuple[int, ...],
) -> torch.Tensor:
    """Patches of ``x : (N, C, *spatial)`` → ``(N, *out_spatial, C, *kernel)``."""
    rank = len(kernel)
    flat_pad = [p for pair in reversed(pads) for p in pair]
    if any(flat_pad):
        x = F.pad(x, flat_pad)
    for axis in range(rank):
        span = dilation[axis] * (kernel[axis] - 1) + 1
        x = x.unfold(2 + axis, span, stride[axis])
        if dilation[axis] > 1:
            x = x[..., :: dilation[axis]]
    order = (0, *range(2, 2 + rank), 1, *range(2 + rank, 2 + 2 * rank))
    return x.permute(order)


def _conv_geometry(module_kwargs: dict, layer_type: str) -> tuple:
    """``(kernel, stride, pads, dilation, groups)`` from ``module_kwargs``."""
    rank = spatial_rank(layer_type)
    kernel = _as_tuple(
        _kwarg(module_kwargs, "kernel_size", layer_type), rank, "kernel_size", layer_type
    )
    stride = _as_tuple(_kwarg(module_kwargs, "stride", layer_type), rank, "stride", layer_type)
    dilation = _as_tuple(
        _kwarg(module_kwargs, "dilation", layer_type), rank, "dilation", layer_type
    )
    pads = _padding_pairs(
        _kwarg(module_kwargs, "padding", layer_type), kernel, dilation, layer_type
    )
    groups = int(module_kwargs.get("groups", 1))
    return kernel, stride, pads, dilation, groups


def _check_conv_ranks(
    a: torch.Tensor, g: torch.Tensor, layer_type: str, groups: int, a_channels: str
) -> None:
    rank = spatial_rank(layer_type)
    if a.ndim != rank + 2 or g.ndim != rank + 2:
        raise ValueError(
            f"{layer_type}: expected batched factors a (N, C_in, *{rank} spatial) and "
            f"g (N, C_out, *{rank} spatial), got {_shapes(a, g)}; add a batch axis to "
            "unbatched inputs."
        )
    if a.shape[1] % groups or g.shape[1] % groups:
        raise ValueError(
            f"{layer_type}: channel counts of {_shapes(a, g)} are not divisible by "
            f"groups={groups}; pass the layer's groups in module_kwargs ({a_channels})."
        )


# --------------------------------------------------------------------------- families


def _preprocess_linear(
    a: torch.Tensor, g: torch.Tensor, module_kwargs: dict, include_bias: bool, layer_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if a.ndim < 2 or a.ndim != g.ndim or a.shape[:-1] != g.shape[:-1]:
        raise ValueError(
            f"{layer_type}: expected a (B, [T, ...], D_in) and g (B, [T, ...], D_out) with "
            f"matching leading axes, got {_shapes(a, g)}."
        )
    if a.ndim > 3:
        a = a.reshape(a.shape[0], -1, a.shape[-1])
        g = g.reshape(g.shape[0], -1, g.shape[-1])
    if include_bias and module_kwargs.get("has_bias", False):
        a = _append_ones(a)
    return a, g


def _preprocess_conv(
    a: torch.Tensor, g: torch.Tensor, module_kwargs: dict, include_bias: bool, layer_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel, stride, pads, dilation, groups = _conv_geometry(module_kwargs, layer_type)
    _check_conv_ranks(a, g, layer_type, groups, "weight (C_out, C_in/groups, *kernel)")
    cols = _im2col(a, kernel, stride, pads, dilation)
    rank = len(kernel)
    if tuple(cols.shape[1 : 1 + rank]) != tuple(g.shape[2:]):
        raise ValueError(
            f"{layer_type}: im2col of a gives output spatial shape "
            f"{tuple(cols.shape[1 : 1 + rank])} but g has {tuple(g.shape[2:])} "
            f"({_shapes(a, g)}); module_kwargs {module_kwargs} do not match the layer."
        )
    n, c_out = g.shape[:2]
    length = math.prod(g.shape[2:])
    cols = cols.reshape(n, length, -1)
    g_rows = g.reshape(n, c_out, length).transpose(1, 2)
    if groups > 1:
        cols = _groups_to_rows(cols, groups)
        g_rows = _group_rows(g_rows, groups)
    if include_bias and module_kwargs.get("has_bias", False):
        cols = _append_ones(cols)
    return cols, g_rows


def _preprocess_conv_transpose(
    a: torch.Tensor, g: torch.Tensor, module_kwargs: dict, include_bias: bool, layer_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel, stride, pads, dilation, groups = _conv_geometry(module_kwargs, layer_type)
    _check_conv_ranks(a, g, layer_type, groups, "weight (C_in, C_out/groups, *kernel)")
    cols = _im2col(g, kernel, stride, pads, dilation)
    rank = len(kernel)
    in_spatial = tuple(a.shape[2:])
    if any(c < s for c, s in zip(cols.shape[1 : 1 + rank], in_spatial)):
        raise ValueError(
            f"{layer_type}: im2col of g gives spatial shape {tuple(cols.shape[1 : 1 + rank])}, "
            f"smaller than the input's {in_spatial} ({_shapes(a, g)}); module_kwargs "
            f"{module_kwargs} do not match the layer."
        )
    # output_padding ≥ stride (allowed when dilation is larger) yields extra windows: drop them.
    cols = cols[(slice(None), *(slice(0, s) for s in in_spatial))]
    n, c_in = a.shape[:2]
    length = math.prod(in_spatial)
    cols = cols.reshape(n, length, -1)
    a_rows = a.reshape(n, c_in, length).transpose(1, 2)
    if groups > 1:
        a_rows = _group_rows(a_rows, groups)
        cols = _groups_to_rows(cols, groups)
    if include_bias and module_kwargs.get("has_bias", False):
        a_rows, cols = _append_conv_transpose_bias(a_rows, cols, g)
    return a_rows, cols


def _append_conv_transpose_bias(
    a_rows: torch.Tensor, cols: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the bias feature block and the extra bias location (see module docstring)."""
    n, _, c_in = a_rows.shape
    c_out = g.shape[1]
    bias_grad = g.reshape(n, c_out, -1).sum(-1)
    a_rows = torch.cat([a_rows, a_rows.new_zeros(n, a_rows.shape[1], 1)], dim=-1)
    a_extra = a_rows.new_zeros(n, 1, c_in + 1)
    a_extra[..., -1] = 1
    cols = torch.cat([cols, cols.new_zeros(n, cols.shape[1], c_out)], dim=-1)
    g_extra = torch.cat([cols.new_zeros(n, 1, cols.shape[-1] - c_out), bias_grad[:, None]], -1)
    return torch.cat([a_rows, a_extra], dim=1), torch.cat([cols, g_extra], dim=1)


def _normalized_shape(module_kwargs: dict, layer_type: str) -> tuple[int, ...]:
    shape = _kwarg(module_kwargs, "normalized_shape", layer_type)
    return (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)


def _preprocess_norm(
    a: torch.Tensor, g: torch.Tensor, module_kwargs: dict, include_bias: bool, layer_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if a.shape != g.shape:
        raise ValueError(
            f"{layer_type}: activation and output gradient must have the same shape, "
            f"got {_shapes(a, g)}."
        )
    if layer_type in ("nn.LayerNorm", "nn.RMSNorm"):
        shape = _normalized_shape(module_kwargs, layer_type)
        if layer_type == "nn.LayerNorm":
            a_hat = layer_norm_hat(a, shape, _kwarg(module_kwargs, "eps", layer_type), layer_type)
        else:
            a_hat = rms_norm_hat(a, shape, module_kwargs.get("eps"), layer_type)
        g_rows = fold_positions(g, len(shape))
    else:
        if layer_type == "nn.GroupNorm":
            groups = _kwarg(module_kwargs, "num_groups", layer_type)
            channels = _kwarg(module_kwargs, "num_channels", layer_type)
        else:
            channels = groups = _kwarg(module_kwargs, "num_features", layer_type)
            if a.ndim == spatial_rank(layer_type) + 1:  # unbatched (C, *spatial)
                a, g = a.unsqueeze(0), g.unsqueeze(0)
        a_hat = group_norm_hat(
            a, groups, channels, _kwarg(module_kwargs, "eps", layer_type), layer_type
        )
        g_rows = g.reshape(g.shape[0], channels, -1).transpose(1, 2)
    if include_bias and module_kwargs.get("has_bias", False):
        return torch.cat([a_hat, torch.ones_like(a_hat)], dim=-1), torch.cat(
            [g_rows, g_rows], dim=-1
        )
    return a_hat, g_rows


def _preprocess_embedding(
    a: torch.Tensor, g: torch.Tensor, module_kwargs: dict, layer_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if a.is_floating_point() or a.is_complex():
        raise TypeError(f"{layer_type}: activation must hold integer token ids, got {a.dtype}.")
    if a.ndim == 1:  # unbatched (e.g. positional) input: one sample
        a, g = a.unsqueeze(0), g.unsqueeze(0)
    if g.ndim != a.ndim + 1 or g.shape[:-1] != a.shape:
        raise ValueError(
            f"{layer_type}: expected ids a (B, T) and g (B, T, E), got {_shapes(a, g)}."
        )
    ids = a.reshape(a.shape[0], -1)
    g = g.reshape(g.shape[0], ids.shape[1], g.shape[-1])
    padding_idx = module_kwargs.get("padding_idx")
    if padding_idx is not None:
        g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
    return ids, g


def _preprocess_embedding_bag(
    a: torch.Tensor, g: torch.Tensor, module_kwargs: dict, layer_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    mode = _kwarg(module_kwargs, "mode", layer_type)
    if mode not in ("sum", "mean"):
        raise NotImplementedError(
            f"{layer_type} with mode={mode!r} is not supported (only 'sum' and 'mean'): "
            "its gradient depends on the argmax positions; exclude this layer."
        )
    if a.ndim != 2:
        raise NotImplementedError(
            f"{layer_type}: only 2-D input (N, T) of fixed-size bags is supported, got ids of "
            f"shape {tuple(a.shape)}. A 1-D input with offsets cannot be attributed from the "
            "captured ids alone: pad the bags to a common length with padding_idx and call "
            "the layer on the 2-D input."
        )
    if a.is_floating_point() or a.is_complex():
        raise TypeError(f"{layer_type}: activation must hold integer token ids, got {a.dtype}.")
    if g.ndim != 2:
        raise ValueError(f"{layer_type}: expected ids a (N, T) and g (N, E), got {_shapes(a, g)}.")
    _check_batch(a, g, layer_type)
    n, length = a.shape
    g = g.unsqueeze(1).expand(n, length, g.shape[-1])
    padding_idx = module_kwargs.get("padding_idx")
    if padding_idx is None:
        return a, (g / length if mode == "mean" else g.clone())
    keep = (a != padding_idx).unsqueeze(-1)
    g = g * keep
    if mode == "mean":
        g = g / keep.sum(dim=1, keepdim=True).clamp(min=1)
    return a, g


# --------------------------------------------------------------------------- public


def preprocess_factors(
    a: torch.Tensor,
    g: torch.Tensor,
    layer_type: str,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical batch-first factors ``(a', g')`` of one layer (see module docstring).

    ``module_kwargs=None`` means the factors are final: they are returned
    unchanged. Raises ``ValueError``/``TypeError`` on unknown layer types and
    inconsistent shapes, ``NotImplementedError`` on unsupported layer modes.
    """
    check_layer_type(layer_type)
    _check_tensors(a, g, layer_type)
    if module_kwargs is None:
        return a, g
    if not isinstance(module_kwargs, dict):
        raise TypeError(
            f"{layer_type}: module_kwargs must be a dict or None, got "
            f"{type(module_kwargs).__name__}; use ops.extract_module_kwargs(module, layer_type)."
        )
    a, g = dtypes.align(a, g)
    if layer_type == "nn.EmbeddingBag":
        return _preprocess_embedding_bag(a, g, module_kwargs, layer_type)
    if layer_type in EMBEDDING_TYPES:
        return _preprocess_embedding(a, g, module_kwargs, layer_type)
    if is_norm(layer_type):
        return _preprocess_norm(a, g, module_kwargs, include_bias, layer_type)
    _check_batch(a, g, layer_type)
    if layer_type == "nn.Bilinear":
        raise NotImplementedError(
            f"nn.Bilinear (a {tuple(a.shape)}, g {tuple(g.shape)}): its weight gradient "
            "Σ_t g ⊗ x1 ⊗ x2 needs both inputs, but only input[0] is captured; capture this "
            "layer with the param_grad hook family or exclude it."
        )
    if is_linear(layer_type):
        return _preprocess_linear(a, g, module_kwargs, include_bias, layer_type)
    if layer_type in CONV_TYPES:
        return _preprocess_conv(a, g, module_kwargs, include_bias, layer_type)
    return _preprocess_conv_transpose(a, g, module_kwargs, include_bias, layer_type)


def preprocess_factorized(
    f: Factorized, layer_type: str, include_bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`preprocess_factors` on a ``Factorized`` (made batch-first, its ``module_kwargs``)."""
    f = f.as_batch_first()
    return preprocess_factors(
        f.activation, f.pre_activation_grad, layer_type, f.module_kwargs, include_bias
    )

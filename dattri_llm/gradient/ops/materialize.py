"""Materialization: factors → flattened per-sample gradients ``(B, d)``.

The coordinate order is the layout documented in docs/API.md:

* linear / conv: row-major ``(D_out, D_in' [+1])`` (bias = last column of each
  row; grouped conv: compact ``(C_out, C_in/groups·Πk [+1])``; HF ``Conv1D``
  is reported ``(out, in)``, i.e. its weight transposed);
* conv-transpose: row-major ``(C_in [+1], C_out/groups·Πk [+C_out])`` of the
  bias-augmented factors (see ``preprocess.py``);
* norms: ``[dγ, dβ]`` with positions summed, or ``(B, S·d)`` per token;
* embeddings: row-major ``(num_embeddings, E)`` (scatter-add by token id).

`materialized_width_estimate` gives a layer's width ``d`` from its factors' shapes
without materializing (``Gradient.materialized_nbytes``, the Fisher accumulator).
"""

from __future__ import annotations

import math

import torch

from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.preprocess import check_layer_type, preprocess_factors
from dattri_llm.gradient.ops.types import is_conv, is_conv_transpose, is_embedding, is_norm


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``(B, *positions, K)`` → ``(B, S, K)`` (``(B, K)`` → ``(B, 1, K)``)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def check_token_ids(ids: torch.Tensor, num_embeddings: int, layer_type: str) -> None:
    """Raise ``ValueError`` if any id in ``ids`` is negative or ``≥ num_embeddings``."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_embeddings:
        raise ValueError(
            f"{layer_type}: token ids of shape {tuple(ids.shape)} range over [{low}, {high}], "
            f"outside [0, {num_embeddings}) for num_embeddings={num_embeddings}; check the "
            "captured ids and module_kwargs['num_embeddings']."
        )


def _materialize_embedding(
    ids: torch.Tensor, g: torch.Tensor, num_embeddings: int, layer_type: str
) -> torch.Tensor:
    """Scatter-add ``g : (B, T, E)`` into ``(B, num_embeddings·E)`` rows by ``ids : (B, T)``."""
    check_token_ids(ids, num_embeddings, layer_type)
    batch, _, width = g.shape
    out = g.new_zeros(batch, num_embeddings, width)
    out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, width), g)
    return out.reshape(batch, -1)


def _check_token_axes(a: torch.Tensor, g: torch.Tensor, layer_type: str) -> None:
    """Raise ``ValueError`` unless ``a : (B, S, K)`` and ``g : (B, S, D)`` share ``(B, S)``."""
    if a.shape[:2] != g.shape[:2]:
        raise ValueError(
            f"{layer_type}: factors disagree on batch/token axes: a {tuple(a.shape)}, "
            f"g {tuple(g.shape)} (expected (B, S, K) and (B, S, D)); pass both factors of the "
            "same capture, batch-first, with this layer's module_kwargs."
        )


def materialize_factors(
    a: torch.Tensor,
    g: torch.Tensor,
    layer_type: str,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
    per_token: bool = False,
) -> torch.Tensor:
    """Per-sample weight gradients ``(B, d)`` from batch-first factors.

    ``dW_i = Σ_t g_it a_itᵀ`` in the layout of the module docstring. Norm
    layers return ``Σ_t a'⊙g'``, or ``(B, T·d)`` when ``per_token=True``
    (ignored for other types). Embeddings require ``module_kwargs`` and raise
    ``ValueError`` for a token id outside ``[0, num_embeddings)``.
    """
    check_layer_type(layer_type)
    if is_embedding(layer_type) and module_kwargs is None:
        raise ValueError(
            f"{layer_type}: materializing an embedding needs module_kwargs (num_embeddings); "
            "pass ops.extract_module_kwargs(module, layer_type)."
        )
    a, g = preprocess_factors(a, g, layer_type, module_kwargs, include_bias)
    a, g = dtypes.align(a, g)
    if is_embedding(layer_type):
        return _materialize_embedding(a, g, int(module_kwargs["num_embeddings"]), layer_type)
    a, g = _tokens(a), _tokens(g)
    _check_token_axes(a, g, layer_type)
    if is_norm(layer_type):
        if a.shape != g.shape:
            raise ValueError(
                f"{layer_type}: norm factors must have equal shapes, got a {tuple(a.shape)}, "
                f"g {tuple(g.shape)}."
            )
        products = a * g
        return products.reshape(a.shape[0], -1) if per_token else products.sum(dim=1)
    if is_conv_transpose(layer_type):
        return torch.bmm(a.transpose(1, 2), g).reshape(a.shape[0], -1)
    return torch.bmm(g.transpose(1, 2), a).reshape(a.shape[0], -1)


def materialize(
    f: Factorized | torch.Tensor,
    layer_type: str,
    include_bias: bool = True,
    per_token: bool = False,
) -> torch.Tensor:
    """Materialize a ``Factorized`` (via :func:`materialize_factors`) or a dense tensor.

    A dense tensor is returned reshaped to ``(B, -1)``.
    """
    if isinstance(f, torch.Tensor):
        return f.reshape(f.shape[0], -1)
    f = f.as_batch_first()
    return materialize_factors(
        f.activation, f.pre_activation_grad, layer_type, f.module_kwargs, include_bias, per_token
    )


def _norm_features(f: Factorized, layer_type: str) -> int:
    """Number of normalised features (parameter length) of a norm layer."""
    kwargs = f.module_kwargs or {}
    if layer_type in ("nn.LayerNorm", "nn.RMSNorm"):
        shape = kwargs.get("normalized_shape")
        return math.prod(shape) if shape is not None else f.activation.shape[-1]
    if layer_type == "nn.GroupNorm":
        return kwargs.get("num_channels", f.activation.shape[1])
    return kwargs.get("num_features", f.activation.shape[1])


def materialized_width_estimate(f: Factorized, layer_type: str) -> int:
    """Materialized width ``d`` per the estimate rule (bias ignored).

    Norms ``d_in``; embeddings ``vocab·E``; conv ``C_out·C_in/groups·Πkernel``;
    conv-transpose ``C_in·C_out/groups·Πkernel``; otherwise ``D_in·D_out``.
    """
    a, g = f.activation, f.pre_activation_grad
    kwargs = f.module_kwargs
    if is_norm(layer_type):
        return _norm_features(f, layer_type)
    if is_embedding(layer_type):
        vocab = (kwargs or {}).get("num_embeddings")
        if vocab is None:
            vocab = int(a.max().item()) + 1 if a.numel() else 0
        return vocab * g.shape[-1]
    if kwargs is not None and (is_conv(layer_type) or is_conv_transpose(layer_type)):
        kernel = math.prod(kwargs["kernel_size"])
        groups = kwargs.get("groups", 1)
        if is_conv(layer_type):
            return g.shape[1] * (a.shape[1] // groups) * kernel
        return a.shape[1] * (g.shape[1] // groups) * kernel
    return a.shape[-1] * g.shape[-1]

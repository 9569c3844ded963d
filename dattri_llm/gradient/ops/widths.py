"""Materialized width of a factorized layer, read from its factor shapes without materializing.

The estimate rule of ``Gradient``'s materialized-size estimate and of
``FisherAccumulator``'s ``max_params`` check.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dattri_llm.gradient.ops.types import is_conv, is_conv_transpose, is_embedding, is_norm

if TYPE_CHECKING:
    # repointed to gradient.model.records at integration
    from dattri_llm.gradient.gradient import Factorized


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

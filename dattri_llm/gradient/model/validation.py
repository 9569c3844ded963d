"""What makes a gradient block valid: metadata entries, payload kinds, factor shapes, batch sizes.

The checks behind :meth:`Gradient.validate <dattri_llm.gradient.gradient.Gradient.validate>`,
one layer at a time (:func:`validate_layer`) and across layers (:func:`validate_batch_sizes`).
"""

from __future__ import annotations

import torch

from dattri_llm.gradient.model.records import Factorized, GradientBlock
from dattri_llm.gradient.ops.types import (
    ALL_LAYER_TYPES,
    PARAM_GRAD_TYPES,
    is_conv,
    is_conv_transpose,
    is_norm,
)

_REPRESENTATIONS = ("materialized", "factorized")
_INDEXINGS = ("batch", "batch_token")


def _check_factor_shapes(name: str, layer_type: str, f: Factorized) -> None:
    """Raise ``ValueError`` if the factors of layer ``name`` are inconsistent for its type."""
    a, g = f.activation, f.pre_activation_grad
    if layer_type == "nn.EmbeddingBag":
        ok = a.ndim == 2 and g.ndim == 2 and a.shape[0] == g.shape[0]
        rule = "a (B, T) and g (B, E) both 2-D with equal batch"
    elif layer_type == "nn.Embedding":
        ok = a.ndim == 2 and g.ndim == 3 and a.shape == g.shape[:2]
        rule = "a (B, T) integer ids and g (B, T, E) with a.shape == g.shape[:2]"
    elif is_norm(layer_type):
        ok = a.shape == g.shape
        rule = "a and g shaped like the normalised input (a.shape == g.shape)"
    elif is_conv(layer_type) or is_conv_transpose(layer_type):
        ok = a.ndim >= 2 and g.ndim >= 2 and a.shape[f.batch_axis] == g.shape[f.batch_axis]
        rule = "a (N, C_in, *spatial) and g (N, C_out, *spatial) with equal batch N"
    else:
        ok = a.shape[:-1] == g.shape[:-1]
        rule = "a (B, [T,] D_in) and g (B, [T,] D_out) with a.shape[:-1] == g.shape[:-1]"
    if not ok:
        raise ValueError(
            f"Gradient: layer {name!r} ({layer_type}) has inconsistent factors: activation "
            f"{tuple(a.shape)}, pre_activation_grad {tuple(g.shape)}; expected {rule}."
        )


def validate_layer(block: GradientBlock, name: str, value: object) -> None:
    """Validate one layer's metadata and payload (``ValueError`` / ``TypeError``)."""
    representation = block.representation.get(name)
    if representation is None:
        raise ValueError(
            f"Gradient: layer {name!r} has no representation entry; set representation"
            f"[{name!r}] to 'factorized' or 'materialized'."
        )
    if representation not in _REPRESENTATIONS:
        raise ValueError(
            f"Gradient: layer {name!r} has representation {representation!r}; it must be "
            f"one of {_REPRESENTATIONS}."
        )
    layer_type = block.layer_types.get(name)
    if layer_type is None:
        raise ValueError(
            f"Gradient: layer {name!r} has no layer_types entry; set it to the canonical "
            f"layer type (e.g. 'nn.Linear') or {PARAM_GRAD_TYPES!r}."
        )
    if block.indexing[name] not in _INDEXINGS:
        raise ValueError(
            f"Gradient: layer {name!r} has indexing {block.indexing[name]!r}; it must be one "
            f"of {_INDEXINGS}."
        )
    if representation == "factorized":
        _validate_factorized(name, layer_type, value)
    else:
        _validate_dense(block, name, layer_type, value)


def _validate_factorized(name: str, layer_type: str, value: object) -> None:
    """Validate a ``"factorized"`` payload."""
    if not isinstance(value, Factorized):
        raise TypeError(
            f"Gradient: layer {name!r} is marked 'factorized' but holds a "
            f"{type(value).__name__}; wrap the factors in Factorized(a, g, ...) or mark the "
            "layer 'materialized'."
        )
    if layer_type not in ALL_LAYER_TYPES:
        raise ValueError(
            f"Gradient: factorized layer {name!r} has layer type {layer_type!r}, which no "
            f"kernel knows; it must be one of {sorted(ALL_LAYER_TYPES)} (a materialized "
            "payload may carry any label)."
        )
    for label, factor in (
        ("activation", value.activation),
        ("pre_activation_grad", value.pre_activation_grad),
    ):
        if not isinstance(factor, torch.Tensor):
            raise TypeError(
                f"Gradient: layer {name!r} factor {label} is a {type(factor).__name__}; "
                "factors must be tensors."
            )
        if factor.ndim == 0:
            raise ValueError(
                f"Gradient: layer {name!r} factor {label} is 0-D; factors need a batch axis."
            )
    _check_factor_shapes(name, layer_type, value)


def _validate_dense(block: GradientBlock, name: str, layer_type: str, value: object) -> None:
    """Validate a ``"materialized"`` payload."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Gradient: layer {name!r} is marked 'materialized' but holds a "
            f"{type(value).__name__}; store a (B, d) or (B, T, d) tensor or mark it "
            "'factorized'."
        )
    if layer_type == PARAM_GRAD_TYPES:
        return
    if value.ndim == 0:
        raise ValueError(
            f"Gradient: layer {name!r} holds a 0-D tensor; a materialized payload is (B, d) "
            "or (B, T, d)."
        )
    if block.indexing[name] == "batch_token" and value.ndim != 3:
        raise ValueError(
            f"Gradient: layer {name!r} is 'batch_token' but its tensor has shape "
            f"{tuple(value.shape)}; a per-token payload is (B, T, d) — reshape it or use "
            "indexing 'batch'."
        )


def validate_batch_sizes(batches: dict[str, int]) -> None:
    """Per-sample layers must agree on batch size (batch-1 layers exempt).

    Args:
        batches: ``{layer: sample count}`` of the non-``param_grad`` layers.
    """
    distinct = {b for b in batches.values() if b != 1}
    if len(distinct) > 1:
        detail = ", ".join(f"{n!r}: {b}" for n, b in batches.items())
        raise ValueError(
            f"Gradient: layers disagree on batch size ({detail}); every per-sample layer "
            "must have the same batch size (or 1 for a broadcast layer)."
        )

"""Parameter-shaped tensors in the materialize layout of a layer's captured gradient.

A Linear / conv layer is ``(out, K)`` row-major with the bias as an extra last
column (HF ``Conv1D`` transposed to ``(out, in)``), an embedding its weight
rows, a norm layer ``[weight, bias]``; these helpers lay out all coordinates
or gather a subset (a ``"mask"`` capture's) without forming the rest.
"""

from __future__ import annotations

import torch

from dattri_llm.gradient.ops.types import (
    CONV_TYPES,
    EMBEDDING_TYPES,
    LINEAR_TYPES,
    NORM_TYPES,
)

# Layouts: "outer" = (out, K [+1 bias column]); "concat" = [weight, bias] flattened;
# "rows" = the weight flattened row-major (no bias).
_HF_CONV1D = "transformers.pytorch_utils.Conv1D"
_UNSUPPORTED_LINEAR = frozenset({"nn.Bilinear"})
_SUPPORTED_TYPES = (LINEAR_TYPES - _UNSUPPORTED_LINEAR) | CONV_TYPES | EMBEDDING_TYPES | NORM_TYPES


def _layout(layer_type: str) -> str:
    if layer_type in NORM_TYPES:
        return "concat"
    if layer_type in EMBEDDING_TYPES:
        return "rows"
    return "outer"


def _weight_matrix(weight: torch.Tensor, layer_type: str) -> torch.Tensor:
    """``(out, K)`` view of a linear / conv weight (HF ``Conv1D`` transposed)."""
    if layer_type == _HF_CONV1D:
        return weight.t()
    return weight.reshape(weight.shape[0], -1)


def _flatten_layer(
    weight: torch.Tensor, bias: torch.Tensor | None, layer_type: str
) -> torch.Tensor:
    """All ``(d,)`` coordinates of parameter-shaped ``weight``/``bias``, materialize layout."""
    layout = _layout(layer_type)
    if layout == "outer":
        matrix = _weight_matrix(weight, layer_type)
        if bias is not None:
            matrix = torch.cat([matrix, bias.reshape(-1, 1)], dim=1)
        return matrix.reshape(-1)
    if layout == "concat" and bias is not None:
        return torch.cat([weight.reshape(-1), bias.reshape(-1)])
    return weight.reshape(-1)


def _gather_layer(
    weight: torch.Tensor, bias: torch.Tensor | None, layer_type: str, idx: torch.Tensor
) -> torch.Tensor:
    """Coordinates ``idx`` of the layer's flattened layout without forming all of it."""
    if _layout(layer_type) != "outer":
        return _flatten_layer(weight, bias, layer_type)[idx]
    matrix = _weight_matrix(weight, layer_type)
    k = matrix.shape[1]
    width = k + (bias is not None)
    rows, cols = idx // width, idx % width
    values = matrix[rows, cols.clamp(max=k - 1)]
    if bias is None:
        return values
    return torch.where(cols == k, bias.reshape(-1)[rows], values)


def _lay_out(
    layer_type: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    idx: torch.Tensor | None,
) -> torch.Tensor:
    """Parameter-shaped ``weight``/``bias`` in materialize layout, all coordinates or ``idx``."""
    if idx is None:
        return _flatten_layer(weight, bias, layer_type)
    return _gather_layer(weight, bias, layer_type, idx.to(weight.device))

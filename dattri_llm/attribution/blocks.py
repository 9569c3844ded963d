"""What the attribution tier does to one gradient block, layer by layer.

Which layers carry per-sample gradients (batch-level ``param_grad`` layers do
not), scaling each sample's rows, and the layout a held test representation
gets for scoring: factorized layers the cost rule prefers dense materialized
within a memory budget (:func:`finalize_factors`), raw factors preprocessed
once into final factors.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.dot import effective_dims, maybe_use_materialized_gram
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.preprocess import preprocess_factorized
from dattri_llm.gradient.ops.types import (
    PARAM_GRAD_TYPES,
    is_conv,
    is_embedding,
    is_linear,
    is_norm,
)
from dattri_llm.utils.cache import CacheBudget


def per_sample_layers(block: Gradient) -> list[str]:
    """Layers of ``block`` that carry per-sample gradients (not batch-level ``param_grad``)."""
    return sorted(n for n, t in block.layer_types.items() if t != PARAM_GRAD_TYPES)


def layer_rows(block: Gradient, name: str) -> torch.Tensor:
    """Layer ``name`` of ``block`` as dense ``(B, D)`` per-sample rows.

    Factorized and low-rank records are materialized; dense per-token rows
    ``(B, T, D)`` are summed over tokens; other tensors are flattened per sample.
    """
    value = block.data[name]
    if isinstance(value, torch.Tensor):
        if block.indexing[name] == "batch_token" and value.dim() == 3:
            return value.sum(1)
        return value.reshape(value.shape[0], -1)
    return materialize(value, block.layer_types[name])


def _drop_param_grad(block: Gradient) -> Gradient:
    """Remove batch-level ``param_grad`` layers (no per-sample gradient) from ``block``."""
    keep = per_sample_layers(block)
    if len(keep) == len(block.layer_types):
        return block
    if not keep:
        raise ValueError(
            "a gradient block holds only param_grad (batch-level) layers, which carry no "
            "per-sample gradient; capture layers with the linear_io hook family"
        )
    warnings.warn(
        "param_grad layers are batch-level and were dropped from scoring: "
        f"{sorted(set(block.layer_types) - set(keep))}",
        UserWarning,
        stacklevel=4,
    )
    return block.select_layers(keep)


def scale_rows(block: Gradient, factors: torch.Tensor) -> Gradient:
    """``block`` with sample ``i``'s gradient multiplied by ``factors[i]`` in every layer.

    Factorized layers scale their output-gradient factor (the gradient is
    linear in it); dense layers scale their rows. ``param_grad`` layers pass
    through.
    """
    data = dict(block.data)
    for name in per_sample_layers(block):
        value = block.data[name]
        if isinstance(value, Factorized):
            grad = value.pre_activation_grad
            shape = [1] * grad.dim()
            shape[value.batch_axis] = -1
            scaled = grad * factors.to(grad).reshape(shape)
            data[name] = Factorized(
                value.activation, scaled, value.module_kwargs, value.batch_first
            )
        else:
            data[name] = value * factors.to(value).reshape(-1, *([1] * (value.dim() - 1)))
    return Gradient(
        dict(block.representation),
        data,
        dict(block.layer_types),
        dict(block.indexing),
        validate_on_init=False,
    )


# ---------------------------------------------------------------------------- test-side layout
def _prefers_dense(value: Any, layer_type: str) -> bool:
    """Whether the cost rule prefers scoring a factorized test layer as a dense block."""
    if is_embedding(layer_type) or is_norm(layer_type):
        return False
    batch, seq, k, d = effective_dims(value, layer_type)
    return maybe_use_materialized_gram(batch, batch, seq, k, d)


def finalize_factors(
    rep: Gradient, *, budget: CacheBudget | int | None = None, held: int = 0
) -> Gradient:
    """Materialize the factorized layers of a held test ``rep`` that score cheaper dense.

    A layer is materialized when the routing rule
    (``ops.maybe_use_materialized_gram`` with equal batch sizes on both sides)
    prefers the dense route and the dense block fits in ``budget`` (a
    ``CacheBudget``, a byte cap, or ``None`` = 35 % of the free memory of the
    rep's device) on top of ``held`` bytes already held. Other layers stay as
    they are.
    """
    if budget is None:
        budget = CacheBudget(rep.device)
    elif isinstance(budget, int):
        budget = CacheBudget(limit_bytes=budget)
    held = held + rep.nbytes

    def convert(name: str, value: Any, layer_type: str) -> Any:
        nonlocal held
        if rep.representation[name] != "factorized" or not _prefers_dense(value, layer_type):
            return value
        single = rep.select_layers([name])
        extra = single.materialized_nbytes
        if not budget.fits(extra, held):
            return value
        held += extra
        return materialize(value, layer_type)

    factorized = [n for n, kind in rep.representation.items() if kind == "factorized"]
    if not factorized:
        return rep
    return rep.map_layers(convert, layers=factorized)


def _preprocess_layers(rep: Gradient, *, conv: bool = True) -> Gradient:
    """Preprocess raw linear (and, with ``conv``, conv) factors once into final factors.

    Final factors carry the bias column (and the im2col patches), so kernels that see
    the layer several times do not redo (and re-allocate) the preprocessing each time.
    """
    names = [
        name
        for name, kind in rep.representation.items()
        if kind == "factorized"
        and rep.data[name].module_kwargs is not None
        and rep.layer_types[name] != "nn.Bilinear"
        and (is_linear(rep.layer_types[name]) or (conv and is_conv(rep.layer_types[name])))
    ]
    if not names:
        return rep

    def preprocess(_name: str, value: Any, layer_type: str) -> Any:
        a, g = preprocess_factorized(value, layer_type)
        return Factorized(a, g, module_kwargs=None)

    return rep.map_layers(preprocess, layers=names)

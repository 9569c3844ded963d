"""How the inner products read gradient blocks: shared layers, dense rows, layer sums.

The helpers behind the block-level functions of :mod:`dattri_llm.gradient.ops.dot`
(``layerwise_cross_dot``, ``layerwise_cross_dot_per_token``) and the similarity maths of
:mod:`dattri_llm.gradient.ops.similarity`: which layers two blocks share, a dense layer
payload as ``(B, d)`` rows, the layer-summed result with broadcast layers expanded, and
errors that name the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from dattri_llm.gradient.model.records import GradientBlock
from dattri_llm.gradient.ops.dot_kernels import _shape
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES


def _shared_layers(
    train: GradientBlock, test: GradientBlock, layers: Iterable[str] | None
) -> list[str]:
    """Layer names in both blocks (train order), restricted to ``layers`` when given."""
    wanted = None if layers is None else ({layers} if isinstance(layers, str) else set(layers))
    return [n for n in train.data if n in test.data and (wanted is None or n in wanted)]


def _dense_rows(block: GradientBlock, name: str) -> Tensor:
    """A dense layer payload as ``(B, d)`` rows.

    ``"batch_token"`` payloads ``(B, T, d)`` are summed over tokens; a ``param_grad``
    payload (batch-level, no sample axis) is one broadcast row.
    """
    x = block.data[name]
    if block.layer_types[name] == PARAM_GRAD_TYPES:
        return x.reshape(1, -1)
    if block.indexing.get(name) == "batch_token" and x.dim() == 3:
        return x.sum(1)
    return x.reshape(x.shape[0], -1)


def _factorized_types_agree(train: GradientBlock, test: GradientBlock, name: str) -> str:
    """The shared layer type of a layer factorized on both sides (``ValueError`` if they differ)."""
    t1, t2 = train.layer_types[name], test.layer_types[name]
    if t1 != t2:
        raise ValueError(
            f"layer {name!r} is {t1!r} in the train block but {t2!r} in the test block; "
            "both sides of an inner product must be captured (and projected) the same way."
        )
    return t1


def _named(name: str, fn, *args):
    """``fn(*args)``, prefixing the layer name to a ``ValueError``/``TypeError`` message."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as err:
        if repr(name) in str(err):
            raise
        raise type(err)(f"layer {name!r}: {err}") from err


def _sum_broadcast(per_layer: dict[str, Tensor], fn: str) -> Tensor:
    """Sum per-layer results, expanding batch-1 (broadcast) layers on axes 0 and last."""
    first = next(iter(per_layer.values()))
    shape = list(first.shape)
    for m in per_layer.values():
        shape[0], shape[-1] = max(shape[0], m.shape[0]), max(shape[-1], m.shape[-1])
    dtype = first.dtype
    for m in per_layer.values():
        dtype = torch.promote_types(dtype, m.dtype)
    total = first.new_zeros(shape, dtype=dtype)
    for name, m in per_layer.items():
        if m.shape[0] not in (1, shape[0]) or m.shape[-1] not in (1, shape[-1]):
            raise ValueError(
                f"{fn}: layer {name!r} gives {_shape(m)} but other layers give {tuple(shape)}; "
                "layers must share batch sizes (or have batch size 1 to broadcast)."
            )
        total += m
    return total


def _fits(total: Tensor, m: Tensor) -> bool:
    """Whether adding ``m`` into ``total`` leaves its shape and dtype as they are."""
    return (
        m.dim() == total.dim()
        and m.shape[0] in (1, total.shape[0])
        and m.shape[-1] in (1, total.shape[-1])
        and m.shape[1:-1] == total.shape[1:-1]
        and torch.promote_types(total.dtype, m.dtype) == total.dtype
    )


def _sum_layers(names: list[str], compute: Callable[[str], Tensor], fn: str) -> Tensor:
    """``_sum_broadcast({name: compute(name)})`` holding one layer's result at a time.

    Each result is added into the running sum as soon as it is computed, so the
    peak is the sum plus one layer's matrix rather than one matrix per layer.
    The sum starts as zeros of the first result's shape and dtype and adds the
    results in order, as :func:`_sum_broadcast` does when the first result has
    the final shape and dtype (bit for bit). A later result that would widen
    the shape or promote the dtype (a broadcast first layer, mixed dtypes)
    makes it start over through :func:`_sum_broadcast` of every result.
    """
    total = None
    for name in names:
        m = compute(name)
        if total is None:
            total = m.new_zeros(m.shape, dtype=m.dtype)
        elif not _fits(total, m):
            del total, m
            return _sum_broadcast({n: compute(n) for n in names}, fn)
        total += m
        del m
    return total

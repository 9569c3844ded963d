"""What the per-layer curvature accumulators share.

The check of the layer type (canonical or short alias) and ``module_kwargs``
they are fed, and the sum of their partial sums across ranks on the union of
the ranks' layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from dattri_llm.gradient.ops.types import resolve_layer_type
from dattri_llm.utils.distributed import all_reduce_named_sums

if TYPE_CHECKING:
    from collections.abc import Callable

Tensor = torch.Tensor


def accumulator_layer_type(layer_type: str, module_kwargs: dict | None, fn: str) -> str:
    """Canonical type of ``layer_type`` (short aliases accepted); ``module_kwargs`` checked.

    Raises:
        ValueError: unknown ``layer_type``.
        KeyError: ``module_kwargs`` given without ``"has_bias"``.
    """
    layer_type = resolve_layer_type(layer_type, fn)
    if module_kwargs is not None and "has_bias" not in module_kwargs:
        raise KeyError(
            f"{fn}({layer_type}): module_kwargs {sorted(module_kwargs)} has no 'has_bias' entry; "
            "build it with ops.extract_module_kwargs(module, layer_type), or pass None for "
            "final factors."
        )
    return layer_type


class LayerSums(Protocol):
    """A per-layer accumulator whose partial sums can be reduced across ranks."""

    def partial_sums(self) -> tuple[list[Tensor], int] | None:
        """``(sums, count)`` accumulated here, ``None`` when nothing was."""

    def load_sums(self, sums: list[Tensor], count: int) -> None:
        """Replace the sums and count (by the reduced ones)."""


def all_reduce_layer_accumulators(
    layers: dict[str, LayerSums], factory: Callable[[], LayerSums]
) -> list[str]:
    """Sum per-layer accumulators across ranks on the union of their layers, in place.

    Ranks may hold different layers (control flow) and different row counts:
    the layer names, with the shapes of their sums, are gathered first, then
    every layer of the union is reduced (``utils.distributed.all_reduce_named_sums``);
    a rank without a layer (or with nothing accumulated in it) contributes
    zeros, and gains the layer (``factory()``) holding the global sums and
    count. Every rank must call it. Returns the reduced layer names (those
    accumulated on some rank), sorted. No-op single-process.
    """
    local = {}
    for name, acc in layers.items():
        sums = acc.partial_sums()
        if sums is not None:
            local[name] = sums
    reduced = all_reduce_named_sums(local, "K-FAC accumulator sums")
    for name, (sums, count) in reduced.items():
        if name not in layers:
            layers[name] = factory()
        layers[name].load_sums(sums, count)
    return sorted(reduced)

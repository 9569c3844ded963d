"""The one contract attributors read per-step gradient blocks through: `GradientSource`.

A source yields `StreamBatch` es ``(step, block, identifiers)``. Attributors
branch only on `GradientSource.reusable` (whether a second pass at the same
parameters is possible). `LossFn` is the loss signature the live sources call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from dattri_llm.gradient.model.container import Gradient

__all__ = ["GradientSource", "LossFn", "StreamBatch"]

StreamBatch = tuple[int, Gradient, list[str]]
LossFn = Callable[[nn.Module, object], torch.Tensor]


@runtime_checkable
class GradientSource(Protocol):
    """Iterable of `StreamBatch` es with a length and a re-iterability flag."""

    def __iter__(self) -> Iterator[StreamBatch]:
        """(Re)start from the first block."""
        ...

    def __len__(self) -> int:
        """Blocks per pass."""
        ...

    @property
    def reusable(self) -> bool:
        """Whether the source can be iterated again at the same parameters."""
        ...

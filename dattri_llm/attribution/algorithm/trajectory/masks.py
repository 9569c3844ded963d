"""Disjoint coordinate masks of the trajectory sweep (AdamW-influence's ``num_masks``).

Averaging a sweep over ``num_masks`` disjoint coordinate groups (each a part of
every layer) bounds the carried ``(n_test, p)`` blocks; ``num_masks=1`` keeps
every coordinate together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["check_num_masks", "coordinate_groups", "mask_groups"]

_GROUP_SEED = 0


def coordinate_groups(widths: Mapping[str, int], num_masks: int) -> list[torch.Tensor | None]:
    """``num_masks`` disjoint index sets over the concatenated coordinates (``[None]`` for 1).

    Each layer's coordinates are permuted (seeded by the width) and split into
    ``num_masks`` near-equal parts; group ``j`` takes part ``j`` of every
    layer, sorted.

    Raises:
        ValueError: a layer with fewer coordinates than ``num_masks``.
    """
    if num_masks == 1:
        return [None]
    groups: list[list[torch.Tensor]] = [[] for _ in range(num_masks)]
    offset = 0
    for name, width in widths.items():
        if width < num_masks:
            raise ValueError(
                f"num_masks={num_masks} exceeds the {width} captured coordinates of layer "
                f"{name!r}; use fewer masks or capture more coordinates"
            )
        gen = torch.Generator().manual_seed(_GROUP_SEED * 1_000_003 + width)
        parts = torch.tensor_split(torch.randperm(width, generator=gen), num_masks)
        for group, part in zip(groups, parts, strict=True):
            group.append(part.sort().values + offset)
        offset += width
    return [torch.cat(group) for group in groups]


def check_num_masks(num_masks: object) -> int:
    """``num_masks`` if it is an int ``>= 1``, else ``ValueError``."""
    if isinstance(num_masks, bool) or not isinstance(num_masks, int) or num_masks < 1:
        raise ValueError(f"num_masks must be an int >= 1, got {num_masks!r}")
    return num_masks


def mask_groups(num_masks: int) -> Callable[[Mapping[str, int]], list[torch.Tensor | None]]:
    """The engine's coordinate groups of ``num_masks`` disjoint masks."""
    return lambda layout: coordinate_groups(layout, num_masks)

"""Re-batching gradient blocks: `rebatch_blocks` cuts any source's dense blocks to size.

Consecutive dense blocks of one layer structure are concatenated until a batch
holds at least the requested number of rows; every other block passes through.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.gradient.stream.readers import concatenate_gradients
from dattri_llm.gradient.stream.source import StreamBatch

__all__ = ["rebatch_blocks"]


def _is_mergeable(block: Gradient, rows: int) -> bool:
    """Dense (no factorized, no ``param_grad`` layer) with one row per sample on every layer.

    A broadcast layer (one row shared by the block's ``rows > 1`` samples) is
    not mergeable: concatenating it with another block would average its row.
    """
    return all(
        not isinstance(value, Factorized)
        and block.layer_types[name] != PARAM_GRAD_TYPES
        and value.shape[0] == rows
        for name, value in block.data.items()
    )


def _structure(block: Gradient) -> tuple:
    return tuple(
        sorted((name, block.layer_types[name], block.indexing[name]) for name in block.data)
    )


class _DenseBuffer:
    """Pending dense rows: pieces of ``(per-row steps, block, identifiers)``."""

    def __init__(self) -> None:
        self.pieces: list[tuple[list[int], Gradient, list[str]]] = []
        self.rows = 0

    def add(self, steps: list[int], block: Gradient, ids: list[str]) -> None:
        self.pieces.append((steps, block, ids))
        self.rows += len(steps)

    def take(self) -> tuple[list[int], Gradient, list[str]]:
        """Every pending row as one block; the buffer is left empty."""
        steps = [s for piece in self.pieces for s in piece[0]]
        ids = [h for piece in self.pieces for h in piece[2]]
        block = concatenate_gradients([piece[1] for piece in self.pieces])
        self.pieces, self.rows = [], 0
        return steps, block, ids


def rebatch_blocks(
    source: Iterable[StreamBatch], batch_size: int
) -> Iterator[tuple[list[int], Gradient, list[str]]]:
    """Re-batch dense blocks to at least ``batch_size`` rows; other blocks pass through.

    Yields ``(per-row steps, block, identifiers)``. Consecutive dense blocks
    (all layers materialized with one row per sample, same layers) are
    concatenated until at least ``batch_size`` rows have accumulated; a batch
    may exceed ``batch_size`` and no block is split. A factorized block, a
    block with a broadcast or ``param_grad`` layer, or one with another layer
    structure first flushes the pending rows, then is yielded on its own.

    Raises:
        ValueError: ``batch_size < 1``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"rebatch_blocks: batch_size must be an int >= 1, got {batch_size!r}.")
    buffer = _DenseBuffer()
    structure = None
    for step, block, ids in source:
        rows = [step] * len(ids)
        if not _is_mergeable(block, len(ids)):
            if buffer.rows:
                yield buffer.take()
            yield rows, block, list(ids)
            del block  # release it before the source produces the next one
            continue
        if buffer.rows and _structure(block) != structure:
            yield buffer.take()
        structure = _structure(block)
        buffer.add(rows, block, list(ids))
        del block
        if buffer.rows >= batch_size:
            yield buffer.take()
    if buffer.rows:
        yield buffer.take()

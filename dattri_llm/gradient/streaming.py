"""Gradient sources: the one contract attributors read per-step gradient blocks through.

A source yields `StreamBatch` es ``(step, block, identifiers)``. Attributors
branch only on `GradientSource.reusable` (whether a second pass at the same
parameters is possible). This module holds the protocol, the store-backed
`DiskGradientSource` and the helpers `rebatch_blocks`, `autocast_for`,
`move_batch`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from dattri_llm.gradient.datasets import (
    GroupBlockDataset,
    concatenate_gradients,
    resolve_layer_filter,
    resolve_steps,
)
from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES

if TYPE_CHECKING:
    from dattri_llm.gradient.storage_manager import GradientStorageManager

__all__ = [
    "DiskGradientSource",
    "GradientSource",
    "GradientStreamer",
    "LossFn",
    "StreamBatch",
    "autocast_for",
    "move_batch",
    "rebatch_blocks",
]

StreamBatch = tuple[int, Gradient, list[str]]
LossFn = Callable[[nn.Module, object], torch.Tensor]

_END = object()


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


def _identity(item: object) -> object:
    return item


def _one_ahead(iterable: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``iterable`` while a background thread already fetches the next item."""
    iterator = iter(iterable)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dattri-llm-prefetch") as pool:
        pending = pool.submit(next, iterator, _END)
        while True:
            item = pending.result()
            if item is _END:
                return
            pending = pool.submit(next, iterator, _END)
            yield item


class DiskGradientSource:
    """Re-iterable source over a `GradientStorageManager` (any residency).

    Yields one block per ``(location, step)`` pair in ``iter_steps`` order: all
    records of that step in that group, batch-concatenated (tokens padded),
    with their identifiers. ``layer_name`` keeps those layers and their
    ``name@k`` virtual layers; ``param_grad`` layers are dropped with a
    `UserWarning`. ``"disk"`` stores are read through a `DataLoader` with
    ``args.dataloader_num_workers`` workers (with 0 workers the next group is
    prefetched on a background thread); RAM stores are read in-process.

    Args:
        file_manager: the store.
        args: attribution arguments (reads ``dataloader_num_workers`` and
            ``should_log``).
        steps: stored steps to read (``None`` = all); see `resolve_steps`.
        layer_name: a layer name or list of names (``None`` = all stored layers).
        desc: progress-bar label; a tqdm bar is shown only when ``desc`` is
            given, ``verbose`` is true and ``args.should_log``.
        verbose: see ``desc``.

    Raises:
        KeyError: a requested layer is not stored.
        ValueError: no requested step is stored, the store is empty, or no
            per-sample layer remains.
        FileNotFoundError: a ``"disk"`` store directory that does not exist.
    """

    def __init__(
        self,
        file_manager: GradientStorageManager,
        args: Any,
        *,
        steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        desc: str | None = None,
        verbose: bool = False,
    ) -> None:
        self._file_manager = file_manager
        self._args = args
        self._steps = resolve_steps(file_manager, steps)
        self._layer_name = [layer_name] if isinstance(layer_name, str) else layer_name
        if self._layer_name is not None:
            self._layer_name = list(self._layer_name)
        self._desc = desc
        self._verbose = verbose
        self._plan = file_manager.iter_steps(self._steps)
        self._num_blocks = sum(len(step_idxs) for _, step_idxs in self._plan)
        location, step_idxs = self._plan[0]
        first = file_manager.load_records(location)[next(iter(step_idxs.values()))[0]]
        resolve_layer_filter(
            first.gradient, self._layer_name, f"gradient store {file_manager.save_dir}"
        )

    @property
    def args(self) -> Any:
        """The attribution arguments."""
        return self._args

    @property
    def file_manager(self) -> GradientStorageManager:
        """The store read from."""
        return self._file_manager

    @property
    def steps(self) -> list[int]:
        """Steps read, ascending."""
        return list(self._steps)

    @property
    def layer_name(self) -> list[str] | None:
        """Layer filter (``None`` = all stored layers)."""
        return None if self._layer_name is None else list(self._layer_name)

    @property
    def reusable(self) -> bool:
        """Always ``True``: a store can be re-read."""
        return True

    def __len__(self) -> int:
        """Number of ``(location, step)`` blocks per pass."""
        return self._num_blocks

    def __repr__(self) -> str:
        """Store, steps and layer filter."""
        return (
            f"DiskGradientSource({self._file_manager!r}, steps={len(self._steps)}, "
            f"blocks={self._num_blocks}, layer_name={self._layer_name})"
        )

    def for_steps(self, steps: int | Iterable[int]) -> DiskGradientSource:
        """Same store and layer filter restricted to ``steps`` (no progress bar).

        Raises:
            ValueError: none of ``steps`` is among this source's steps.
        """
        wanted = {int(steps)} if isinstance(steps, int) else {int(s) for s in steps}
        restricted = [s for s in self._steps if s in wanted]
        if not restricted:
            raise ValueError(
                f"DiskGradientSource.for_steps: none of {sorted(wanted)} is among the source's "
                f"steps {self._steps}."
            )
        return DiskGradientSource(
            self._file_manager, self._args, steps=restricted, layer_name=self._layer_name
        )

    def __iter__(self) -> Iterator[StreamBatch]:
        """Blocks in store order; each group is read once."""
        blocks = (block for group in self._groups() for block in group)
        if self._desc is not None and self._verbose and getattr(self._args, "should_log", True):
            from tqdm.auto import tqdm

            blocks = tqdm(blocks, total=self._num_blocks, desc=self._desc)
        return iter(blocks)

    def _groups(self) -> Iterator[list[StreamBatch]]:
        dataset = GroupBlockDataset.for_store(self._file_manager, self._plan, self._layer_name)
        if self._file_manager.residency != "disk":
            return (dataset[i] for i in range(len(dataset)))
        workers = int(getattr(self._args, "dataloader_num_workers", 0) or 0)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, shuffle=False, num_workers=workers, collate_fn=_identity
        )
        return iter(loader) if workers > 0 else _one_ahead(loader)


# --------------------------------------------------------------------------- helpers


def _is_dense(block: Gradient) -> bool:
    """No factorized and no batch-level ``param_grad`` layer."""
    return all(
        not isinstance(value, Factorized) and block.layer_types[name] != PARAM_GRAD_TYPES
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

    def merged(self) -> tuple[list[int], Gradient, list[str]]:
        steps = [s for piece in self.pieces for s in piece[0]]
        ids = [h for piece in self.pieces for h in piece[2]]
        return steps, concatenate_gradients([piece[1] for piece in self.pieces]), ids

    def take(self, n: int) -> tuple[list[int], Gradient, list[str]]:
        """The first ``n`` rows; the rest stays buffered."""
        steps, block, ids = self.merged()
        self.pieces, self.rows = [], 0
        if len(steps) > n:
            rest = block.slice("batch", list(range(n, len(steps))))
            self.add(steps[n:], rest, ids[n:])
            block = block.slice("batch", list(range(n)))
        return steps[:n], block, ids[:n]


def rebatch_blocks(
    source: Iterable[StreamBatch], batch_size: int
) -> Iterator[tuple[list[int], Gradient, list[str]]]:
    """Re-batch dense blocks to ``batch_size`` rows; factorized blocks pass through.

    Yields ``(per-row steps, block, identifiers)``. Consecutive dense blocks
    (all layers materialized, same layers) are concatenated and cut into
    blocks of exactly ``batch_size`` rows (the last of a run may be smaller);
    a factorized block (or one with another layer structure) first flushes
    the pending rows, and factorized blocks are yielded one at a time.

    Raises:
        ValueError: ``batch_size < 1``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"rebatch_blocks: batch_size must be an int >= 1, got {batch_size!r}.")
    buffer = _DenseBuffer()
    structure = None
    for step, block, ids in source:
        rows = [step] * len(ids)
        if not _is_dense(block):
            if buffer.rows:
                yield buffer.take(buffer.rows)
            yield rows, block, list(ids)
            del block  # release it before the source produces the next one
            continue
        if buffer.rows and _structure(block) != structure:
            yield buffer.take(buffer.rows)
        structure = _structure(block)
        buffer.add(rows, block, list(ids))
        del block
        while buffer.rows >= batch_size:
            yield buffer.take(batch_size)
    if buffer.rows:
        yield buffer.take(buffer.rows)


def autocast_for(args: Any) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``args.device`` for ``args.bf16`` / ``args.fp16``, else a no-op."""
    if getattr(args, "bf16", False):
        dtype = torch.bfloat16
    elif getattr(args, "fp16", False):
        dtype = torch.float16
    else:
        return contextlib.nullcontext()
    device = torch.device(getattr(args, "device", "cpu"))
    return torch.autocast(device_type=device.type, dtype=dtype)


def move_batch(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor moved to ``device`` (tensor, mapping, list/tuple; else as is)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        moved = {key: move_batch(value, device) for key, value in batch.items()}
        return moved if type(batch) is dict else _rebuild_mapping(batch, moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_batch(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(value, device) for value in batch)
    return batch


def _rebuild_mapping(original: Mapping, moved: dict) -> Mapping:
    """A mapping of ``original``'s type holding ``moved`` (plain dict when it cannot be rebuilt)."""
    try:
        return type(original)(moved)
    except TypeError:
        return moved


# GradientStreamer / ReplayGradientSource live in dattri_llm.gradient._live (another module).
from dattri_llm.gradient._live import GradientStreamer  # noqa: E402

"""Reading a gradient store back as blocks: `DiskGradientSource` and the reading helpers.

A *block* is ``(step, gradient, identifiers)``: all records of one step inside
one stored group, batch-concatenated (token axes right-padded) in record order.
Blocks come in `GradientStorageManager.iter_steps` order (store order of the
groups, then ascending step), and each group is read once even when it holds
several steps. `DiskGradientSource` is the re-iterable gradient source over a
store. `GradientFileMultiStepDataset` / `make_gradient_multistep_dataloader`
are the reading helpers of the reference design (one ``{step: (block,
hashes)}`` item per group file); they read through the same `GroupBlockDataset`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch.utils.data
from tqdm.auto import tqdm

from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.model.layout import concatenate_batches
from dattri_llm.gradient.model.records import Factorized, base_layer_name
from dattri_llm.gradient.stream.source import StreamBatch

if TYPE_CHECKING:
    from dattri_llm.gradient.storage_manager import GradientStorageManager

__all__ = [
    "DiskGradientSource",
    "GradientFileMultiStepDataset",
    "GroupBlockDataset",
    "concatenate_gradients",
    "group_blocks",
    "iter_gradient_blocks",
    "make_gradient_multistep_dataloader",
    "resolve_layer_filter",
    "resolve_steps",
    "select_block_layers",
]

StepPlan = list[tuple[str, dict[int, list[int]]]]

_END = object()
_PAGE_BYTES = 4096


def resolve_steps(
    file_manager: GradientStorageManager, steps: int | Iterable[int] | None = None
) -> list[int]:
    """Stored steps to read: all (``steps=None``) or the ascending intersection with ``steps``.

    Raises:
        FileNotFoundError: a ``"disk"`` store whose directory does not exist.
        ValueError: the store holds no records, or the intersection is empty.
    """
    if file_manager.residency == "disk" and not file_manager.save_dir.is_dir():
        raise FileNotFoundError(
            f"gradient store directory {file_manager.save_dir} does not exist; collect "
            f"gradients into it first (e.g. with OffloadCallback)."
        )
    available = file_manager.available_steps()
    if not available:
        raise ValueError(
            f"gradient store {file_manager.save_dir} holds no records; collect gradients "
            f"into it first."
        )
    if steps is None:
        return available
    requested = {int(steps)} if isinstance(steps, int) else {int(s) for s in steps}
    chosen = sorted(requested.intersection(available))
    if not chosen:
        raise ValueError(
            f"none of the requested steps {sorted(requested)} is stored in gradient store "
            f"{file_manager.save_dir}; stored steps: {available}."
        )
    return chosen


def resolve_layer_filter(gradient: Gradient, layer_name: Sequence[str] | None, where: str) -> None:
    """Check a layer filter against a stored gradient; warn about dropped ``param_grad`` layers.

    Raises:
        KeyError: a requested layer (or base name of a ``name@k`` layer) is not stored.
        ValueError: no per-sample layer remains after dropping ``param_grad`` layers.
    """
    stored = set(gradient.layer_names)
    if layer_name is not None:
        known = stored | {base_layer_name(n) for n in stored}
        missing = [n for n in layer_name if n not in known]
        if missing:
            raise KeyError(f"layers {missing} are not in {where}; stored layers: {sorted(stored)}.")
        stored = {n for n in stored if n in layer_name or base_layer_name(n) in layer_name}
    param_grad = sorted(n for n in stored if gradient._is_param_grad(n))
    if param_grad:
        warnings.warn(
            f"{where}: dropping batch-level param_grad layers {param_grad} (they hold no "
            f"per-sample gradient); capture them with linear_io to attribute them.",
            UserWarning,
            stacklevel=3,
        )
    if len(param_grad) == len(stored):
        raise ValueError(
            f"{where}: no per-sample layer remains (selected layers {sorted(stored)} are all "
            f"param_grad); select linear_io layers."
        )


def select_block_layers(
    gradient: Gradient, layer_name: Sequence[str] | None, per_sample_only: bool = True
) -> Gradient:
    """``gradient`` restricted to ``layer_name`` (plus ``name@k``).

    ``per_sample_only`` also drops the batch-level ``param_grad`` layers.
    """
    if layer_name is not None:
        gradient = gradient.select_layers(layer_name, include_derived=True)
    if not per_sample_only:
        return gradient
    keep = [n for n in gradient.data if not gradient._is_param_grad(n)]
    if len(keep) == len(gradient.data):
        return gradient
    return gradient.select_layers(keep)


def concatenate_gradients(gradients: Sequence[Gradient]) -> Gradient:
    """Batch-concatenate blocks in order.

    Blocks of one structure with a row per sample on every layer are joined in
    one copy per payload (`concatenate_batches`); others pairwise as a tree
    (``O(n log n)`` copying), which handles broadcast and ``param_grad``
    layers. Both give the same result.
    """
    level = list(gradients)
    if len(level) > 2:
        joined = concatenate_batches(level)
        if joined is not None:
            return joined
    while len(level) > 1:
        paired = [a.concatenate(b, dim="batch") for a, b in zip(level[::2], level[1::2])]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def group_blocks(
    records: Sequence[GradientRecord],
    step_idxs: Mapping[int, Sequence[int]],
    layer_name: Sequence[str] | None = None,
    per_sample_only: bool = True,
) -> list[StreamBatch]:
    """The blocks of one group: per step, its records concatenated, identifiers in order.

    Consecutive records of a step with the same layers form one block; a record
    with another layer set (a micro-batch that skipped a layer, say) starts a
    new block of the same step. ``per_sample_only`` drops ``param_grad`` layers
    (else they are summed over the records, as `Gradient.concatenate` does).
    """
    blocks = []
    for step, idxs in step_idxs.items():
        runs: list[list[GradientRecord]] = []
        for i in idxs:
            record = records[i]
            if runs and set(record.gradient.data) == set(runs[-1][-1].gradient.data):
                runs[-1].append(record)
            else:
                runs.append([record])
        for run in runs:
            gradient = concatenate_gradients(
                [select_block_layers(r.gradient, layer_name, per_sample_only) for r in run]
            )
            identifiers = [
                h
                for r in run
                for h in ([r.input_hash] if isinstance(r.input_hash, str) else r.input_hash)
            ]
            blocks.append((step, gradient, identifiers))
    return blocks


def iter_gradient_blocks(
    file_manager: GradientStorageManager,
    steps: int | Iterable[int] | None = None,
    layer_name: Sequence[str] | None = None,
) -> Iterator[StreamBatch]:
    """Blocks of a store in the calling thread (no prefetch, no layer-filter checks)."""
    for location, step_idxs in file_manager.iter_steps(resolve_steps(file_manager, steps)):
        yield from group_blocks(file_manager.load_records(location), step_idxs, layer_name)


class GroupBlockDataset(torch.utils.data.Dataset):
    """Map-style dataset: item ``i`` = the blocks of the ``i``-th planned group.

    ``per_sample_only`` drops ``param_grad`` layers (see `group_blocks`). In a
    `DataLoader` worker process the blocks are cloned (memory-mapped views are
    not sent across processes).
    """

    def __init__(
        self,
        load: Callable[[str], list[GradientRecord]],
        plan: StepPlan,
        layer_name: Sequence[str] | None,
        per_sample_only: bool = True,
    ) -> None:
        self.load = load
        self.plan = plan
        self.layer_name = None if layer_name is None else list(layer_name)
        self.per_sample_only = per_sample_only

    @classmethod
    def for_store(
        cls,
        file_manager: GradientStorageManager,
        plan: StepPlan,
        layer_name: Sequence[str] | None,
        per_sample_only: bool = True,
    ) -> GroupBlockDataset:
        """Dataset over ``plan``, read through ``file_manager.load_records``.

        The store drops samples that were saved again later from their older
        records; the manager is picklable, so worker processes read the same way.
        """
        return cls(file_manager.load_records, plan, layer_name, per_sample_only)

    def __len__(self) -> int:
        """Number of groups."""
        return len(self.plan)

    def __getitem__(self, index: int) -> list[StreamBatch]:
        """Blocks ``[(step, gradient, identifiers)]`` of group ``index``."""
        blocks = self.blocks(index, self.records(index))
        if torch.utils.data.get_worker_info() is not None:
            blocks = [(step, gradient.clone(), ids) for step, gradient, ids in blocks]
        return blocks

    def records(self, index: int) -> list[GradientRecord]:
        """The stored records of group ``index`` (memory-mapped views for a memmap group)."""
        return self.load(self.plan[index][0])

    def blocks(self, index: int, records: list[GradientRecord]) -> list[StreamBatch]:
        """The blocks of group ``index`` built from its ``records`` (see `group_blocks`)."""
        return group_blocks(records, self.plan[index][1], self.layer_name, self.per_sample_only)


def _layer_list(layer_name: str | Sequence[str] | None) -> list[str] | None:
    """A layer filter as a list (one name → ``[name]``); ``None`` stays ``None``."""
    if layer_name is None:
        return None
    return [layer_name] if isinstance(layer_name, str) else list(layer_name)


class GradientFileMultiStepDataset(torch.utils.data.Dataset):
    """One item per stored group file holding a record of any step in ``steps``.

    Item ``i`` reads that file once and returns ``{step: (block, hashes)}`` for
    every requested step present in it (ascending step): ``block`` is the
    `Gradient` of that step's records in stored order (token axes zero-padded
    to the longest), ``hashes`` their identifiers. Groups come in store order;
    samples re-saved later are read from their newest record only. Inside a
    `DataLoader` worker the tensors are copied so they cross the process
    boundary. ``param_grad`` layers are kept (summed over the records).

    Args:
        file_manager: the store.
        steps: a step or steps to read; steps the store does not hold are ignored.
        layer_name: a layer name or list of names to keep, with their ``name@k``
            use-site layers (``None`` = every stored layer).
    """

    def __init__(
        self,
        file_manager: GradientStorageManager,
        steps: int | Iterable[int],
        layer_name: str | Sequence[str] | None = None,
    ) -> None:
        self.file_manager = file_manager
        self.layer_name = _layer_list(layer_name)
        self._groups = GroupBlockDataset.for_store(
            file_manager, file_manager.iter_steps(steps), self.layer_name, per_sample_only=False
        )

    def __len__(self) -> int:
        """Number of group files holding a requested step."""
        return len(self._groups)

    def __getitem__(self, index: int) -> dict[int, tuple[Gradient, list[str]]]:
        """``{step: (block, hashes)}`` of group file ``index``.

        Raises:
            ValueError: a step's records in this group hold different layer sets
                (they cannot form one block; read the store with
                `iter_gradient_blocks` or `DiskGradientSource`, which keep them apart).
        """
        item: dict[int, tuple[Gradient, list[str]]] = {}
        for step, block, hashes in self._groups[index]:
            if step in item:
                raise ValueError(
                    f"group {self._groups.plan[index][0]!r} holds records of step {step} with "
                    "different layer sets, which cannot form one block; read it with "
                    "iter_gradient_blocks or DiskGradientSource, which keep them apart."
                )
            item[step] = (block, hashes)
        return item


def make_gradient_multistep_dataloader(
    file_manager: GradientStorageManager,
    steps: int | Iterable[int],
    args: Any,
    layer_name: str | Sequence[str] | None = None,
) -> torch.utils.data.DataLoader:
    """A `DataLoader` over `GradientFileMultiStepDataset`: each batch is one ``{step: ...}`` item.

    Batch size 1, no shuffling, the single item returned unchanged; worker and
    pin-memory / persistent / prefetch settings from ``args`` (see `_store_loader`).
    """
    dataset = GradientFileMultiStepDataset(file_manager, steps, layer_name)
    return _store_loader(dataset, file_manager, args)


def _single_item(batch: list[Any]) -> Any:
    """Collate of a batch-size-1 loader: the item itself."""
    return batch[0]


def _store_loader(
    dataset: torch.utils.data.Dataset, file_manager: GradientStorageManager, args: Any
) -> torch.utils.data.DataLoader:
    """Loader over a per-group dataset: one group per batch, in order.

    ``args.dataloader_num_workers`` workers for a ``"disk"`` store, 0 for RAM
    stores; ``dataloader_pin_memory`` (default ``False``), and with workers
    ``dataloader_persistent_workers`` / ``dataloader_prefetch_factor``.
    """
    workers = 0
    if file_manager.residency == "disk":
        workers = int(getattr(args, "dataloader_num_workers", 0) or 0)
    options: dict[str, Any] = {}
    if workers > 0:
        options["persistent_workers"] = bool(getattr(args, "dataloader_persistent_workers", False))
        prefetch = getattr(args, "dataloader_prefetch_factor", None)
        if prefetch is not None:
            options["prefetch_factor"] = int(prefetch)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=1,
        shuffle=False,
        num_workers=workers,
        collate_fn=_single_item,
        pin_memory=bool(getattr(args, "dataloader_pin_memory", False)),
        **options,
    )


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
            del item  # not held while the next item is awaited


def _touch_pages(records: list[GradientRecord]) -> list[GradientRecord]:
    """``records`` after reading one element per page of each payload tensor.

    Memory-mapped parts are then read from disk on the calling thread; nothing
    is copied.
    """
    for record in records:
        for value in record.gradient.data.values():
            if isinstance(value, Factorized):
                parts = (value.activation, value.pre_activation_grad)
            else:
                parts = (value,) if isinstance(value, torch.Tensor) else ()
            for tensor in parts:
                if tensor.is_contiguous() and tensor.numel():
                    stride = max(1, _PAGE_BYTES // tensor.element_size())
                    tensor.reshape(-1)[::stride].sum()
    return records


def _prefetched_groups(dataset: GroupBlockDataset) -> Iterator[list[StreamBatch]]:
    """The groups of ``dataset`` in order, the next group's records read on a background thread.

    The background thread only maps the next group's file and reads its pages;
    the blocks (concatenated copies) are built on the consuming thread, so their
    memory is allocated and freed by one thread and reused from block to block
    instead of accumulating in a second allocator arena.
    """

    def read(index: int) -> list[GradientRecord]:
        return _touch_pages(dataset.records(index))

    count = len(dataset)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dattri-llm-prefetch") as pool:
        pending = pool.submit(read, 0) if count else None
        for index in range(count):
            records = pending.result()
            pending = pool.submit(read, index + 1) if index + 1 < count else None
            blocks = dataset.blocks(index, records)
            del records  # the blocks alone keep what they view
            yield blocks
            del blocks


def _released_blocks(groups: Iterable[list[StreamBatch]]) -> Iterator[StreamBatch]:
    """The blocks of each group in order, each dropped from its group when yielded.

    Neither a yielded block nor a finished group stays referenced here while
    the consumer scores the next block or the next group is awaited, so a
    scored block's tensors (and a group's memory-mapped file) are released as
    soon as the consumer drops them.
    """
    for group in groups:
        pending = group if isinstance(group, list) else list(group)
        del group
        pending.reverse()  # emptied in place (a producer may still hold the list)
        while pending:
            block = pending.pop()
            yield block
            del block


class DiskGradientSource:
    """Re-iterable source over a `GradientStorageManager` (any residency).

    Yields one block per ``(location, step)`` pair in ``iter_steps`` order: all
    records of that step in that group, batch-concatenated (tokens padded),
    with their identifiers. ``layer_name`` keeps those layers and their
    ``name@k`` virtual layers; ``param_grad`` layers are dropped with a
    `UserWarning`. ``"disk"`` stores are read through a `DataLoader` set up as
    in `make_gradient_multistep_dataloader` (``args.dataloader_num_workers``
    workers, pin-memory / persistent / prefetch settings); with 0 workers and
    no pinned memory, a background thread maps the next group's file and
    reads its pages while the blocks are built on the iterating thread. RAM
    stores are read in-process. A yielded block is referenced by nothing here
    once the iteration moves on: reading holds the block being consumed, the
    rest of its group and the next group's records, not the blocks already
    yielded.

    Args:
        file_manager: the store.
        args: the run settings (reads the ``dataloader_*`` settings and
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
        self._layer_name = _layer_list(layer_name)
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
        """The run settings."""
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
        # Same store and (already checked) layer filter: no need to read a record again.
        view = copy.copy(self)
        view._steps = resolve_steps(self._file_manager, restricted)
        view._plan = self._file_manager.iter_steps(view._steps)
        view._num_blocks = sum(len(step_idxs) for _, step_idxs in view._plan)
        view._desc = None
        return view

    def __iter__(self) -> Iterator[StreamBatch]:
        """Blocks in store order; each group is read once."""
        blocks = _released_blocks(self._groups())
        if self._desc is not None and self._verbose and getattr(self._args, "should_log", True):
            blocks = tqdm(blocks, total=self._num_blocks, desc=self._desc)
        return iter(blocks)

    def _groups(self) -> Iterator[list[StreamBatch]]:
        dataset = GroupBlockDataset.for_store(self._file_manager, self._plan, self._layer_name)
        if self._file_manager.residency != "disk":
            return (dataset[i] for i in range(len(dataset)))
        loader = _store_loader(dataset, self._file_manager, self._args)
        if loader.num_workers > 0 or loader.pin_memory:
            return iter(loader) if loader.num_workers > 0 else _one_ahead(loader)
        return _prefetched_groups(dataset)

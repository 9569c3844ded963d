"""Reading a gradient store as a sequence of per-step blocks.

A *block* is ``(step, gradient, identifiers)``: all records of one step inside
one stored group, batch-concatenated (token axes right-padded) in record
order. Blocks come in `GradientStorageManager.iter_steps` order (store order
of the groups, then ascending step), and each group is read once even when
it holds several steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch.utils.data

from dattri_llm.gradient.gradient import Gradient, GradientRecord, base_layer_name
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.gradient.storage_manager import load_group_file

if TYPE_CHECKING:
    from dattri_llm.gradient.storage_manager import GradientStorageManager

__all__ = [
    "GroupBlockDataset",
    "concatenate_gradients",
    "group_blocks",
    "iter_gradient_blocks",
    "resolve_layer_filter",
    "resolve_steps",
    "select_block_layers",
]

Block = tuple[int, Gradient, list[str]]
StepPlan = list[tuple[str, dict[int, list[int]]]]


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


def _is_param_grad(gradient: Gradient, name: str) -> bool:
    return gradient.layer_types[name] == PARAM_GRAD_TYPES


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
    param_grad = sorted(n for n in stored if _is_param_grad(gradient, n))
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


def select_block_layers(gradient: Gradient, layer_name: Sequence[str] | None) -> Gradient:
    """``gradient`` restricted to ``layer_name`` (plus ``name@k``) without ``param_grad`` layers."""
    if layer_name is not None:
        gradient = gradient.select_layers(layer_name, include_derived=True)
    keep = [n for n in gradient.data if not _is_param_grad(gradient, n)]
    if len(keep) == len(gradient.data):
        return gradient
    return gradient.select_layers(keep)


def concatenate_gradients(gradients: Sequence[Gradient]) -> Gradient:
    """Batch-concatenate blocks in order (pairwise tree: ``O(n log n)`` copying)."""
    level = list(gradients)
    while len(level) > 1:
        paired = [a.concatenate(b, dim="batch") for a, b in zip(level[::2], level[1::2])]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def group_blocks(
    records: Sequence[GradientRecord],
    step_idxs: Mapping[int, Sequence[int]],
    layer_name: Sequence[str] | None = None,
) -> list[Block]:
    """One block per step of one group: its records concatenated, identifiers in order."""
    blocks = []
    for step, idxs in step_idxs.items():
        chosen = [records[i] for i in idxs]
        gradient = concatenate_gradients(
            [select_block_layers(r.gradient, layer_name) for r in chosen]
        )
        identifiers = [
            h
            for r in chosen
            for h in ([r.input_hash] if isinstance(r.input_hash, str) else r.input_hash)
        ]
        blocks.append((step, gradient, identifiers))
    return blocks


def iter_gradient_blocks(
    file_manager: GradientStorageManager,
    steps: int | Iterable[int] | None = None,
    layer_name: Sequence[str] | None = None,
) -> Iterator[Block]:
    """Blocks of a store in the calling thread (no prefetch, no layer-filter checks)."""
    for location, step_idxs in file_manager.iter_steps(resolve_steps(file_manager, steps)):
        yield from group_blocks(file_manager.load_records(location), step_idxs, layer_name)


class _DiskGroupLoader:
    """Picklable ``location → records`` reader of a ``"disk"`` store (for worker processes)."""

    def __init__(self, file_manager: GradientStorageManager) -> None:
        self.save_dir = file_manager.save_dir

    def __call__(self, location: str) -> list[GradientRecord]:
        return load_group_file(self.save_dir / location)


class GroupBlockDataset(torch.utils.data.Dataset):
    """Map-style dataset: item ``i`` = the blocks of the ``i``-th planned group.

    In a `DataLoader` worker process the blocks are cloned (memory-mapped
    views are not sent across processes).
    """

    def __init__(
        self,
        load: Callable[[str], list[GradientRecord]],
        plan: StepPlan,
        layer_name: Sequence[str] | None,
    ) -> None:
        self.load = load
        self.plan = plan
        self.layer_name = None if layer_name is None else list(layer_name)

    @classmethod
    def for_store(
        cls,
        file_manager: GradientStorageManager,
        plan: StepPlan,
        layer_name: Sequence[str] | None,
    ) -> GroupBlockDataset:
        """Dataset over ``plan``: disk groups read from their files, RAM groups via the store."""
        load = (
            _DiskGroupLoader(file_manager)
            if file_manager.residency == "disk"
            else file_manager.load_records
        )
        return cls(load, plan, layer_name)

    def __len__(self) -> int:
        """Number of groups."""
        return len(self.plan)

    def __getitem__(self, index: int) -> list[Block]:
        """Blocks ``[(step, gradient, identifiers)]`` of group ``index``."""
        location, step_idxs = self.plan[index]
        blocks = group_blocks(self.load(location), step_idxs, self.layer_name)
        if torch.utils.data.get_worker_info() is not None:
            blocks = [(step, gradient.clone(), ids) for step, gradient, ids in blocks]
        return blocks

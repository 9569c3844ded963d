"""Guarded ``torch.distributed`` helpers, safe with or without a process group."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch

__all__ = ["dist_rank", "dist_world_size", "is_dist_initialized"]


def is_dist_initialized() -> bool:
    """Whether ``torch.distributed`` is available and a default process group exists."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def dist_rank() -> int | None:
    """This process's rank, or ``None`` outside a process group."""
    return torch.distributed.get_rank() if is_dist_initialized() else None


def dist_world_size() -> int:
    """Number of ranks in the default process group (``1`` outside one)."""
    return torch.distributed.get_world_size() if is_dist_initialized() else 1


def _backend_device() -> torch.device:
    """Device collectives run on: the current CUDA device for NCCL, else CPU."""
    if "nccl" in str(torch.distributed.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it (no-op when world size is 1).

    The reduction runs on the backend's device (CUDA for NCCL, else CPU); a
    tensor elsewhere is copied there and the result copied back.
    """
    if dist_world_size() == 1:
        return tensor
    device = _backend_device()
    work = tensor if tensor.device == device else tensor.to(device)
    torch.distributed.all_reduce(work, op=torch.distributed.ReduceOp.SUM)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def dist_barrier() -> None:
    """Synchronise all ranks (no-op outside a process group)."""
    if is_dist_initialized():
        torch.distributed.barrier()


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's picklable ``obj`` in rank order (``[obj]`` outside a process group)."""
    world = dist_world_size()
    if world == 1:
        return [obj]
    gathered: list[object] = [None] * world
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


NamedSums = Mapping[str, tuple[Sequence[torch.Tensor], int]]


def all_reduce_named_sums(
    local: NamedSums, what: str = "sums"
) -> dict[str, tuple[list[torch.Tensor], int]]:
    """Sum named groups of tensors and their counts over ranks, on the union of the names.

    ``local`` maps a name (a layer) to ``(tensors, count)``: this rank's partial
    sums and the rows they cover. Ranks may hold different names: every rank
    first gathers the others' names with the shapes and dtypes of their
    tensors, then reduces the sorted union name by name; a rank without a name
    contributes zeros of the gathered shapes, and the counts go in one float64
    collective. Tensors of one name are reduced in the dtype all ranks promote
    to; a local tensor already of that dtype is reduced in place. Returns
    ``{name: (tensors, count)}`` over the union, sorted by name (``local``'s
    own tensors single-process). Every rank must call it.

    Raises:
        ValueError: ranks hold a name with different tensor shapes (raised on
            every rank, so none is left waiting); ``what`` names the sums.
    """
    if dist_world_size() == 1:
        return {name: (list(local[name][0]), int(local[name][1])) for name in sorted(local)}
    layout = {
        name: [(tuple(t.shape), t.dtype) for t in tensors] for name, (tensors, _) in local.items()
    }
    layouts: list[dict] = all_gather_objects(layout)  # type: ignore[assignment]
    names = sorted(set().union(*layouts))
    reduced: dict[str, tuple[list[torch.Tensor], int]] = {}
    for name in names:
        shapes, dtypes = _agreed_layout(name, layouts, what)
        mine = local[name][0] if name in local else None
        tensors = []
        for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            tensor = (
                mine[index].to(dtype)
                if mine is not None
                else torch.zeros(shape, dtype=dtype, device=_backend_device())
            )
            tensors.append(all_reduce_sum(tensor))
        reduced[name] = (tensors, 0)
    if names:
        counts = torch.tensor(
            [float(local[name][1]) if name in local else 0.0 for name in names],
            dtype=torch.float64,
        )
        all_reduce_sum(counts)
        for name, count in zip(names, counts.tolist()):
            reduced[name] = (reduced[name][0], int(round(count)))
    return reduced


def _agreed_layout(
    name: str, layouts: list[dict], what: str
) -> tuple[list[tuple[int, ...]], list[torch.dtype]]:
    """Shapes every rank holding ``name`` agrees on, and the dtypes they promote to."""
    held = {rank: layout[name] for rank, layout in enumerate(layouts) if name in layout}
    shapes = {rank: [shape for shape, _ in entries] for rank, entries in held.items()}
    first = next(iter(shapes.values()))
    if any(other != first for other in shapes.values()):
        raise ValueError(
            f"{what} of {name!r} have different shapes on different ranks "
            f"({{rank: shapes}} = {shapes}); every rank must capture this layer the same way "
            "(same model, projection and include_bias setting)."
        )
    dtypes = [
        functools.reduce(torch.promote_types, (entries[i][1] for entries in held.values()))
        for i in range(len(first))
    ]
    return first, dtypes

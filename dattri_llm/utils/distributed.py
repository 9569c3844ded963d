"""Guarded ``torch.distributed`` helpers, safe with or without a process group."""

from __future__ import annotations

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

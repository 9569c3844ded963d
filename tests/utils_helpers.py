"""Helpers for tests/utils: a spawnable worker for the 2-process gloo test."""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed_worker(rank: int, world_size: int, init_method: str) -> None:
    """Check the distributed helpers inside a real gloo process group (raises on failure)."""
    from dattri_llm.utils.distributed import (
        all_reduce_sum,
        dist_barrier,
        dist_rank,
        dist_world_size,
        is_dist_initialized,
    )

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        assert is_dist_initialized()
        assert dist_rank() == rank, (dist_rank(), rank)
        assert dist_world_size() == world_size
        values = torch.tensor([rank + 1.0, 10.0 * rank], dtype=torch.float64)
        out = all_reduce_sum(values)
        assert out is values
        expected = torch.tensor([3.0, 10.0], dtype=torch.float64)
        assert torch.equal(values, expected), values
        strided = torch.arange(6.0).reshape(2, 3).T  # non-contiguous input is reduced in place
        all_reduce_sum(strided)
        assert torch.equal(strided, 2 * torch.arange(6.0).reshape(2, 3).T), strided
        dist_barrier()
    finally:
        dist.destroy_process_group()

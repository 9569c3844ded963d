"""Tests of the guarded torch.distributed helpers (single process and 2-process gloo)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from free_port import free_port
from utils_helpers import distributed_worker

from dattri_llm.utils import distributed
from dattri_llm.utils.distributed import (
    all_reduce_sum,
    dist_barrier,
    dist_rank,
    dist_world_size,
    is_dist_initialized,
)


def test_helpers_outside_a_process_group():
    assert not is_dist_initialized()
    assert dist_rank() is None
    assert dist_world_size() == 1
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_sum(t) is t and torch.equal(t, torch.tensor([1.0, 2.0]))
    dist_barrier()  # no-op


def test_helpers_when_distributed_is_unavailable(monkeypatch):
    monkeypatch.setattr(distributed.torch.distributed, "is_available", lambda: False)
    assert not is_dist_initialized()
    assert dist_rank() is None and dist_world_size() == 1
    t = torch.ones(2)
    assert all_reduce_sum(t) is t
    dist_barrier()


def test_two_process_gloo_rank_world_size_all_reduce_and_barrier():
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.start_processes(
        distributed_worker, args=(2, init_method), nprocs=2, join=True, start_method="fork"
    )

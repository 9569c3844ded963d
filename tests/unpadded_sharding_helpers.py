"""Fork worker for the unpadded live-sharding tests (2 gloo ranks, CPU).

Each rank runs the attributors' live path with ``WORLD_SIZE=2`` / ``RANK=r``
(the train set sharded by the streamer, the model wrapped in DDP) on train
sets whose size is not a multiple of 2: ``N = 7`` (4 and 3 samples, 2 batches
each) and ``N = 5`` (3 and 2 samples: rank 1 runs its 2 samples as 2 batches
of 1 so that both ranks run 2 batches). The model is
`kfac_distributed_helpers.SkipNet` with its ``side`` branch on in every batch,
so every sample's gradient is independent of how samples are batched.

Each rank saves ``{N: {method: {"raw_fit", "scores", "row_ids", "test_ids"}}}``
to ``<out_dir>/rank<r>.pt`` (``raw_fit`` is ``None`` for Grad-Dot).
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
from kfac_distributed_helpers import (
    WORLD,
    arguments,
    build_model,
    queries,
    run_attribute,
    samples,
    skip_loss,
)

TRAIN_SIZES = (7, 5)  # neither a multiple of WORLD
CURVATURE_METHODS = ("kfac", "ekfac")


def train_set(n: int) -> list[dict]:
    """``n`` training samples, every one running the ``side`` branch."""
    return samples([True] * n, 30 + n)


def run_grad_dot(args, train: list[dict]) -> dict:
    """One Grad-Dot (TracIn at one checkpoint) ``attribute`` call on a fresh ``SkipNet``."""
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.task import AttributionTask

    attributor = TracInAttributor(args, task=AttributionTask(skip_loss, build_model()))
    score = attributor.attribute(train, queries())
    return {
        "raw_fit": None,
        "scores": score.scores,
        "row_ids": list(score.row_train_ids),
        "test_ids": list(score.test_ids),
    }


def run_methods(out_dir: str, train: list[dict], **extra) -> dict:
    """``{method: result}`` for K-FAC, EK-FAC and Grad-Dot on ``train``."""
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in CURVATURE_METHODS:
            result = run_attribute(method, arguments(f"{out_dir}_{method}", **extra), train)
            results[method] = {key: result[key] for key in ("raw_fit", "scores", "row_ids")}
            results[method]["test_ids"] = result["test_ids"]
        results["grad_dot"] = run_grad_dot(arguments(f"{out_dir}_grad_dot", **extra), train)
    return results


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One rank: every method on every train size, through the sharded live path."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20)
    )
    try:
        results = {n: run_methods(f"{out_dir}/n{n}_rank{rank}", train_set(n)) for n in TRAIN_SIZES}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()

"""Fork worker for the complete-distributed-scores tests (2 gloo ranks, CPU).

Each rank runs ``attribute`` with ``WORLD_SIZE=2`` / ``RANK=r`` (the train set
sharded by the streamer without padding, the model wrapped in DDP) on
``N_TRAIN = 7`` samples (4 on rank 0, 3 on rank 1) and 3 queries, for every
case of `CASES`: Grad-Dot, TracIn over two checkpoints, K-FAC (each at
instance and token granularity), Grad-Dot through a ``"memory"`` store (one
per rank), and Grad-Dot through a ``"disk"`` store that both ranks share
(``SHARED_STORE_CASES``: one ``output_dir``, each rank writing its
``rank_<r>/`` shard, both scoring the whole store). Sample 5 repeats
sample 2 (positions 2 and 5 live on different ranks), so the train set holds
one sample twice, as a single-process run sees it.

Each rank saves ``{case: result}`` to ``<out_dir>/rank<r>.pt`` where a result
is `describe` of the returned score plus ``"saved"``, the score that rank 0
wrote to its ``output_dir`` (read back by rank 0 after a barrier, ``None`` on
rank 1), and ``"wrote_score"``: whether a score file is in the rank's own
``output_dir`` (``False`` for a shared one).
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
from kfac_distributed_helpers import WORLD, build_model, queries, samples, skip_loss

N_TRAIN = 7  # not a multiple of WORLD
DUPLICATE = (2, 5)  # sample 5 is a copy of sample 2 (rank 0 and rank 1)
CASES = {
    "grad_dot_instance": ("tracin", 1, {}),
    "grad_dot_token": ("tracin", 1, {"attribution_granularity": "token"}),
    "tracin_2ckpt_instance": ("tracin", 2, {}),
    "tracin_2ckpt_token": ("tracin", 2, {"attribution_granularity": "token"}),
    "kfac_instance": ("kfac", 1, {"damping": 0.05}),
    "kfac_token": ("kfac", 1, {"damping": 0.05, "attribution_granularity": "token"}),
    "grad_dot_memory_store": ("tracin", 1, {"gradient_cache_residency": "memory"}),
    "grad_dot_disk_store": ("tracin", 1, {"gradient_cache_residency": "disk"}),
}
SHARED_STORE_CASES = ("grad_dot_disk_store",)  # one output_dir (and store) for both ranks


def train_set() -> list[dict]:
    """``N_TRAIN`` samples, every one running the ``side`` branch; sample 5 = sample 2."""
    rows = samples([True] * N_TRAIN, 41)
    rows[DUPLICATE[1]] = {key: value.clone() for key, value in rows[DUPLICATE[0]].items()}
    return rows


def checkpoints(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` state dicts of `build_model`: the seed-0 weights, then scaled copies."""
    base = build_model().state_dict()
    return [{k: v * (1.0 + 0.25 * index) for k, v in base.items()} for index in range(count)]


def describe(score) -> dict:
    """The parts of an ``AttributionScore`` the tests compare."""
    return {
        "scores": score.scores.clone(),
        "row_ids": list(score.row_train_ids),
        "row_steps": list(score.row_steps),
        "row_tokens": None if score.row_token_ids is None else list(score.row_token_ids),
        "test_ids": list(score.test_ids),
    }


def run_case(case: str, out_dir: str, **extra) -> dict:
    """One ``attribute`` call of ``case`` on a fresh model; ``describe`` of its score."""
    from dattri_llm.attribution.algorithm.kronecker import KFACAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.task import AttributionTask

    method, count, options = CASES[case]
    args = AttributionArguments(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        **extra,
    )
    task = AttributionTask(skip_loss, build_model(), checkpoints=checkpoints(count))
    cls = KFACAttributor if method == "kfac" else TracInAttributor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        score = cls(args, task=task).attribute(train_set(), queries(), **options)
    return describe(score)


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One rank: every case through the sharded live path; rank 0 reads back what it saved."""
    import torch.distributed as dist

    from dattri_llm.attribution.score import AttributionScore

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        results = {}
        for case in CASES:
            shared = case in SHARED_STORE_CASES
            case_dir = f"{out_dir}/{case}" if shared else f"{out_dir}/{case}_rank{rank}"
            results[case] = run_case(case, case_dir)
            dist.barrier()
            results[case]["saved"] = (
                describe(AttributionScore.load(case_dir)) if rank == 0 else None
            )
            results[case]["wrote_score"] = not shared and os.path.exists(f"{case_dir}/scores.pt")
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()

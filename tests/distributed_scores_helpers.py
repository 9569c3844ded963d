"""Fork worker for the complete-distributed-scores tests (2 gloo ranks, CPU).

Each rank runs ``attribute`` with ``WORLD_SIZE=2`` / ``RANK=r`` (the train set
sharded by the streamer without padding) on ``N_TRAIN = 7`` samples (4 on
rank 0, 3 on rank 1) and 3 queries, for every case of `CASES`, with the model
wrapped in DDP: Grad-Dot, TracIn over two checkpoints, K-FAC (each at
instance and token granularity), Grad-Dot through a ``"memory"`` store (one
per rank), and Grad-Dot through a ``"disk"`` store that both ranks share
(``SHARED_STORE_CASES``: one ``output_dir``, each rank writing its
``rank_<r>/`` shard, both scoring the whole store). Sample 5 repeats
sample 2 (positions 2 and 5 live on different ranks), so the train set holds
one sample twice, as a single-process run sees it.

Under FSDP: `FSDP_CASES` repeat a case with ``fsdp="full_shard"`` (the
streamer wraps the model in ``FullyShardedDataParallel(use_orig_params=True)``);
`WRAPPED_CASES` give the task a model the worker wrapped in FSDP itself (and,
for checkpoints, `load_through` as the loader): the route for the calls that
``fsdp="full_shard"`` refuses because they would wrap the model twice
(`refusals`: an ensemble of checkpoints, a collected store, a second call on
the same model). `TWINS` maps each of these cases to the case it repeats,
whose single-process score is its reference.

Each rank saves ``{case: result}`` (plus ``"refusals"``) to
``<out_dir>/rank<r>.pt`` where a result is `describe` of the returned score
plus ``"saved"``, the score that rank 0 wrote to its ``output_dir`` (read back
by rank 0 after a barrier, ``None`` on rank 1), ``"wrote_score"``: whether a
score file is in the rank's own ``output_dir`` (``False`` for a shared one),
and ``"wrappers"``: the classes of the wrappers the streamers built
(``[]`` when the task brought its own).
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
FSDP_CASES = {  # the case with fsdp="full_shard" -> the case it repeats
    "grad_dot_instance_fsdp": "grad_dot_instance",
    "grad_dot_token_fsdp": "grad_dot_token",
    "kfac_instance_fsdp": "kfac_instance",
    "kfac_token_fsdp": "kfac_token",
}
WRAPPED_CASES = {  # the task given an FSDP wrapper -> the case it repeats
    "tracin_2ckpt_instance_wrapped": "tracin_2ckpt_instance",
    "grad_dot_memory_store_wrapped": "grad_dot_memory_store",
}
TWINS = {**FSDP_CASES, **WRAPPED_CASES}


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


def load_through(wrapper):
    """A ``checkpoints_load_func`` for a task given an FSDP ``wrapper``: load the full state
    inside ``summon_full_params`` (written back to every rank's shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    def load(model: torch.nn.Module, checkpoint: dict) -> torch.nn.Module:
        with FullyShardedDataParallel.summon_full_params(wrapper, writeback=True):
            model.load_state_dict(checkpoint)
        return model

    return load


def attributor(case: str, out_dir: str, **extra) -> tuple:
    """``(attributor, attribute options)`` of ``case`` on a fresh model (see `TWINS`)."""
    from dattri_llm.attribution.algorithm.kronecker import KFACAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.task import AttributionTask

    if case in FSDP_CASES:
        extra = {**extra, "fsdp": "full_shard"}
    model, loader = build_model(), None
    if case in WRAPPED_CASES:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
        loader = load_through(model)
    method, count, options = CASES[TWINS.get(case, case)]
    args = AttributionArguments(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        **extra,
    )
    task = AttributionTask(
        skip_loss, model, checkpoints=checkpoints(count), checkpoints_load_func=loader
    )
    cls = KFACAttributor if method == "kfac" else TracInAttributor
    return cls(args, task=task), options


def run_case(case: str, out_dir: str, **extra) -> dict:
    """One ``attribute`` call of ``case`` on a fresh model; ``describe`` of its score."""
    method, options = attributor(case, out_dir, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        score = method.attribute(train_set(), queries(), **options)
    return describe(score)


def refusals(out_dir: str) -> dict[str, str]:
    """The errors of the calls ``fsdp="full_shard"`` refuses: they would wrap one model twice."""
    calls = {
        "ensemble": ("tracin_2ckpt_instance", 1),
        "collected": ("grad_dot_memory_store", 1),
        "again": ("grad_dot_instance", 2),  # the second call on the same model
    }
    messages = {}
    for label, (case, calls_made) in calls.items():
        method, options = attributor(case, f"{out_dir}/{label}", fsdp="full_shard")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                for _ in range(calls_made):
                    method.attribute(train_set(), queries(), **options)
            except (ValueError, RuntimeError) as error:
                messages[label] = f"{type(error).__name__}: {error}"
    return messages


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One rank: every case through the sharded live path; rank 0 reads back what it saved."""
    import torch.distributed as dist

    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.stream import streamer

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    wrappers: list[str] = []
    place_model = streamer.place_model

    def recording_place_model(*args, **kwargs):
        wrapper = place_model(*args, **kwargs)
        wrappers.append(type(wrapper).__name__)
        return wrapper

    streamer.place_model = recording_place_model  # forked worker: patched in this rank only
    try:
        results = {}
        for case in [*CASES, *TWINS]:
            wrappers.clear()
            shared = case in SHARED_STORE_CASES
            case_dir = f"{out_dir}/{case}" if shared else f"{out_dir}/{case}_rank{rank}"
            results[case] = run_case(case, case_dir)
            results[case]["wrappers"] = sorted(set(wrappers))
            dist.barrier()
            results[case]["saved"] = (
                describe(AttributionScore.load(case_dir)) if rank == 0 else None
            )
            results[case]["wrote_score"] = not shared and os.path.exists(f"{case_dir}/scores.pt")
        results["refusals"] = refusals(f"{out_dir}/refused_rank{rank}")
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()

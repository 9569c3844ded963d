"""Fork worker for the distributed SOURCE tests (2 gloo ranks, CPU).

Each rank runs ``SourceAttributor.attribute`` with ``WORLD_SIZE=2`` /
``RANK=r`` (the training set sharded by the streamer without padding, the
model wrapped in DDP) on ``N_TRAIN = 7`` samples (4 on rank 0, 3 on rank 1)
and 3 queries, over ``L = 2`` checkpoints, for every case of `CASES`; then
every rank scores the same whole stores (written by one process before the
ranks start) with ``attribute_from_cache``; then ``fsdp="full_shard"`` and a
task given an FSDP wrapper, which SOURCE refuses. The model `WideNet` has two
linear layers (``fc1``: 4 → 6, ``fc2``: 6 → 5, with biases).

Each rank saves ``{case: describe(score)}`` (and ``"fsdp_error"``,
``"fsdp_wrapper_error"``: the refusals' messages) to ``<out_dir>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
from torch import nn

WORLD = 2
N_TRAIN = 7  # not a multiple of WORLD
RATES = [0.5, 0.3]
CASES = {  # case -> constructor options
    "kfac": {"curvature": "kfac"},
    "ekfac": {"curvature": "ekfac"},
    "ekfac_relative_damping": {"curvature": "ekfac", "damping": 0.1, "relative_damping": True},
}


class WideNet(nn.Module):
    """``(B, T, 4) -> (B, T, 5)``: ``fc2(tanh(fc1(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def build_model(seed: int = 0) -> WideNet:
    torch.manual_seed(seed)
    return WideNet()


def squared_error(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum squared error over the batch and its positions."""
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def samples(count: int, seed: int) -> list[dict]:
    """``count`` samples ``{"x": (3, 4), "y": (3, 5)}``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(3, 4, generator=gen), "y": torch.randn(3, 5, generator=gen)}
        for _ in range(count)
    ]


def train_set() -> list[dict]:
    return samples(N_TRAIN, 41)


def queries() -> list[dict]:
    return samples(3, 2)


def make_attributor(case: str, out_dir: str, *, fsdp_wrapper: bool = False, **extra):
    """A fresh SOURCE attributor of ``case`` on a fresh model with two checkpoints.

    ``fsdp_wrapper``: the task is given the model wrapped in FSDP (refused).
    """
    from dattri_llm.attribution.algorithm.source import SourceAttributor
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.task import AttributionTask

    args = AttributionArguments(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        **extra,
    )
    checkpoints = [build_model(0).state_dict(), build_model(1).state_dict()]
    model, loader = build_model(), None
    if fsdp_wrapper:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))

        def loader(inner: nn.Module, state: dict) -> nn.Module:
            with FSDP.summon_full_params(model, writeback=True):
                inner.load_state_dict(state)
            return inner

    task = AttributionTask(
        squared_error, model, checkpoints=checkpoints, checkpoints_load_func=loader
    )
    return SourceAttributor(args, task=task, segment_learning_rates=RATES, **CASES[case])


def describe(score) -> dict:
    """The parts of a score the tests compare."""
    return {
        "scores": score.scores.clone(),
        "row_ids": list(score.row_train_ids),
        "row_steps": list(score.row_steps),
        "test_ids": list(score.test_ids),
    }


def run_case(case: str, out_dir: str) -> dict:
    """One live ``attribute`` call of ``case``; ``describe`` of its score."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        score = make_attributor(case, out_dir).attribute(train_set(), queries())
    return describe(score)


def write_stores(out_dir: str) -> tuple[list[str], str]:
    """One process: the training store at each checkpoint and the query store at the last."""
    pairs = make_attributor("kfac", out_dir).cache(train_set(), queries())
    return [train for train, _ in pairs], pairs[-1][1]


def score_stores(case: str, out_dir: str, stores: tuple[list[str], str]) -> dict:
    """``attribute_from_cache`` of ``case`` over the whole stores."""
    score = make_attributor(case, out_dir).attribute_from_cache(*stores)
    return describe(score)


def worker(rank: int, init_method: str, out_dir: str, stores: tuple[list[str], str]) -> None:
    """One rank: every case live, then from the shared stores, then the FSDP refusal."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    try:
        results = {}
        for case in CASES:
            results[case] = run_case(case, f"{out_dir}/{case}_rank{rank}")
            dist.barrier()
        results["ekfac_from_cache"] = score_stores("ekfac", f"{out_dir}/cache_rank{rank}", stores)
        dist.barrier()
        refused = {
            "fsdp_error": {"fsdp": "full_shard"},
            "fsdp_wrapper_error": {"fsdp_wrapper": True},
        }
        for key, options in refused.items():
            attributor = make_attributor("kfac", f"{out_dir}/{key}_rank{rank}", **options)
            try:
                attributor.attribute(train_set(), queries())
                results[key] = None
            except ValueError as error:
                results[key] = str(error)
            dist.barrier()
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()

"""Fork worker for the distributed curvature-fit tests (LoRIF and its kin; 2 gloo ranks, CPU).

Each rank runs ``attribute`` with ``WORLD_SIZE=2`` / ``RANK=r`` (the training
set sharded by the streamer without padding, the model wrapped in DDP) on
``N_TRAIN = 7`` samples (4 on rank 0, 3 on rank 1) and 3 queries, for every
case of `CASES`. The model `WideNet` has two linear layers: ``fc1`` (4 → 12,
``D = 60`` with its bias) and ``fc2`` (12 → 8, ``D = 104``), so LoRIF at
``svd_rank = 2`` fits ``fc1`` from ``GᵀG`` and ``fc2`` by randomized range
finding (``D > 2·(2 + 2)·(2 + 10) = 96``).

Each rank saves ``{case: describe(score) + {"fit_rows": {layer: N}}}`` to
``<out_dir>/rank<r>.pt``, plus ``"rank0_alone"``: rank 0 alone (rank 1 waits
at a barrier) scoring the shared ``"disk"`` store of ``lorif_full_disk`` with
``attribute_from_cache``: a store-based fit issues no collective.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
from torch import nn

WORLD = 2
N_TRAIN = 7  # not a multiple of WORLD
CASES = {  # case -> (method, constructor options, attribute options)
    "lorif_full": ("lorif", {"rank": 1, "svd_rank": None}, {}),
    "lorif_randomized": ("lorif", {"rank": None, "svd_rank": 2}, {}),
    "lorif_randomized_memory": (
        "lorif",
        {"rank": None, "svd_rank": 2},
        {"gradient_cache_residency": "memory"},
    ),
    "lorif_full_disk": (
        "lorif",
        {"rank": 1, "svd_rank": None},
        {"gradient_cache_residency": "disk"},
    ),
    "trak": ("trak", {}, {}),
    "trak_token": ("trak", {}, {"attribution_granularity": "token"}),
    "datainf": ("datainf", {}, {}),
    "datainf_fixed_damping_memory": (
        "datainf",
        {"damping": 0.3},
        {"gradient_cache_residency": "memory"},
    ),
    "trackstar": ("trackstar", {"mixing": 0.7}, {}),
    "trackstar_disk": ("trackstar", {"mixing": 0.7}, {"gradient_cache_residency": "disk"}),
}
# one output_dir (and store) for both ranks
SHARED_STORE_CASES = ("lorif_full_disk", "trackstar_disk")


class WideNet(nn.Module):
    """``(B, T, 4) -> (B, T, 8)``: ``fc2(tanh(fc1(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 12)
        self.fc2 = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def build_model() -> WideNet:
    torch.manual_seed(0)
    return WideNet()


def squared_error(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum squared error over the batch and its positions."""
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def output_and_weights(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRAK's ``(f (B,), 1 − p (B,))``: ``f`` = −per-sample error, weights ``1/(1 + |f|/10)``."""
    f = -((model(batch["x"]) - batch["y"]) ** 2).flatten(1).sum(1)
    return f, 1.0 / (1.0 + 0.1 * f.detach().abs())


def samples(count: int, seed: int) -> list[dict]:
    """``count`` samples ``{"x": (3, 4), "y": (3, 8)}``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(3, 4, generator=gen), "y": torch.randn(3, 8, generator=gen)}
        for _ in range(count)
    ]


def optimizer_state() -> dict:
    """TrackStar's optimizer: AdamW's state after 3 steps on `WideNet` (the same everywhere)."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    for sample in samples(3, 7):
        optimizer.zero_grad()
        squared_error(model, {key: value[None] for key, value in sample.items()}).backward()
        optimizer.step()
    return optimizer.state_dict()


def train_set() -> list[dict]:
    return samples(N_TRAIN, 41)


def queries() -> list[dict]:
    return samples(3, 2)


def make_attributor(case: str, out_dir: str):
    """A fresh attributor of ``case`` on a fresh model."""
    from dattri_llm.attribution.algorithm.datainf import DataInfAttributor
    from dattri_llm.attribution.algorithm.lorif import LoRIFAttributor
    from dattri_llm.attribution.algorithm.trackstar import TrackStarAttributor
    from dattri_llm.attribution.algorithm.trak import TRAKAttributor
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.task import AttributionTask

    method, options, _ = CASES[case]
    args = AttributionArguments(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
    )
    task = AttributionTask(squared_error, build_model(), checkpoints=[build_model().state_dict()])
    if method == "trak":
        return TRAKAttributor(args, task=task, output_func=output_and_weights, **options)
    if method == "trackstar":
        return TrackStarAttributor(
            args, task=task, optimizer=optimizer_state(), loss_reduction="sum", **options
        )
    cls = LoRIFAttributor if method == "lorif" else DataInfAttributor
    return cls(args, task=task, **options)


def describe(score, attributor) -> dict:
    """The parts of a score the tests compare, and the rows each LoRIF layer fit counted."""
    fits = getattr(attributor, "layer_fits", None) or {}
    return {
        "scores": score.scores.clone(),
        "row_ids": list(score.row_train_ids),
        "row_tokens": None if score.row_token_ids is None else list(score.row_token_ids),
        "test_ids": list(score.test_ids),
        "fit_rows": {name: fit.rows for name, fit in fits.items()},
        "fit_width": {name: fit.width for name, fit in fits.items()},
    }


def run_case(case: str, out_dir: str) -> dict:
    """One ``attribute`` call of ``case``; ``describe`` of its score."""
    attributor = make_attributor(case, out_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        score = attributor.attribute(train_set(), queries(), **CASES[case][2])
    return describe(score, attributor)


def score_store_alone(out_dir: str, store_dir: str) -> dict:
    """LoRIF (``lorif_full_disk``'s settings) scored from a whole store by one process."""
    attributor = make_attributor("lorif_full_disk", out_dir)
    score = attributor.attribute_from_cache(
        f"{store_dir}/ckpt_0/train_grads", f"{store_dir}/ckpt_0/test_grads"
    )
    return describe(score, attributor)


def worker(rank: int, init_method: str, out_dir: str) -> None:
    """One rank: every case through ``attribute``; then rank 0 alone scores the shared store."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    try:
        results = {}
        for case in CASES:
            shared = case in SHARED_STORE_CASES
            case_dir = f"{out_dir}/{case}" if shared else f"{out_dir}/{case}_rank{rank}"
            results[case] = run_case(case, case_dir)
            dist.barrier()
        if rank == 0:
            results["rank0_alone"] = score_store_alone(
                f"{out_dir}/alone", f"{out_dir}/{SHARED_STORE_CASES[0]}"
            )
        dist.barrier()
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()

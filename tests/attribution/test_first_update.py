"""The first-update statistic and warning of AdamW-influence and the exact metagradient.

The run: a tiny MLP trained with AdamW (4 updates of 4 samples, float64). Its
head starts with zero weights and a bias giving the class probabilities
``(1/2, 1/4, 1/4)`` for every input, and the first batch's labels are
``(0, 0, 1, 2)``: the batch gradient of the head's bias is exactly zero at the
first update, where Adam's step ``g/(|g| + eps)`` has slope ``1/eps``. Later
batches (labels ``(1, 1, 2, 2)`` or ``(0, 0, 0, 0)``) have no such coordinate.
With a constant learning rate the first batch's rows are ~1e8 times the
others; with a linear warm-up (learning rate 0 at the first update, Adam's
moments still see its batch) they are about the others' size.
"""

from __future__ import annotations

import math
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.metagradient import MetagradientAttributor
from dattri_llm.attribution.algorithm.trajectory.first_update import (
    FIRST_UPDATE_KEY,
    FIRST_UPDATE_RATIO_THRESHOLD,
    first_update_statistic,
    first_update_steps,
)
from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.gradient.stream.inputs import make_loader
from dattri_llm.task import AttributionTask

N_TRAIN, BATCH = 16, 4
LABELS = ((0, 0, 1, 2), (1, 1, 2, 2), (0, 0, 0, 0))  # first batch, then odd / even batches


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        with torch.no_grad():
            self.fc2.weight.zero_()
            self.fc2.bias.copy_(torch.tensor([0.5, 0.25, 0.25]).log())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def record(root: str, warmup_steps: int):
    """``(args, task, train_dir, test_dir, test)`` of a recorded run (snapshots)."""
    torch.manual_seed(1)
    model = MLP().double()
    args = AttributionArguments(
        output_dir=f"{root}/out", use_cpu=True, per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=4, learning_rate=0.01, weight_decay=0.0, max_grad_norm=None,
        lr_scheduler_type="constant_with_warmup" if warmup_steps else "constant",
        warmup_steps=warmup_steps, recompute_gradients=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_TRAIN + 4, 6, generator=gen, dtype=torch.float64)
    y = torch.zeros(N_TRAIN + 4, dtype=torch.long)
    y[N_TRAIN:] = torch.tensor([0, 1, 2, 1])
    # The library's loader gives the run's batch order: plant the labels batch by batch.
    order = make_loader(list(range(N_TRAIN)), BATCH, args, collate_fn=None, shuffle=True,
                        shard=False)  # fmt: skip
    for b, batch in enumerate(order):
        for k, i in enumerate(batch.tolist()):
            y[i] = LABELS[min(b, 1 + b % 2)][k]
    samples = [{"x": x[i], "y": y[i]} for i in range(N_TRAIN + 4)]
    train, test = samples[:N_TRAIN], samples[N_TRAIN:]
    task = AttributionTask(loss, model)
    attributor = AdamWInfluenceAttributor(args, task=task)
    ((train_dir, test_dir),) = attributor.cache(train, test, cache_dir=f"{root}/run")
    first = TrajectorySnapshots(f"{train_dir}").load_batch(0)["y"].tolist()
    assert first == list(LABELS[0]), first  # the planted first batch is the run's
    return args, task, train_dir, test_dir, test


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as root:
        yield {"constant": record(f"{root}/c", 0), "warmup": record(f"{root}/w", 2)}


def score(run, method: str, **kwargs):
    """``(score, first-update warnings)`` of one call."""
    args, task, train_dir, test_dir, test = run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if method == "AdamWInfluence":
            result = AdamWInfluenceAttributor(args, task=task).attribute_from_cache(
                train_dir, test_dir, loss_reduction="sum", block_dtype=torch.float64, **kwargs
            )
        else:
            result = MetagradientAttributor(args, task=task).attribute_from_cache(
                train_dir, test, loss_reduction="sum", block_dtype=torch.float64, **kwargs
            )
    found = [w for w in caught if "first update" in str(w.message)]
    return result, found


def by_hand(result) -> dict:
    """The statistic written out with plain Python from the score's rows."""
    first_step = min(result.row_steps)  # one backward per update: the first update is step 0
    sizes = [sum(abs(float(v)) for v in row) / len(row) for row in result.scores.double()]
    first = [s for s, step in zip(sizes, result.row_steps) if step == first_step]
    other = [s for s, step in zip(sizes, result.row_steps) if step != first_step]

    def median(values):
        values = sorted(values)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    return {
        "steps": [first_step],
        "num_rows": len(first),
        "magnitude_ratio": median(first) / median(other),
        "mass_share": sum(first) / sum(sizes),
    }


METHODS = ["AdamWInfluence", "Metagradient"]


@pytest.mark.parametrize("method", METHODS)
def test_a_sign_like_first_update_warns_with_the_hand_numbers(runs, method):
    result, found = score(runs["constant"], method)
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    for phrase in ("sign-like", "selected_training_steps", "warming the optimizer up"):
        assert phrase in message, message
    meta, want = result.algorithm_meta[FIRST_UPDATE_KEY], by_hand(result)
    assert meta["steps"] == want["steps"] == [0]
    assert meta["num_rows"] == want["num_rows"] == BATCH
    assert meta["magnitude_ratio"] == pytest.approx(want["magnitude_ratio"], rel=1e-9)
    assert meta["mass_share"] == pytest.approx(want["mass_share"], rel=1e-9)
    assert meta["magnitude_ratio"] > 1e6 and meta["mass_share"] > 0.999999


@pytest.mark.parametrize("method", METHODS)
def test_a_warmed_up_first_update_does_not_warn(runs, method):
    result, found = score(runs["warmup"], method)
    assert not found, [str(w.message) for w in found]
    meta, want = result.algorithm_meta[FIRST_UPDATE_KEY], by_hand(result)
    assert meta["magnitude_ratio"] == pytest.approx(want["magnitude_ratio"], rel=1e-9)
    assert meta["mass_share"] == pytest.approx(want["mass_share"], rel=1e-9)
    assert meta["magnitude_ratio"] < FIRST_UPDATE_RATIO_THRESHOLD / 2


@pytest.mark.parametrize("method", METHODS)
def test_excluding_the_first_update_records_nothing(runs, method):
    result, found = score(runs["constant"], method, selected_training_steps=[1, 2, 3])
    assert sorted(set(result.row_steps)) == [1, 2, 3]
    assert not found and FIRST_UPDATE_KEY not in result.algorithm_meta


def test_the_statistic_on_a_hand_matrix():
    scores = torch.tensor([[4.0, -4.0], [2.0, 2.0], [-1.0, 1.0], [0.5, -0.5], [3.0, 1.0]])
    steps = [0, 0, 1, 2, 2]
    # sizes 4, 2 | 1, 0.5, 2: medians 3 and 1, mass 6 / 9.5
    got = first_update_statistic(scores, steps, [0])
    assert got == {"steps": [0], "num_rows": 2, "magnitude_ratio": 3.0, "mass_share": 6 / 9.5}
    assert first_update_statistic(scores, steps, [5]) is None
    alone = first_update_statistic(scores[:2], steps[:2], [0])
    assert alone["magnitude_ratio"] is None and alone["mass_share"] == 1.0
    zeros = torch.cat([scores[:2], torch.zeros(3, 2)])
    assert first_update_statistic(zeros, steps, [0])["magnitude_ratio"] == math.inf
    with pytest.raises(ValueError, match="one step per row"):
        first_update_statistic(scores, steps[:3], [0])


def test_first_update_steps_from_the_recorded_counts():
    """An accumulation window is one update (all its steps); a group whose first update comes
    later (its parameters had no gradient before) marks that update too; unrecorded AdamW
    entries give their one count."""

    def update(index, steps, counts):
        return {"update": index, "steps": steps, "groups": [{"step": c} for c in counts]}

    run = RunDynamics(
        updates={
            1: update(0, [0, 1], [1, 0]),
            3: update(1, [2, 3], [2, 1]),
            5: update(2, [4, 5], [3, 2]),
        }
    )
    windows = run.windows(range(6))
    assert first_update_steps(run, windows) == [0, 1, 2, 3]
    assert first_update_steps(run, windows[2:]) == []
    legacy = RunDynamics.from_records(None, entries={0: {"step": 1}, 1: {"step": 2}})
    assert first_update_steps(legacy, legacy.windows([0, 1])) == [0]
    assert first_update_steps(RunDynamics(), RunDynamics().windows([0, 1])) == []

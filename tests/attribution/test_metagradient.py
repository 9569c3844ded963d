"""MetagradientAttributor against the run written out as a pure function of the sample weights.

The reference (:func:`unrolled`) is the recorded training run as a function of
one weight per row (sample occurrence): the same batches in the same order,
per-sample losses from ``functional_call`` with ``reduction="none"``, the clip
``min(1, M/(‖G‖+1e-6))`` and torch's Adam / AdamW maths written out here, the
query losses at the end. ``torch.func.jacrev`` of it at ``w = 1`` is the exact
metagradient; the attributor must match it to ~1e-8 in float64.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.metagradient import MetagradientAttributor
from dattri_llm.attribution.algorithm.trajectory import unroll
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.gradient.streaming import ReplayGradientSource
from dattri_llm.task import AttributionTask

LR, BETAS, EPS, WD = 0.05, (0.8, 0.9), 1e-4, 0.1
RTOL = 1e-8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Attention(nn.Module):
    """One attention head over two 3-dimensional tokens (``F.scaled_dot_product_attention`` on
    ``(B, heads, tokens, dim)``, which its fused CPU kernel takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(3, 9)
        self.out = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x.reshape(x.shape[0], 1, 2, 3)).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v).mean((1, 2)))


def make_loss(reduction: str):
    def loss(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction=reduction)

    return loss


def data(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64) * 2.0
    y = torch.randint(0, 3, (n,), generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def stack(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


# ---------------------------------------------------------------------------- reference
def unrolled(model, theta0, updates, queries, *, max_norm, reduction, divisor):
    """``w (R,) -> (n_query,)`` query losses after the run; ``updates``: ``[(micro-batches,
    {param: (lr, wd, decoupled, step)})]``, rows in run order."""
    names = list(theta0)

    def losses(params, batch):
        return F.cross_entropy(functional_call(model, params, (batch["x"],)), batch["y"],
                               reduction="none")  # fmt: skip

    def run(w):
        theta = dict(theta0)
        m = {n: torch.zeros_like(p) for n, p in theta.items()}
        v = {n: torch.zeros_like(p) for n, p in theta.items()}
        offset = 0
        for micro, hyper in updates:
            starts = []
            for batch in micro:
                starts.append(offset)
                offset += batch["y"].shape[0]

            def window(params, starts=starts, micro=micro):
                total = 0.0
                for start, batch in zip(starts, micro):
                    per = losses(params, batch)
                    share = 1 / divisor if reduction == "sum" else 1 / (per.shape[0] * divisor)
                    total = total + (w[start : start + per.shape[0]] * per).sum() * share
                return total

            g = grad(window)(theta)
            if max_norm is not None:
                norm = torch.sqrt(sum((g[n] ** 2).sum() for n in names))
                c = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
                g = {n: g[n] * c for n in names}
            for n in names:
                lr, wd, decoupled, step = hyper[n]
                p, gn = theta[n], g[n]
                if decoupled:
                    p = p * (1 - lr * wd)
                else:
                    gn = gn + wd * p
                m[n] = BETAS[0] * m[n] + (1 - BETAS[0]) * gn
                v[n] = BETAS[1] * v[n] + (1 - BETAS[1]) * gn**2
                denom = torch.sqrt(v[n]) / math.sqrt(1 - BETAS[1] ** step) + EPS
                theta[n] = p - lr / (1 - BETAS[0] ** step) * m[n] / denom
        return losses(theta, queries)

    return run


def reference(model, theta0, updates, queries, rows, **options):
    """``(R, n_query)`` float64 exact metagradients."""
    w = torch.ones(rows, dtype=torch.float64)
    return jacrev(unrolled(model, theta0, updates, queries, **options))(w).T


def rows_by_step(score) -> dict[int, torch.Tensor]:
    """Score rows grouped by step, ascending steps, batch order within a step."""
    out: dict[int, list[int]] = {}
    for row, step in enumerate(score.row_steps):
        out.setdefault(step, []).append(row)
    return {step: score.scores[idx] for step, idx in sorted(out.items())}


def in_run_order(score) -> torch.Tensor:
    return torch.cat(list(rows_by_step(score).values())).double()


def close(got, want, rtol=RTOL):
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale)


# ---------------------------------------------------------------------------- the streamer run
def args_for(tmp_path, **kwargs) -> AttributionArguments:
    options = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 2,
        "learning_rate": LR,
        "weight_decay": WD,
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "max_grad_norm": 0.5,
        "lr_scheduler_type": "linear",
        **kwargs,
    }
    return AttributionArguments(**options)


def streamer_case(tmp_path, reduction, accumulation=1, max_norm=0.5):
    torch.manual_seed(0)
    model = MLP().double()
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    train, test = data(12, 1), data(3, 2)
    args = args_for(tmp_path, gradient_accumulation_steps=accumulation, max_grad_norm=max_norm)
    attributor = MetagradientAttributor(args, task=AttributionTask(make_loss(reduction), model))
    score = attributor.attribute(
        train, test, cache_dir=str(tmp_path / "run"), loss_reduction=reduction,
        block_dtype=torch.float64,
    )  # fmt: skip
    snaps = TrajectorySnapshots(tmp_path / "run" / "train_snapshots")
    steps = snaps.steps()
    windows = [steps[i : i + accumulation] for i in range(0, len(steps), accumulation)]
    total = len(windows)
    updates = []
    for t, window in enumerate(windows):
        lr = LR * (total - t) / total  # transformers' linear schedule, no warm-up
        hyper = {n: (lr, 0.0 if n.endswith("bias") else WD, True, t + 1) for n in theta0}
        updates.append(([snaps.load_batch(s) for s in window], hyper))
    rows = sum(int(b["y"].shape[0]) for micro, _ in updates for b in micro)
    want = reference(
        model, theta0, updates, stack(test), rows,
        max_norm=max_norm, reduction=reduction, divisor=accumulation,
    )  # fmt: skip
    return attributor, score, want, snaps, model, args, test


@pytest.mark.parametrize(
    "reduction, accumulation", [("sum", 1), ("mean", 1), ("mean", 2), ("sum", 2)]
)
def test_streamer_run_matches_the_unrolled_reference(tmp_path, reduction, accumulation):
    attributor, score, want, snaps, _, _, _ = streamer_case(tmp_path, reduction, accumulation)
    assert score.polarity == -1 and score.algorithm == "Metagradient"
    clips = score.algorithm_meta["clip_coefficients"]
    assert sum(c < 1 for c in clips.values()) >= len(clips) // 2 + 1, clips
    assert max(score.algorithm_meta["replay_errors"].values(), default=0.0) < 1e-10
    close(in_run_order(score), want)


def test_ids_are_the_capture_ids(tmp_path):
    """Train rows carry the ids a replayed capture gives each step; test columns those of the
    query store the recording wrote."""
    attributor, score, _, snaps, model, args, _ = streamer_case(tmp_path, "sum")
    replay = ReplayGradientSource(model, args, snaps, loss_fn=make_loss("sum"))
    with replay:
        expected = {step: ids for step, _block, ids in replay}
    got: dict[int, list[str]] = {}
    for sample, step in zip(score.row_train_ids, score.row_steps):
        got.setdefault(step, []).append(sample)
    assert got == expected
    test_ids = [i for _s, _b, ids in attributor.load_test_rep(tmp_path / "run" / "test_grads")
                for i in ids]  # fmt: skip
    assert score.test_ids == test_ids


def test_finite_difference_of_one_sample(tmp_path):
    """``(L(w_b = 1 − ε) − L(1)) / −ε`` through the plain replay agrees with the row."""
    _, score, _, snaps, model, _, test = streamer_case(tmp_path, "mean")
    steps = snaps.steps()
    theta0 = snaps.parameter_dict(steps[0])
    updates = []
    for t, step in enumerate(steps):
        lr = LR * (len(steps) - t) / len(steps)
        hyper = {n: (lr, 0.0 if n.endswith("bias") else WD, True, t + 1) for n in theta0}
        updates.append(([snaps.load_batch(step)], hyper))
    run = unrolled(model, theta0, updates, stack(test), max_norm=0.5, reduction="mean", divisor=1)
    eps = 1e-6
    w = torch.ones(12, dtype=torch.float64)
    w[5] -= eps
    finite = (run(w) - run(torch.ones(12, dtype=torch.float64))) / -eps
    close(in_run_order(score)[5], finite, rtol=1e-4)


# ---------------------------------------------------------------------------- hand-written loops
def hand_run(
    tmp_path,
    optimizer_fn,
    *,
    epochs=1,
    accumulation=1,
    max_norm=0.5,
    reduction="sum",
    dtype=torch.float64,
    model_fn=MLP,
    **options,
):
    """Train with a hand-written loop recording snapshots and dynamics (``dtype`` the model's
    and the data's); the reference is computed in float64 from the same start and batches."""
    torch.manual_seed(0)
    model = model_fn().double().to(dtype)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    optimizer = optimizer_fn(model)
    train, test = data(12, 1), data(3, 2)
    train = [{"x": s["x"].to(dtype), "y": s["y"]} for s in train]
    gen = torch.Generator().manual_seed(3)
    order = [int(i) for _ in range(epochs) for i in torch.randperm(12, generator=gen)]
    batches = [stack([train[i] for i in order[k : k + 4]]) for k in range(0, len(order), 4)]
    windows = [batches[k : k + accumulation] for k in range(0, len(batches), accumulation)]
    loss_fn = make_loss(reduction)
    snaps = TrajectorySnapshots(tmp_path / "snaps")
    recorder = TrainingDynamicsCallback(model, optimizer, gradient_accumulation_steps=accumulation)
    manager = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[recorder])
    names = {id(p): n for n, p in model.named_parameters()}
    updates, step = [], 0
    with manager.collect():
        for t, micro in enumerate(windows):
            optimizer.zero_grad(set_to_none=True)
            start = step
            for batch in micro:
                snaps.save_parameters(step, model, same_as=None if step == start else start)
                snaps.save_batch(step, batch)
                (loss_fn(model, batch) / accumulation).backward()
                step += 1
            if max_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            hyper = {}
            for group in optimizer.param_groups:
                decoupled = isinstance(optimizer, torch.optim.AdamW)
                for p in group["params"]:
                    hyper[names[id(p)]] = (group["lr"], group["weight_decay"], decoupled, t + 1)
            optimizer.step()
            updates.append(([{"x": b["x"].double(), "y": b["y"]} for b in micro], hyper))
    manager.remove()
    recorder.save(snaps.root)
    rows = len(order)
    want = reference(
        model, theta0, updates, stack(test), rows,
        max_norm=max_norm, reduction=reduction, divisor=accumulation,
    )  # fmt: skip
    test = [{"x": s["x"].to(dtype), "y": s["y"]} for s in test]
    args = args_for(tmp_path, max_grad_norm=max_norm)
    attributor = MetagradientAttributor(args, task=AttributionTask(loss_fn, model), **options)
    return attributor, snaps, test, want, order, recorder


def two_groups(model, cls=torch.optim.AdamW, **kwargs):
    """Weights decayed at the base rate, biases undecayed at twice the rate."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return cls(
        [{"params": weights, "weight_decay": WD}, {"params": biases, "weight_decay": 0.0,
                                                    "lr": 2 * LR}],
        lr=LR, betas=BETAS, eps=EPS, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, optimizer_fn",
    [
        ("adamw-two-groups", two_groups),
        ("adam-coupled", lambda m: two_groups(m, torch.optim.Adam)),
    ],
)
def test_hand_loop_matches_the_unrolled_reference(tmp_path, name, optimizer_fn):
    attributor, snaps, test, want, _, recorder = hand_run(tmp_path, optimizer_fn)
    assert set(recorder.parameter_groups.values()) == {0, 1}
    score = attributor.attribute_from_cache(
        snaps, test, loss_reduction="sum", block_dtype=torch.float64
    )
    close(in_run_order(score), want)


def test_a_sample_in_two_epochs_sums_to_its_total_effect(tmp_path):
    attributor, snaps, test, want, order, recorder = hand_run(
        tmp_path, two_groups, epochs=2, accumulation=2, reduction="mean"
    )
    score = attributor.attribute_from_cache(
        snaps, test, dynamics=recorder, loss_reduction="mean", block_dtype=torch.float64
    )
    got = in_run_order(score)
    close(got, want)
    ids = [i for _step, rows in sorted(_ids_by_step(score).items()) for i in rows]
    per_sample: dict[int, torch.Tensor] = {}
    for row, index in enumerate(order):
        per_sample[index] = per_sample.get(index, 0) + want[row]
    by_id: dict[str, torch.Tensor] = {}
    for row, sample in enumerate(ids):
        by_id[sample] = by_id.get(sample, 0) + got[row]
    assert len(by_id) == 12 and all(len(score.train_index[s]) == 2 for s in by_id)
    first_row = {index: row for row, index in reversed(list(enumerate(order)))}
    for index, total in per_sample.items():
        close(by_id[ids[first_row[index]]], total)


def _ids_by_step(score):
    out: dict[int, list[str]] = {}
    for sample, step in zip(score.row_train_ids, score.row_steps):
        out.setdefault(step, []).append(sample)
    return out


@pytest.mark.filterwarnings("ignore:the replayed clip coefficient")
def test_ignoring_the_clip_jacobian_is_far_off(tmp_path, monkeypatch):
    """A broken variant (the clip coefficient held constant) misses the reference."""
    attributor, snaps, test, want, _, _ = hand_run(tmp_path, two_groups, max_norm=0.3)
    original = unroll.adam_update

    def constant_clip(theta, m, v, grads, values, *, max_grad_norm):
        if max_grad_norm is None:
            return original(theta, m, v, grads, values, max_grad_norm=None)
        norm = torch.sqrt(sum((g * g).sum() for g in grads)).detach()
        coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        return original(theta, m, v, [g * coef for g in grads], values, max_grad_norm=None)

    monkeypatch.setattr(
        "dattri_llm.attribution.algorithm.trajectory.reverse.adam_update", constant_clip
    )
    score = attributor.attribute_from_cache(
        snaps, test, loss_reduction="sum", block_dtype=torch.float64
    )
    error = float((in_run_order(score) - want).norm() / want.norm())
    assert error > 1e-2


# ---------------------------------------------------------------------------- refusals / checks
def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="optim='adamw_torch'"):
        MetagradientAttributor(
            args_for(tmp_path, optim="sgd"), task=AttributionTask(make_loss("sum"), MLP())
        ).cache(data(4, 1), data(2, 2), cache_dir=str(tmp_path / "sgd"))
    attributor, snaps, test, *_ = hand_run(
        tmp_path / "ams", lambda m: torch.optim.AdamW(m.parameters(), lr=LR, amsgrad=True)
    )
    with pytest.raises(ValueError, match="amsgrad"):
        attributor.attribute_from_cache(snaps, test)
    attributor, snaps, test, *_ = hand_run(
        tmp_path / "sgd", lambda m: torch.optim.SGD(m.parameters(), lr=LR)
    )
    with pytest.raises(ValueError, match="Adam and AdamW; the recorded run used \\['SGD'\\]"):
        attributor.attribute_from_cache(snaps, test)
    attributor, snaps, test, _, _, recorder = hand_run(tmp_path / "groups", two_groups)
    records = recorder.records()
    del records["parameter_groups"]
    with pytest.raises(ValueError, match="2 parameter groups but no record"):
        attributor.attribute_from_cache(snaps, test, dynamics=records)
    records = recorder.records()  # a run recorded under 2 processes
    for update in records["updates"].values():
        update["world_size"] = 2
    with pytest.raises(ValueError, match="recorded run's world_size is 2"):
        attributor.attribute_from_cache(snaps, test, dynamics=records)
    with pytest.MonkeyPatch.context() as patch:  # a process of a 2-process launch
        patch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match="replays single-process runs; args.world_size is 2"):
            MetagradientAttributor(
                args_for(tmp_path), task=AttributionTask(make_loss("sum"), MLP())
            ).cache(data(4, 1), data(2, 2), cache_dir=str(tmp_path / "ddp"))


@pytest.mark.filterwarnings("ignore:the replayed clip coefficient")
def test_a_perturbed_snapshot_warns(tmp_path):
    attributor, snaps, test, *_ = hand_run(tmp_path, two_groups)
    params = snaps.parameter_dict(2)
    params["fc1.weight"] = params["fc1.weight"] + 1e-2
    torch.save(params, snaps.root / "parameters_00000002.pt")
    with pytest.warns(UserWarning, match=r"update ending at step 1 differ from the snapshot of "
                      r"step 2 by [0-9.e-]+ \(relative"):  # fmt: skip
        attributor.attribute_from_cache(
            snaps, test, loss_reduction="sum", block_dtype=torch.float64
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hand = hand_run(tmp_path / "clean", two_groups)
        hand[0].attribute_from_cache(hand[1], hand[2], loss_reduction="sum",
                                     block_dtype=torch.float64)  # fmt: skip


@pytest.mark.filterwarnings("ignore:the replayed parameters")
def test_a_wrong_clip_threshold_warns(tmp_path):
    attributor, snaps, test, *_ = hand_run(tmp_path, two_groups, max_norm=0.3)
    with pytest.warns(UserWarning, match="clip coefficient"):
        attributor.attribute_from_cache(
            snaps, test, loss_reduction="sum", max_grad_norm=None, block_dtype=torch.float64
        )


@pytest.mark.parametrize(
    "block_dtype, rtol", [(torch.float64, 1e-4), (torch.float32, 2e-3)], ids=["f64", "f32"]
)
def test_a_float32_run(tmp_path, block_dtype, rtol):
    """A float32 run scored in float64 (a cast copy of the model) or in float32 agrees with the
    float64 reference within float32 rounding of the recorded run."""
    attributor, snaps, test, want, _, _ = hand_run(tmp_path, two_groups, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score = attributor.attribute_from_cache(
            snaps, test, loss_reduction="sum", block_dtype=block_dtype
        )
    assert score.scores.dtype == block_dtype
    assert next(attributor.require_task("t").model.parameters()).dtype == torch.float32
    close(in_run_order(score), want, rtol=rtol)


def test_sample_loss_func_gives_the_same_scores(tmp_path):
    def per_sample(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")

    attributor, snaps, test, want, _, _ = hand_run(
        tmp_path, two_groups, reduction="mean", sample_loss_func=per_sample,
        sample_target_func=per_sample,
    )  # fmt: skip
    score = attributor.attribute_from_cache(
        snaps, test, loss_reduction="mean", block_dtype=torch.float64
    )
    close(in_run_order(score), want)


def test_a_single_group_run_recorded_without_parameter_groups(tmp_path):
    """Older records (no parameter_groups) are accepted when the optimizer had one group."""
    single = lambda m: torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS)  # noqa: E731
    attributor, snaps, test, want, _, recorder = hand_run(tmp_path, single)
    records = recorder.records()
    del records["parameter_groups"]
    score = attributor.attribute_from_cache(
        snaps, test, dynamics=records, loss_reduction="sum", block_dtype=torch.float64
    )
    close(in_run_order(score), want)


@pytest.mark.filterwarnings("ignore:the replayed")
def test_a_wrong_loss_reduction_warns(tmp_path):
    attributor, snaps, test, *_ = hand_run(tmp_path, two_groups, reduction="sum")
    with pytest.warns(UserWarning, match="not a mean of per-sample losses"):
        attributor.attribute_from_cache(
            snaps, test, loss_reduction="mean", block_dtype=torch.float64
        )


def test_selected_steps_and_progress(tmp_path):
    """``selected_training_steps`` keeps those steps' rows (the same values); verbose shows
    the loops' bars."""
    attributor, snaps, test, want, _, _ = hand_run(tmp_path, two_groups)
    score = attributor.attribute_from_cache(
        snaps, test, loss_reduction="sum", block_dtype=torch.float64,
        selected_training_steps=[1], verbose=True,
    )  # fmt: skip
    assert set(score.row_steps) == {1}
    close(score.scores.double(), want[4:8])


def test_agrees_with_adamw_influence_on_the_last_update_only(tmp_path):
    """At the last update nothing is propagated: AdamW-influence's row (the exact Adam and clip
    Jacobians at one step) is the exact metagradient. Earlier rows propagate through later
    updates, where AdamW-influence keeps only the Gauss–Newton part of the curvature: they
    differ."""
    torch.manual_seed(0)
    model = MLP().double()
    train, test = data(12, 1), data(3, 2)
    args = args_for(tmp_path, recompute_gradients=True)
    task = AttributionTask(make_loss("sum"), model)
    adamw = AdamWInfluenceAttributor(args, task=task)
    ((train_dir, test_dir),) = adamw.cache(train, test, cache_dir=str(tmp_path / "run"))
    linear = adamw.attribute_from_cache(
        train_dir, test_dir, loss_reduction="sum", block_dtype=torch.float64
    )
    exact = MetagradientAttributor(args, task=task).attribute_from_cache(
        train_dir, test, loss_reduction="sum", block_dtype=torch.float64
    )
    assert exact.test_ids == linear.test_ids
    got, want = exact.step_matrices(), linear.step_matrices()
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for step in got:
        assert got[step][0] == want[step][0]  # the same row ids
    close(got[2][1].double(), want[2][1].double(), rtol=1e-6)
    early = got[0][1].double()
    assert float((early - want[0][1].double()).norm() / early.norm()) > 1e-3


def test_an_attention_model(tmp_path):
    """``scaled_dot_product_attention``'s fused CPU kernel has no double backward: the passes
    run it on its math kernel (the reference too)."""
    with sdpa_kernel([SDPBackend.MATH]):
        attributor, snaps, test, want, _, _ = hand_run(tmp_path, two_groups, model_fn=Attention)
    score = attributor.attribute_from_cache(
        snaps, test, loss_reduction="sum", block_dtype=torch.float64
    )
    close(in_run_order(score), want)


def test_query_blocks_give_the_same_scores(tmp_path):
    """Batched products over all queries, blocks of two, and one backward per query agree."""
    attributor, snaps, test, want, _, _ = hand_run(tmp_path, two_groups)
    for block in (None, 2, 1):
        score = attributor.attribute_from_cache(
            snaps, test, loss_reduction="sum", block_dtype=torch.float64, query_block=block
        )
        close(in_run_order(score), want)
    with pytest.raises(ValueError, match="query_block must be None or an int >= 1"):
        attributor.attribute_from_cache(snaps, test, query_block=0)

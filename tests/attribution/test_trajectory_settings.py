"""The trajectory methods in the settings people train with, against a run written out by hand.

Every run trains an MLP with biases (every parameter captured) from a hand-written
loop, a ``GradientStreamer`` or a Hugging Face ``Trainer``, with gradient clipping
active on most steps, parameter groups (no-decay biases, per-layer learning rates),
Adam (coupled L2) or AdamW, ``amsgrad``, gradient accumulation, mean and sum losses
and a ``GradScaler``. ``tests/trajectory_reference.py`` replays each run by hand
(checking that the replay reproduces the recorded parameters) and gives every
method's scores from the maths; the attributors' rows must match them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from trajectory_reference import HandLoop, Reference

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
)
from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
from dattri_llm.gradient.callbacks import OptimizerStateCallback

LAYERS = ("fc1", "fc2")


class MLP(nn.Module):
    """Two linear layers with biases; inputs ``(B, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def sample_loss(call, sample):
    """One sample's loss ``ℓ``."""
    return ((call(sample["x"]) - sample["y"]) ** 2).sum()


def batch_loss(reduction):
    def loss(model, batch):
        per_sample = ((model(batch["x"]) - batch["y"]) ** 2).sum(1)
        return per_sample.mean() if reduction == "mean" else per_sample.sum()

    return loss


def data(n: int, seed: int, scale: float = 3.0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = scale * torch.randn(n, 3, generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def stack(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def capture_queries(model, directory, loss, layers=LAYERS):
    """The query gradients of ``loss()`` (sum convention) into a fresh store at ``directory``."""
    store = GradientStorageManager(directory)
    config = HookManagerConfig(linear_io=list(layers))
    with HookManager(model, config=config, callbacks=[OffloadCallback(1, store)]).collect(
        deregister_on_exit=True
    ):
        model.zero_grad()
        loss().backward()
    return directory


def trainer_values(names, rate, step):
    """Each parameter's optimizer values under a ``Trainer``-built AdamW: weight decay 0.1 on
    weights, none on biases."""
    hyper = {"lr": rate, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": False}
    return {
        name: {
            **hyper,
            "wd": 0.0 if name.endswith("bias") else 0.1,
            "decoupled": True,
            "step": step,
        }  # fmt: skip
        for name in names
    }


def windows_of(samples, batch, accumulation):
    micro = [stack(samples[i : i + batch]) for i in range(0, len(samples), batch)]
    return [micro[i : i + accumulation] for i in range(0, len(micro), accumulation)]


def groups(model, kind: str, lr: float):
    """Parameter groups: ``"one"`` (everything decayed), ``"two"`` (no-decay biases), ``"three"``
    (no-decay biases, ``fc2`` weight at twice the rate with its own decay)."""
    weights = [model.fc1.weight, model.fc2.weight]
    biases = [model.fc1.bias, model.fc2.bias]
    if kind == "one":
        return [{"params": weights + biases, "weight_decay": 0.1}]
    if kind == "two":
        return [
            {"params": weights, "weight_decay": 0.1},
            {"params": biases, "weight_decay": 0.0},
        ]
    return [
        {"params": [model.fc1.weight], "weight_decay": 0.1},
        {"params": [model.fc2.weight], "weight_decay": 0.05, "lr": 2 * lr},
        {"params": biases, "weight_decay": 0.0},
    ]


def scores_by_step(score):
    """``{step: (ids, (B, n_test) float64)}``."""
    return {step: (ids, m.double()) for step, (ids, m) in score.step_matrices().items()}


def assert_rows(score, expected_blocks, rtol=2e-4):
    """Score rows per step (ascending) against the reference's per-micro-batch blocks."""
    by_step = scores_by_step(score)
    assert len(by_step) == len(expected_blocks)
    scale = max(float(b.abs().max()) for b in expected_blocks)
    for (step, (_ids, got)), want in zip(sorted(by_step.items()), expected_blocks, strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale, msg=f"step {step}")


def capture_hand_loop(
    tmp_path,
    *,
    optimizer_fn,
    reduction="sum",
    accumulation=1,
    max_norm=1.0,
    scaler=None,
    n=8,
    batch=2,
    lr=0.05,
    seed=0,
):
    """Train with a hand loop under a HookManager; returns (model, store dir, query dir, run,
    callback, test batch)."""
    torch.manual_seed(seed)
    model = MLP()
    optimizer = optimizer_fn(model, lr)
    train, test = data(n, 1), data(3, 2)
    store = GradientStorageManager(tmp_path / "train")
    state = OptimizerStateCallback(
        model, optimizer, grad_scaler=scaler, gradient_accumulation_steps=accumulation
    )
    config = HookManagerConfig(linear_io=list(LAYERS))
    hm = HookManager(model, config=config, callbacks=[OffloadCallback(1, store), state])
    loop = HandLoop(
        model, optimizer, batch_loss(reduction), accumulation, max_norm, scaler, reduction
    )
    with hm.collect():
        run = loop.run(windows_of(train, batch, accumulation))
    hm.remove()
    state.save(tmp_path / "train")
    test_batch = stack(test)
    capture_queries(model, tmp_path / "test", lambda: batch_loss("sum")(model, test_batch))
    return model, tmp_path / "train", tmp_path / "test", run, state, test_batch


def adamw(**kwargs):
    return lambda model, lr: torch.optim.AdamW(groups(model, "three", lr), lr=lr, **kwargs)


def adam(**kwargs):
    return lambda model, lr: torch.optim.Adam(groups(model, "three", lr), lr=lr, **kwargs)


def args_for(tmp_path, **kwargs):
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kwargs)


# ---------------------------------------------------------------------------- AdamW-influence
@pytest.mark.parametrize(
    "name, optimizer_fn, reduction, accumulation",
    [
        ("adamw-sum", adamw(), "sum", 1),
        ("unclipped", adamw(), "none", 1),
        ("adamw-mean", adamw(), "mean", 1),
        ("adam-l2", adam(weight_decay=0.1), "sum", 1),
        ("amsgrad", adamw(amsgrad=True), "sum", 1),
        ("foreach", adamw(foreach=True), "mean", 1),
        ("fused", adamw(fused=True), "sum", 1),
        ("accumulate-2", adamw(), "mean", 2),
        ("accumulate-3", adamw(), "sum", 3),
    ],
)
@pytest.mark.parametrize("propagation", ["test", "train"])
def test_adamw_influence_hand_loop(
    tmp_path, name, optimizer_fn, reduction, accumulation, propagation
):
    max_norm = None if reduction == "none" else 1.0
    reduction = "sum" if reduction == "none" else reduction
    model, train, test, run, state, queries = capture_hand_loop(
        tmp_path,
        optimizer_fn=optimizer_fn,
        reduction=reduction,
        accumulation=accumulation,
        n=12,
        max_norm=max_norm,
    )
    reference = Reference(model, sample_loss, run, queries)
    clipped = [reference.clip_coef(t) < 1 for t in range(len(run.updates))]
    if max_norm is None:
        assert not any(clipped)
        assert all(u["clip_coef"] == pytest.approx(1.0) for u in state.updates.values())
    else:
        assert sum(clipped) >= len(clipped) // 2, "the clip must be active on most updates"
    attributor = AdamWInfluenceAttributor(args_for(tmp_path))
    score = attributor.attribute_from_cache(
        train, test, dynamics=state.dynamics(), loss_reduction=reduction, propagation=propagation
    )
    assert score.polarity == -1
    assert_rows(score, reference.split(reference.adamw()))


def test_adamw_influence_hand_loop_with_a_grad_scaler(tmp_path):
    """Loss-scaled backwards (the stored rows carry the scale) and clipping after ``unscale_``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    model, train, test, run, state, queries = capture_hand_loop(
        tmp_path, optimizer_fn=adamw(), reduction="mean", scaler=scaler, n=12
    )
    reference = Reference(model, sample_loss, run, queries)
    assert any(u["row_scale"] > 1024 for u in state.updates.values())  # the scale grew
    attributor = AdamWInfluenceAttributor(args_for(tmp_path))
    score = attributor.attribute_from_cache(
        train, test, dynamics=state.dynamics(), loss_reduction="mean", propagation="test"
    )
    assert_rows(score, reference.split(reference.adamw()))


# ---------------------------------------------------------------------------- the streamer
def streamer_run(tmp_path, *, reduction, accumulation, recompute, warmup=0, n=12, lr=0.05):
    """A ``GradientStreamer`` trajectory (through the attributor's ``cache``): clip 1.0, weight
    decay 0.1 on weights, none on biases, linear decay after ``warmup`` windows."""
    torch.manual_seed(0)
    model = MLP()
    args = AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=3,
        learning_rate=lr,
        weight_decay=0.1,
        max_grad_norm=1.0,
        gradient_accumulation_steps=accumulation,
        warmup_steps=warmup,
        recompute_gradients=recompute,
    )
    from dattri_llm import AttributionTask

    task = AttributionTask(batch_loss(reduction), model, target_func=batch_loss("sum"))
    attributor = AdamWInfluenceAttributor(args, task=task)
    train, test = data(n, 1), data(3, 2)
    config = HookManagerConfig(linear_io=list(LAYERS))
    ((train_dir, test_dir),) = attributor.cache(
        train,
        test,
        cache_dir=str(tmp_path / ("snaps" if recompute else "grads")),
        hook_config=config,
    )
    return attributor, model, train_dir, test_dir, stack(test), config


def streamer_reference(snap_dir, model, queries, *, reduction, accumulation, lr, warmup=0):
    """The run a ``GradientStreamer`` made, from its snapshots, for :class:`Reference`."""
    from trajectory_reference import Run, Update

    from dattri_llm.gradient.snapshots import TrajectorySnapshots

    snapshots = TrajectorySnapshots(snap_dir)
    steps = snapshots.steps()
    names = [n for n, _ in model.named_parameters()]
    windows = [steps[i : i + accumulation] for i in range(0, len(steps), accumulation)]
    total = len(windows)
    probe = MLP()
    updates = []
    for k, window in enumerate(windows):
        snapshots.load_parameters(window[0], probe)
        theta = {n: p.detach().double().clone() for n, p in probe.named_parameters()}
        rate = lr * k / warmup if k < warmup else lr * (total - k) / (total - warmup)
        hyper = trainer_values(names, rate, k + 1)
        micro = [snapshots.load_batch(step) for step in window]
        updates.append(Update(theta, micro, hyper))
    final = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    run = Run(updates, final, names, accumulation, reduction, 1.0)
    return Reference(model, sample_loss, run, queries)


@pytest.mark.parametrize("reduction, accumulation", [("sum", 1), ("mean", 2), ("mean", 3)])
def test_adamw_influence_streamer_run(tmp_path, reduction, accumulation):
    lr = 0.05
    attributor, model, snap_dir, test_dir, queries, config = streamer_run(
        tmp_path, reduction=reduction, accumulation=accumulation, recompute=True, warmup=1
    )
    reference = streamer_reference(
        snap_dir, model, queries, reduction=reduction, accumulation=accumulation, lr=lr, warmup=1
    )
    assert sum(reference.clip_coef(t) < 1 for t in range(len(reference.run.updates))) >= 2
    expected = reference.split(reference.adamw())
    store_run = streamer_run(
        tmp_path, reduction=reduction, accumulation=accumulation, recompute=False, warmup=1
    )
    for source, test in ((snap_dir, test_dir), (store_run[2], store_run[3])):
        for propagation in ("test", "train"):
            score = attributor.attribute_from_cache(
                source,
                test,
                loss_reduction=reduction,
                propagation=propagation,
                hook_config=config,
            )
            assert_rows(score, expected)


# ---------------------------------------------------------------------------- HF Trainer
class Regressor(nn.Module):
    """The MLP as a Hugging Face ``Trainer`` model: ``forward(x, y) -> {"loss": mean}``."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        return {"loss": ((self.mlp(x) - y) ** 2).sum(1).mean()}


def regressor_sample_loss(call, sample):
    return call(x=sample["x"], y=sample["y"])["loss"]


@pytest.mark.slow
def test_adamw_influence_hf_trainer_defaults(tmp_path):
    """An unmodified ``Trainer`` with its defaults (fused AdamW, clip 1.0, linear decay, no-decay
    biases), weight decay 0.1, accumulation 2, the capture opened around ``trainer.train()``."""
    transformers = pytest.importorskip("transformers")
    from trajectory_reference import Run, Update

    torch.manual_seed(0)
    model = Regressor()
    names = [n for n, _ in model.named_parameters()]
    layers = ["mlp.fc1", "mlp.fc2"]
    store = GradientStorageManager(tmp_path / "train")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=0.05,
        weight_decay=0.1,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data(12, 1))
    state = OptimizerStateCallback(model, lambda: trainer.optimizer, gradient_accumulation_steps=2)
    hm = HookManager(
        model,
        config=HookManagerConfig(linear_io=layers),
        callbacks=[OffloadCallback(1, store), state],
    )
    seen: list[tuple[dict, dict]] = []  # (parameters, batch) of every micro-batch

    def record(module, args_, kwargs):
        if module.training and torch.is_grad_enabled():
            params = {n: p.detach().double().clone() for n, p in module.named_parameters()}
            seen.append((params, {k: v.detach().clone() for k, v in kwargs.items()}))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    with hm.collect(deregister_on_exit=True):
        trainer.train()
    handle.remove()
    state.save(tmp_path / "train")
    windows = [seen[i : i + 2] for i in range(0, len(seen), 2)]
    total = len(windows)
    updates = []
    for k, window in enumerate(windows):
        hyper = trainer_values(names, 0.05 * (total - k) / total, k + 1)
        updates.append(Update(window[0][0], [batch for _, batch in window], hyper))
    final = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    test_batch = stack(data(3, 2))
    reference = Reference(
        model, regressor_sample_loss, Run(updates, final, names, 2, "mean", 1.0), test_batch
    )
    assert sum(reference.clip_coef(t) < 1 for t in range(total)) >= total // 2
    capture_queries(model, tmp_path / "test", lambda: model(**test_batch)["loss"] * 3, layers)
    attributor = AdamWInfluenceAttributor(args_for(tmp_path))
    score = attributor.attribute_from_cache(
        tmp_path / "train",
        tmp_path / "test",
        dynamics=state.dynamics(),
        loss_reduction="mean",
        propagation="test",
    )
    assert_rows(score, reference.split(reference.adamw()))


# ---------------------------------------------------------------------------- DVEmb and TracIn
def sgd_like_groups(model, lr):
    return torch.optim.AdamW(groups(model, "three", lr), lr=lr)


@pytest.mark.parametrize("reduction, accumulation", [("sum", 1), ("mean", 2), ("sum", 3)])
def test_dvemb_and_trajectory_tracin_hand_loop(tmp_path, reduction, accumulation):
    """Per-group learning rates, clip scale and accumulation windows (one update each)."""
    from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor

    model, train, test, run, _state, queries = capture_hand_loop(
        tmp_path, optimizer_fn=adamw(), reduction=reduction, accumulation=accumulation, n=12
    )
    reference = Reference(model, sample_loss, run, queries)
    args = args_for(tmp_path)
    for propagation in ("test", "train"):
        for mode, blocks in (("full", None), ("diagonal", [25, 18])):
            score = DVEmbAttributor(args).attribute_from_cache(
                train,
                test,
                learning_rate=None,
                loss_reduction=reduction,
                propagation=propagation,
                hessian_mode=mode,
            )
            assert_rows(score, reference.split(reference.dvemb(blocks)))
    tracin = TrajectoryTracInAttributor(args).attribute_from_cache(train, test)
    assert tracin.polarity == 1
    assert_rows(tracin, reference.split(reference.tracin()))


# ---------------------------------------------------------------------------- refusals and warnings
def test_maximize_and_other_optimizers_are_refused_before_any_pass(tmp_path, monkeypatch):
    from dattri_llm.attribution.algorithm.trajectory.base import TrajectoryAttributor

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass over the data ran before the refusal")

    for name, optimizer_fn, match in (
        ("max", adamw(maximize=True), "maximize=True"),
        ("sgd", lambda m, lr: torch.optim.SGD(m.parameters(), lr=lr), r"\['SGD'\]"),
    ):
        root = tmp_path / name
        root.mkdir()
        _model, train, test, _run, state, _queries = (
            capture_hand_loop(root, optimizer_fn=optimizer_fn)
            if name == "max"
            else _capture_with_recorder(root, optimizer_fn)
        )
        dynamics = state.dynamics() if name == "max" else _fake_moments(state)
        monkeypatch.setattr(TrajectoryAttributor, "open_train_source", no_pass)
        with pytest.raises(ValueError, match=match):
            AdamWInfluenceAttributor(args_for(root)).attribute_from_cache(
                train, test, dynamics=dynamics
            )
        monkeypatch.undo()


def _capture_with_recorder(root, optimizer_fn):
    """An SGD run recorded with the optimizer-agnostic ``TrainingDynamicsCallback``."""
    from dattri_llm.gradient.callbacks import TrainingDynamicsCallback

    torch.manual_seed(0)
    model = MLP()
    optimizer = optimizer_fn(model, 0.05)
    store = GradientStorageManager(root / "train")
    recorder = TrainingDynamicsCallback(model, optimizer)
    hm = HookManager(
        model,
        config=HookManagerConfig(linear_io=list(LAYERS)),
        callbacks=[OffloadCallback(1, store), recorder],
    )
    loop = HandLoop(model, optimizer, batch_loss("sum"), max_norm=1.0)
    with hm.collect():
        run = loop.run(windows_of(data(8, 1), 2, 1))
    hm.remove()
    recorder.save(root / "train")
    capture_queries(model, root / "test", lambda: batch_loss("sum")(model, stack(data(2, 2))))
    return model, root / "train", root / "test", run, recorder, None


def _fake_moments(recorder):
    """Zero moments for every recorded update (the refusal must come before they are read)."""
    zeros = {name: (torch.zeros(1), torch.zeros(1)) for name in LAYERS}
    return {
        step: {
            "pre": zeros,
            "post": zeros,
            "step": 1,
            "lr": 0.1,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
        }
        for step in recorder.updates
    }


def test_partial_capture_warns_that_the_clip_jacobian_is_approximated(tmp_path):
    """Only ``fc2`` captured while ``fc1`` trains: ĝ·t misses fc1's part; one warning."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = adamw()(model, 0.05)
    store = GradientStorageManager(tmp_path / "train")
    state = OptimizerStateCallback(model, optimizer)
    config = HookManagerConfig(linear_io=["fc2"])
    hm = HookManager(model, config=config, callbacks=[OffloadCallback(1, store), state])
    with hm.collect():
        HandLoop(model, optimizer, batch_loss("sum"), max_norm=1.0).run(
            windows_of(data(8, 1), 2, 1)
        )
    hm.remove()
    capture_queries(
        model, tmp_path / "test", lambda: batch_loss("sum")(model, stack(data(2, 2))), ["fc2"]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AdamWInfluenceAttributor(args_for(tmp_path)).attribute_from_cache(
            tmp_path / "train", tmp_path / "test", dynamics=state.dynamics(), loss_reduction="sum"
        )
    messages = [str(w.message) for w in caught if "clip Jacobian" in str(w.message)]
    assert len(messages) == 1 and "approximated" in messages[0]


# ---------------------------------------------------------------------------- LESS
def capture_less_run(tmp_path, model, optimizer, reduction, accumulation):
    """A hand loop's preconditioned train store and dynamics, and a query store at ``θ_T``."""
    from dattri_llm import TrainingDynamicsCallback

    train, test = data(12, 1), data(3, 2)
    store = GradientStorageManager(tmp_path / "train")
    recorder = TrainingDynamicsCallback(model, optimizer, gradient_accumulation_steps=accumulation)
    config = HookManagerConfig(linear_io=list(LAYERS))
    hm = HookManager(
        model, config=config, callbacks=[OffloadCallback(1, store), recorder], optimizer=optimizer
    )
    hm.set_loss_convention(reduction, accumulation)
    loop = HandLoop(model, optimizer, batch_loss(reduction), accumulation, 1.0, None, reduction)
    with hm.collect():
        run = loop.run(windows_of(train, 2, accumulation))
    hm.remove()
    recorder.save(tmp_path / "train")
    test_batch = stack(test)
    capture_queries(model, tmp_path / "test", lambda: batch_loss("sum")(model, test_batch))
    return run, test_batch


@pytest.mark.parametrize("reduction, accumulation", [("mean", 1), ("sum", 2), ("mean", 3)])
def test_less_hand_loop(tmp_path, reduction, accumulation):
    """Preconditioned capture of each sample's own gradient (the map sees ``c_b·share``), weights
    ``η_ref·c_t``, coordinates scaled by their group's rate."""
    from dattri_llm import LESSAttributor

    torch.manual_seed(0)
    model = MLP()
    optimizer = adamw()(model, 0.05)
    run, test_batch = capture_less_run(tmp_path, model, optimizer, reduction, accumulation)
    reference = Reference(model, sample_loss, run, test_batch)
    assert sum(reference.clip_coef(t) < 1 for t in range(len(run.updates))) >= 2
    score = LESSAttributor(args_for(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test"
    )
    assert score.algorithm_meta["weights_from"] == "training_dynamics"
    assert_rows(score, reference.split(reference.less("fc1.weight")))


def test_less_reference_group_at_rate_zero_weighs_its_steps_zero(tmp_path):
    """The weight ``w_t`` is the first group's rate: at 0 (that group frozen) every row is 0, not
    the NaN of dividing the other groups' rates by it."""
    from dattri_llm import LESSAttributor

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(
        [
            {"params": [model.fc1.weight], "lr": 0.0},
            {"params": [model.fc2.weight, model.fc1.bias, model.fc2.bias]},
        ],
        lr=0.05,
    )
    capture_less_run(tmp_path, model, optimizer, "mean", 1)
    score = LESSAttributor(args_for(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test"
    )
    assert score.algorithm_meta["weights_from"] == "training_dynamics"
    assert score.scores.numel() > 0
    torch.testing.assert_close(score.scores, torch.zeros_like(score.scores), rtol=0, atol=0)


def test_trajectory_tracin_with_one_rate_is_weighted_grad_dot(tmp_path):
    """One learning rate for every coordinate (the fast, factored path) and clipping."""
    from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor

    def one_group(model, lr):
        return torch.optim.AdamW(groups(model, "one", lr), lr=lr)

    model, train, test, run, _state, queries = capture_hand_loop(
        tmp_path, optimizer_fn=one_group, reduction="mean", accumulation=2, n=12
    )
    reference = Reference(model, sample_loss, run, queries)
    score = TrajectoryTracInAttributor(args_for(tmp_path)).attribute_from_cache(train, test)
    assert score.row_steps == sorted(score.row_steps, reverse=True)
    assert_rows(score, reference.split(reference.tracin()))


def test_train_side_adamw_summary_is_sized_before_the_sweep(tmp_path, monkeypatch):
    """``propagation="train"`` carries ``(p, ·)`` blocks: estimated first, a warning when large."""
    from dattri_llm.attribution.algorithm.trajectory import sweep as trajectory_sweep

    model, train, test, _run, state, _queries = capture_hand_loop(tmp_path, optimizer_fn=adamw())
    monkeypatch.setattr(trajectory_sweep, "SUMMARY_WARN_BYTES", 1000)
    attributor = AdamWInfluenceAttributor(args_for(tmp_path))
    with pytest.warns(UserWarning, match=r"train-side summary holds .* \(43, 43\).*'test'"):
        attributor.attribute_from_cache(train, test, dynamics=state.dynamics())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attributor.attribute_from_cache(train, test, dynamics=state.dynamics(), propagation="test")


def test_collect_around_each_backward_still_records_the_steps(tmp_path):
    """A loop that opens ``collect()`` around each backward and steps outside it."""
    from dattri_llm import TrainingDynamicsCallback

    records = []
    for per_backward in (False, True):
        torch.manual_seed(0)
        model = MLP()
        optimizer = adamw()(model, 0.05)
        recorder = TrainingDynamicsCallback(model, optimizer)
        hm = HookManager(model, config=HookManagerConfig(linear_io=list(LAYERS)),
                         callbacks=[recorder])  # fmt: skip
        windows = windows_of(data(8, 1), 2, 1)
        whole = hm.collect() if not per_backward else None
        if whole is not None:
            whole.__enter__()
        for (batch,) in windows:
            optimizer.zero_grad()
            if per_backward:
                with hm.collect():
                    batch_loss("sum")(model, batch).backward()
            else:
                batch_loss("sum")(model, batch).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        if whole is not None:
            whole.__exit__(None, None, None)
        hm.remove()
        records.append(recorder.updates)
    assert sorted(records[0]) == sorted(records[1]) == [0, 1, 2, 3]
    for step in range(4):
        assert records[0][step]["clip_coef"] == pytest.approx(records[1][step]["clip_coef"])
        assert records[1][step]["clip_coef"] < 1


def test_adamw_influence_accelerate_loop(tmp_path):
    """An accelerate loop: ``accumulate`` (loss divided by 2, the step skipped on the first
    micro-batch), ``accelerator.clip_grad_norm_``, the wrapped optimizer."""
    accelerate = pytest.importorskip("accelerate")
    from trajectory_reference import Run, Update, optimizer_values, snapshot

    torch.manual_seed(0)
    model = MLP()
    optimizer = adamw()(model, 0.05)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    names = [n for n, _ in model.named_parameters()]
    ids = {id(p): n for n, p in model.named_parameters()}
    store = GradientStorageManager(tmp_path / "train")
    state = OptimizerStateCallback(model, optimizer, gradient_accumulation_steps=2)
    hm = HookManager(model, config=HookManagerConfig(linear_io=list(LAYERS)),
                     callbacks=[OffloadCallback(1, store), state])  # fmt: skip
    micro = [stack(data(12, 1)[i : i + 2]) for i in range(0, 12, 2)]
    updates, window = [], []
    with hm.collect():
        for batch in micro:
            if not window:
                theta = snapshot(model, names)
            window.append(batch)
            with accelerator.accumulate(model):
                accelerator.backward(batch_loss("mean")(model, batch))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    hyper = optimizer_values(optimizer.optimizer, ids, len(updates) + 1)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                updates.append(Update(theta, window, hyper))
                window = []
    hm.remove()
    run = Run(updates, snapshot(model, names), names, 2, "mean", 1.0)
    test_batch = stack(data(3, 2))
    capture_queries(model, tmp_path / "test", lambda: batch_loss("sum")(model, test_batch))
    reference = Reference(model, sample_loss, run, test_batch)
    assert sum(reference.clip_coef(t) < 1 for t in range(len(updates))) >= 2
    score = AdamWInfluenceAttributor(args_for(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", dynamics=state.dynamics(), loss_reduction="mean"
    )
    assert_rows(score, reference.split(reference.adamw()))


def test_recorder_measures_the_clip_and_leaves_out_a_skipped_step(tmp_path):
    """The recorded ``c`` equals ``min(1, M/(‖G‖+1e-6))``; an update a ``GradScaler`` skips
    (an inf gradient) records no window, and its rows are left out with a warning."""
    from dattri_llm import TrainingDynamicsCallback

    torch.manual_seed(0)
    model = MLP()
    optimizer = adamw()(model, 0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    recorder = TrainingDynamicsCallback(model, optimizer, grad_scaler=scaler)
    store = GradientStorageManager(tmp_path / "train")
    hm = HookManager(model, config=HookManagerConfig(linear_io=list(LAYERS)),
                     callbacks=[OffloadCallback(1, store), recorder])  # fmt: skip
    batches = [stack(data(8, 1)[i : i + 2]) for i in range(0, 8, 2)]
    norms = []
    with hm.collect():
        for step, batch in enumerate(batches):
            optimizer.zero_grad()
            loss = batch_loss("sum")(model, batch)
            if step == 2:
                loss = loss * float("inf")  # an overflow: the scaler skips this update
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            scaler.step(optimizer)
            scaler.update()
    hm.remove()
    recorder.save(tmp_path / "train")
    assert sorted(recorder.updates) == [0, 1, 3] and recorder.skipped_steps == [2]
    for step in (0, 1, 3):
        want = min(1.0, 1.0 / (norms[step] + 1e-6))
        assert recorder.updates[step]["clip_coef"] == pytest.approx(want, rel=1e-5)
        assert recorder.updates[step]["row_scale"] in (2.0**8, 2.0**7)
    capture_queries(model, tmp_path / "test", lambda: batch_loss("sum")(model, stack(data(2, 2))))
    from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor

    with pytest.warns(
        UserWarning, match=r"store steps \[2\] belong to no recorded optimizer update"
    ):
        score = TrajectoryTracInAttributor(args_for(tmp_path)).attribute_from_cache(
            tmp_path / "train", tmp_path / "test"
        )
    assert sorted(set(score.row_steps)) == [0, 1, 3]


class MixedMLP(nn.Module):
    """An HF ``Conv1D`` (its weight stored transposed), a ``LayerNorm`` and a ``Linear``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.conv = Conv1D(5, 4)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.conv(x))))


@pytest.mark.parametrize("propagation", ["test", "train"])
def test_adamw_influence_conv1d_and_layernorm_groups(tmp_path, propagation):
    """No-decay biases and LayerNorm parameters on a transposed ``Conv1D`` and a ``LayerNorm``
    (bias coordinates at other places of their layouts), clip active."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = MixedMLP()
    decayed = [model.conv.weight, model.head.weight]
    other = [p for p in model.parameters() if all(p is not q for q in decayed)]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=0.05,
    )
    layers = ["conv", "norm", "head"]
    store = GradientStorageManager(tmp_path / "train")
    state = OptimizerStateCallback(model, optimizer)
    hm = HookManager(model, config=HookManagerConfig(linear_io=layers),
                     callbacks=[OffloadCallback(1, store), state])  # fmt: skip
    with hm.collect():
        run = HandLoop(model, optimizer, batch_loss("mean"), 1, 1.0, None, "mean").run(
            windows_of(data(12, 1), 2, 1)
        )
    hm.remove()
    assert state.layer_map["conv"]["bias_index"] == [4, 9, 14, 19, 24]  # (out, in + 1) rows
    assert state.layer_map["norm"]["bias_index"] == [5, 6, 7, 8, 9]  # [weight, bias]
    test_batch = stack(data(3, 2))
    capture_queries(model, tmp_path / "test", lambda: batch_loss("sum")(model, test_batch), layers)
    reference = Reference(model, sample_loss, run, test_batch)
    assert sum(reference.clip_coef(t) < 1 for t in range(len(run.updates))) >= 3
    score = AdamWInfluenceAttributor(args_for(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", dynamics=state.dynamics(), loss_reduction="mean",
        propagation=propagation,
    )  # fmt: skip
    assert_rows(score, reference.split(reference.adamw()))

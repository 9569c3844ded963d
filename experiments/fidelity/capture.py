"""Capture the fine-tuning trajectory once with the library, and what each method needs beside it.

Stores under one working directory (sample identifiers = content hashes of the
model inputs, ``hash_sample({"input_ids", "attention_mask"})``):

* ``trajectory/``: raw per-sample gradients of every step (HookManager +
  OffloadCallback), ``lr_schedule.json`` and ``training_dynamics.json`` (each
  update's clip coefficient and parameter groups) beside them; the Adam
  moments before/after every update come from ``OptimizerStateCallback``
  (returned);
* ``trajectory_preconditioned/``: the same run with preconditioned capture
  (``HookManager(optimizer=...)`` mapping each sample's own gradient, LESS's
  train side), ``lr_schedule.json`` and ``training_dynamics.json``;
* ``queries_final/``: query gradients at the final parameters ``θ_T``;
* ``final_train/``: training-sample gradients at ``θ_T`` (a frozen pass, for the
  single-checkpoint methods);
* ``queries_step/<t>/``: query gradients at every ``θ_t`` (TracIn, LESS);
* ``snapshots/``: ``TrajectorySnapshots`` of the reference trajectory, recorded during
  the raw capture run: the trained parameters ``θ_t`` before every update
  (``save_parameters(t)``), ``θ_T`` at step ``T``, and every step's batch
  (``save_batch(t)``, the collated kept samples): the metagradient's replay, SOURCE's
  segment checkpoints;
* ``optimizer.pt``: the run's AdamW ``state_dict()`` after its last update (TrackStar's
  second moment), in the order ``setting.adamw_for`` builds the optimizer.

Every run restarts from the same pretrained weights and follows
``setting.run_trajectory``; the capture runs are checked to end at the
reference's final parameters bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from setting import (
    Data,
    Setting,
    adamw_for,
    batch_order,
    collate,
    lr_schedule,
    run_trajectory,
    summed_loss,
)

from dattri_llm import (
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerStateCallback,
    TrainingDynamicsCallback,
    hash_sample,
)
from dattri_llm.attribution.utils import write_lr_schedule
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots

FROZEN_BATCH = 16
OPTIMIZER_STATE = "optimizer.pt"


@dataclass
class Captured:
    """Everything the methods score from, with the capture costs each method is charged.

    ``train_ids`` / ``query_ids`` are the sample hashes in fine-tuning / query
    order: the row / column order of every method's score matrix.
    ``seconds[key]`` is the wall time of a capture that only some methods need
    (``"frozen"``: the frozen pass at ``θ_T``; ``"per_step_queries"``: the query
    passes at every ``θ_t``).
    """

    root: Path
    train_ids: list[str]
    query_ids: list[str]
    lrs: dict[int, float]
    dynamics: dict
    setting: Setting
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def trajectory(self) -> Path:
        """Raw per-step training gradients."""
        return self.root / "trajectory"

    @property
    def trajectory_preconditioned(self) -> Path:
        """Per-step update directions (LESS's train side)."""
        return self.root / "trajectory_preconditioned"

    @property
    def queries_final(self) -> Path:
        """Query gradients at ``θ_T``."""
        return self.root / "queries_final"

    @property
    def final_train(self) -> Path:
        """Training gradients at ``θ_T``."""
        return self.root / "final_train"

    @property
    def snapshots(self) -> Path:
        """``TrajectorySnapshots`` directory: ``θ_t`` and the batch of every step, ``θ_T``."""
        return self.root / "snapshots"

    @property
    def optimizer_state(self) -> Path:
        """The run's AdamW ``state_dict()`` after its last update (``torch.save``)."""
        return self.root / OPTIMIZER_STATE

    def queries_at(self, step: int) -> Path:
        """Query gradients at ``θ_step`` (before that step's update)."""
        return self.root / "queries_step" / str(step)

    def clip(self, step: int) -> float:
        """The clip coefficient the update of ``step`` applied (1 when unclipped)."""
        update = self.dynamics[step].get("update")
        return 1.0 if update is None else float(update["clip_coef"])


class OptimizerBox:
    """The run's optimizer, built by ``run_trajectory`` and handed to the capture on first use."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.optimizer: torch.optim.Optimizer | None = None

    def make(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """Build the fine-tuning AdamW over ``params`` (``run_trajectory``'s factory)."""
        self.optimizer = adamw_for(self.setting)(params)
        return self.optimizer

    def __call__(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("the optimizer is read before run_trajectory built it")
        return self.optimizer


def hook_config(setting: Setting) -> HookManagerConfig:
    """Hooks on the fine-tuned layers only."""
    return HookManagerConfig(linear_io=setting.hooked_layers)


def offloading(model: torch.nn.Module, directory: Path, setting: Setting, **kwargs) -> HookManager:
    """A HookManager writing per-sample gradients of every backward to a fresh store."""
    store = GradientStorageManager(str(directory))
    offload = OffloadCallback(offload_interval=1, file_manager=store, recording_type="per_sample")
    return HookManager(model, config=hook_config(setting), callbacks=[offload], **kwargs)


def backward_over(model: torch.nn.Module, samples: list, batch_size: int) -> None:
    """One backward of the summed loss per batch of ``samples`` (no update), grads cleared."""
    model.eval()
    for start in range(0, len(samples), batch_size):
        summed_loss(model, collate(samples[start : start + batch_size])).backward()
    model.zero_grad(set_to_none=True)
    model.train()


def final_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the parameters."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def check_same_end(model: torch.nn.Module, reference: dict[str, torch.Tensor], what: str) -> None:
    """``RuntimeError`` unless ``model`` ends at the reference's parameters bit for bit."""
    for name, value in model.named_parameters():
        if not torch.equal(value.detach(), reference[name]):
            raise RuntimeError(f"{what} diverged from the reference trajectory at {name!r}")


def capture_all(
    model_at_start: Callable[[], torch.nn.Module],
    setting: Setting,
    data: Data,
    root: Path,
    reference: dict[str, torch.Tensor],
) -> Captured:
    """Run the captures listed in the module docstring; return the :class:`Captured` bundle."""
    lrs = dict(enumerate(lr_schedule(setting)))
    captured = Captured(
        root=root,
        train_ids=[hash_sample(x) for x in data.finetune],
        query_ids=[hash_sample(q) for q in data.queries],
        lrs=lrs,
        dynamics={},
        setting=setting,
    )
    captured.dynamics = capture_trajectory(model_at_start(), setting, data, captured, reference)
    capture_preconditioned(model_at_start(), setting, data, captured, reference)
    capture_per_step_queries(model_at_start(), setting, data, captured, reference)
    return captured


def capture_trajectory(
    model: torch.nn.Module,
    setting: Setting,
    data: Data,
    captured: Captured,
    reference: dict[str, torch.Tensor],
) -> dict:
    """Raw per-step gradients + Adam dynamics; then queries and a frozen pass at ``θ_T``."""
    box = OptimizerBox(setting)
    manager = offloading(model, captured.trajectory, setting)
    states = OptimizerStateCallback(model, box)
    manager.add_callback(states)
    snapshots = TrajectorySnapshots(captured.snapshots)
    batches = batch_order(setting)

    def snapshot(step: int) -> None:
        snapshots.save_parameters(step, model)
        snapshots.save_batch(step, collate([data.finetune[i] for i in batches[step]]))

    with manager.collect(deregister_on_exit=True):
        run_trajectory(model, setting, data, make_optimizer=box.make, before_step=snapshot)
    snapshots.save_parameters(len(batches), model)
    write_lr_schedule(captured.trajectory, captured.lrs)
    states.save(captured.trajectory)
    torch.save(box().state_dict(), captured.optimizer_state)
    check_same_end(model, reference, "the raw capture run")
    with offloading(model, captured.queries_final, setting).collect(deregister_on_exit=True):
        backward_over(model, data.queries, len(data.queries))
    start = time.perf_counter()
    with offloading(model, captured.final_train, setting).collect(deregister_on_exit=True):
        backward_over(model, data.finetune, FROZEN_BATCH)
    captured.seconds["frozen"] = time.perf_counter() - start
    return states.dynamics()


def capture_preconditioned(
    model: torch.nn.Module,
    setting: Setting,
    data: Data,
    captured: Captured,
    reference: dict[str, torch.Tensor],
) -> None:
    """The same run with preconditioned capture (each sample's Adam update direction)."""
    box = OptimizerBox(setting)
    manager = offloading(model, captured.trajectory_preconditioned, setting, optimizer=box)
    manager.set_loss_convention(setting.loss_reduction)
    recorder = TrainingDynamicsCallback(model, box)
    manager.add_callback(recorder)
    with manager.collect(deregister_on_exit=True):
        run_trajectory(model, setting, data, make_optimizer=box.make)
    write_lr_schedule(captured.trajectory_preconditioned, captured.lrs)
    recorder.save(captured.trajectory_preconditioned)
    check_same_end(model, reference, "the preconditioned capture run")


def capture_per_step_queries(
    model: torch.nn.Module,
    setting: Setting,
    data: Data,
    captured: Captured,
    reference: dict[str, torch.Tensor],
) -> None:
    """Query gradients at every ``θ_t`` (timed: charged to TracIn and LESS)."""
    elapsed = 0.0

    def queries_at(step: int) -> None:
        nonlocal elapsed
        start = time.perf_counter()
        manager = offloading(model, captured.queries_at(step), setting)
        manager.reset_steps(step)
        with manager.collect(deregister_on_exit=True):
            backward_over(model, data.queries, len(data.queries))
        elapsed += time.perf_counter() - start

    run_trajectory(model, setting, data, before_step=queries_at)
    check_same_end(model, reference, "the per-step query run")
    captured.seconds["per_step_queries"] = elapsed


FINAL_MODEL = "final_model.pt"


def capture_final_model(model: torch.nn.Module, captured: Captured) -> Path:
    """Save the final model's state dict ``θ_T`` beside the stores (for model-based methods).

    STRIDE needs the model, not gradients; it rebuilds it with ``setting.make_model`` and
    these weights. Returns the file.
    """
    path = captured.root / FINAL_MODEL
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
    return path

"""Recording a trajectory run: the training side's steps, then the queries at ``θ_T``.

A trajectory method trains once from checkpoint 0. The run goes into a
gradient store (every step's per-sample gradients) or, with
``args.recompute_gradients``, into ``TrajectorySnapshots`` (each step's
parameters and batch, replayed at scoring time); the dynamics recorder saves
what each update applied (``training_dynamics.json``) beside it. The queries
are then collected at the final parameters, labelled with the final step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dattri_llm.attribution.sources import fresh_store
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots

if TYPE_CHECKING:
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.gradient.stream.streamer import GradientStreamer

TRAIN_GRADS_DIR = "train_grads"
TRAIN_SNAPSHOTS_DIR = "train_snapshots"
TEST_GRADS_DIR = "test_grads"


def fresh_targets(
    root: Path, recompute: bool
) -> tuple[Path, GradientStorageManager | TrajectorySnapshots, Path, GradientStorageManager]:
    """``(train_dir, train_target, test_dir, test_store)`` of a new run under ``root``.

    The train target is a snapshot store in ``train_snapshots`` when
    ``recompute``, else a gradient store in ``train_grads``; the queries go to
    ``test_grads``. ``ValueError`` when a target already holds records or steps.
    """
    test_dir = root / TEST_GRADS_DIR
    if recompute:
        train_dir = root / TRAIN_SNAPSHOTS_DIR
        train_target: TrajectorySnapshots | GradientStorageManager = _fresh_snapshots(train_dir)
    else:
        train_dir = root / TRAIN_GRADS_DIR
        train_target = fresh_store(train_dir)
    test_store = fresh_store(test_dir)
    return train_dir, train_target, test_dir, test_store


def record_run(
    attributor: Any,
    train_target: GradientStorageManager | TrajectorySnapshots,
    test_store: GradientStorageManager,
    train_dataset: object,
    test_dataset: object,
    *,
    hook_config: HookManagerConfig | None,
    offload_interval: int,
) -> dict[int, float]:
    """Record the run into ``train_target``, then the queries at ``θ_T`` into ``test_store``.

    ``attributor`` is the ``TrajectoryAttributor`` (typed ``Any``: this module
    does not import ``base``, which imports it) whose streamers, dynamics
    recorder and trajectory hooks run. Returns ``{step: lr}``.
    """
    snapshots = train_target if isinstance(train_target, TrajectorySnapshots) else None
    streamer = attributor.generate_train_rep(
        train_dataset, enable_update=True, hook_config=hook_config, snapshots=snapshots
    )
    recorder = attributor.attach_dynamics_recorder(streamer, snapshots)
    for callback in attributor.trajectory_callbacks(streamer.model, streamer, snapshots):
        streamer.hook_manager.add_callback(callback)
    attributor._hooked_layers = list(streamer.hook_manager.layer_names)
    try:
        if snapshots is None:
            attributor.collect_gradients(
                streamer,
                train_target,
                offload_interval=offload_interval,
                on_block=lambda step, block, ids: attributor.on_trajectory_block(),
            )
        else:
            _run_without_storing(streamer, attributor.on_trajectory_block)
        directory = attributor.train_dir_of(train_target)
        if directory is not None and attributor.args.should_log:
            recorder.save(directory)
        attributor.finish_trajectory(train_target)
    finally:
        attributor._forget_loaded_checkpoint(True)
    lrs = streamer.learning_rates
    final_step = max(lrs, default=-1) + 1
    test = attributor.generate_test_rep(
        test_dataset, checkpoint_step=final_step, hook_config=hook_config, shard=False
    )
    attributor.collect_gradients(test, test_store)
    return lrs


def _fresh_snapshots(path: Path) -> TrajectorySnapshots:
    """A snapshot store on ``path`` for a new run; ``ValueError`` if it already holds steps."""
    snapshots = TrajectorySnapshots(path)
    if snapshots.steps():
        raise ValueError(
            f"snapshot directory {path} already holds steps {snapshots.steps()}; remove it or "
            "choose another cache_dir"
        )
    return snapshots


def _run_without_storing(streamer: GradientStreamer, after_block: Callable[[], None]) -> None:
    """Iterate a snapshotting trajectory, discarding the blocks, calling ``after_block()``."""
    with streamer:
        for _step, block, _ids in streamer:
            del block
            after_block()

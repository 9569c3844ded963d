"""Collection: saving gradients (or transformed representations) into gradient stores.

:func:`collect_gradients` saves every block of a streamer into a store. An
attributor's collection builds on it: one checkpoint (:func:`collect_checkpoint`:
the queries first, then the training side, with its learning rates and the
dynamics recorder of :func:`attach_dynamics_recorder` when it trains), every
checkpoint into fresh disk stores (:func:`cache_checkpoints`, behind
``cache``), and transformed blocks (:func:`cache_representations`). The
attributor is typed ``Any``: this module does not import ``base``, which
imports it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dattri_llm.attribution.checks import source_projection
from dattri_llm.attribution.schedule import write_lr_schedule
from dattri_llm.attribution.sources import fresh_store
from dattri_llm.gradient.async_writer import AsyncGradientWriter
from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback
from dattri_llm.gradient.model.container import Gradient, GradientRecord

if TYPE_CHECKING:
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.gradient.stream.source import GradientSource
    from dattri_llm.gradient.stream.streamer import GradientStreamer


def collect_gradients(
    streamer: Any,
    store: Any,
    *,
    offload_interval: int = 1,
    on_block: Callable[[int, Gradient, Any], None] | None = None,
    async_write: bool | None = None,
) -> Any:
    """Enter ``streamer``, save every block into ``store`` and return the store.

    Needs from the streamer only ``args.async_disk_write`` (read with
    ``getattr``, missing = ``False``, and only when ``async_write is None``),
    ``hook_manager.sample_id_key``, the context-manager protocol and iteration
    yielding ``(step, grad, hashes)``; from the store only ``save_bulk``. Each
    block becomes ``GradientRecord(step, hashes as yielded, grad,
    sample_id_key)`` after ``on_block(step, grad, hashes)`` saw it; every
    ``offload_interval`` records are saved as one group, the rest at the end.
    With ``async_write`` the groups go through an ``AsyncGradientWriter(store)``,
    closed before returning (every write drained, a write error re-raised).

    Raises:
        ValueError: ``offload_interval < 1`` (before anything else happens).
    """
    if offload_interval < 1:
        raise ValueError(f"offload_interval must be >= 1, got {offload_interval}")
    if async_write is None:
        async_write = getattr(getattr(streamer, "args", None), "async_disk_write", False)
    sample_id_key = streamer.hook_manager.sample_id_key
    writer = AsyncGradientWriter(store) if async_write else None
    write = writer.submit if writer is not None else store.save_bulk
    try:
        with streamer:
            staged: list[GradientRecord] = []
            for step, grad, hashes in streamer:
                if on_block is not None:
                    on_block(step, grad, hashes)
                staged.append(GradientRecord(step, hashes, grad, sample_id_key))
                if len(staged) >= offload_interval:
                    write(staged)
                    staged = []
            if staged:
                write(staged)
    finally:
        if writer is not None:
            writer.close()
    return store


def collect_checkpoint(
    attributor: Any,
    k: int,
    train_dataset: object,
    test_dataset: object,
    train_store: GradientStorageManager,
    test_store: GradientStorageManager,
    *,
    hook_config: HookManagerConfig | None,
    enable_update: bool,
    on_train_block: Callable[[int, Gradient, list[str]], None] | None = None,
) -> list[str]:
    """Collect test then train gradients at checkpoint ``k``; return the hooked layers.

    ``attributor`` is the ``BaseInnerProductAttributor`` whose streamers and
    ``collect_gradients`` run; an updating pass (``enable_update``) records
    its dynamics and writes its learning rates beside ``train_store``.
    """
    test = attributor.generate_test_rep(
        test_dataset, checkpoint_step=k, hook_config=hook_config, shard=False
    )
    attributor.collect_gradients(test, test_store)
    train = attributor.generate_train_rep(
        train_dataset, checkpoint_step=k, enable_update=enable_update, hook_config=hook_config
    )
    layers = list(train.hook_manager.layer_names)
    attributor._hooked_layers = layers
    recorder = attributor.attach_dynamics_recorder(train) if enable_update else None
    rows = _RowCounter(on_train_block)
    try:
        attributor.collect_gradients(train, train_store, on_block=rows)
    finally:
        attributor._forget_loaded_checkpoint(enable_update)
    if attributor.args.world_size == 1:  # a sharded store indexes every rank's rows
        _warn_if_rows_replaced(train_store, rows.rows)
    if recorder is not None and attributor.args.should_log:
        write_lr_schedule(train_store.save_dir, train.learning_rates)
        recorder.save(train_store.save_dir)
    return layers


class _RowCounter:
    """An ``on_block`` callback counting the rows collected, then handing each block on."""

    def __init__(self, then: Callable[[int, Gradient, list[str]], None] | None) -> None:
        self.then = then
        self.rows = 0

    def __call__(self, step: int, block: Gradient, ids: list[str]) -> None:
        """Count the block's rows, then call ``then``."""
        self.rows += len(ids)
        if self.then is not None:
            self.then(step, block, ids)


def _warn_if_rows_replaced(store: GradientStorageManager, collected: int) -> None:
    """``UserWarning`` when a fresh store indexes fewer rows than were collected into it.

    A store keeps one occurrence per (step, sample) across its groups: a
    training set holding a sample more than once at one step (a pass without
    updates is one step) loses the later rows, so scores from the store count
    such a sample once, while a live ``attribute`` counts every occurrence.
    """
    lost = collected - sum(1 for _ in store.index_rows())
    if lost > 0:
        warnings.warn(
            f"{lost} training row(s) repeat a sample already collected at the same step (the "
            "training set holds it more than once; a pass without updates is one step). The "
            "store keeps one occurrence per (step, sample), so scores from it count such a "
            "sample once, while a live attribute() (gradient_cache_residency=None) and "
            "covariances recorded at capture (covariances_at_capture=True) count every "
            "occurrence. Deduplicate the training set, or score live, for one consistent count",
            UserWarning,
            stacklevel=4,
        )


def cache_checkpoints(
    attributor: Any,
    indices: list[int],
    root: Path,
    train_dataset: object,
    test_dataset: object,
    *,
    hook_config: HookManagerConfig | None,
    enable_update: bool,
    on_train_block: Callable[[int, Gradient, list[str]], None] | None,
) -> list[tuple[str, str]]:
    """Collect checkpoints ``indices`` into fresh disk stores ``root/ckpt_<k>/{train,test}_grads``.

    Both stores of a checkpoint are opened (``ValueError`` when one already
    holds records) before it is loaded and collected (:func:`collect_checkpoint`).
    Returns ``[(train_dir, test_dir), ...]``.
    """
    pairs = []
    for k in indices:
        train_dir = root / f"ckpt_{k}" / "train_grads"
        test_dir = root / f"ckpt_{k}" / "test_grads"
        stores = [fresh_store(d) for d in (train_dir, test_dir)]
        attributor.load_checkpoint(k)
        collect_checkpoint(
            attributor,
            k,
            train_dataset,
            test_dataset,
            *stores,
            hook_config=hook_config,
            enable_update=enable_update,
            on_train_block=on_train_block,
        )
        pairs.append((str(train_dir), str(test_dir)))
    return pairs


def attach_dynamics_recorder(
    attributor: Any, streamer: GradientStreamer, snapshots: object | None
) -> TrainingDynamicsCallback:
    """The streamer manager's ``TrainingDynamicsCallback``, else the attributor's
    ``dynamics_recorder``, attached, noting that the streamer's rows carry no loss scale."""
    for callback in streamer.hook_manager.callbacks:
        if isinstance(callback, TrainingDynamicsCallback):
            return callback
    recorder = attributor.dynamics_recorder(streamer, snapshots)
    recorder.rows_unscaled = True
    streamer.hook_manager.add_callback(recorder)
    return recorder


def cache_representations(
    source: GradientSource,
    store: GradientStorageManager,
    transform: Callable[[Gradient], Gradient],
    sample_id_key: str | int | None,
) -> GradientStorageManager:
    """Save ``transform(block).materialize()`` (CPU) of each block as one per-batch record.

    Records keep the block's step and identifiers. A known projection of
    ``source`` is declared to ``store`` (the representations live in the same
    basis).
    """
    projection = source_projection(source)
    if projection is not None:
        store.declare_projection(projection)
    for step, block, ids in source:
        rep = transform(block).materialize().to(device="cpu")
        store.save_bulk([GradientRecord(step, list(ids), rep, sample_id_key)])
    return store

"""``ReplayGradientSource``: recompute a trajectory's per-step gradients from its snapshots.

The class is part of :mod:`dattri_llm.gradient.streaming` (re-exported there,
with that ``__module__``), next to the `GradientStreamer` that writes the
snapshots it reads.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Iterator
from contextlib import ExitStack

import torch
from torch import nn
from tqdm.auto import tqdm

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.state.snapshots import MANIFEST_FILE, TrajectorySnapshots
from dattri_llm.gradient.stream.readers import (
    _layer_list,
    resolve_layer_filter,
    select_block_layers,
)
from dattri_llm.gradient.stream.settings import TrainingSettings
from dattri_llm.gradient.stream.source import LossFn, StreamBatch
from dattri_llm.gradient.stream.training import (
    StashedGradient,
    autocast_for,
    check_loss,
    clear_probe_gradients,
    move_batch,
    record_identifiers,
    restore_gradients,
    restore_modes,
    rng_state,
    set_rng_state,
    stash_gradients,
    take_record,
)
from dattri_llm.task import default_loss_func

__all__ = ["ReplayGradientSource", "open_snapshots"]


def open_snapshots(
    snapshots: TrajectorySnapshots | str | os.PathLike, *, must_exist: bool = False
) -> TrajectorySnapshots:
    """``snapshots`` itself, or the `TrajectorySnapshots` store at that directory path.

    A path is opened (created if needed) unless ``must_exist``, which requires
    the manifest to be there already and creates nothing.

    Raises:
        FileNotFoundError: ``must_exist`` and the path holds no snapshot store.
        TypeError: neither a store nor a path.
    """
    if isinstance(snapshots, TrajectorySnapshots):
        return snapshots
    if not isinstance(snapshots, (str, os.PathLike)):
        raise TypeError(
            f"snapshots must be a TrajectorySnapshots or a directory path, got "
            f"{type(snapshots).__name__}"
        )
    if must_exist and not TrajectorySnapshots.is_snapshot_dir(snapshots):
        raise FileNotFoundError(
            f"{os.fspath(snapshots)!r} is not a snapshot directory (no {MANIFEST_FILE}); record "
            "one with GradientStreamer(..., enable_update=True, snapshots=<dir>)"
        )
    return TrajectorySnapshots(snapshots)


def resolve_replay_steps(
    available: list[int], steps: int | Iterable[int] | None, where: str
) -> list[int]:
    """The steps to replay: ``available`` for ``None``, else ``steps`` in their order.

    Requested steps not in ``available`` are dropped, as are repeats.

    Raises:
        ValueError: nothing is left.
    """
    if steps is None:
        chosen = list(available)
        requested: list[int] = []
    else:
        requested = [int(steps)] if isinstance(steps, int) else [int(s) for s in steps]
        present = set(available)
        chosen = list(dict.fromkeys(s for s in requested if s in present))
    if not chosen:
        asked = "" if steps is None else f" for the requested steps {requested}"
        raise ValueError(
            f"{where} holds no replayable step{asked} (a step needs stored parameters and a "
            f"batch); available steps: {available}"
        )
    return chosen


class _SharedReplay:
    """Hooks and the pre-replay parameters a source shares with its `for_steps` views."""

    def __init__(self, model: nn.Module, config: HookManagerConfig | None) -> None:
        self.model = model
        self.capture = CaptureCallback()
        self.manager = HookManager(
            model,
            config=HookManagerConfig(linear_io=REGISTER_ALL) if config is None else config,
            callbacks=[self.capture],
        )
        self.original: dict[str, torch.Tensor] | None = None
        self.closed = False
        self.layers_checked = False

    def remember_parameters(self) -> None:
        """Keep CPU copies of every parameter before the first replay overwrites them."""
        if self.original is None:
            self.original = {
                name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()
            }

    def close(self) -> None:
        """Remove the hooks and copy the remembered parameters back (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.manager.remove()
        if self.original is None:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in self.original.items():
                params[name].copy_(value)
        self.original = None


class ReplayGradientSource:
    """Re-iterable source recomputing each snapshot step's block from its parameters and batch.

    For every step (in the order of ``steps``; default all snapshot steps,
    ascending): copy the step's stored parameters into ``model``, run the
    stored batch (moved to the device of ``model``'s parameters) through
    ``loss_fn`` under ``autocast_for(args)`` with ``model.train(train_mode)``,
    divide the loss by ``args.gradient_accumulation_steps`` as the recording
    `GradientStreamer` did, and backward under the source's hooks; yield
    ``(step, block, identifiers)``. With the same ``args`` as the recording
    trajectory every block equals the one the trajectory yielded live (up to
    the randomness of stochastic layers such as dropout, which draw fresh
    samples here).

    The hooks (default config ``linear_io=REGISTER_ALL``) are registered at
    construction and persist across passes; each step collects inside its own
    ``collect()``. A pass hands back the global RNG state, module train/eval
    modes and any gradients already on the parameters, so passes repeat
    (``reusable``). The parameters stay at the last replayed step between
    passes; `close` (or leaving the ``with`` block) removes the hooks and
    restores the parameters the model had before the first replay.

    `for_steps` views share the hooks: closing a view does nothing, closing
    the source ends every view (iterating a closed source → ``RuntimeError``).

    Args:
        model: the (unwrapped) model the snapshots were taken from.
        args: the run settings, a `TrainingSettings` (``world_size``, ``bf16``/``fp16``,
            ``gradient_accumulation_steps``, ``should_log``).
        snapshots: a `TrajectorySnapshots` or the path of an existing store.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss``.
        config: hook config (default ``HookManagerConfig(linear_io=REGISTER_ALL)``).
        steps: steps to replay, in this order; steps without a snapshot are dropped.
        layer_name: a layer name or list of names to keep (with their ``name@k``).
        train_mode: replay in ``train()`` (default) or ``eval()`` mode.
        desc: progress-bar label; a tqdm bar is shown only when ``desc`` is
            given, ``verbose`` is true and ``args.should_log``.
        verbose: see ``desc``.

    Raises:
        NotImplementedError: ``args.world_size > 1``.
        FileNotFoundError: a path that holds no snapshot store.
        ValueError: no requested step has a snapshot.
    """

    __module__ = "dattri_llm.gradient.streaming"

    def __init__(
        self,
        model: nn.Module,
        args: TrainingSettings,
        snapshots: TrajectorySnapshots | str,
        *,
        loss_fn: LossFn | None = None,
        config: HookManagerConfig | None = None,
        steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        train_mode: bool = True,
        desc: str | None = None,
        verbose: bool = False,
    ) -> None:
        if args.world_size > 1:
            raise NotImplementedError(
                f"ReplayGradientSource runs in a single process (args.world_size="
                f"{args.world_size}); replay each rank's snapshots in its own process with "
                "world_size=1"
            )
        self._args = args
        self._snapshots = open_snapshots(snapshots, must_exist=True)
        self._steps = resolve_replay_steps(
            self._snapshots.steps(), steps, f"snapshot store {self._snapshots.root}"
        )
        self._layer_name = _layer_list(layer_name)
        self._loss_fn = default_loss_func if loss_fn is None else loss_fn
        self._train_mode = train_mode
        self._desc = desc
        self._verbose = verbose
        self._owner = True
        self._shared = _SharedReplay(model, config)

    # ------------------------------------------------------------ properties

    @property
    def args(self) -> TrainingSettings:
        """The run settings."""
        return self._args

    @property
    def snapshots(self) -> TrajectorySnapshots:
        """The snapshot store replayed."""
        return self._snapshots

    @property
    def steps(self) -> list[int]:
        """Steps replayed per pass, in replay order."""
        return list(self._steps)

    @property
    def layer_name(self) -> list[str] | None:
        """Layer filter (``None`` = every hooked layer)."""
        return None if self._layer_name is None else list(self._layer_name)

    @property
    def reusable(self) -> bool:
        """Always ``True``: every pass recomputes the same blocks."""
        return True

    def __len__(self) -> int:
        """Blocks per pass (one per step)."""
        return len(self._steps)

    def __repr__(self) -> str:
        """Store, steps and layer filter."""
        return (
            f"ReplayGradientSource({self._snapshots!r}, steps={self._steps}, "
            f"layer_name={self._layer_name})"
        )

    # ------------------------------------------------------------- lifecycle

    def for_steps(self, steps: int | Iterable[int]) -> ReplayGradientSource:
        """A view replaying ``steps`` (in that order) with the same hooks (no progress bar).

        Raises:
            ValueError: none of ``steps`` is among this source's steps.
        """
        view = copy.copy(self)
        view._steps = resolve_replay_steps(
            self._steps, steps, f"ReplayGradientSource.for_steps (source steps {self._steps})"
        )
        view._owner = False
        view._desc = None
        return view

    def close(self) -> None:
        """Remove the hooks and restore the pre-replay parameters (a view: no-op)."""
        if self._owner:
            self._shared.close()

    def __enter__(self) -> ReplayGradientSource:
        """Return ``self``; leaving the block calls `close`."""
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """`close`."""
        self.close()

    # ----------------------------------------------------------------- passes

    def __iter__(self) -> Iterator[StreamBatch]:
        """One pass: ``(step, block, identifiers)`` per step, in `steps` order."""
        if self._shared.closed:
            raise RuntimeError(
                "this ReplayGradientSource is closed (its hooks are removed); build a new one"
            )
        blocks = self._pass()
        if self._desc is not None and self._verbose and getattr(self._args, "should_log", True):
            blocks = tqdm(blocks, total=len(self._steps), desc=self._desc)
        return iter(blocks)

    def _pass(self) -> Iterator[StreamBatch]:
        """Replay every step; RNG, module modes and gradients are handed back however it ends."""
        model = self._shared.model
        self._shared.remember_parameters()
        with ExitStack() as restore:
            restore.callback(set_rng_state, rng_state())
            restore.callback(restore_modes, {m: m.training for m in model.modules()})
            stash = stash_gradients(list(model.parameters()))
            restore.callback(restore_gradients, stash)
            model.train(self._train_mode)
            for step in self._steps:
                yield self._replay(step, stash)

    def _replay(self, step: int, stash: list[StashedGradient]) -> StreamBatch:
        """Recompute ``step``'s block at its stored parameters and batch."""
        shared = self._shared
        self._snapshots.load_parameters(step, shared.model)
        batch = move_batch(self._snapshots.load_batch(step), _device_of(shared.model))
        shared.manager.reset_steps(step)
        shared.capture.record = None
        with shared.manager.collect():
            with autocast_for(self._args):
                loss = check_loss(self._loss_fn(shared.model, batch), step)
            divisor = self._args.gradient_accumulation_steps
            (loss / divisor if divisor > 1 else loss).backward()
        record = take_record(shared.capture, step, f"replayed step {step}")
        clear_probe_gradients(stash)
        return step, self._select_layers(record.gradient), record_identifiers(record)

    def _select_layers(self, gradient: Gradient) -> Gradient:
        """``gradient`` restricted to the layer filter (checked on the first block)."""
        if not self._shared.layers_checked:
            resolve_layer_filter(gradient, self._layer_name, "the replayed gradient")
            self._shared.layers_checked = True
        return select_block_layers(gradient, self._layer_name)


def _device_of(model: nn.Module) -> torch.device | str:
    """The device of ``model``'s first parameter (CPU for a parameterless model)."""
    param = next(model.parameters(), None)
    return "cpu" if param is None else param.device

"""The live gradient source: `GradientStreamer`, forward+backward per batch, frozen or training.

Its pieces live next to it: input batching in `inputs`, the training step
(optimizer, scheduler, update, gradient stash) in `training`, model
preparation (checkpointing, DDP / FSDP, loss scaling) in `wrapping`.
``transformers`` is imported only where seeding and scheduling need it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.installation import BackwardTargets
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots
from dattri_llm.gradient.stream.inputs import check_dataset, make_loader
from dattri_llm.gradient.stream.replay import open_snapshots
from dattri_llm.gradient.stream.settings import TrainingSettings
from dattri_llm.gradient.stream.source import LossFn, StreamBatch
from dattri_llm.gradient.stream.training import (
    StashedGradient,
    apply_update,
    autocast_for,
    build_optimizer,
    build_scheduler,
    check_loss,
    clear_probe_gradients,
    decay_parameter_groups,
    move_batch,
    precondition_mode,
    record_identifiers,
    restore_gradients,
    restore_modes,
    rng_state,
    set_rng_state,
    stash_gradients,
    take_record,
)
from dattri_llm.gradient.stream.wrapping import (
    enable_gradient_checkpointing,
    make_grad_scaler,
    place_model,
    unscale_gradient,
)
from dattri_llm.task import default_loss_func

if TYPE_CHECKING:
    from torch.utils.data import Dataset

__all__ = ["GradientStreamer"]


class GradientStreamer:
    """Live gradient source: one ``(step, Gradient, identifiers)`` block per batch.

    Two regimes. **Frozen probe** (``enable_update=False``): batches in dataset
    order, model in ``eval()``, every block labelled ``checkpoint_step``;
    gradients already on the parameters, module modes and the global RNG state
    are restored after each pass (however it ends), so the probe is
    ``reusable`` and a probe taken between a trajectory's steps leaves it
    bit-identical, also for gradients a wrapper keeps in its own buffers (DDP
    ``gradient_as_bucket_view``, FSDP ``keep_low_precision_grads``).
    **Trajectory** (``enable_update=True``): model in ``train()``, batches in
    the order of ``DataLoader(dataset, batch_size, shuffle=True,
    generator=torch.Generator().manual_seed(args.data_seed))`` (``args.seed``
    when ``data_seed`` is ``None``), as a Hugging Face ``Trainer`` draws them;
    the loss divided by ``N = args.gradient_accumulation_steps`` and the
    optimizer stepped every ``N`` batches and on the last batch (forward → backward → clip →
    ``optimizer.step`` → ``scheduler.step``; zero-grad at the next window
    start); blocks are labelled with the batch index and the streamer can be
    iterated once.

    ``dataset`` is a list of dicts, a map-style ``torch`` `Dataset` of dicts or a
    Hugging Face ``datasets.Dataset`` (anything else → ``TypeError`` here, see
    `check_dataset`). The attribute ``role`` (``"training"``, or ``"query"``
    for a test-side probe) names the batches in loss errors.

    Must be entered as a context manager before iterating. Blocks keep the
    captured device and dtype. Under fp16 with a ``GradScaler`` the captured
    gradients are divided by the scale before they are yielded.

    ``model`` must be unwrapped: hooks go on it first, then it is moved to
    ``args.device`` and wrapped, unless ``forward_model=`` is given. With
    ``args.fsdp`` set it is wrapped in ``FullyShardedDataParallel(model,
    use_orig_params=True)`` (``full_shard``/``shard_grad_op`` → sharding
    strategy, ``offload`` → parameter CPU offload (GPU only), ``fsdp_config``
    ``transformer_layer_cls_to_wrap`` / ``min_num_params`` → auto-wrap policy,
    ``auto_wrap`` alone → the model's ``_no_split_modules``); in a single
    process without a process group it stays unwrapped (``UserWarning``).
    Otherwise it is wrapped in ``DistributedDataParallel`` when
    ``args.world_size > 1``. Under FSDP, clipping uses the wrapper's global norm.
    With ``args.world_size > 1`` and ``shard=True`` each rank streams its own
    part of the dataset, without padding (`_UnpaddedShardBatches`): every
    sample on exactly one rank, the same number of batches on every rank.

    ``precondition=True`` captures optimizer update directions instead of raw
    gradients (``ops.precondition`` with the optimizer state before the
    coming update, see `HookManager`'s ``optimizer=``): the trajectory's own
    optimizer, or the ``optimizer=`` given to a frozen probe (``ValueError``
    without one). An owned manager is built with that optimizer; a shared
    ``hook_manager=`` must support preconditioning (``ValueError``). Each batch
    switches the manager's ``precondition`` to this streamer's setting and back,
    so a raw probe and a preconditioned trajectory can share hooks.

    ``snapshots=`` (a `TrajectorySnapshots` or a directory path; trajectories
    only) stores, for every batch index, the parameters its gradients were
    taken at (micro-batches of one accumulation window point to the window
    start with ``same_as``) and the batch as the loader produced it, so that a
    `ReplayGradientSource` over the store recomputes every block. Under
    ``world_size > 1`` every rank writes its own batches: give each rank its
    own directory.

    Not supported: DeepSpeed, ``snapshots=`` with FSDP, and ``precondition=True``
    with an fp16 ``GradScaler`` (an updating fp16 run on GPU; the map is not
    linear in the loss scale) — each ``NotImplementedError``.
    """

    __module__ = "dattri_llm.gradient.streaming"

    def __init__(
        self,
        model: nn.Module,
        dataset: Dataset,
        args: TrainingSettings,
        *,
        batch_size: int,
        enable_update: bool = False,
        loss_fn: LossFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: object | None = None,
        config: HookManagerConfig | None = None,
        collate_fn: Callable | None = None,
        checkpoint_step: int = 0,
        hook_manager: HookManager | None = None,
        precondition: bool = False,
        snapshots: TrajectorySnapshots | str | None = None,
        forward_model: nn.Module | None = None,
        shard: bool = True,
        defer_update: bool = False,
    ) -> None:
        self._check_options(batch_size, enable_update, precondition, optimizer, snapshots, args)
        check_dataset(dataset, "the GradientStreamer dataset")
        self._snapshots = None if snapshots is None else open_snapshots(snapshots)
        self._args = args
        self._model = model
        self.enable_update = enable_update
        self.defer_update = defer_update
        self.role = "training"
        self._loss_fn = default_loss_func if loss_fn is None else loss_fn
        self._optimizer = optimizer
        self._param_groups = decay_parameter_groups(model, args.weight_decay)
        self._scheduler = scheduler
        self._checkpoint_step = checkpoint_step
        self._precondition = precondition
        self._manager, self._owns_manager = self._resolve_manager(
            model, config, hook_manager, forward_model, args
        )
        self._capture = _find_capture_callback(self._manager)
        if self._capture is None:
            raise ValueError(
                "hook_manager= must carry a CaptureCallback (the streamer reads each batch's "
                "record from it); build it with callbacks=[CaptureCallback(), ...]"
            )
        try:
            enable_gradient_checkpointing(model, args)
            self._forward_model = forward_model or place_model(model, args)
        except BaseException:
            if self._owns_manager:  # do not leave hooks on a model we failed to wrap
                self._manager.remove()
            raise
        self._dataset = dataset
        self._batch_size = batch_size
        self._collate_fn = collate_fn
        self._shard = shard
        self._scaler: torch.amp.GradScaler | None = None
        self._collect_stack: ExitStack | None = None
        self._active = False
        self._trajectory_started = False
        self._pending_update = False
        self._learning_rates: dict[int, float] = {}

    # ----------------------------------------------------------------- setup

    @staticmethod
    def _check_options(
        batch_size: int,
        enable_update: bool,
        precondition: bool,
        optimizer: torch.optim.Optimizer | None,
        snapshots: TrajectorySnapshots | str | os.PathLike | None,
        args: TrainingSettings,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if snapshots is not None and not enable_update:
            raise ValueError(
                "snapshots= records a training trajectory and needs enable_update=True"
            )
        if snapshots is not None and args.fsdp:
            raise NotImplementedError(
                f"GradientStreamer(snapshots=...) does not support FSDP (args.fsdp={args.fsdp!r}): "
                "each rank holds only a shard of the parameters; unset args.fsdp to record "
                "snapshots"
            )
        if precondition and not enable_update and optimizer is None:
            raise ValueError(
                "precondition=True on a frozen probe needs optimizer= (the optimizer whose state "
                "preconditions the captured gradients); pass it, or set precondition=False"
            )
        if precondition and enable_update and args.fp16 and _is_cuda(args):
            raise NotImplementedError(
                "precondition=True is not supported with fp16 loss scaling (an updating fp16 "
                "run on GPU): the optimizer map is not linear in the loss scale; use bf16"
            )
        if args.deepspeed:
            raise NotImplementedError(
                "GradientStreamer does not support DeepSpeed; unset args.deepspeed"
            )

    def _resolve_manager(
        self,
        model: nn.Module,
        config: HookManagerConfig | None,
        hook_manager: HookManager | None,
        forward_model: nn.Module | None,
        args: TrainingSettings,
    ) -> tuple[HookManager, bool]:
        if hook_manager is not None:
            if args.world_size > 1 and forward_model is None:
                raise ValueError(
                    "sharing hook_manager= under world_size>1 needs forward_model= (the wrapper "
                    "the owning streamer built); pass other.forward_model"
                )
            if self._precondition and not hook_manager.supports_preconditioning:
                raise ValueError(
                    "precondition=True with a shared hook_manager= needs a manager that supports "
                    "preconditioning: build it with HookManager(model, optimizer=...), or let the "
                    "streamer build its own"
                )
            return hook_manager, False
        if config is None:
            config = HookManagerConfig(linear_io=REGISTER_ALL)
        # A trajectory's optimizer may be built from args on first use: hand the manager a
        # callable it resolves then (a callable optimizer is resolved on first use).
        optimizer = self._capture_optimizer if self._precondition else None
        manager = HookManager(
            model, config=config, callbacks=[CaptureCallback()], optimizer=optimizer
        )
        return manager, True

    def _capture_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose pre-step state preconditions the captures (`optimizer`)."""
        return self.optimizer

    def _make_loader(self, shuffle: bool) -> DataLoader:
        """A fresh loader over the dataset, ``batch_size`` per batch (see `make_loader`)."""
        return make_loader(
            self._dataset,
            self._batch_size,
            self._args,
            collate_fn=self._collate_fn,
            shuffle=shuffle,
            shard=self._shard,
        )

    # ------------------------------------------------------------ properties

    @property
    def args(self) -> TrainingSettings:
        """The :class:`TrainingSettings` the streamer was built with."""
        return self._args

    @property
    def reusable(self) -> bool:
        """``True`` for a frozen probe (re-iterable at the same parameters)."""
        return not self.enable_update

    @property
    def model(self) -> nn.Module:
        """The unwrapped, hooked model."""
        return self._model

    @property
    def forward_model(self) -> nn.Module:
        """The module the loss is evaluated on (the wrapper, or ``model`` itself)."""
        return self._forward_model

    @property
    def hook_manager(self) -> HookManager:
        """The :class:`HookManager` capturing each batch (owned or shared)."""
        return self._manager

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer: given, or built from ``args`` for a trajectory.

        Raises ``RuntimeError`` for a probe built without one.
        """
        if self._optimizer is None and self.enable_update:
            self._optimizer = build_optimizer(self._param_groups, self._args)
        if self._optimizer is None:
            raise RuntimeError(
                "this GradientStreamer has no optimizer (a frozen probe built without "
                "optimizer=); pass optimizer= or use enable_update=True"
            )
        return self._optimizer

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler of an updating pass on GPU (``None`` otherwise)."""
        return self._scaler

    @property
    def learning_rates(self) -> dict[int, float]:
        """LR in effect for each batch index of the last updating pass (``{}`` for probes)."""
        return dict(self._learning_rates)

    def __len__(self) -> int:
        """Number of batches (= blocks) per pass."""
        return len(self._make_loader(shuffle=False))

    # ------------------------------------------------------------- lifecycle

    def __enter__(self) -> GradientStreamer:
        """Seed, and enter the owned manager's ``collect()``."""
        if self._active:
            raise RuntimeError("this GradientStreamer is already active; do not re-enter it")
        # optional dependency: transformers
        from transformers import enable_full_determinism, set_seed

        if self._args.full_determinism:
            enable_full_determinism(self._args.seed)
        else:
            set_seed(self._args.seed)
        stack = ExitStack()
        if self._owns_manager:
            stack.enter_context(self._manager.collect())
        self._collect_stack = stack
        self._active = True
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Apply a deferred update (clean exit only), end collection, remove owned hooks."""
        try:
            if exc_type is None:
                self._apply_pending_update()
        finally:
            self._pending_update = False
            self._active = False
            stack, self._collect_stack = self._collect_stack, None
            try:
                if stack is not None:
                    stack.close()
            finally:
                if self._owns_manager:
                    self._manager.remove()

    def __iter__(self) -> Iterator[StreamBatch]:
        """Run one pass; yields ``(step, Gradient, identifiers)`` per batch."""
        if not self._active:
            raise RuntimeError(
                "GradientStreamer must be entered before iterating: use `with streamer: for "
                "step, block, ids in streamer: ...`"
            )
        if self.enable_update:
            if self._trajectory_started:
                raise RuntimeError(
                    "an updating GradientStreamer (enable_update=True) can be iterated only once; "
                    "its parameters have moved (reusable is False)"
                )
            self._trajectory_started = True
            return self._trajectory_pass()
        return self._probe_pass()

    # ----------------------------------------------------------------- passes

    def _probe_pass(self) -> Iterator[StreamBatch]:
        """One frozen pass; RNG, module modes and gradients are handed back however it ends.

        Gradients already on the parameters (a trajectory's, between its
        backward and its deferred update) are stashed by `stash_gradients`:
        those living in a wrapper's buffer (DDP bucket views, FSDP flat
        gradients), which the probe's own backward rewrites, get their values
        written back in place; the others are set aside and re-attached.
        """
        params = list(self._model.parameters())
        with ExitStack() as restore:  # every restore runs even if an earlier one raises
            restore.callback(set_rng_state, rng_state())
            restore.callback(restore_modes, {m: m.training for m in self._model.modules()})
            stash = stash_gradients(params)
            restore.callback(restore_gradients, stash)
            self._model.eval()
            for index, batch in enumerate(self._make_loader(shuffle=False)):
                # Yield without binding the block here: a local would keep the previous
                # batch's captures alive through the next batch's forward and backward.
                yield self._probe_batch(index, batch, stash)

    def _probe_batch(self, index: int, batch: object, stash: list[StashedGradient]) -> StreamBatch:
        """Run one probe batch and empty the parameter gradients it left behind."""
        block, ids = self._run_batch(index, batch, loss_divisor=1)
        clear_probe_gradients(stash)
        return self._checkpoint_step, block, ids

    def _trajectory_pass(self) -> Iterator[StreamBatch]:
        optimizer = self.optimizer
        if self._scheduler is None:
            self._scheduler = build_scheduler(optimizer, self._args, len(self))
        device = torch.device(self._args.device)
        if self._args.fp16 and device.type == "cuda":
            self._scaler = make_grad_scaler(self._forward_model)
        self._learning_rates = {}
        window = self._args.gradient_accumulation_steps
        loader = self._make_loader(shuffle=True)
        last = len(loader) - 1
        self._model.train()
        for index, batch in enumerate(loader):
            self._apply_pending_update()
            if index % window == 0:
                optimizer.zero_grad(set_to_none=True)
            self._learning_rates[index] = float(optimizer.param_groups[0]["lr"])
            yield self._trajectory_batch(index, batch, window, last)
        self._apply_pending_update()

    def _trajectory_batch(self, index: int, batch: object, window: int, last: int) -> StreamBatch:
        """Run one training batch (and snapshot it); step (or defer) the update at a window end."""
        block, ids = self._run_batch(index, batch, loss_divisor=window)
        if self._snapshots is not None:
            self._save_snapshot(index, batch, window)
        if (index + 1) % window == 0 or index == last:
            if self.defer_update:
                self._pending_update = True
            else:
                self._apply_update()
        return index, block, ids

    def _save_snapshot(self, index: int, batch: object, window: int) -> None:
        """Store batch ``index`` and the parameters its gradients were taken at.

        Called after the batch's backward and before any update, so the model
        holds those parameters; later micro-batches of an accumulation window
        point to the window start (``same_as``) instead of copying them again.
        """
        start = index - index % window
        same_as = None if index == start else start
        self._snapshots.save_parameters(index, self._model, same_as=same_as)
        self._snapshots.save_batch(index, batch)

    def _run_batch(self, index: int, batch: object, loss_divisor: int) -> tuple[Gradient, list]:
        """Forward + backward one batch under the hooks; return its captured block and ids."""
        batch = move_batch(batch, torch.device(self._args.device))
        self._manager.reset_steps(index)
        self._capture.record = None
        with ExitStack() as stack:
            stack.enter_context(precondition_mode(self._manager, self._precondition))
            targets = stack.enter_context(self._backward_targets())
            with autocast_for(self._args):
                loss = check_loss(self._loss_fn(self._forward_model, batch), index, self.role)
            if loss_divisor > 1:
                loss = loss / loss_divisor
            if self._scaler is not None:
                loss = self._scaler.scale(loss)
            outputs = None if targets is None else targets.tensors()
            if outputs:  # to the captured outputs only: no weight gradient is computed
                torch.autograd.grad(loss, outputs, allow_unused=True)
            else:
                loss.backward()
        record = take_record(self._capture, index, f"batch {index}")
        block = record.gradient
        if self._scaler is not None:
            block = unscale_gradient(block, float(self._scaler.get_scale()))
        return block, record_identifiers(record)

    def _backward_targets(self) -> AbstractContextManager[BackwardTargets | None]:
        """Where a frozen probe may backpropagate to the hooked outputs only.

        A probe discards its parameter gradients, so when every capture comes
        from a hooked layer output (no ``param_grad`` or invasive layer), the
        model is not wrapped (DDP / FSDP reduce parameter gradients in the
        backward) and activations are not recomputed (gradient checkpointing),
        the backward runs ``torch.autograd.grad`` on the outputs the hooks
        recorded (unless one was modified in place) and skips every
        weight-gradient GEMM. Otherwise ``None``.
        """
        if (
            self.enable_update
            or self._forward_model is not self._model
            or self._args.gradient_checkpointing
        ):
            return nullcontext(None)
        return self._manager._collect_backward_targets()

    def _apply_pending_update(self) -> None:
        if self._pending_update:
            self._pending_update = False
            self._apply_update()

    def _apply_update(self) -> None:
        """Clip to ``max_grad_norm``, ``optimizer.step()``, then ``scheduler.step()``."""
        apply_update(
            self.optimizer,
            self._scheduler,
            self._scaler,
            self._args.max_grad_norm,
            self._model,
            self._forward_model,
        )


def _is_cuda(args: TrainingSettings) -> bool:
    """Whether ``args.device`` is a CUDA device."""
    return torch.device(args.device).type == "cuda"


def _find_capture_callback(manager: HookManager) -> CaptureCallback | None:
    """The first `CaptureCallback` attached to ``manager``, or ``None``."""
    return next((cb for cb in manager.callbacks if isinstance(cb, CaptureCallback)), None)

"""``GradientStreamer``: live per-batch gradient blocks from forward+backward passes.

Re-exported by :mod:`dattri_llm.gradient.streaming`. The streamer runs the
model over a dataset under capture hooks and yields one ``(step, Gradient,
identifiers)`` block per batch, either at frozen parameters (a reusable probe)
or while training (a one-shot trajectory that mirrors the Hugging Face
``Trainer`` step). ``transformers`` is imported lazily, only where seeding and
scheduling need it.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, Dataset

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
    from dattri_llm.gradient.gradient import Gradient
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager

    StreamBatch = tuple[int, Gradient, list[str]]
    LossFn = Callable[[nn.Module, object], torch.Tensor]


def check_loss(loss: object, batch_index: int) -> torch.Tensor:
    """Return ``loss`` if it is a finite 0-d tensor, else raise ``ValueError`` naming the batch."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn returned {shape} for batch {batch_index}; it must return a scalar tensor "
            "(reduce per-sample losses with .sum() or .mean())"
        )
    if not bool(torch.isfinite(loss.detach())):
        raise ValueError(
            f"loss_fn returned a non-finite loss ({loss.item()}) for batch {batch_index}; "
            "check the batch and the model's numerical stability"
        )
    return loss


def unscale_gradient(block: Gradient, scale: float) -> Gradient:
    """Divide every captured gradient of ``block`` by a loss-scaler ``scale``.

    Factorized layers divide their output-gradient factor ``(B, *, D_out)``;
    dense layers ``(B, d)`` divide the whole tensor.
    """
    from dattri_llm.gradient.gradient import Factorized

    def unscale(_name: str, value: object, _layer_type: str) -> object:
        if isinstance(value, Factorized):
            return Factorized(
                value.activation,
                value.pre_activation_grad / scale,
                value.module_kwargs,
                value.batch_first,
            )
        return value / scale

    return block.map_layers(unscale)


def decay_parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable parameters into a decayed group and a no-decay group.

    Parameters with ``ndim < 2`` or whose names end with ``.bias`` get weight
    decay 0; the others ``weight_decay``. Empty groups are omitted.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.endswith(".bias") or name == "bias":
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    groups: list[dict[str, Any]], args: AttributionArguments
) -> torch.optim.Optimizer:
    """The optimizer ``args`` describes over the parameter ``groups``.

    ``groups`` come from :func:`decay_parameter_groups`, taken before any FSDP
    wrapping (which flattens parameters to 1-D shards).
    ``optim`` ``"adamw_torch"``/``"adamw"`` → ``AdamW(lr, betas, eps)``;
    ``"sgd"`` → ``SGD(lr)``; anything else → ``ValueError``.
    """
    if not groups:
        raise ValueError(
            "enable_update=True but the model has no trainable parameter "
            "(every parameter has requires_grad=False)"
        )
    if args.optim in ("adamw_torch", "adamw"):
        return torch.optim.AdamW(
            groups,
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        )
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    raise ValueError(
        f"unsupported optim {args.optim!r}; use 'adamw_torch', 'adamw' or 'sgd', or pass an "
        "optimizer= to GradientStreamer"
    )


def find_capture_callback(manager: HookManager) -> CaptureCallback | None:
    """The first :class:`CaptureCallback` attached to ``manager``, or ``None``."""
    from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback

    for callback in manager.callbacks:
        if isinstance(callback, CaptureCallback):
            return callback
    return None


FSDP_CONFIG_KEYS = ("transformer_layer_cls_to_wrap", "min_num_params")


def fsdp_sharding_strategy(tokens: list[str]) -> object:
    """The ``ShardingStrategy`` named by ``args.fsdp`` tokens (default ``FULL_SHARD``).

    ``full_shard`` → ``FULL_SHARD``, ``shard_grad_op`` → ``SHARD_GRAD_OP``;
    both together → ``ValueError``.
    """
    from torch.distributed.fsdp import ShardingStrategy

    if "full_shard" in tokens and "shard_grad_op" in tokens:
        raise ValueError(
            f"args.fsdp {tokens} names two sharding strategies; keep one of 'full_shard' and "
            "'shard_grad_op'"
        )
    if "shard_grad_op" in tokens:
        return ShardingStrategy.SHARD_GRAD_OP
    return ShardingStrategy.FULL_SHARD


def fsdp_config_options(fsdp_config: object) -> dict[str, Any]:
    """``args.fsdp_config`` as a dict of the keys the streamer uses.

    Hugging Face style ``fsdp_``-prefixed keys are accepted; other keys are
    ignored with a ``UserWarning``; a non-dict config → ``TypeError``.
    """
    if fsdp_config is None:
        return {}
    if not isinstance(fsdp_config, dict):
        raise TypeError(
            f"args.fsdp_config must be a dict, a JSON string or a path to a JSON file, got "
            f"{fsdp_config!r}"
        )
    options = {key.removeprefix("fsdp_"): value for key, value in fsdp_config.items()}
    ignored = sorted(key for key in options if key not in FSDP_CONFIG_KEYS)
    if ignored:
        warnings.warn(
            f"GradientStreamer ignores fsdp_config keys {ignored}; it reads only "
            f"{list(FSDP_CONFIG_KEYS)}",
            UserWarning,
            stacklevel=4,
        )
    return {key: options[key] for key in FSDP_CONFIG_KEYS if options.get(key) is not None}


def resolve_module_classes(model: nn.Module, names: list[str]) -> set[type[nn.Module]]:
    """The classes of ``model``'s modules named ``names`` (class ``__name__``).

    A name no module of ``model`` has → ``ValueError`` listing the classes present.
    """
    present = {type(module).__name__: type(module) for module in model.modules()}
    unknown = [name for name in names if name not in present]
    if unknown:
        raise ValueError(
            f"fsdp_config transformer_layer_cls_to_wrap names {unknown}, which are not module "
            f"classes of {type(model).__name__}; classes present: {sorted(present)}"
        )
    return {present[name] for name in names}


def fsdp_auto_wrap_policy(
    model: nn.Module, tokens: list[str], options: dict[str, Any]
) -> Callable | None:
    """The FSDP auto-wrap policy from ``fsdp_config`` options (``None``: wrap only the root).

    ``transformer_layer_cls_to_wrap`` (class names, a list or one string) →
    ``transformer_auto_wrap_policy``; ``min_num_params`` (positive int) →
    ``size_based_auto_wrap_policy``; both → ``ValueError``. With neither key,
    the ``auto_wrap`` token wraps the classes of the model's
    ``_no_split_modules`` (Hugging Face models), as the ``Trainer`` does.
    """
    from functools import partial

    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    if "min_num_params" in options and "transformer_layer_cls_to_wrap" in options:
        raise ValueError(
            "fsdp_config sets both transformer_layer_cls_to_wrap and min_num_params; they are "
            "alternative auto-wrap policies, keep one"
        )
    if "min_num_params" in options:
        threshold = options["min_num_params"]
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(
                f"fsdp_config min_num_params must be a positive int, got {threshold!r}"
            )
        return partial(size_based_auto_wrap_policy, min_num_params=threshold)
    names = options.get("transformer_layer_cls_to_wrap")
    if names is None and "auto_wrap" in tokens:
        names = no_split_module_names(model)
    if names is None:
        return None
    names = [names] if isinstance(names, str) else list(names)
    classes = resolve_module_classes(model, names)
    return partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)


def no_split_module_names(model: nn.Module) -> list[str]:
    """The ``_no_split_modules`` classes ``model`` contains, for the ``auto_wrap`` token.

    ``ValueError`` when the model declares none of them.
    """
    declared = getattr(model, "_no_split_modules", None) or []
    present = {type(module).__name__ for module in model.modules()}
    names = [name for name in declared if name in present]
    if not names:
        raise ValueError(
            f"args.fsdp has 'auto_wrap' but {type(model).__name__} declares no "
            "_no_split_modules it contains; set fsdp_config transformer_layer_cls_to_wrap "
            "(class names) or min_num_params"
        )
    return names


def fsdp_wrap_kwargs(model: nn.Module, args: AttributionArguments) -> dict[str, Any]:
    """Keyword arguments of ``FullyShardedDataParallel`` for ``model`` under ``args``.

    ``use_orig_params=True`` (the hooks and the optimizer see the original
    parameters), ``sharding_strategy`` from the tokens, ``cpu_offload`` for
    ``offload`` (ignored with a ``UserWarning`` on a CPU device, where FSDP
    cannot offload), ``auto_wrap_policy`` from ``fsdp_config``.
    """
    from torch.distributed.fsdp import CPUOffload

    options = fsdp_config_options(args.fsdp_config)
    kwargs: dict[str, Any] = {
        "use_orig_params": True,
        "sharding_strategy": fsdp_sharding_strategy(args.fsdp),
        "auto_wrap_policy": fsdp_auto_wrap_policy(model, args.fsdp, options),
    }
    if "offload" in args.fsdp:
        if torch.device(args.device).type == "cpu":
            warnings.warn(
                "args.fsdp 'offload' has no effect on a CPU device (the parameters already live "
                "in CPU memory); ignoring it",
                UserWarning,
                stacklevel=4,
            )
        else:
            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    return kwargs


def compute_device(args: AttributionArguments) -> torch.device:
    """``args.device``, with the current CUDA device index filled in when it has none."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def distributed_ready() -> bool:
    """Whether a default ``torch.distributed`` process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def require_process_group(args: AttributionArguments) -> None:
    """``RuntimeError`` unless a process group is initialised (wrapping needs one)."""
    if not distributed_ready():
        raise RuntimeError(
            f"args.world_size is {args.world_size} but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group() first (e.g. launch with torchrun)"
        )


def wrap_fsdp(model: nn.Module, args: AttributionArguments) -> nn.Module:
    """``FullyShardedDataParallel(model, use_orig_params=True, ...)`` per ``args.fsdp``.

    The options are checked first; a single process without a process group
    has nothing to shard: the model is returned unwrapped with a ``UserWarning``.
    """
    kwargs = fsdp_wrap_kwargs(model, args)
    if args.world_size <= 1 and not distributed_ready():
        warnings.warn(
            f"args.fsdp is {args.fsdp} but this is a single process without a torch.distributed "
            "process group; running the model unwrapped (launch with torchrun to shard it)",
            UserWarning,
            stacklevel=4,
        )
        return model
    require_process_group(args)
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=compute_device(args), **kwargs)


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is a ``FullyShardedDataParallel`` wrapper (never imports FSDP)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel)


class GradientStreamer:
    """Live gradient source: one ``(step, Gradient, identifiers)`` block per batch.

    Two regimes. **Frozen probe** (``enable_update=False``): batches in dataset
    order, model in ``eval()``, every block labelled ``checkpoint_step``;
    gradients already on the parameters, module modes and the global RNG state
    are restored after each pass, so the probe is ``reusable``.
    **Trajectory** (``enable_update=True``): model in ``train()``, shuffled with
    a generator seeded by ``args.data_seed``, the loss divided by
    ``N = args.gradient_accumulation_steps`` and the optimizer stepped every
    ``N`` batches and on the last batch (forward → backward → clip →
    ``optimizer.step`` → ``scheduler.step``; zero-grad at the next window
    start); blocks are labelled with the batch index and the streamer can be
    iterated once.

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

    Not implemented in this version: ``precondition=True``, ``snapshots=`` and
    DeepSpeed (``NotImplementedError``).
    """

    def __init__(
        self,
        model: nn.Module,
        dataset: Dataset,
        args: AttributionArguments,
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
        snapshots: object | None = None,
        forward_model: nn.Module | None = None,
        shard: bool = True,
        defer_update: bool = False,
    ) -> None:
        self._check_options(batch_size, enable_update, precondition, snapshots, args)
        self._args = args
        self._model = model
        self.enable_update = enable_update
        self.defer_update = defer_update
        if loss_fn is None:
            from dattri_llm.task import default_loss_func as loss_fn
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._param_groups = decay_parameter_groups(model, args.weight_decay)
        self._scheduler = scheduler
        self._checkpoint_step = checkpoint_step
        self._manager, self._owns_manager = self._resolve_manager(
            model, config, hook_manager, forward_model, args
        )
        self._capture = find_capture_callback(self._manager)
        if self._capture is None:
            raise ValueError(
                "hook_manager= must carry a CaptureCallback (the streamer reads each batch's "
                "record from it); build it with callbacks=[CaptureCallback(), ...]"
            )
        try:
            self._enable_gradient_checkpointing(model, args)
            self._forward_model = forward_model or self._place_model(model, args)
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
        snapshots: object | None,
        args: AttributionArguments,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if snapshots is not None and not enable_update:
            raise ValueError(
                "snapshots= records a training trajectory and needs enable_update=True"
            )
        if snapshots is not None:
            raise NotImplementedError(
                "GradientStreamer(snapshots=...) is not implemented in this version; capture "
                "parameters with ParameterSnapshotCallback from your own loop instead"
            )
        if precondition:
            raise NotImplementedError(
                "GradientStreamer(precondition=True) is not implemented in this version; build "
                "HookManager(model, optimizer=...) around your own loop for preconditioned capture"
            )
        if args.deepspeed:
            raise NotImplementedError(
                "GradientStreamer does not support DeepSpeed; unset args.deepspeed"
            )

    @staticmethod
    def _resolve_manager(
        model: nn.Module,
        config: HookManagerConfig | None,
        hook_manager: HookManager | None,
        forward_model: nn.Module | None,
        args: AttributionArguments,
    ) -> tuple[HookManager, bool]:
        if hook_manager is not None:
            if args.world_size > 1 and forward_model is None:
                raise ValueError(
                    "sharing hook_manager= under world_size>1 needs forward_model= (the wrapper "
                    "the owning streamer built); pass other.forward_model"
                )
            return hook_manager, False
        from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
        from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
        from dattri_llm.gradient.hooks.manager import HookManager

        if config is None:
            config = HookManagerConfig(linear_io=REGISTER_ALL)
        return HookManager(model, config=config, callbacks=[CaptureCallback()]), True

    @staticmethod
    def _enable_gradient_checkpointing(model: nn.Module, args: AttributionArguments) -> None:
        if not args.gradient_checkpointing:
            return
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            warnings.warn(
                f"args.gradient_checkpointing is set but {type(model).__name__} has no "
                "gradient_checkpointing_enable(); running without it",
                UserWarning,
                stacklevel=3,
            )
            return
        enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)

    @staticmethod
    def _place_model(model: nn.Module, args: AttributionArguments) -> nn.Module:
        """Move the hooked model to ``args.device`` and wrap it per ``args`` ``(FSDP or DDP)``."""
        model.to(args.device)
        if args.fsdp:
            return wrap_fsdp(model, args)
        if args.world_size <= 1:
            return model
        require_process_group(args)
        device = torch.device(args.device)
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=bool(args.ddp_find_unused_parameters),
        )

    def _make_loader(self, shuffle: bool) -> DataLoader:
        """A fresh loader: sharded with ``DistributedSampler`` when ``world_size>1`` and
        ``shard``; else a ``RandomSampler`` seeded by ``data_seed`` (``shuffle``) or dataset
        order."""
        from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

        args = self._args
        if args.world_size > 1 and self._shard:
            sampler = DistributedSampler(
                self._dataset,
                num_replicas=args.world_size,
                rank=args.process_index,
                shuffle=shuffle,
                seed=self._data_seed(),
            )
        elif shuffle:
            generator = torch.Generator().manual_seed(self._data_seed())
            sampler = RandomSampler(self._dataset, generator=generator)
        else:
            sampler = None
        workers = args.dataloader_num_workers
        extra: dict[str, Any] = {}
        if workers > 0:
            extra["persistent_workers"] = args.dataloader_persistent_workers
            if args.dataloader_prefetch_factor is not None:
                extra["prefetch_factor"] = args.dataloader_prefetch_factor
        return DataLoader(
            self._dataset,
            batch_size=self._batch_size,
            sampler=sampler,
            collate_fn=self._collate_fn,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            **extra,
        )

    def _data_seed(self) -> int:
        seed = getattr(self._args, "data_seed", None)
        return self._args.seed if seed is None else seed

    def _build_scheduler(self, optimizer: torch.optim.Optimizer) -> object:
        from transformers import get_scheduler

        windows = math.ceil(len(self) / self._args.gradient_accumulation_steps)
        return get_scheduler(
            self._args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=self._args.warmup_steps,
            num_training_steps=windows,
        )

    # ------------------------------------------------------------ properties

    @property
    def args(self) -> AttributionArguments:
        """The :class:`AttributionArguments` the streamer was built with."""
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
        params = list(self._model.parameters())
        saved_grads = [p.grad for p in params]
        saved_modes = {m: m.training for m in self._model.modules()}
        saved_rng = _rng_state()
        try:
            for p in params:
                p.grad = None
            self._model.eval()
            for index, batch in enumerate(self._make_loader(shuffle=False)):
                # Yield without binding the block here: a local would keep the previous
                # batch's captures alive through the next batch's forward and backward.
                yield self._probe_batch(index, batch, params)
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
            for module, training in saved_modes.items():
                module.train(training)
            _set_rng_state(saved_rng)

    def _probe_batch(self, index: int, batch: object, params: list[nn.Parameter]) -> StreamBatch:
        """Run one probe batch and clear the parameter gradients it left behind."""
        block, ids = self._run_batch(index, batch, loss_divisor=1)
        for p in params:
            p.grad = None
        return self._checkpoint_step, block, ids

    def _trajectory_pass(self) -> Iterator[StreamBatch]:
        optimizer = self.optimizer
        if self._scheduler is None:
            self._scheduler = self._build_scheduler(optimizer)
        device = torch.device(self._args.device)
        if self._args.fp16 and device.type == "cuda":
            self._scaler = self._make_grad_scaler()
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

    def _make_grad_scaler(self) -> torch.amp.GradScaler:
        """A CUDA ``GradScaler``; the sharded one under FSDP (inf checks agree across ranks)."""
        if is_fsdp(self._forward_model):
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler("cuda")
        return torch.amp.GradScaler("cuda")

    def _trajectory_batch(self, index: int, batch: object, window: int, last: int) -> StreamBatch:
        """Run one training batch; step (or defer) the update at a window end."""
        block, ids = self._run_batch(index, batch, loss_divisor=window)
        if (index + 1) % window == 0 or index == last:
            if self.defer_update:
                self._pending_update = True
            else:
                self._apply_update()
        return index, block, ids

    def _run_batch(self, index: int, batch: object, loss_divisor: int) -> tuple[Gradient, list]:
        """Forward + backward one batch under the hooks; return its captured block and ids."""
        from dattri_llm.gradient.streaming import autocast_for, move_batch

        batch = move_batch(batch, torch.device(self._args.device))
        self._manager.reset_steps(index)
        self._capture.record = None
        with autocast_for(self._args):
            loss = check_loss(self._loss_fn(self._forward_model, batch), index)
        if loss_divisor > 1:
            loss = loss / loss_divisor
        if self._scaler is not None:
            self._scaler.scale(loss).backward()
        else:
            loss.backward()
        record = self._capture.record
        if record is None:
            raise RuntimeError(
                f"batch {index} produced no gradient record: no hooked layer took part in the "
                "backward (check the hook config and that loss_fn calls the model on the batch)"
            )
        if record.step != index:
            raise RuntimeError(
                f"step desync: the capture record of batch {index} is stamped step "
                f"{record.step}; loss_fn must run exactly one forward+backward step per batch"
            )
        self._capture.record = None
        block = record.gradient
        if self._scaler is not None:
            block = unscale_gradient(block, float(self._scaler.get_scale()))
        ids = record.input_hash
        return block, list(ids) if isinstance(ids, list) else [ids]

    def _apply_pending_update(self) -> None:
        if self._pending_update:
            self._pending_update = False
            self._apply_update()

    def _apply_update(self) -> None:
        """Clip to ``max_grad_norm``, ``optimizer.step()``, then ``scheduler.step()``."""
        optimizer = self.optimizer
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)
        max_norm = self._args.max_grad_norm
        if max_norm is not None and max_norm > 0:
            self._clip_gradients(max_norm)
        if self._scaler is not None:
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()

    def _clip_gradients(self, max_norm: float) -> None:
        """Clip to total norm ``max_norm``; under FSDP the norm spans every rank's shard."""
        if is_fsdp(self._forward_model):
            self._forward_model.clip_grad_norm_(max_norm)
            return
        trainable = [p for p in self._model.parameters() if p.requires_grad]
        nn.utils.clip_grad_norm_(trainable, max_norm)


def _rng_state() -> dict[str, object]:
    state: dict[str, object] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])

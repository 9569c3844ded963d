"""Preparing a hooked model for `GradientStreamer`: checkpointing, device, DDP / FSDP, scaling.

The streamer registers its hooks on the unwrapped model first, turns on
gradient checkpointing when asked (`enable_gradient_checkpointing`), then calls
`place_model` to move it to ``args.device`` and wrap it per ``args``:
``FullyShardedDataParallel(use_orig_params=True)`` when ``args.fsdp`` is set,
``DistributedDataParallel`` when ``args.world_size > 1``, else the model
itself. ``torch.distributed.fsdp`` is imported only where FSDP is used (it is
absent from builds without distributed support).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.stream.settings import TrainingSettings
from dattri_llm.utils.distributed import dist_world_size, is_dist_initialized
from dattri_llm.utils.wrappers import is_fsdp

__all__ = [
    "FSDP_CONFIG_KEYS",
    "compute_device",
    "enable_gradient_checkpointing",
    "fsdp_auto_wrap_policy",
    "fsdp_config_options",
    "fsdp_sharding_strategy",
    "fsdp_wrap_kwargs",
    "is_fsdp",
    "make_grad_scaler",
    "no_split_module_names",
    "place_model",
    "require_process_group",
    "resolve_module_classes",
    "unscale_gradient",
    "wrap_ddp",
    "wrap_fsdp",
]

FSDP_CONFIG_KEYS = ("transformer_layer_cls_to_wrap", "min_num_params")

# Models `wrap_fsdp` sharded over several ranks: FSDP flattens and shards their parameters in
# place and cannot be undone, so wrapping one again would run it on 1-D shards.
_SHARDED_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


# --------------------------------------------------------------------------- FSDP options


def fsdp_sharding_strategy(tokens: list[str]) -> object:
    """The ``ShardingStrategy`` named by ``args.fsdp`` tokens (default ``FULL_SHARD``).

    ``full_shard`` → ``FULL_SHARD``, ``shard_grad_op`` → ``SHARD_GRAD_OP``;
    both together → ``ValueError``.
    """
    # optional dependency: torch.distributed.fsdp (absent from non-distributed builds)
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


def _build_auto_wrap_policy(model: nn.Module, fsdp_config: dict[str, Any]) -> Callable | None:
    """The FSDP auto-wrap policy of ``fsdp_config``; pops the keys it reads from the dict.

    ``transformer_layer_cls_to_wrap`` (a class name or a list of names) →
    ``transformer_auto_wrap_policy`` over those classes of ``model``;
    ``min_num_params`` (positive int) → ``size_based_auto_wrap_policy``;
    both → ``ValueError``; neither, or an explicit ``auto_wrap_policy`` in
    the dict → ``None``.
    """
    # optional dependency: torch.distributed.fsdp (absent from non-distributed builds)
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    names = fsdp_config.pop("transformer_layer_cls_to_wrap", None)
    threshold = fsdp_config.pop("min_num_params", None)
    if names is not None and threshold is not None:
        raise ValueError(
            "fsdp_config sets both transformer_layer_cls_to_wrap and min_num_params; they are "
            "alternative auto-wrap policies: set one of them, not both"
        )
    if fsdp_config.get("auto_wrap_policy") is not None:
        return None
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(
                f"fsdp_config min_num_params must be a positive int, got {threshold!r}"
            )
        return partial(size_based_auto_wrap_policy, min_num_params=threshold)
    if names is None:
        return None
    classes = resolve_module_classes(model, [names] if isinstance(names, str) else list(names))
    return partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)


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
    options = dict(options)
    if "auto_wrap" in tokens and not any(key in options for key in FSDP_CONFIG_KEYS):
        options["transformer_layer_cls_to_wrap"] = no_split_module_names(model)
    return _build_auto_wrap_policy(model, options)


def fsdp_wrap_kwargs(model: nn.Module, args: TrainingSettings) -> dict[str, Any]:
    """Keyword arguments of ``FullyShardedDataParallel`` for ``model`` under ``args``.

    ``use_orig_params=True`` (the hooks and the optimizer see the original
    parameters), ``sharding_strategy`` from the tokens, ``cpu_offload`` for
    ``offload`` (ignored with a ``UserWarning`` on a CPU device, where FSDP
    cannot offload), ``auto_wrap_policy`` from ``fsdp_config``.
    """
    # optional dependency: torch.distributed.fsdp (absent from non-distributed builds)
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


# --------------------------------------------------------------------------- placing


def enable_gradient_checkpointing(model: nn.Module, args: TrainingSettings) -> None:
    """``model.gradient_checkpointing_enable(...)`` when ``args.gradient_checkpointing`` is set.

    A model without that method runs without it (``UserWarning``).
    """
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


def compute_device(args: TrainingSettings) -> torch.device:
    """``args.device``, with the current CUDA device index filled in when it has none."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def require_process_group(args: TrainingSettings) -> None:
    """``RuntimeError`` unless a process group is initialised (wrapping needs one)."""
    if not is_dist_initialized():
        raise RuntimeError(
            f"args.world_size is {args.world_size} but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group() first (e.g. launch with torchrun)"
        )


def wrap_fsdp(model: nn.Module, args: TrainingSettings) -> nn.Module:
    """``FullyShardedDataParallel(model, use_orig_params=True, ...)`` per ``args.fsdp``.

    The options are checked first; a single process without a process group
    has nothing to shard: the model is returned unwrapped with a ``UserWarning``.
    A model this function already sharded over several ranks → ``RuntimeError``
    (FSDP shards it in place, for good).
    """
    kwargs = fsdp_wrap_kwargs(model, args)
    if args.world_size <= 1 and not is_dist_initialized():
        warnings.warn(
            f"args.fsdp is {args.fsdp} but this is a single process without a torch.distributed "
            "process group; running the model unwrapped (launch with torchrun to shard it)",
            UserWarning,
            stacklevel=4,
        )
        return model
    require_process_group(args)
    if model in _SHARDED_MODELS:
        raise RuntimeError(
            f"{type(model).__name__} was already wrapped in FullyShardedDataParallel by an "
            "earlier streamer (a previous attribute() or GradientStreamer on this model): FSDP "
            "sharded its parameters in place and cannot be undone, so it cannot be wrapped "
            "again. Build a fresh model, or wrap it once yourself and pass the wrapper "
            "(AttributionTask(model=wrapper) or forward_model=wrapper)"
        )
    # optional dependency: torch.distributed.fsdp (absent from non-distributed builds)
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapper = FullyShardedDataParallel(model, device_id=compute_device(args), **kwargs)
    if dist_world_size() > 1:  # one rank keeps its parameters whole: wrapping again is harmless
        _SHARDED_MODELS.add(model)
    return wrapper


def wrap_ddp(model: nn.Module, args: TrainingSettings) -> nn.Module:
    """``DistributedDataParallel(model)`` on ``args.device`` (needs a process group)."""
    require_process_group(args)
    device = torch.device(args.device)
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=bool(args.ddp_find_unused_parameters),
    )


def place_model(model: nn.Module, args: TrainingSettings) -> nn.Module:
    """Move the hooked ``model`` to ``args.device``; wrap it in FSDP or DDP per ``args``.

    FSDP when ``args.fsdp`` is set, DDP when ``args.world_size > 1``, else
    ``model`` itself.
    """
    model.to(args.device)
    if args.fsdp:
        return wrap_fsdp(model, args)
    if args.world_size <= 1:
        return model
    return wrap_ddp(model, args)


# --------------------------------------------------------------------------- loss scaling


def make_grad_scaler(forward_model: nn.Module) -> torch.amp.GradScaler:
    """A CUDA ``GradScaler``; the sharded one under FSDP (inf checks agree across ranks)."""
    if is_fsdp(forward_model):
        # optional dependency: torch.distributed.fsdp (absent from non-distributed builds)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cuda")
    return torch.amp.GradScaler("cuda")


def unscale_gradient(block: Gradient, scale: float) -> Gradient:
    """Divide every captured gradient of ``block`` by a loss-scaler ``scale``.

    Factorized layers divide their output-gradient factor ``(B, *, D_out)``;
    dense layers ``(B, d)`` divide the whole tensor.
    """

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

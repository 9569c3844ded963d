"""Old path of :mod:`dattri_llm.gradient.stream.wrapping` (DDP / FSDP placement); re-exports it."""

from dattri_llm.gradient.stream.wrapping import (
    FSDP_CONFIG_KEYS,
    compute_device,
    fsdp_auto_wrap_policy,
    fsdp_config_options,
    fsdp_sharding_strategy,
    fsdp_wrap_kwargs,
    is_fsdp,
    make_grad_scaler,
    no_split_module_names,
    place_model,
    require_process_group,
    resolve_module_classes,
    unscale_gradient,
    wrap_ddp,
    wrap_fsdp,
)

__all__ = [
    "FSDP_CONFIG_KEYS",
    "compute_device",
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

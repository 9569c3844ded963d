"""The ``linear_io`` hook family: layer selection, capture settings checks and registration.

:func:`attach_linear_io` builds one :class:`LayerCapture` per selected layer
and registers its forward hook; :func:`register_linear_io_hooks` is the
low-level public entry point over it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.hooks.layer_capture import LayerBuffer, LayerCapture
from dattri_llm.gradient.hooks.layers import is_linear_io_capable, owns_trainable_params
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.gradient.ops.projection import CAPTURE_STYLES
from dattri_llm.gradient.ops.projector import DattriProjector
from dattri_llm.gradient.ops.types import detect_layer_type, is_norm
from dattri_llm.options import CaptureStyle
from dattri_llm.utils.wrappers import unwrap_model

__all__ = [
    "attach_linear_io",
    "check_capture_style",
    "check_preconditionable_projection",
    "layer_projection",
    "register_linear_io_hooks",
]


def _frozen(module: nn.Module) -> bool:
    return not owns_trainable_params(module)


def _linear_io_layers(
    root: nn.Module,
    layer_names: Iterable[str] | None,
    type_overrides: dict[str, str],
    include_frozen: bool,
) -> dict[str, nn.Module]:
    modules = dict(root.named_modules())
    if layer_names is None:
        names = [n for n, m in modules.items() if is_linear_io_capable(m) or n in type_overrides]
    else:
        names = list(layer_names)
    selected: dict[str, nn.Module] = {}
    for name in names:
        if name not in modules:
            raise ValueError(f"Layer {name!r} is not a module of the model (named_modules()).")
        module = modules[name]
        if not is_linear_io_capable(module) and name not in type_overrides:
            raise ValueError(
                f"Layer {name!r} ({type(module).__name__}) is not linear_io-capable; declare "
                "its type with type_overrides={name: '<layer type>'}."
            )
        if _frozen(module) and not include_frozen:
            continue
        selected[name] = module
    return selected


def register_linear_io_hooks(
    model: nn.Module,
    layer_names: Iterable[str] | None = None,
    on_layer_forward: Callable[[str, torch.Tensor, str, dict | None], None] | None = None,
    on_layer_backward: Callable[[str, torch.Tensor, str, dict | None], None] | None = None,
    type_overrides: dict[str, str] | None = None,
    kwargs_overrides: dict[str, dict] | None = None,
    projection_kwargs: dict[str, dict] | None = None,
    capture_style: CaptureStyle = "factorized",
    projector: Callable | None = None,
    offload_to_cpu: bool = False,
    preconditioner: Callable | None = None,
    include_frozen: bool = False,
) -> tuple[dict[str, LayerBuffer], list]:
    """Hook capable modules (or any named in ``type_overrides``) for factor capture.

    Every grad-enabled forward of a hooked layer is buffered: ``buffers[name]
    ["captures"]`` receives one :class:`Capture` per matched forward/backward
    pair (raw ``Factorized``, projected factors, or a dense ``(B, d)`` tensor
    per ``projection_kwargs`` / ``capture_style``). Callbacks are called as
    ``fn(layer_name, tensor, layer_type, module_kwargs)``. Layers whose own
    parameters are all frozen are skipped unless ``include_frozen``.
    ``preconditioner`` (e.g. ``optimizer_state.GradientPreconditioner``) maps
    each capture's dense per-sample gradient on the captured coordinates,
    ``preconditioner(layer_name, (B, k) entries, layer projection or None)``,
    and the dense result is buffered; ``"logra"`` projections are then refused
    (``ValueError``). Returns ``(buffers, handles)``; release with
    :func:`remove_hooks`.
    """
    captures, handles = attach_linear_io(
        model,
        layer_names,
        type_overrides=type_overrides or {},
        kwargs_overrides=kwargs_overrides or {},
        projection_kwargs=projection_kwargs,
        capture_style=capture_style,
        projector=projector,
        offload_to_cpu=offload_to_cpu,
        include_frozen=include_frozen,
        on_layer_forward=on_layer_forward,
        on_layer_backward=on_layer_backward,
        preconditioner=preconditioner,
    )
    return {name: capture.buffer for name, capture in captures.items()}, handles


def check_capture_style(capture_style: object, where: str) -> str:
    """``capture_style`` as a str; ``ValueError`` unless it is one of ``CAPTURE_STYLES``."""
    if capture_style not in CAPTURE_STYLES:
        raise ValueError(
            f"{where}: capture_style {capture_style!r} is invalid; it must be one of "
            f"{list(CAPTURE_STYLES)}."
        )
    return str(capture_style)


def check_preconditionable_projection(proj: dict | None, entry: str, where: str) -> None:
    """``ValueError`` if projection settings ``proj`` (``projection_kwargs[entry]``) are logra.

    A preconditioned gradient is no longer rank-structured, so it cannot be
    projected factor-wise; ``style`` defaults to ``"logra"`` when absent.
    """
    if proj is not None and proj.get("style", "logra") == "logra":
        raise ValueError(
            f"{where}: projection_kwargs[{entry!r}] uses style 'logra' (the default when "
            "'style' is absent), but a preconditioned gradient is no longer rank-structured; "
            "use style 'mask' or 'dense' or no projection with preconditioned capture."
        )


def layer_projection(projection_kwargs: dict[str, dict] | None, name: str) -> dict | None:
    """Projection settings of ``name``: its own entry, else ``"__default__"``, else ``None``."""
    if not projection_kwargs:
        return None
    proj = projection_kwargs.get(name, projection_kwargs.get("__default__"))
    return None if proj is None else dict(proj)


def attach_linear_io(
    model: nn.Module,
    layer_names: Iterable[str] | None,
    *,
    type_overrides: dict[str, str],
    kwargs_overrides: dict[str, dict],
    projection_kwargs: dict[str, dict] | None,
    capture_style: str,
    projector: Callable | None,
    offload_to_cpu: bool,
    include_frozen: bool,
    non_batch_first: frozenset[str] = frozenset(),
    preconditioner: Callable[[str, torch.Tensor, dict | None], torch.Tensor] | None = None,
    **capture_kwargs: Any,
) -> tuple[dict[str, LayerCapture], list]:
    """Build a :class:`LayerCapture` per selected layer and register its forward hook.

    With a ``preconditioner`` a layer projected with ``"logra"`` → ``ValueError``.
    """
    check_capture_style(capture_style, "linear_io hooks")
    root = unwrap_model(model)
    projector = DattriProjector.coerce(projector)
    captures: dict[str, LayerCapture] = {}
    handles: list = []
    for name, module in _linear_io_layers(
        root, layer_names, type_overrides, include_frozen
    ).items():
        layer_type = type_overrides.get(name) or detect_layer_type(module)
        proj = layer_projection(projection_kwargs, name)
        if preconditioner is not None:
            entry = name if name in (projection_kwargs or {}) else "__default__"
            check_preconditionable_projection(proj, entry, f"preconditioned capture of {name!r}")
        if proj is not None and proj.get("style", "logra") == "logra" and is_norm(layer_type):
            raise ValueError(
                f"Layer {name!r} is a normalization layer ({layer_type}); the 'logra' factor "
                "projection is not defined for it. Use style 'dense' or 'mask' for this layer "
                "in projection_kwargs."
            )
        capture = LayerCapture(
            name,
            layer_type,
            _module_kwargs(name, module, layer_type, kwargs_overrides),
            projection=proj,
            capture_style=capture_style,
            projector=projector,
            offload_to_cpu=offload_to_cpu,
            batch_first=name not in non_batch_first,
            preconditioner=preconditioner,
            **capture_kwargs,
        )
        handles.append(module.register_forward_hook(capture.forward_hook, with_kwargs=True))
        captures[name] = capture
    return captures, handles


def _module_kwargs(
    name: str, module: nn.Module, layer_type: str, overrides: dict[str, dict]
) -> dict:
    if name in overrides:
        return dict(overrides[name])
    try:
        return extract_module_kwargs(module, layer_type)
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"Layer {name!r}: cannot read the {layer_type} hyperparameters off "
            f"{type(module).__name__} ({err}); pass module_kwargs={{{name!r}: ...}} built "
            "with dattri_llm.utils.module."
        ) from err

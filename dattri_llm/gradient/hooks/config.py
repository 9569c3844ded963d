"""Capture configuration: hook families, layer selectors and their resolution.

:class:`HookManagerConfig` says which layers get which hook family;
:func:`resolve_hook_assignments` turns it into ``{layer_name: family}`` for a
concrete model, and :func:`default_hook_assignment` derives an assignment
from one real forward/backward pass (only layers that actually fire).
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import torch
from torch import nn

from dattri_llm.gradient.hooks.layers import (
    is_invasive_capable,
    is_linear_io_capable,
    owns_trainable_params,
)
from dattri_llm.gradient.hooks.linear_io import check_capture_style
from dattri_llm.gradient.ops.projection import MASK_KEYS, PROJECTION_STYLES
from dattri_llm.gradient.ops.types import ALL_LAYER_TYPES
from dattri_llm.options import CaptureStyle
from dattri_llm.utils.wrappers import unwrap_model

__all__ = [
    "INVASIVE_LINEAR_IO",
    "LINEAR_IO",
    "PARAM_GRAD",
    "REGISTER_ALL",
    "HookManagerConfig",
    "Selector",
    "default_hook_assignment",
    "resolve_hook_assignments",
]


LINEAR_IO = "linear_io"
PARAM_GRAD = "param_grad"
INVASIVE_LINEAR_IO = "invasive_linear_io"
HOOK_FAMILIES = (LINEAR_IO, PARAM_GRAD, INVASIVE_LINEAR_IO)


class _RegisterAll:
    """Type of the :data:`REGISTER_ALL` singleton ("every applicable layer")."""

    _instance: _RegisterAll | None = None

    def __new__(cls) -> _RegisterAll:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REGISTER_ALL"

    def __reduce__(self) -> str:
        return "REGISTER_ALL"


REGISTER_ALL = _RegisterAll()
Selector = Union[_RegisterAll, list[str], None]  # noqa: UP007 (runtime alias)

_SELECTOR_FIELDS = (LINEAR_IO, PARAM_GRAD, INVASIVE_LINEAR_IO)


# --------------------------------------------------------------------------- validation


def _check_str_dict(value: object, field: str) -> dict:
    """``None`` → ``{}``; a dict with string keys is copied; anything else → ``TypeError``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"HookManagerConfig.{field} must be a dict keyed by layer name, "
            f"got {type(value).__name__}."
        )
    for key in value:
        if not isinstance(key, str):
            raise TypeError(
                f"HookManagerConfig.{field} keys must be layer-name strings, got {key!r}."
            )
    return dict(value)


def _check_hook_types(hook_types: object) -> dict[str, str]:
    result = _check_str_dict(hook_types, "hook_types")
    for name, family in result.items():
        if family not in HOOK_FAMILIES:
            raise ValueError(
                f"hook_types[{name!r}] = {family!r} is not a hook family; "
                f"it must be one of {list(HOOK_FAMILIES)}."
            )
    return result


def _check_selector(selector: object, field: str) -> Selector:
    """Validate one selector add-on (``None``, ``REGISTER_ALL`` or regex strings)."""
    if selector is None or selector is REGISTER_ALL:
        return selector
    if not isinstance(selector, (list, tuple)):
        raise TypeError(
            f"HookManagerConfig.{field} must be None, REGISTER_ALL or a list of regex "
            f"strings, got {type(selector).__name__}."
        )
    for pattern in selector:
        if not isinstance(pattern, str):
            raise TypeError(f"HookManagerConfig.{field} patterns must be strings, got {pattern!r}.")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(
                f"HookManagerConfig.{field} pattern {pattern!r} is not a valid regex: {err}."
            ) from err
    return list(selector)


def _check_layer_types(layer_types: object) -> dict[str, str]:
    result = _check_str_dict(layer_types, "layer_types")
    for name, layer_type in result.items():
        if not isinstance(layer_type, str):
            raise TypeError(
                f"layer_types[{name!r}] must be a layer-type string, got {layer_type!r}."
            )
        if layer_type not in ALL_LAYER_TYPES:
            raise ValueError(
                f"layer_types[{name!r}] = {layer_type!r} is not a known layer type; "
                f"it must be one of {sorted(ALL_LAYER_TYPES)}."
            )
    return result


def _check_module_kwargs(module_kwargs: object) -> dict[str, dict]:
    result = _check_str_dict(module_kwargs, "module_kwargs")
    for name, kwargs in result.items():
        if not isinstance(kwargs, Mapping) or "has_bias" not in kwargs:
            raise TypeError(
                f"module_kwargs[{name!r}] must be a dict with at least 'has_bias' plus the "
                f"layer type's keys (build it with dattri_llm.utils.module), got {kwargs!r}."
            )
        result[name] = dict(kwargs)
    return result


def _check_projection_kwargs(projection_kwargs: object) -> dict[str, dict] | None:
    if projection_kwargs is None:
        return None
    result = _check_str_dict(projection_kwargs, "projection_kwargs")
    for name, proj in result.items():
        if not isinstance(proj, Mapping):
            raise TypeError(
                f"projection_kwargs[{name!r}] must be a dict of projection settings, "
                f"got {type(proj).__name__}."
            )
        style = proj.get("style", "logra")
        if style not in PROJECTION_STYLES:
            raise ValueError(
                f"projection_kwargs[{name!r}] has style {style!r}; "
                f"it must be one of {list(PROJECTION_STYLES)}."
            )
        if "seq_len" in proj:
            raise ValueError(
                f"projection_kwargs[{name!r}] has a 'seq_len' key; the token length is read "
                "from the captured tensors, remove it."
            )
        if style == "mask" and not set(proj) <= MASK_KEYS:
            raise ValueError(
                f"projection_kwargs[{name!r}] uses style 'mask' with unsupported keys "
                f"{sorted(set(proj) - MASK_KEYS)}; each key must be one of {sorted(MASK_KEYS)}."
            )
        result[name] = dict(proj)
    return result


# --------------------------------------------------------------------------- config


class HookManagerConfig:
    """Which layers a :class:`HookManager` hooks, with which family, and how it captures.

    ``hook_types`` assigns families explicitly; the selectors ``linear_io``,
    ``param_grad`` and ``invasive_linear_io`` add every capable layer
    (``REGISTER_ALL``) or the capable layers whose name matches any regex
    (``re.search``). ``layer_types`` relabels layers (it never selects);
    ``module_kwargs`` replaces ``ops.extract_module_kwargs``;
    ``projection_kwargs`` (``{name or "__default__": proj_kwargs}``) projects at
    capture; ``capture_style`` picks the buffered representation;
    ``include_frozen`` hooks linear_io layers whose own parameters are frozen.
    """

    def __init__(
        self,
        hook_types: dict[str, str] | None = None,
        linear_io: Selector = None,
        param_grad: Selector = None,
        invasive_linear_io: Selector = None,
        layer_types: dict[str, str] | None = None,
        module_kwargs: dict[str, dict] | None = None,
        projection_kwargs: dict[str, dict] | None = None,
        projector: Callable | None = None,
        capture_style: CaptureStyle = "factorized",
        include_frozen: bool = False,
    ) -> None:
        self.hook_types = _check_hook_types(hook_types)
        self.linear_io = _check_selector(linear_io, LINEAR_IO)
        self.param_grad = _check_selector(param_grad, PARAM_GRAD)
        self.invasive_linear_io = _check_selector(invasive_linear_io, INVASIVE_LINEAR_IO)
        self.layer_types = _check_layer_types(layer_types)
        self.module_kwargs = _check_module_kwargs(module_kwargs)
        self.projection_kwargs = _check_projection_kwargs(projection_kwargs)
        if projector is not None and not callable(projector):
            raise TypeError(
                f"HookManagerConfig.projector must be a projection factory (callable) or None, "
                f"got {type(projector).__name__}."
            )
        self.projector = projector
        self.capture_style = check_capture_style(capture_style, "HookManagerConfig")
        self.include_frozen = bool(include_frozen)

    @property
    def is_default(self) -> bool:
        """``True`` when no family is assigned explicitly and every selector is ``None``."""
        return not self.hook_types and all(
            getattr(self, field) is None for field in _SELECTOR_FIELDS
        )

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{key}={value!r}" for key, value in vars(self).items() if value not in (None, {})
        )
        return f"HookManagerConfig({fields})"


# --------------------------------------------------------------------------- resolution


def _default_family(module: nn.Module) -> str | None:
    """Family of ``module`` under the default config, ``None`` if nothing to hook."""
    return next((family for family in (LINEAR_IO, PARAM_GRAD) if _capable(module, family)), None)


def _capable(module: nn.Module, family: str) -> bool:
    """Whether a ``family`` selector may add ``module`` (linear_io: a capable type with params)."""
    if family == LINEAR_IO:
        return is_linear_io_capable(module) and any(True for _ in module.parameters(recurse=False))
    if family == PARAM_GRAD:
        return owns_trainable_params(module)
    return is_invasive_capable(module)


def _unknown_layer_error(name: str, modules: dict[str, nn.Module], field: str) -> ValueError:
    close = difflib.get_close_matches(name, list(modules), n=3)
    hint = f" Did you mean {close}?" if close else ""
    return ValueError(
        f"{field} names layer {name!r}, which is not a module of the model "
        f"(names are model.named_modules() paths).{hint}"
    )


def _validate_explicit(
    name: str, family: str, modules: dict[str, nn.Module], config: HookManagerConfig
) -> None:
    """Check one ``hook_types`` entry against the model (``ValueError`` naming the layer)."""
    if name not in modules:
        raise _unknown_layer_error(name, modules, "hook_types")
    module = modules[name]
    kind = type(module).__name__
    if family == LINEAR_IO and not is_linear_io_capable(module):
        if config.layer_types.get(name) not in ALL_LAYER_TYPES:
            raise ValueError(
                f"hook_types[{name!r}] = 'linear_io' but {kind} is not a linear_io-capable "
                "layer; declare what it is with layer_types={name: '<type>'} (and "
                "module_kwargs from dattri_llm.utils.module), or use 'param_grad'."
            )
    elif family == PARAM_GRAD and not owns_trainable_params(module):
        raise ValueError(
            f"hook_types[{name!r}] = 'param_grad' but {kind} directly owns no parameter "
            "with requires_grad=True; remove the entry or unfreeze the layer."
        )
    elif family == INVASIVE_LINEAR_IO and not is_invasive_capable(module):
        raise ValueError(
            f"hook_types[{name!r}] = 'invasive_linear_io' but {kind} is not an nn.Linear; "
            "use 'linear_io' for this layer."
        )


def _assign(assignments: dict[str, str], name: str, family: str) -> None:
    previous = assignments.setdefault(name, family)
    if previous != family:
        raise ValueError(
            f"Layer {name!r} is assigned two hook families ({previous!r} and {family!r}); "
            "narrow the selector regexes or hook_types so each layer gets one family."
        )


def _select(selector: Selector, family: str, modules: dict[str, nn.Module]) -> list[str]:
    """Names of the ``family``-capable modules a selector adds."""
    capable = [name for name, module in modules.items() if _capable(module, family)]
    if selector is REGISTER_ALL:
        return capable
    chosen: list[str] = []
    for pattern in selector:
        matched = [name for name in capable if re.search(pattern, name)]
        if not matched:
            raise ValueError(
                f"{family} selector pattern {pattern!r} matches no {family}-capable layer; "
                f"capable layers are e.g. {capable[:8]} (patterns use re.search on "
                "named_modules() paths)."
            )
        chosen.extend(name for name in matched if name not in chosen)
    return chosen


def resolve_hook_assignments(root: nn.Module, config: HookManagerConfig) -> dict[str, str]:
    """``{layer_name: family}`` for ``root`` (unwrapped ``.module`` when present).

    Default config: every linear_io-capable module that owns parameters →
    ``"linear_io"``, every other module directly owning a trainable parameter →
    ``"param_grad"``. Otherwise explicit ``hook_types`` (validated) plus the
    selector add-ons; a layer assigned two families → ``ValueError``. An
    empty result warns ("registered zero layers").
    """
    modules = dict(unwrap_model(root).named_modules())
    assignments: dict[str, str] = {}
    if config.is_default:
        for name, module in modules.items():
            family = _default_family(module)
            if family is not None:
                assignments[name] = family
    else:
        for name, family in config.hook_types.items():
            _validate_explicit(name, family, modules, config)
            assignments[name] = family
        for family in _SELECTOR_FIELDS:
            selector = getattr(config, family)
            if selector is not None:
                for name in _select(selector, family, modules):
                    _assign(assignments, name, family)
    if not assignments:
        warnings.warn(
            "HookManagerConfig registered zero layers on this model: no module matched the "
            "selectors / hook_types (or the model has no trainable linear_io-capable layer).",
            UserWarning,
            stacklevel=2,
        )
    return assignments


# --------------------------------------------------------------------------- probing


def _call_model(model: nn.Module, sample_input: object) -> Any:
    if isinstance(sample_input, Mapping):
        return model(**sample_input)
    if isinstance(sample_input, (list, tuple)):
        return model(*sample_input)
    return model(sample_input)


def _first_floating_tensor(output: object) -> torch.Tensor | None:
    """First floating tensor in ``output``, ``output.logits``, dict values or sequence items."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.is_floating_point():
        return logits
    items: Iterable[object] = ()
    if isinstance(output, Mapping):
        items = output.values()
    elif isinstance(output, (list, tuple)):
        items = output
    for item in items:
        found = _first_floating_tensor(item)
        if found is not None:
            return found
    return None


def _derive_loss(output: object, loss_fn: Callable | None) -> torch.Tensor | None:
    """Scalar to differentiate: ``loss_fn(output)``, ``output.loss``, else a floating sum."""
    if loss_fn is not None:
        loss = loss_fn(output)
    else:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if not isinstance(loss, torch.Tensor):
            tensor = _first_floating_tensor(output)
            loss = None if tensor is None else tensor.sum()
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return loss.reshape(())
    return None


def default_hook_assignment(
    model: nn.Module, sample_input: object, loss_fn: Callable[[Any], torch.Tensor] | None = None
) -> dict[str, str]:
    """Default-style assignment restricted to the layers that fire on ``sample_input``.

    Runs one real forward (``dict`` → ``model(**x)``, list/tuple →
    ``model(*x)``, else ``model(x)``) with temporary monitor hooks, then a
    backward when a differentiable scalar is available (``loss_fn(output)``,
    else ``output.loss``, else the sum of the first floating tensor found).
    linear_io candidates are kept if their forward fired, param_grad
    candidates if one of their parameters received a gradient. Gradients are
    zeroed (``set_to_none=True``) before and after. Typical use:
    ``HookManagerConfig(hook_types=default_hook_assignment(model, batch))``.
    """
    root = unwrap_model(model)
    candidates = resolve_hook_assignments(root, HookManagerConfig())
    modules = dict(root.named_modules())
    fired: set[str] = set()
    handles = []
    for name, family in candidates.items():
        module = modules[name]
        if family == LINEAR_IO:
            handles.append(module.register_forward_hook(_mark_fired(fired, name)))
        else:
            for param in module.parameters(recurse=False):
                if param.requires_grad:
                    handles.append(param.register_hook(_mark_fired(fired, name)))
    model.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            loss = _derive_loss(_call_model(model, sample_input), loss_fn)
            if loss is not None:
                loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    if loss is None and PARAM_GRAD in candidates.values():
        warnings.warn(
            "default_hook_assignment could not derive a differentiable scalar loss from the "
            "model output, so param_grad candidates could not be probed and are left out; "
            "pass loss_fn=.",
            UserWarning,
            stacklevel=2,
        )
    never = sorted(name for name in candidates if name not in fired)
    if never:
        warnings.warn(
            f"default_hook_assignment: these layers never fired on the sample input and are "
            f"left out: {never}.",
            UserWarning,
            stacklevel=2,
        )
    result = {name: family for name, family in candidates.items() if name in fired}
    if not result:
        warnings.warn("default_hook_assignment registered zero layers.", UserWarning, stacklevel=2)
    return result


def _mark_fired(fired: set[str], name: str) -> Callable[..., None]:
    def hook(*_: object) -> None:
        fired.add(name)

    return hook

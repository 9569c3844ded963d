"""Capture hooks: configuration, low-level registration and the ``HookManager``.

``HF_Conv1D`` resolves lazily (module ``__getattr__``): it is the Hugging Face
``Conv1D`` class once ``transformers.pytorch_utils`` has been imported, else
``None`` — importing this package never imports ``transformers``.
"""

from typing import Any

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
from dattri_llm.gradient.hooks import hooks as _hooks
from dattri_llm.gradient.hooks.config import (
    INVASIVE_LINEAR_IO,
    LINEAR_IO,
    PARAM_GRAD,
    REGISTER_ALL,
    HookManagerConfig,
    Selector,
    default_hook_assignment,
    resolve_hook_assignments,
)
from dattri_llm.gradient.hooks.hooks import (
    LayerBuffer,
    ParamGradBuffer,
    install_invasive_forward,
    register_linear_io_hooks,
    register_linear_param_hooks,
    register_param_grad_hooks,
    remove_hooks,
)
from dattri_llm.gradient.hooks.manager import HookManager

__all__ = [
    "INVASIVE_LINEAR_IO",
    "LINEAR_IO",
    "PARAM_GRAD",
    "REGISTER_ALL",
    "HF_Conv1D",
    "HookManager",
    "HookManagerCallback",
    "HookManagerConfig",
    "LayerBuffer",
    "OffloadCallback",
    "ParamGradBuffer",
    "Selector",
    "default_hook_assignment",
    "install_invasive_forward",
    "register_linear_io_hooks",
    "register_linear_param_hooks",
    "register_param_grad_hooks",
    "remove_hooks",
    "resolve_hook_assignments",
]


def __getattr__(name: str) -> Any:
    if name == "HF_Conv1D":
        return _hooks.HF_Conv1D
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

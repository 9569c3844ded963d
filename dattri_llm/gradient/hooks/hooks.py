"""Low-level hook registration: per-sample factor capture, parameter gradients, invasive forwards.

The public path of the low-level API; the code lives by hook family:

* :mod:`.layer_capture` — one ``linear_io`` layer's forward/backward pairing
  and its captures (:data:`LayerBuffer`, :func:`current_forward_token`);
* :mod:`.linear_io` — ``linear_io`` layer selection and
  :func:`register_linear_io_hooks`;
* :mod:`.param_grad` — :func:`register_param_grad_hooks` (:data:`ParamGradBuffer`)
  and :func:`register_linear_param_hooks`;
* :mod:`.invasive` — :func:`install_invasive_forward` and :func:`remove_hooks`;
* :mod:`.layers` — module capability and type lookup, the unwrapped root.

Hugging Face ``Conv1D`` is recognised lazily from ``sys.modules`` (a model
that contains one has already imported it), so importing this module never
imports ``transformers``; ``HF_Conv1D`` is resolved by the module
``__getattr__``.
"""

from __future__ import annotations

from typing import Any

from dattri_llm.gradient.hooks.invasive import install_invasive_forward, remove_hooks
from dattri_llm.gradient.hooks.layer_capture import LayerBuffer, current_forward_token
from dattri_llm.gradient.hooks.layers import hf_conv1d
from dattri_llm.gradient.hooks.linear_io import (
    check_preconditionable_projection,
    register_linear_io_hooks,
)
from dattri_llm.gradient.hooks.param_grad import (
    ParamGradBuffer,
    register_linear_param_hooks,
    register_param_grad_hooks,
)

__all__ = [
    "HF_Conv1D",  # noqa: F822 (resolved lazily by __getattr__)
    "LayerBuffer",
    "ParamGradBuffer",
    "check_preconditionable_projection",
    "current_forward_token",
    "install_invasive_forward",
    "register_linear_io_hooks",
    "register_linear_param_hooks",
    "register_param_grad_hooks",
    "remove_hooks",
]


def __getattr__(name: str) -> Any:
    if name == "HF_Conv1D":
        return hf_conv1d()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

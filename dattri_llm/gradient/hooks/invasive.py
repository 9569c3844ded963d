"""The invasive forward of ``invasive_linear_io`` layers, and hook removal.

An invasively hooked ``nn.Linear`` runs an input-gradient-only op while
capturing, so its backward computes no weight or bias gradient.
:func:`install_invasive_forward` returns revert closures, which
:func:`remove_hooks` takes alongside ordinary hook handles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dattri_llm.gradient.hooks.layers import is_invasive_capable
from dattri_llm.utils.wrappers import unwrap_model

__all__ = ["InputGradOnlyLinear", "install_invasive_forward", "remove_hooks"]


class InputGradOnlyLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns only the input gradient (no weight/bias grads)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, saving only ``weight`` for the backward."""
        ctx.save_for_backward(weight)
        ctx.input_dtype = x.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        """The input gradient in the input's dtype; no weight or bias gradient."""
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_x = grad_out.matmul(weight.to(grad_out.dtype))
        return grad_x.to(ctx.input_dtype), None, None


def install_invasive_forward(
    model: nn.Module, layer_names: set[str], should_intervene: Callable[[], bool]
) -> list[Callable[[], None]]:
    """Override the named ``nn.Linear`` instances' forward with the input-gradient-only op.

    ``should_intervene()`` is consulted on every call; when it is false the
    original forward runs. Returns one idempotent revert closure per layer.
    A named layer that is not an ``nn.Linear`` → ``ValueError``.
    """
    modules = dict(unwrap_model(model).named_modules())
    reverts = []
    for name in sorted(layer_names):
        module = modules.get(name)
        if module is None or not is_invasive_capable(module):
            kind = "missing" if module is None else type(module).__name__
            raise ValueError(
                f"invasive_linear_io needs nn.Linear layers; {name!r} is {kind}. "
                "Use 'linear_io' for it instead."
            )
        reverts.append(_override_forward(module, should_intervene))
    return reverts


def _override_forward(
    module: nn.Linear, should_intervene: Callable[[], bool]
) -> Callable[[], None]:
    previous = module.__dict__.get("forward")
    original = previous if previous is not None else type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if should_intervene():
            return InputGradOnlyLinear.apply(x, module.weight, module.bias)
        return original(x)

    module.forward = forward

    def revert() -> None:
        if module.__dict__.get("forward") is not forward:
            return
        if previous is None:
            del module.forward
        else:
            module.forward = previous

    return revert


def remove_hooks(handles: list) -> None:
    """Remove every handle (hook handles or zero-argument revert callables) and clear the list."""
    for handle in handles:
        if callable(handle) and not hasattr(handle, "remove"):
            handle()
        else:
            handle.remove()
    handles.clear()

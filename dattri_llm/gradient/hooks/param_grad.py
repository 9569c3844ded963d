"""The ``param_grad`` hook family: batch-level parameter gradients by tensor hooks.

The :data:`ParamGradBuffer` of one layer is a plain dict
``{param_name: batch-level grad or None}``. Also the post-accumulate-grad
hooks of :func:`register_linear_param_hooks`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch
from torch import nn

from dattri_llm.gradient.hooks.layers import (
    always,
    is_linear_io_capable,
    owns_trainable_params,
)
from dattri_llm.utils.wrappers import unwrap_model

__all__ = [
    "ParamGradBuffer",
    "ParamGradCapture",
    "register_linear_param_hooks",
    "register_param_grad_hooks",
]

ParamGradBuffer = dict


class ParamGradCapture:
    """``Tensor.register_hook`` on each trainable parameter of the selected layers.

    ``buffers[layer][param_name]`` holds the batch-level gradient of the
    current backward (summed if a parameter's hook fires twice), ``None``
    until it fires.
    """

    def __init__(
        self,
        on_param_grad: Callable[[str, str, torch.Tensor], None] | None,
        offload_to_cpu: bool,
        gate: Callable[[], bool] = always,
        on_backward: Callable[[str], None] | None = None,
        lock: threading.RLock | None = None,
    ) -> None:
        self.on_param_grad = on_param_grad
        self.offload_to_cpu = offload_to_cpu
        self.gate = gate
        self.on_backward = on_backward
        self.lock = lock or threading.RLock()
        self.buffers: dict[str, ParamGradBuffer] = {}

    def attach(self, root: nn.Module, layer_names: Iterable[str] | None) -> list:
        """Register the hooks on ``root``'s selected layers; returns the handles."""
        modules = dict(root.named_modules())
        names = (
            [n for n, m in modules.items() if owns_trainable_params(m)]
            if layer_names is None
            else list(layer_names)
        )
        handles = []
        for layer in names:
            if layer not in modules:
                raise ValueError(f"Layer {layer!r} is not a module of the model (named_modules()).")
            params = [(n, p) for n, p in modules[layer].named_parameters(recurse=False)]
            self.buffers[layer] = {n: None for n, p in params if p.requires_grad}
            for pname, param in params:
                if param.requires_grad:
                    handles.append(param.register_hook(self._hook(layer, pname)))
        return handles

    def _hook(self, layer: str, pname: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # A copy: autograd reuses this tensor as ``param.grad``, which later zeroing,
            # clipping or DDP's in-place all-reduce would rewrite under the record.
            g = grad.detach().to("cpu", copy=True) if self.offload_to_cpu else grad.detach().clone()
            if self.on_param_grad is not None:
                self.on_param_grad(layer, pname, g)
            if not self.gate():
                return
            with self.lock:
                previous = self.buffers[layer][pname]
                self.buffers[layer][pname] = g if previous is None else previous + g
            if self.on_backward is not None:
                self.on_backward(layer)

        return hook


def register_param_grad_hooks(
    model: nn.Module,
    layer_names: Iterable[str] | None = None,
    on_param_grad: Callable[[str, str, torch.Tensor], None] | None = None,
    offload_to_cpu: bool = False,
) -> tuple[dict[str, ParamGradBuffer], list]:
    """Batch-level gradient hooks on every trainable parameter the named layers own directly.

    ``layer_names=None`` selects every module directly owning a trainable
    parameter. Returns ``({layer: {param_name: Tensor | None}}, handles)``;
    ``on_param_grad(layer_name, param_name, grad)`` is called on each fire
    (under DDP the hook sees the local, pre-all-reduce gradient).
    """
    capture = ParamGradCapture(on_param_grad, offload_to_cpu)
    handles = capture.attach(unwrap_model(model), layer_names)
    return capture.buffers, handles


def register_linear_param_hooks(
    model: nn.Module,
    layer_names: Iterable[str] | None = None,
    on_linear_param_grad: Callable[[str, str, torch.Tensor], None] | None = None,
) -> tuple[int, list]:
    """Post-accumulate-grad hooks on the trainable parameters of linear_io-capable layers.

    The callback receives ``(layer_name, param_name, param.grad.detach())``
    once ``param.grad`` is populated. Returns ``(n_params, handles)``.
    """
    root = unwrap_model(model)
    modules = dict(root.named_modules())
    names = (
        [n for n, m in modules.items() if is_linear_io_capable(m)]
        if layer_names is None
        else list(layer_names)
    )
    handles = []
    for layer in names:
        if layer not in modules:
            raise ValueError(f"Layer {layer!r} is not a module of the model (named_modules()).")
        for pname, param in modules[layer].named_parameters(recurse=False):
            if param.requires_grad:
                handles.append(
                    param.register_post_accumulate_grad_hook(
                        _post_accumulate(layer, pname, on_linear_param_grad)
                    )
                )
    return len(handles), handles


def _post_accumulate(
    layer: str, pname: str, fn: Callable[[str, str, torch.Tensor], None] | None
) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        if fn is not None:
            fn(layer, pname, param.grad.detach())

    return hook

"""The hooks a :class:`HookManager` installs on its model, and what depends on them.

:class:`InstalledHooks` turns a resolved hook assignment into ``linear_io``
captures, ``param_grad`` hooks, the root-module hooks and invasive forwards,
with the registration checks and warnings; it holds them until removal, clears
and checkpoints their buffers, refuses optimizer steps over invasively hooked
parameters and collects the backward targets of a weight-gradient-free backward.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dattri_llm.gradient.hooks.config import (
    INVASIVE_LINEAR_IO,
    LINEAR_IO,
    PARAM_GRAD,
    HookManagerConfig,
)
from dattri_llm.gradient.hooks.invasive import install_invasive_forward, remove_hooks
from dattri_llm.gradient.hooks.layer_capture import LayerCapture
from dattri_llm.gradient.hooks.layers import owns_trainable_params
from dattri_llm.gradient.hooks.linear_io import attach_linear_io
from dattri_llm.gradient.hooks.param_grad import ParamGradCapture
from dattri_llm.gradient.ops.projector import DattriProjector

if TYPE_CHECKING:
    from dattri_llm.gradient.callbacks.base import HookManagerCallback

__all__ = ["BackwardTargets", "InstalledHooks", "split_families"]


def split_families(assignments: dict[str, str]) -> tuple[list[str], set[str], list[str]]:
    """``(linear_io and invasive layers, invasive layers, param_grad layers)`` of an assignment."""
    linear = [n for n, f in assignments.items() if f in (LINEAR_IO, INVASIVE_LINEAR_IO)]
    invasive = {n for n, f in assignments.items() if f == INVASIVE_LINEAR_IO}
    param_layers = [n for n, f in assignments.items() if f == PARAM_GRAD]
    return linear, invasive, param_layers


class BackwardTargets:
    """Hooked layer outputs recorded during one forward, each with its version at recording."""

    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, int]] = []

    def add(self, output: torch.Tensor) -> None:
        """Record ``output`` (its capture hook was just registered on it)."""
        self._entries.append((output, output._version))

    def tensors(self) -> list[torch.Tensor] | None:
        """The recorded outputs; ``None`` when there are none or one was modified in place.

        An in-place op after the hook (``nn.ReLU(inplace=True)`` on a linear
        output) moves the tensor onto a new autograd node, while its capture
        hook stays on the old one, which a backward to the tensor need not reach.
        """
        if not self._entries or any(t._version != v for t, v in self._entries):
            return None
        return [tensor for tensor, _version in self._entries]


class InstalledHooks:
    """The hooks of one manager: empty until :meth:`install`, emptied by :meth:`remove`.

    ``captures`` maps each hooked linear_io / invasive layer to its
    :class:`LayerCapture`; ``params`` is the ``param_grad`` capture;
    ``invasive`` the invasively hooked layers and ``invasive_params`` their
    parameters' owners by identity; ``handles`` / ``reverts`` undo the hooks.
    """

    def __init__(self) -> None:
        self.captures: dict[str, LayerCapture] = {}
        self.invasive: set[str] = set()
        self.invasive_params: dict[int, str] = {}
        self.params: ParamGradCapture | None = None
        self.handles: list = []
        self.reverts: list = []

    @property
    def param_layer_names(self) -> list[str]:
        """Layers hooked with the ``param_grad`` family."""
        return [] if self.params is None else list(self.params.buffers)

    @property
    def param_buffers(self) -> dict[str, dict]:
        """``{layer: {param_name: batch-level grad or None}}`` of the ``param_grad`` layers."""
        return {} if self.params is None else self.params.buffers

    def install(
        self,
        model: nn.Module,
        root: nn.Module,
        linear: list[str],
        invasive: set[str],
        param_layers: list[str],
        config: HookManagerConfig,
        *,
        non_batch_first: frozenset[str],
        offload_to_cpu: bool,
        projector: DattriProjector,
        preconditioner: Callable | None,
        callbacks: Iterable[HookManagerCallback],
        gate: Callable[[], bool],
        intervening: Callable[[], bool],
        lock: threading.RLock,
        decisions: dict[str, bool],
        on_layer_forward: Callable[..., None],
        on_layer_backward: Callable[..., None],
        on_forward: Callable[[str], None],
        on_backward: Callable[[str], None],
        on_orphan: Callable[[str], None],
        root_pre_hook: Callable[..., None],
        root_forward_hook: Callable[..., None],
    ) -> None:
        """Hook the assigned layers of ``root`` (the unwrapped ``model``) and ``model`` itself.

        ``linear`` / ``invasive`` / ``param_layers`` are the assignment's
        families (:func:`split_families`); the callables wire the hooks to the
        manager (see :class:`LayerCapture`), ``root_pre_hook`` /
        ``root_forward_hook`` go on ``model`` with kwargs and ``intervening``
        switches the invasive forwards. ``ValueError`` if no layer can be hooked;
        ``RuntimeError`` if a callback needs the parameter gradients invasive
        layers do not compute.
        """
        captures, handles = attach_linear_io(
            root,
            linear,
            type_overrides=config.layer_types,
            kwargs_overrides=config.module_kwargs,
            projection_kwargs=config.projection_kwargs,
            capture_style=config.capture_style,
            projector=projector,
            offload_to_cpu=offload_to_cpu,
            include_frozen=config.include_frozen,
            non_batch_first=non_batch_first,
            on_layer_forward=on_layer_forward,
            on_layer_backward=on_layer_backward,
            gate=gate,
            on_forward=on_forward,
            on_backward=on_backward,
            on_orphan=on_orphan,
            lock=lock,
            decisions=decisions,
            preconditioner=preconditioner,
        )
        _warn_registration(root, config, non_batch_first, linear, captures)
        if not captures and not param_layers:
            remove_hooks(handles)
            raise ValueError(
                f"HookManager hooked no layer of {type(root).__name__}: nothing is linear_io-"
                "capable and trainable, or the selectors matched nothing. Select layers with "
                "HookManagerConfig(linear_io=[regex, ...] / REGISTER_ALL, param_grad=..., "
                "hook_types={name: family}); set include_frozen=True to hook frozen layers."
            )
        self.captures = captures
        self.invasive = invasive & set(captures)
        modules = dict(root.named_modules())
        # Owners by parameter identity, taken now: a later FSDP auto-wrap renames modules.
        self.invasive_params = {
            id(param): name
            for name in self.invasive
            for param in modules[name].parameters(recurse=False)
        }
        self.check_invasive_callbacks(callbacks)
        self.params = ParamGradCapture(
            None,
            offload_to_cpu,
            gate=gate,
            on_backward=on_backward,
            lock=lock,
        )
        handles += self.params.attach(root, param_layers)
        handles.append(model.register_forward_pre_hook(root_pre_hook, with_kwargs=True))
        handles.append(model.register_forward_hook(root_forward_hook, with_kwargs=True))
        self.reverts = install_invasive_forward(root, self.invasive, intervening)
        self.handles = handles

    def remove(self) -> None:
        """Restore invasive forwards, remove every hook and forget the layers."""
        for revert in self.reverts:
            revert()
        self.reverts = []
        remove_hooks(self.handles)
        self.captures = {}
        self.invasive = set()
        self.invasive_params = {}
        self.params = None

    def check_invasive_callbacks(self, callbacks: Iterable[HookManagerCallback]) -> None:
        """``RuntimeError`` if a callback needs parameter gradients and a layer is invasive."""
        needy = [type(cb).__name__ for cb in callbacks if getattr(cb, "needs_param_grads", False)]
        if self.invasive and needy:
            raise RuntimeError(
                f"Callbacks {needy} need parameter gradients, but invasive_linear_io layers "
                f"{sorted(self.invasive)} compute none (capture only). Use 'linear_io' for "
                "these layers."
            )

    # ------------------------------------------------------------------ buffers

    def any_captured(self) -> bool:
        """Whether a linear_io layer has buffered a capture in this step."""
        return any(capture.buffer["captures"] for capture in self.captures.values())

    def clear_buffers(self) -> None:
        """Drop pending forwards, captures and ``param_grad`` sums."""
        for capture in self.captures.values():
            capture.buffer["pending"] = []
            capture.buffer["captures"] = []
        self.clear_param_grads()

    def clear_param_grads(self) -> None:
        """Reset every ``param_grad`` sum to ``None``."""
        for grads in self.param_buffers.values():
            for pname in grads:
                grads[pname] = None

    def save_buffers(self) -> dict[str, Any]:
        """Copies of the pending forwards, captures and ``param_grad`` sums."""
        return {
            "pending": {n: list(c.buffer["pending"]) for n, c in self.captures.items()},
            "captures": {n: list(c.buffer["captures"]) for n, c in self.captures.items()},
            "params": {} if self.params is None else _copy_params(self.params.buffers),
        }

    def load_buffers(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`save_buffers` returned (layers it lacks come back empty)."""
        for name, capture in self.captures.items():
            capture.buffer["pending"] = list(state["pending"].get(name, []))
            capture.buffer["captures"] = list(state["captures"].get(name, []))
        if self.params is not None:
            for layer, grads in self.params.buffers.items():
                grads.update(state["params"].get(layer, {}))

    # ------------------------------------------------------------------ what depends on them

    @contextlib.contextmanager
    def backward_targets(self) -> Iterator[BackwardTargets | None]:
        """Record the layer outputs whose gradients the hooks capture (forward runs inside).

        Yields the :class:`BackwardTargets` the hooked layers add their
        backpropagated outputs to during the block, so a caller that needs no
        parameter gradients can run ``torch.autograd.grad(loss, targets.tensors())``:
        every capture hook fires and no weight gradient is computed. Yields
        ``None`` when such a backward would miss a capture (``param_grad`` layers,
        ``invasive_linear_io`` layers).
        """
        if self.param_layer_names or self.invasive:
            yield None
            return
        targets = BackwardTargets()
        for capture in self.captures.values():
            capture.target_sink = targets
        try:
            yield targets
        finally:
            for capture in self.captures.values():
                capture.target_sink = None

    def guard_invasive_optimizer_steps(self) -> torch.utils.hooks.RemovableHandle | None:
        """Refuse optimizer steps over invasively hooked parameters while collecting.

        Registers a global optimizer step pre-hook (``None`` when no layer is
        invasive) that raises ``RuntimeError`` if the stepping optimizer holds
        a parameter of an ``invasive_linear_io`` layer: those layers compute no
        weight/bias gradient, so the update would silently skip them.
        """
        if not self.invasive:
            return None
        owners = self.invasive_params

        def refuse_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            held = sorted(
                {
                    owners[id(param)]
                    for group in optimizer.param_groups
                    for param in group["params"]
                    if id(param) in owners
                }
            )
            if held:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() inside HookManager.collect() would "
                    f"update invasive_linear_io layers {held}, which compute no weight/bias "
                    "gradients (capture only). Use 'linear_io' for these layers when training "
                    "or selecting data; keep invasive_linear_io for attribution at a fixed "
                    "checkpoint."
                )

        return register_optimizer_step_pre_hook(refuse_step)


def _warn_registration(
    root: nn.Module,
    config: HookManagerConfig,
    non_batch_first: frozenset[str],
    linear: list[str],
    captures: dict[str, LayerCapture],
) -> None:
    # stacklevel=4: the warnings name the caller of HookManager.register().
    unhooked = sorted(set(config.layer_types) - set(captures))
    if unhooked:
        warnings.warn(
            f"layer_types names layers that are not hooked via linear_io: {unhooked}; "
            "layer_types only relabels, select them with hook_types or a selector.",
            UserWarning,
            stacklevel=4,
        )
    stray = sorted(non_batch_first - set(captures))
    if stray:
        warnings.warn(
            f"non_batch_first_layers names layers not hooked via linear_io: {stray}.",
            UserWarning,
            stacklevel=4,
        )
    modules = dict(root.named_modules())
    frozen = sorted(n for n in captures if not owns_trainable_params(modules[n]))
    if frozen:
        warnings.warn(
            f"include_frozen=True hooks frozen layers {frozen}: they only receive output "
            "gradients if some parameter earlier in the network requires grad.",
            UserWarning,
            stacklevel=4,
        )
    if linear and not captures:
        warnings.warn(
            f"All {len(linear)} selected linear_io layers are frozen and were skipped; pass "
            "HookManagerConfig(include_frozen=True) to hook them.",
            UserWarning,
            stacklevel=4,
        )


def _copy_params(buffers: dict[str, dict]) -> dict[str, dict]:
    return {layer: dict(grads) for layer, grads in buffers.items()}

"""``HookManager``: per-sample gradient capture from unmodified training loops.

A capture step is one backward pass. The manager hooks the selected layers
(:mod:`dattri_llm.gradient.hooks.hooks`), observes the backward start through
a tensor hook on the root output, and queues an end-of-backward callback on
the autograd engine. When that callback runs, every hooked layer reached by
this backward has fired and every ``param.grad`` is written, so the step is
complete: layers skipped by control flow and ``param_grad`` layers that got no
gradient never stall it, and forwards left without a backward (gradient
checkpointing duplicates, detached branches) are discarded. The record is
assembled, the step counter advances, the per-step state resets and
``on_step_end(record)`` is dispatched to every callback outside the lock.
A backward that only reaches forwards an earlier backward already consumed (a
repeated ``backward()`` over a retained graph) warns per layer fire and is
dropped whole: no step, no record, no callbacks, its ``param_grad`` sums cleared.

Tied or reused modules are scored per use site: a module invoked k times in a
step yields virtual layers ``name``, ``name@2``, …, ``name@k`` (forward order);
cross-site gradient terms are dropped.

With ``optimizer=`` (preconditioned capture) every linear_io layer buffers
``ops.precondition`` of its dense per-sample gradient on the captured
coordinates, with the optimizer's pre-step state of those coordinates
(``optimizer_state.GradientPreconditioner``); ``precondition = False`` turns
the map off for a pass, which then captures exactly as without an optimizer.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    base_layer_name,
)
from dattri_llm.gradient.hooks.config import (
    INVASIVE_LINEAR_IO,
    LINEAR_IO,
    PARAM_GRAD,
    HookManagerConfig,
    resolve_hook_assignments,
)
from dattri_llm.gradient.hooks.hooks import (
    Capture,
    LayerCapture,
    ParamGradCapture,
    attach_linear_io,
    check_preconditionable_projection,
    install_invasive_forward,
    owns_trainable_params,
    remove_hooks,
    unwrap_model,
)
from dattri_llm.gradient.ops.projection import DattriProjector
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.gradient.optimizer_state import (
    GradientPreconditioner,
    OptimizerLike,
    OptimizerSnapshot,
    optimizer_type,
)
from dattri_llm.utils.autograd import queue_backward_end_callback
from dattri_llm.utils.distributed import all_reduce_sum, dist_world_size
from dattri_llm.utils.hashing import hash_batch, occurrence_ids

if TYPE_CHECKING:
    from dattri_llm.gradient.callbacks.base import HookManagerCallback

__all__ = ["HookManager"]

_MISSING = object()


@dataclass
class _StepState:
    """Per-step bookkeeping that is not held in the layer buffers."""

    inputs: dict[str, Any] | None = None
    sample_ids: Any = _MISSING
    forward_layers: set[str] = field(default_factory=set)
    end_queued: bool = False
    orphan_layers: set[str] = field(default_factory=set)

    def copy(self) -> _StepState:
        return _StepState(
            self.inputs,
            self.sample_ids,
            set(self.forward_layers),
            self.end_queued,
            set(self.orphan_layers),
        )


def _device_order(device: torch.device) -> tuple[str, int]:
    return (device.type, -1 if device.index is None else device.index)


def _batch_of(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return data.shape[0]
    return data.activation.shape[0 if data.batch_first else 1]


def _leading_len(value: object) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.ndim > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def _stringify_ids(values: object) -> list[str]:
    if isinstance(values, torch.Tensor):
        values = values.tolist() if values.ndim > 0 else [values.item()]
    return [str(v) for v in values]


def _merge_chunks(chunks: list[Capture]) -> Any:
    """Concatenate one virtual layer's per-device captures along the batch axis."""
    chunks = sorted(chunks, key=lambda c: _device_order(c.device))
    first = chunks[0].data
    if len(chunks) == 1:
        return first
    device = chunks[0].device
    if isinstance(first, torch.Tensor):
        return torch.cat([c.data.to(device) for c in chunks], dim=0)
    axis = 0 if first.batch_first else 1
    a = torch.cat([c.data.activation.to(device) for c in chunks], dim=axis)
    g = torch.cat([c.data.pre_activation_grad.to(device) for c in chunks], dim=axis)
    return Factorized(a, g, first.module_kwargs, first.batch_first)


def _virtual_layers(name: str, captures: list[Capture]) -> dict[str, list[Capture]]:
    """``{name, name@2, …: per-device chunks}``; invocations numbered per device, forward order."""
    per_device: dict[tuple[str, int], list[Capture]] = {}
    for capture in captures:
        per_device.setdefault(_device_order(capture.device), []).append(capture)
    layers: dict[str, list[Capture]] = {}
    for device_captures in per_device.values():
        for k, capture in enumerate(sorted(device_captures, key=lambda c: c.seq)):
            layers.setdefault(name if k == 0 else f"{name}@{k + 1}", []).append(capture)
    return layers


class _BackwardTargets:
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


class HookManager:
    """Capture per-sample gradients from any loop that calls ``backward()``.

    Hooks go on ``model.module`` when present (DataParallel / DDP / FSDP
    wrapper), else on ``model``; model inputs are read from the model as given.
    Construction calls :meth:`register`, then ``cb.on_register(self)`` for every
    callback that has it. Use ``with manager.collect(): ...`` around the
    training code; each backward inside is one capture step whose
    :class:`GradientRecord` goes to every callback's ``on_step_end``.

    ``optimizer`` (an optimizer, or a zero-argument callable returning one,
    called on first use) enables preconditioned capture (``capture.md`` §5):
    each hooked layer buffers the dense ``(B, k)`` ``ops.precondition`` map of
    its per-sample gradient on the captured coordinates (whole layer; the mask
    subset under ``"mask"``; the whole layer before a ``"dense"`` projection,
    applied after the map), read against the optimizer's current state with
    ``step = state["step"] + 1`` and the group hyperparameters. ``param_grad``
    layers and ``"logra"`` projections are refused (``ValueError``) and the
    capture style is ignored (captures are dense). :attr:`precondition`
    switches the map per pass; :meth:`set_loss_convention` makes it map each
    sample's own gradient rather than its share of a mean or accumulated loss.
    Works under DDP, FSDP1 (``use_orig_params=True``) and FSDP2, each rank
    reading its own shard's state (``docs/distributed.md``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: HookManagerConfig | None = None,
        callbacks: list[HookManagerCallback] | None = None,
        sample_id_key: str | int | None = None,
        sample_hash_fields: Iterable[str | int] | str | int | None = None,
        non_batch_first_layers: Iterable[str] | None = None,
        offload_to_cpu: bool = False,
        optimizer: OptimizerLike | None = None,
    ) -> None:
        if config is not None and not isinstance(config, HookManagerConfig):
            raise TypeError(
                f"HookManager config must be a HookManagerConfig, got {type(config).__name__}."
            )
        self.model = model
        self.config = config if config is not None else HookManagerConfig()
        self.callbacks: list[HookManagerCallback] = list(callbacks or [])
        self._sample_id_key = _check_sample_id_key(sample_id_key)
        self._sample_hash_fields = _check_hash_fields(sample_hash_fields, sample_id_key)
        self._non_batch_first = frozenset(non_batch_first_layers or ())
        self.offload_to_cpu = bool(offload_to_cpu)
        self._lock = threading.RLock()
        self._collecting = False
        self._handles: list = []
        self._reverts: list = []
        self._captures: dict[str, LayerCapture] = {}
        self._invasive: set[str] = set()
        self._invasive_params: dict[int, str] = {}
        self._params: ParamGradCapture | None = None
        self._decisions: dict[str, bool] = {}
        self._state = _StepState()
        self._step = 0
        self._last_gradient: Gradient | None = None
        self._warned_missing: set[frozenset[str]] = set()
        self._warned_broadcast: set[str] = set()
        self._projector: Any = None
        self._snapshot = _optimizer_snapshot(model, optimizer)
        # Built with the projector in register(), so masks and matrices are the capture's own.
        self._preconditioner: GradientPreconditioner | None = None
        self.register()
        for callback in self.callbacks:
            self._attach_callback(callback)

    # ------------------------------------------------------------------ properties

    @property
    def layer_names(self) -> list[str]:
        """Hooked linear_io / invasive_linear_io layer names."""
        return list(self._captures)

    @property
    def layer_name(self) -> list[str]:
        """Alias of :attr:`layer_names`."""
        return self.layer_names

    @property
    def param_layer_names(self) -> list[str]:
        """Layers hooked with the ``param_grad`` family."""
        return [] if self._params is None else list(self._params.buffers)

    @property
    def steps_collected(self) -> int:
        """The step counter: the step number the next completed step is stamped with."""
        return self._step

    @property
    def sample_id_key(self) -> str | int | None:
        """Input field read as per-sample identifier, ``None`` for content hashing."""
        return self._sample_id_key

    @property
    def sample_hash_fields(self) -> tuple[str | int, ...] | None:
        """Fields the content hash is restricted to, ``None`` for the default fields."""
        return self._sample_hash_fields

    @property
    def supports_preconditioning(self) -> bool:
        """Whether the manager was built with an optimizer (preconditioned capture)."""
        return self._snapshot is not None

    @property
    def precondition(self) -> bool:
        """Whether captures are mapped through the optimizer (default ``True`` with one).

        Settable per pass, e.g. ``False`` for a raw query pass sharing the hooks
        (captures are then exactly those of a manager without optimizer). Read
        at each layer's backward, so switch it between steps, not inside one.
        """
        return self._preconditioner is not None and self._preconditioner.enabled

    @precondition.setter
    def precondition(self, value: bool) -> None:
        if self._preconditioner is None:
            if value:
                raise ValueError(
                    "precondition=True needs a HookManager built with optimizer=... "
                    "(preconditioned capture); this one has no optimizer."
                )
            return
        self._preconditioner.enabled = bool(value)

    def set_loss_convention(
        self, loss_reduction: str | None, gradient_accumulation_steps: int = 1
    ) -> None:
        """How the loss splits into per-sample shares, for preconditioned capture.

        A hook captures each sample's *share* of the backpropagated loss. The
        optimizer map of preconditioned capture is not linear, so a method
        that maps each sample's *own* gradient (LESS's update direction) says
        how to recover it: ``loss_reduction="mean"`` (each micro-batch loss is
        the mean over its ``B`` rows) or ``"sum"``, and the loss divisor
        ``gradient_accumulation_steps`` the loop divides each micro-batch loss
        by. The map then sees ``share · (B if mean else 1) · divisor``.
        ``None`` (the default) maps the shares as captured.

        Raises:
            ValueError: another reduction, a divisor below 1, or a manager
                without an optimizer.
        """
        if loss_reduction not in (None, "mean", "sum"):
            raise ValueError(
                f"loss_reduction must be one of [None, 'mean', 'sum'], got {loss_reduction!r}"
            )
        if (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1
        ):
            raise ValueError(
                "gradient_accumulation_steps must be an int >= 1, got "
                f"{gradient_accumulation_steps!r}"
            )
        if self._preconditioner is None:
            raise ValueError(
                "set_loss_convention applies to preconditioned capture; build the HookManager "
                "with optimizer=..."
            )
        self._preconditioner.loss_reduction = loss_reduction
        self._preconditioner.loss_divisor = gradient_accumulation_steps

    # ------------------------------------------------------------------ registration

    def register(self) -> None:
        """Attach the hooks (no-op if attached); ``ValueError`` if no layer can be hooked."""
        if self._handles:
            return
        root = unwrap_model(self.model)
        assignments = resolve_hook_assignments(root, self.config)
        linear = [n for n, f in assignments.items() if f in (LINEAR_IO, INVASIVE_LINEAR_IO)]
        invasive = {n for n, f in assignments.items() if f == INVASIVE_LINEAR_IO}
        param_layers = [n for n, f in assignments.items() if f == PARAM_GRAD]
        if self._snapshot is not None:
            self._check_preconditionable(param_layers)
        if self._projector is None:
            self._projector = DattriProjector.coerce(self.config.projector)
        if self._snapshot is not None and self._preconditioner is None:
            self._preconditioner = GradientPreconditioner(self._snapshot, self._projector)
        captures, handles = attach_linear_io(
            root,
            linear,
            type_overrides=self.config.layer_types,
            kwargs_overrides=self.config.module_kwargs,
            projection_kwargs=self.config.projection_kwargs,
            capture_style=self.config.capture_style,
            projector=self._projector,
            offload_to_cpu=self.offload_to_cpu,
            include_frozen=self.config.include_frozen,
            non_batch_first=self._non_batch_first,
            on_layer_forward=self._emit_forward,
            on_layer_backward=self._emit_backward,
            gate=self._is_collecting,
            on_forward=self._note_forward,
            on_backward=self._note_layer_backward,
            on_orphan=self._note_orphan,
            lock=self._lock,
            decisions=self._decisions,
            preconditioner=self._preconditioner,
        )
        self._warn_registration(root, linear, captures)
        if not captures and not param_layers:
            remove_hooks(handles)
            raise ValueError(
                f"HookManager hooked no layer of {type(root).__name__}: nothing is linear_io-"
                "capable and trainable, or the selectors matched nothing. Select layers with "
                "HookManagerConfig(linear_io=[regex, ...] / REGISTER_ALL, param_grad=..., "
                "hook_types={name: family}); set include_frozen=True to hook frozen layers."
            )
        self._captures = captures
        self._invasive = invasive & set(captures)
        modules = dict(root.named_modules())
        # Owners by parameter identity, taken now: a later FSDP auto-wrap renames modules.
        self._invasive_params = {
            id(param): name
            for name in self._invasive
            for param in modules[name].parameters(recurse=False)
        }
        self._check_invasive_callbacks(self.callbacks)
        self._params = ParamGradCapture(
            None,
            self.offload_to_cpu,
            gate=self._is_collecting,
            on_backward=self._note_layer_backward,
            lock=self._lock,
        )
        handles += self._params.attach(root, param_layers)
        handles.append(self.model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True))
        handles.append(self.model.register_forward_hook(self._root_forward_hook, with_kwargs=True))
        self._reverts = install_invasive_forward(root, self._invasive, self._intervening)
        self._handles = handles

    def _check_preconditionable(self, param_layers: list[str]) -> None:
        """``ValueError`` for ``param_grad`` layers or ``"logra"`` projections (preconditioning)."""
        if param_layers:
            raise ValueError(
                f"HookManager(optimizer=...) preconditions per-sample gradients, but layers "
                f"{sorted(param_layers)} are assigned 'param_grad', which captures batch-level "
                "gradients only. Capture only linear_io layers with an optimizer: "
                "HookManagerConfig(linear_io=REGISTER_ALL) or hook_types={name: 'linear_io'}."
            )
        for entry, proj in (self.config.projection_kwargs or {}).items():
            check_preconditionable_projection(proj, entry, "HookManager(optimizer=...)")

    def _warn_registration(
        self,
        root: nn.Module,
        linear: list[str],
        captures: dict[str, LayerCapture],
    ) -> None:
        unhooked = sorted(set(self.config.layer_types) - set(captures))
        if unhooked:
            warnings.warn(
                f"layer_types names layers that are not hooked via linear_io: {unhooked}; "
                "layer_types only relabels, select them with hook_types or a selector.",
                UserWarning,
                stacklevel=3,
            )
        stray = sorted(self._non_batch_first - set(captures))
        if stray:
            warnings.warn(
                f"non_batch_first_layers names layers not hooked via linear_io: {stray}.",
                UserWarning,
                stacklevel=3,
            )
        modules = dict(root.named_modules())
        frozen = sorted(n for n in captures if not owns_trainable_params(modules[n]))
        if frozen:
            warnings.warn(
                f"include_frozen=True hooks frozen layers {frozen}: they only receive output "
                "gradients if some parameter earlier in the network requires grad.",
                UserWarning,
                stacklevel=3,
            )
        if linear and not captures:
            warnings.warn(
                f"All {len(linear)} selected linear_io layers are frozen and were skipped; pass "
                "HookManagerConfig(include_frozen=True) to hook them.",
                UserWarning,
                stacklevel=3,
            )

    def _check_invasive_callbacks(self, callbacks: Iterable[HookManagerCallback]) -> None:
        needy = [type(cb).__name__ for cb in callbacks if getattr(cb, "needs_param_grads", False)]
        if self._invasive and needy:
            raise RuntimeError(
                f"Callbacks {needy} need parameter gradients, but invasive_linear_io layers "
                f"{sorted(self._invasive)} compute none (capture only). Use 'linear_io' for "
                "these layers."
            )

    def remove(self) -> None:
        """Remove every hook, restore invasive forwards, clear buffers and the last gradient."""
        with self._lock:
            for revert in self._reverts:
                revert()
            self._reverts = []
            remove_hooks(self._handles)
            self._captures = {}
            self._invasive = set()
            self._invasive_params = {}
            self._params = None
            self._reset_step()
            self._last_gradient = None
            if self._projector is not None:
                self._projector.close()

    def add_callback(self, callback: HookManagerCallback) -> None:
        """Append ``callback`` and call its ``on_register(self)`` if present."""
        self._check_invasive_callbacks([callback])
        self.callbacks.append(callback)
        self._attach_callback(callback)

    def _attach_callback(self, callback: HookManagerCallback) -> None:
        on_register = getattr(callback, "on_register", None)
        if callable(on_register):
            on_register(self)

    @contextlib.contextmanager
    def _collect_backward_targets(self) -> Iterator[_BackwardTargets | None]:
        """Record the layer outputs whose gradients the hooks capture (forward runs inside).

        Yields the ``_BackwardTargets`` the hooked layers add their
        backpropagated outputs to during the block, so a caller that needs no
        parameter gradients can run ``torch.autograd.grad(loss, targets.tensors())``:
        every capture hook fires and no weight gradient is computed. Yields
        ``None`` when such a backward would miss a capture (``param_grad`` layers,
        ``invasive_linear_io`` layers).
        """
        if self.param_layer_names or self._invasive:
            yield None
            return
        targets = _BackwardTargets()
        for capture in self._captures.values():
            capture.target_sink = targets
        try:
            yield targets
        finally:
            for capture in self._captures.values():
                capture.target_sink = None

    # ------------------------------------------------------------------ collection

    @contextlib.contextmanager
    def collect(self, deregister_on_exit: bool = False) -> Iterator[HookManager]:
        """Context manager capturing every backward inside it; yields ``self``.

        On enter: :meth:`register`, reset buffers/flags and the last gradient,
        start collecting. On exit (always): stop collecting, call every
        callback's ``on_context_end()``, then :meth:`remove` if
        ``deregister_on_exit`` (the last gradient is kept). While it is active
        with ``invasive_linear_io`` layers, an optimizer step over their
        parameters raises ``RuntimeError`` (they compute no weight gradient).
        """
        if self._collecting:
            raise RuntimeError("HookManager.collect() is already active; do not nest it.")
        self.register()
        if self._invasive and unwrap_model(self.model).training:
            warnings.warn(
                f"invasive_linear_io layers {sorted(self._invasive)} compute no weight/bias "
                "gradients while collecting: an optimizer step over them raises RuntimeError. "
                "Use it for attribution at a fixed checkpoint (model.eval()), not for training.",
                UserWarning,
                stacklevel=3,
            )
        step_guard = self._guard_invasive_optimizer_steps()
        with self._lock:
            self._reset_step()
            self._last_gradient = None
            self._collecting = True
        try:
            yield self
        finally:
            self._collecting = False
            if step_guard is not None:
                step_guard.remove()
            for callback in list(self.callbacks):
                on_context_end = getattr(callback, "on_context_end", None)
                if callable(on_context_end):
                    on_context_end()
            if deregister_on_exit:
                last = self._last_gradient
                self.remove()
                self._last_gradient = last

    def _guard_invasive_optimizer_steps(self) -> torch.utils.hooks.RemovableHandle | None:
        """Refuse optimizer steps over invasively hooked parameters while collecting.

        Registers a global optimizer step pre-hook (``None`` when no layer is
        invasive) that raises ``RuntimeError`` if the stepping optimizer holds
        a parameter of an ``invasive_linear_io`` layer: those layers compute no
        weight/bias gradient, so the update would silently skip them.
        """
        if not self._invasive:
            return None
        owners = self._invasive_params

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

    def get_gradient(self) -> Gradient:
        """The assembled gradient of the most recently completed step (``RuntimeError`` if none)."""
        with self._lock:
            if self._last_gradient is None:
                raise RuntimeError(
                    "No gradient available: no capture step completed since the last collect() "
                    "entry or grad-enabled forward. Run forward and backward inside collect()."
                )
            return self._last_gradient

    def reset_steps(self, to: int = 0) -> None:
        """Set the number the next completed step is stamped with."""
        self._step = int(to)

    # ------------------------------------------------------------------ state

    def save_state(self) -> dict:
        """Checkpoint buffers, captured inputs, step counter, last gradient and flags."""
        with self._lock:
            return {
                "step_state": self._state.copy(),
                "pending": {n: list(c.buffer["pending"]) for n, c in self._captures.items()},
                "captures": {n: list(c.buffer["captures"]) for n, c in self._captures.items()},
                "params": {} if self._params is None else _copy_params(self._params.buffers),
                "decisions": dict(self._decisions),
                "step": self._step,
                "last_gradient": self._last_gradient,
            }

    def clear_state(self) -> None:
        """Empty buffers, captured inputs, last gradient and flags (the step counter is kept)."""
        with self._lock:
            self._reset_step()
            self._last_gradient = None

    def load_state(self, state: dict) -> None:
        """Restore a :meth:`save_state` checkpoint."""
        with self._lock:
            self._state = state["step_state"].copy()
            for name, capture in self._captures.items():
                capture.buffer["pending"] = list(state["pending"].get(name, []))
                capture.buffer["captures"] = list(state["captures"].get(name, []))
            if self._params is not None:
                for layer, grads in self._params.buffers.items():
                    grads.update(state["params"].get(layer, {}))
            self._decisions.clear()
            self._decisions.update(state["decisions"])
            self._step = state["step"]
            self._last_gradient = state["last_gradient"]

    def _reset_step(self) -> None:
        self._state = _StepState()
        for capture in self._captures.values():
            capture.buffer["pending"] = []
            capture.buffer["captures"] = []
        self._clear_param_grads()
        self._decisions.clear()

    def _clear_param_grads(self) -> None:
        for grads in ({} if self._params is None else self._params.buffers).values():
            for pname in grads:
                grads[pname] = None

    # ------------------------------------------------------------------ hook plumbing

    def _is_collecting(self) -> bool:
        return self._collecting

    def _intervening(self) -> bool:
        return self._collecting and torch.is_grad_enabled()

    def _emit_forward(
        self, name: str, activation: torch.Tensor, layer_type: str, kwargs: dict | None
    ) -> None:
        for callback in self.callbacks:
            callback.on_layer_forward(name, activation, layer_type, kwargs)

    def _emit_backward(
        self, name: str, grad_output: torch.Tensor, layer_type: str, kwargs: dict | None
    ) -> None:
        for callback in self.callbacks:
            callback.on_layer_backward(name, grad_output, layer_type, kwargs)

    def _note_forward(self, name: str) -> None:
        if self.precondition:
            # Parameter shapes are read here, where FSDP holds the layer unsharded.
            self._snapshot.bind(name)
        with self._lock:
            self._state.forward_layers.add(name)

    def _note_layer_backward(self, name: str) -> None:
        self._note_backward()

    def _note_orphan(self, name: str) -> None:
        """A backward fire of ``name`` found no pending forward (already warned about)."""
        with self._lock:
            self._state.orphan_layers.add(name)
        self._note_backward()

    def _root_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._collecting or not torch.is_grad_enabled():
            return
        inputs, sample_ids = self._capture_inputs(args, kwargs)
        with self._lock:
            self._last_gradient = None
            self._state.inputs = inputs
            self._state.sample_ids = sample_ids

    def _capture_inputs(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], Any]:
        """Identity fields of one root forward, plus the raw ``sample_id_key`` value."""

        def lookup(key: str | int) -> Any:
            if isinstance(key, int):
                return args[key] if key < len(args) else _MISSING
            return kwargs.get(key, _MISSING)

        def detach(value: Any) -> Any:
            return value.detach() if isinstance(value, torch.Tensor) else value

        sample_ids = _MISSING if self._sample_id_key is None else lookup(self._sample_id_key)
        if self._sample_hash_fields is not None:
            inputs = {
                _field_key(key): detach(value)
                for key in self._sample_hash_fields
                if (value := lookup(key)) is not _MISSING
            }
        else:
            inputs = {k: v.detach() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            if not inputs:
                inputs = {
                    f"_arg{i}": v.detach()
                    for i, v in enumerate(args)
                    if isinstance(v, torch.Tensor)
                }
        return inputs, sample_ids

    def _root_forward_hook(
        self, module: nn.Module, args: tuple, kwargs: dict, output: object
    ) -> None:
        if not self._collecting or not torch.is_grad_enabled():
            return
        values: Iterable[object] = (output,)
        if isinstance(output, Mapping):
            values = output.values()
        elif isinstance(output, (list, tuple)):
            values = output
        for value in values:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(self._backward_reached_output)

    def _backward_reached_output(self, grad: torch.Tensor) -> None:
        self._note_backward()

    def _note_backward(self) -> None:
        """Queue the step-completion callback once per backward."""
        with self._lock:
            if self._state.end_queued or not self._collecting:
                return
            self._state.end_queued = True
        if not queue_backward_end_callback(self._on_backward_end):
            raise RuntimeError(
                "HookManager could not queue its end-of-backward callback on the autograd "
                "engine (torch.autograd.Variable._execution_engine.queue_callback); capture "
                "needs a PyTorch build that exposes it (torch>=2.1)."
            )

    # ------------------------------------------------------------------ step completion

    def _on_backward_end(self) -> None:
        with self._lock:
            if self._is_orphan_pass():
                self._discard_orphan_pass()
                return
            try:
                record = self._assemble_record()
            finally:
                self._reset_step()
            self._step += 1
            self._last_gradient = record.gradient
        with torch.no_grad():
            for callback in list(self.callbacks):
                callback.on_step_end(record)

    def _is_orphan_pass(self) -> bool:
        """Whether this backward only re-ran consumed forwards (no layer capture was buffered)."""
        return bool(self._state.orphan_layers) and not any(
            capture.buffer["captures"] for capture in self._captures.values()
        )

    def _discard_orphan_pass(self) -> None:
        """Drop a repeated backward over a retained graph: no step, no record, no callbacks.

        Its ``param_grad`` sums are cleared; forwards still pending (a step in
        progress), captured inputs and the last gradient are kept.
        """
        self._clear_param_grads()
        self._state.orphan_layers.clear()
        self._state.end_queued = False

    def _synchronized_param_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A batch-level gradient as DDP applies it: averaged over ranks when DDP syncs.

        Parameter tensor hooks see the local gradient before DDP's all-reduce; a
        synchronizing DDP step (not inside ``no_sync()``) averages it over ranks, so
        the record does too. Every rank completes the step, so the collective matches.
        """
        ddp = torch.nn.parallel.DistributedDataParallel
        if not isinstance(self.model, ddp) or not self.model.require_backward_grad_sync:
            return grad
        return all_reduce_sum(grad.clone()) / dist_world_size()

    def _assemble_record(self) -> GradientRecord:
        representation: dict[str, str] = {}
        data: dict[str, Any] = {}
        layer_types: dict[str, str] = {}
        indexing: dict[str, str] = {}
        for name, capture in self._captures.items():
            for virtual, chunks in _virtual_layers(name, capture.buffer["captures"]).items():
                first = min(chunks, key=lambda c: c.seq)
                representation[virtual] = first.representation
                data[virtual] = _merge_chunks(chunks)
                layer_types[virtual] = first.layer_type
                indexing[virtual] = first.indexing
        self._check_missing(set(data))
        for layer, grads in ({} if self._params is None else self._params.buffers).items():
            for pname, grad in grads.items():
                if grad is not None:
                    key = f"{layer}.{pname}" if layer else pname
                    representation[key] = "materialized"
                    data[key] = self._synchronized_param_grad(grad)
                    layer_types[key] = PARAM_GRAD_TYPES
                    indexing[key] = "batch"
        if not data:
            if self._state.forward_layers:
                raise RuntimeError(
                    f"No hooked layer received a gradient in this backward although "
                    f"{sorted(self._state.forward_layers)} ran forward; the loss does not "
                    "depend on the hooked layers (detached or frozen path)."
                )
            raise RuntimeError(
                f"A backward through {type(self.model).__name__} inside collect() reached none "
                f"of the hooked layers ({self.layer_names + self.param_layer_names}), so no "
                "record could be assembled; hook the layers this loss depends on, or run this "
                "backward outside collect()."
            )
        gradient = Gradient(representation, data, layer_types, indexing)
        self._warn_broadcast(gradient)
        return GradientRecord(
            step=self._step,
            input_hash=self._identifiers(gradient),
            gradient=gradient,
            sample_id_key=self._sample_id_key,
        )

    def _check_missing(self, assembled: set[str]) -> None:
        got = {base_layer_name(name) for name in assembled}
        missing = frozenset(self._state.forward_layers - got)
        if got and missing and missing not in self._warned_missing:
            self._warned_missing.add(missing)
            warnings.warn(
                f"Layers {sorted(missing)} ran forward but received no gradient in this "
                "backward; they are left out of the record.",
                UserWarning,
                stacklevel=2,
            )

    def _warn_broadcast(self, gradient: Gradient) -> None:
        """Warn once per layer captured with batch 1 in a step of batch > 1.

        Every captured layer counts, factorized or dense (a materialized or
        optimizer-preconditioned capture of a broadcast input is a ``(1, d)``
        row too); ``param_grad`` layers hold batch-summed gradients by design.
        """
        batches = {
            name: _batch_of(value)
            for name, value in gradient.data.items()
            if gradient.layer_types[name] != PARAM_GRAD_TYPES
        }
        step_batch = max(batches.values(), default=1)
        for name, batch in batches.items():
            if batch == 1 and step_batch > 1 and name not in self._warned_broadcast:
                self._warned_broadcast.add(name)
                warnings.warn(
                    f"Layer {name!r} has batch size 1 while the step batch is {step_batch} "
                    "(an input shared by all samples, e.g. positional ids): its gradient is "
                    "summed over the batch, not per sample. Exclude it from the linear_io "
                    "selector to score only per-sample layers.",
                    UserWarning,
                    stacklevel=2,
                )

    def _identifiers(self, gradient: Gradient) -> list[str]:
        """The step's per-sample identifiers in batch order, one per occurrence.

        Content hashes (or ``sample_id_key`` values) repeated within the step
        get ``#k`` suffixes (`occurrence_ids`), so every row keeps its own id.
        """
        try:
            batch_size: int | None = gradient.batch_size
        except ValueError:
            batch_size = None
        if self._sample_id_key is not None:
            ids = self._state.sample_ids
            if ids is _MISSING:
                raise KeyError(
                    f"sample_id_key {self._sample_id_key!r} was not among the model inputs of "
                    "this step; pass it to the model call or drop sample_id_key."
                )
            values = _stringify_ids(ids)
            if batch_size is not None and len(values) != batch_size:
                raise ValueError(
                    f"sample_id_key {self._sample_id_key!r} holds {len(values)} values but the "
                    f"step batch size is {batch_size}; pass one identifier per sample."
                )
            return occurrence_ids(values)
        inputs = self._state.inputs or {}
        if self._sample_hash_fields is not None:
            for key in self._sample_hash_fields:
                if _field_key(key) not in inputs:
                    raise KeyError(
                        f"sample_hash_fields entry {key!r} was not among the model inputs of "
                        "this step."
                    )
        if not inputs:
            raise ValueError(
                "No model inputs were captured for this step, so samples cannot be identified: "
                f"call the model given to HookManager ({type(self.model).__name__}) inside "
                "collect(), or set sample_id_key."
            )
        lengths = [_leading_len(v) for v in inputs.values()]
        if batch_size is None or batch_size not in lengths:
            batch_size = next(
                (n for v, n in zip(inputs.values(), lengths) if isinstance(v, torch.Tensor) and n),
                batch_size,
            )
        return occurrence_ids(hash_batch(inputs, batch_size))


def _optimizer_snapshot(
    model: nn.Module, optimizer: OptimizerLike | None
) -> OptimizerSnapshot | None:
    """The optimizer-state reader of preconditioned capture (``None`` without optimizer).

    A given optimizer instance is checked now (``NotImplementedError`` for an
    unsupported type); a callable is resolved on first use.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer_type(optimizer)
    elif not callable(optimizer):
        raise TypeError(
            "HookManager optimizer must be a torch.optim.Optimizer or a zero-argument callable "
            f"returning one, got {type(optimizer).__name__}."
        )
    return OptimizerSnapshot(model, optimizer)


def _field_key(key: str | int) -> str:
    return f"_arg{key}" if isinstance(key, int) else key


def _copy_params(buffers: dict[str, dict]) -> dict[str, dict]:
    return {layer: dict(grads) for layer, grads in buffers.items()}


def _check_sample_id_key(key: object) -> str | int | None:
    if key is not None and (not isinstance(key, (str, int)) or isinstance(key, bool)):
        raise TypeError(
            f"sample_id_key must be a kwarg name (str), a positional index (int) or None, "
            f"got {key!r}."
        )
    return key


def _check_hash_fields(
    fields: Iterable[str | int] | str | int | None, sample_id_key: object
) -> tuple[str | int, ...] | None:
    if fields is None:
        return None
    result = (fields,) if isinstance(fields, (str, int)) else tuple(fields)
    if not result:
        raise ValueError("sample_hash_fields is empty; pass at least one field or None.")
    for key in result:
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"sample_hash_fields entries must be str or int, got {key!r}.")
    if sample_id_key is not None:
        raise ValueError(
            "sample_hash_fields and sample_id_key are exclusive: identifiers come either from "
            "a content hash or from the sample_id_key field."
        )
    return result

"""``HookManager``: per-sample gradient capture from unmodified training loops.

A capture step is one backward pass. The manager hooks the selected layers
(:mod:`.installation`), observes the backward start through
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
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dattri_llm.gradient.hooks.assembly import StepAssembler, StepState
from dattri_llm.gradient.hooks.config import HookManagerConfig, resolve_hook_assignments
from dattri_llm.gradient.hooks.identity import SampleIdentity
from dattri_llm.gradient.hooks.installation import (
    BackwardTargets,
    InstalledHooks,
    split_families,
)
from dattri_llm.gradient.hooks.preconditioning import Preconditioning
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.ops.projector import DattriProjector
from dattri_llm.gradient.state.optimizer_snapshot import OptimizerLike
from dattri_llm.utils.autograd import queue_backward_end_callback
from dattri_llm.utils.wrappers import unwrap_model

if TYPE_CHECKING:
    from dattri_llm.gradient.callbacks.base import HookManagerCallback

__all__ = ["HookManager"]


class HookManager:
    """Capture per-sample gradients from any loop that calls ``backward()``.

    Hooks go on ``model.module`` when present (DataParallel / DDP / FSDP
    wrapper), else on ``model``; model inputs are read from the model as given.
    Construction calls :meth:`register`, then ``cb.on_register(self)`` for every
    callback that has it. Use ``with manager.collect(): ...`` around the
    training code; each backward inside is one capture step whose
    :class:`GradientRecord` goes to every callback's ``on_step_end``.

    ``optimizer`` (an optimizer, or a zero-argument callable returning one,
    called on first use) enables preconditioned capture:
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
        self._identity = SampleIdentity(sample_id_key, sample_hash_fields)
        self._non_batch_first = frozenset(non_batch_first_layers or ())
        self.offload_to_cpu = bool(offload_to_cpu)
        self._lock = threading.RLock()
        self._collecting = False
        self._hooks = InstalledHooks()
        self._decisions: dict[str, bool] = {}
        self._state = StepState()
        self._step = 0
        self._last_gradient: Gradient | None = None
        self._assembler = StepAssembler(self._identity)
        self._projector: Any = None
        self._preconditioning = Preconditioning(model, optimizer)
        self.register()
        for callback in self.callbacks:
            self._attach_callback(callback)

    # ------------------------------------------------------------------ properties

    @property
    def layer_names(self) -> list[str]:
        """Hooked linear_io / invasive_linear_io layer names."""
        return list(self._hooks.captures)

    @property
    def layer_name(self) -> list[str]:
        """Alias of :attr:`layer_names`."""
        return self.layer_names

    @property
    def param_layer_names(self) -> list[str]:
        """Layers hooked with the ``param_grad`` family."""
        return self._hooks.param_layer_names

    @property
    def steps_collected(self) -> int:
        """The step counter: the step number the next completed step is stamped with."""
        return self._step

    @property
    def sample_id_key(self) -> str | int | None:
        """Input field read as per-sample identifier, ``None`` for content hashing."""
        return self._identity.sample_id_key

    @property
    def sample_hash_fields(self) -> tuple[str | int, ...] | None:
        """Fields the content hash is restricted to, ``None`` for the default fields."""
        return self._identity.sample_hash_fields

    @property
    def supports_preconditioning(self) -> bool:
        """Whether the manager was built with an optimizer (preconditioned capture)."""
        return self._preconditioning.snapshot is not None

    @property
    def precondition(self) -> bool:
        """Whether captures are mapped through the optimizer (default ``True`` with one).

        Settable per pass, e.g. ``False`` for a raw query pass sharing the hooks
        (captures are then exactly those of a manager without optimizer). Read
        at each layer's backward, so switch it between steps, not inside one.
        """
        return self._preconditioning.enabled

    @precondition.setter
    def precondition(self, value: bool) -> None:
        self._preconditioning.enabled = value

    @property
    def precondition_rule(self) -> str:
        """What the optimizer map computes: ``"update"`` (default) or ``"second_moment"``.

        ``"update"``: the update direction (``ops.precondition``);
        ``"second_moment"``: the gradient over the optimizer's second-moment
        denominator (``ops.second_moment_normalize``; Adam, AdamW, Adafactor).
        Setting it on a manager without optimizer raises ``ValueError``.
        """
        return self._preconditioning.rule

    @precondition_rule.setter
    def precondition_rule(self, value: str) -> None:
        self._preconditioning.rule = value

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
        self._preconditioning.set_loss_convention(loss_reduction, gradient_accumulation_steps)

    # ------------------------------------------------------------------ registration

    def register(self) -> None:
        """Attach the hooks (no-op if attached); ``ValueError`` if no layer can be hooked."""
        if self._hooks.handles:
            return
        root = unwrap_model(self.model)
        linear, invasive, param_layers = split_families(resolve_hook_assignments(root, self.config))
        if self._preconditioning.snapshot is not None:
            self._preconditioning.check_capturable(param_layers, self.config.projection_kwargs)
        if self._projector is None:
            self._projector = DattriProjector.coerce(self.config.projector)
        self._preconditioning.build(self._projector)
        self._hooks.install(
            self.model,
            root,
            linear,
            invasive,
            param_layers,
            self.config,
            non_batch_first=self._non_batch_first,
            offload_to_cpu=self.offload_to_cpu,
            projector=self._projector,
            preconditioner=self._preconditioning.preconditioner,
            callbacks=self.callbacks,
            gate=self._is_collecting,
            intervening=self._intervening,
            lock=self._lock,
            decisions=self._decisions,
            on_layer_forward=self._emit_forward,
            on_layer_backward=self._emit_backward,
            on_forward=self._note_forward,
            on_backward=self._note_layer_backward,
            on_orphan=self._note_orphan,
            root_pre_hook=self._root_pre_hook,
            root_forward_hook=self._root_forward_hook,
        )

    def remove(self) -> None:
        """Remove every hook, restore invasive forwards, clear buffers and the last gradient."""
        with self._lock:
            self._hooks.remove()
            self._reset_step()
            self._last_gradient = None
            if self._projector is not None:
                self._projector.close()

    def add_callback(self, callback: HookManagerCallback) -> None:
        """Append ``callback`` and call its ``on_register(self)`` if present."""
        self._hooks.check_invasive_callbacks([callback])
        self.callbacks.append(callback)
        self._attach_callback(callback)

    def _attach_callback(self, callback: HookManagerCallback) -> None:
        on_register = getattr(callback, "on_register", None)
        if callable(on_register):
            on_register(self)

    def _collect_backward_targets(self) -> AbstractContextManager[BackwardTargets | None]:
        """Record the outputs a weight-gradient-free backward needs (see ``InstalledHooks``)."""
        return self._hooks.backward_targets()

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
        if self._hooks.invasive and unwrap_model(self.model).training:
            warnings.warn(
                f"invasive_linear_io layers {sorted(self._hooks.invasive)} compute no weight/bias "
                "gradients while collecting: an optimizer step over them raises RuntimeError. "
                "Use it for attribution at a fixed checkpoint (model.eval()), not for training.",
                UserWarning,
                stacklevel=3,
            )
        step_guard = self._hooks.guard_invasive_optimizer_steps()
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
                **self._hooks.save_buffers(),
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
            self._hooks.load_buffers(state)
            self._decisions.clear()
            self._decisions.update(state["decisions"])
            self._step = state["step"]
            self._last_gradient = state["last_gradient"]

    def _reset_step(self) -> None:
        self._state = StepState()
        self._hooks.clear_buffers()
        self._decisions.clear()

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
            self._preconditioning.snapshot.bind(name)
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
        inputs, sample_ids = self._identity.capture_inputs(args, kwargs)
        with self._lock:
            self._last_gradient = None
            self._state.inputs = inputs
            self._state.sample_ids = sample_ids

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
                record = self._assembler.assemble(
                    self.model,
                    self._hooks.captures,
                    self._hooks.param_buffers,
                    self._state,
                    self._step,
                )
            finally:
                self._reset_step()
            self._step += 1
            self._last_gradient = record.gradient
        with torch.no_grad():
            for callback in list(self.callbacks):
                callback.on_step_end(record)

    def _is_orphan_pass(self) -> bool:
        """Whether this backward only re-ran consumed forwards (no layer capture was buffered)."""
        return bool(self._state.orphan_layers) and not self._hooks.any_captured()

    def _discard_orphan_pass(self) -> None:
        """Drop a repeated backward over a retained graph: no step, no record, no callbacks.

        Its ``param_grad`` sums are cleared; forwards still pending (a step in
        progress), captured inputs and the last gradient are kept.
        """
        self._hooks.clear_param_grads()
        self._state.orphan_layers.clear()
        self._state.end_queued = False

"""One ``linear_io`` layer's forward/backward hook pair and the processing of its captures.

A forward hook stores the layer input ``input[0]`` and registers a tensor hook
on the layer output, which stores ``grad_output[0]`` when the backward reaches
it. Each backward is thereby paired with exactly the forward that produced it
(the LIFO-per-device pairing of the contract, made exact); forwards whose
output never receives a gradient stay pending and are discarded by the owner
(gradient checkpointing recomputes, detached branches). A further gradient for
a forward already consumed (a repeated backward over a retained graph) is
discarded with a ``UserWarning`` and reported to the owner.

The :data:`LayerBuffer` of one layer is a plain dict: ``"layer_type"``
(declared or detected type), ``"module_kwargs"``, ``"pending"`` (forward
entries awaiting their backward) and ``"captures"`` (list of :class:`Capture`,
in backward order).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.hooks.invasive import InputGradOnlyLinear
from dattri_llm.gradient.hooks.layers import always
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.dot import effective_dims
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.projection import (
    mask_factorized,
    project_activation,
    project_gradient,
    project_layer,
    should_materialize,
)
from dattri_llm.gradient.ops.types import is_conv, is_conv_transpose, is_embedding, is_linear

__all__ = [
    "Capture",
    "LayerBuffer",
    "LayerCapture",
    "auto_materialize",
    "current_forward_token",
]

LayerBuffer = dict


def _refuse_inexact_embedding_bag(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise for EmbeddingBag calls whose gradient the captured ``(ids, g)`` cannot give exactly."""
    if not isinstance(module, nn.EmbeddingBag):
        return
    offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    weights = args[2] if len(args) > 2 else kwargs.get("per_sample_weights")
    if offsets is not None or weights is not None:
        raise NotImplementedError(
            f"Layer {name!r} (nn.EmbeddingBag) was called with "
            f"{'offsets' if offsets is not None else 'per_sample_weights'}: its per-sample "
            "gradient cannot be formed exactly from the captured input ids. Pad the bags to a "
            "2-D (B, T) input with padding_idx and no per_sample_weights, or exclude the layer "
            "(hook it as 'param_grad' or leave it out of the selectors)."
        )


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


@dataclass
class Capture:
    """One matched forward/backward pair of a layer, already in its buffered form.

    ``data`` is a ``Factorized`` (``representation == "factorized"``) or a dense
    ``(B, d)`` tensor; ``seq`` orders forwards; ``device`` is the capture device
    the pair ran on (DataParallel replicas differ).
    """

    seq: int
    device: torch.device
    data: Any
    representation: str
    layer_type: str
    indexing: str


class _Pending:
    """A grad-enabled forward of a layer waiting for its backward (identity-compared).

    It is also the token per-layer callbacks pair events with
    (:func:`current_forward_token`): held by the hook on the layer output, it
    is released with that output when no backward comes. ``alias`` and
    ``version`` are set when the kept activation shares the input's storage
    (see :func:`_autograd_guards_input`).
    """

    __slots__ = ("__weakref__", "activation", "alias", "collecting", "device", "seq", "version")

    def __init__(
        self,
        seq: int,
        activation: torch.Tensor | None,
        device: torch.device,
        collecting: bool,
        alias: torch.Tensor | None = None,
    ) -> None:
        self.seq = seq
        self.activation = activation
        self.device = device
        self.collecting = collecting
        self.alias = alias
        self.version = None if alias is None else alias._version


_SEQ = itertools.count()
_DISPATCH = threading.local()


def current_forward_token() -> object | None:
    """The layer forward the per-layer callback event being dispatched belongs to.

    Inside ``on_layer_forward`` / ``on_layer_backward`` called by the hooks: an
    object identifying that layer forward; the backward of a forward gets the
    same object, so a callback can pair them exactly (a forward whose output
    is never backpropagated gets no backward). Hold it weakly: it is released
    with the layer output. ``None`` outside such a dispatch (a direct call).
    """
    return getattr(_DISPATCH, "token", None)


@contextlib.contextmanager
def _dispatching(entry: _Pending) -> Iterator[None]:
    """Expose ``entry`` as :func:`current_forward_token` while the callbacks run."""
    previous = getattr(_DISPATCH, "token", None)
    _DISPATCH.token = entry
    try:
        yield
    finally:
        _DISPATCH.token = previous


def _shares_storage(a: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``a`` views ``x``'s memory (assumed when there is no storage, e.g. functorch)."""
    try:
        return a.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return True


def _autograd_guards_input(
    module: nn.Module, x: torch.Tensor, out: torch.Tensor, layer_type: str
) -> bool:
    """Whether autograd keeps ``x`` itself for this layer's backward (so it cannot change).

    The capture keeps the layer input ``x`` until the step's record is used,
    possibly after the step. Aliasing ``x`` is exact only if nobody can edit
    it in place in between: when the layer's backward saved ``x``, an in-place
    edit bumps its version counter and the backward raises, and after the
    backward a graph tensor is unreachable to the caller. That is the common
    training path, which therefore keeps a view (no copy). Everywhere else the
    capture keeps a private copy:

    * ``x`` has no ``grad_fn``: model inputs, buffers and frozen-path
      activations — the caller may rewrite them at any time (in-place ops in
      the model, a reused input buffer after the step);
    * the layer's weight needs no gradient (frozen layer): its backward saves
      only the weight, not the input;
    * the invasive input-gradient-only linear, which saves only the weight;
    * under autocast, the op computes on a cast copy unless ``x`` already has
      the autocast dtype and the layer is linear/conv (norms run in float32).

    The aliased case is still checked at the backward with ``x._version``.
    """
    weight = getattr(module, "weight", None)
    if x.grad_fn is None or not isinstance(weight, torch.Tensor) or not weight.requires_grad:
        return False
    if isinstance(out.grad_fn, InputGradOnlyLinear._backward_cls):
        return False
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return x.dtype == torch.get_autocast_dtype(device_type) and (
            is_linear(layer_type) or is_conv(layer_type) or is_conv_transpose(layer_type)
        )
    return True


def _is_integer(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex())


class LayerCapture:
    """Forward/backward hook pair of one linear_io layer and the processing of its captures.

    ``gate()`` says whether captures are buffered now (per-layer callbacks
    fire regardless); ``on_forward(name)`` / ``on_backward(name)`` notify the
    owner of buffered events; ``on_orphan(name)`` of a discarded backward fire
    whose forward is no longer pending (a repeated backward over a retained
    graph: a ``UserWarning``, no buffering, no ``on_layer_backward``);
    ``decisions`` (shared, reset by the owner per step) fixes each layer's
    representation by its first capture. ``preconditioner`` (preconditioned
    capture), called as ``preconditioner(name, entries, projection)`` on the
    dense per-sample gradient of the captured coordinates, maps each capture
    while its ``enabled`` attribute (default ``True``) is true.
    """

    def __init__(
        self,
        name: str,
        layer_type: str,
        module_kwargs: dict,
        *,
        projection: dict | None,
        capture_style: str,
        projector: Any,
        offload_to_cpu: bool,
        batch_first: bool = True,
        on_layer_forward: Callable[..., None] | None = None,
        on_layer_backward: Callable[..., None] | None = None,
        gate: Callable[[], bool] = always,
        on_forward: Callable[[str], None] | None = None,
        on_backward: Callable[[str], None] | None = None,
        on_orphan: Callable[[str], None] | None = None,
        lock: threading.RLock | None = None,
        decisions: dict[str, bool] | None = None,
        preconditioner: Callable[[str, torch.Tensor, dict | None], torch.Tensor] | None = None,
    ) -> None:
        self.name = name
        self.layer_type = layer_type
        self.module_kwargs = module_kwargs
        self.projection = projection
        self.capture_style = capture_style
        self.projector = projector
        self.offload_to_cpu = offload_to_cpu
        self.batch_first = batch_first
        self.on_layer_forward = on_layer_forward
        self.on_layer_backward = on_layer_backward
        self.gate = gate
        self.on_forward = on_forward
        self.on_backward = on_backward
        self.on_orphan = on_orphan
        self.lock = lock or threading.RLock()
        self.decisions = {} if decisions is None else decisions
        self.preconditioner = preconditioner
        # set by InstalledHooks.backward_targets: backpropagated outputs go here
        self.target_sink: Any = None
        self.logra_at_forward = (
            projection is not None
            and projection.get("style", "logra") == "logra"
            and is_linear(layer_type)
        )
        self.buffer: LayerBuffer = {
            "layer_type": layer_type,
            "module_kwargs": module_kwargs,
            "pending": [],
            "captures": [],
        }

    # ---- emitted view (what per-layer callbacks see)

    @property
    def emitted_type(self) -> str:
        """Layer type given to per-layer callbacks (``"nn.Linear"`` for logra-projected linears)."""
        return "nn.Linear" if self.logra_at_forward else self.layer_type

    @property
    def emitted_kwargs(self) -> dict | None:
        """Module kwargs given to per-layer callbacks (``None`` for logra-projected linears)."""
        return None if self.logra_at_forward else self.module_kwargs

    def _proj_args(self) -> tuple[str, dict]:
        proj = dict(self.projection or {})
        style = proj.pop("style", "logra")
        return style, proj

    def _offload(self, x: torch.Tensor) -> torch.Tensor:
        return x.to("cpu") if self.offload_to_cpu else x

    # ---- hooks

    def forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """Store ``input[0]`` and hook the output so its gradient pairs with this forward."""
        if not torch.is_grad_enabled():
            return
        collecting = self.gate()
        if not collecting and self.on_layer_forward is None:
            return
        x = args[0] if args else next(iter(kwargs.values()), None)
        _refuse_inexact_embedding_bag(self.name, module, args, kwargs)
        out = _first_tensor(output)
        if not isinstance(x, torch.Tensor):
            return
        backpropagated = out is not None and out.requires_grad
        a = x.detach()
        if self.logra_at_forward:
            a = self._project_activation(a)
        a = self._offload(a)
        alias = None
        if backpropagated and _shares_storage(a, x):
            if _autograd_guards_input(module, x, out, self.layer_type):
                alias = a
            else:
                a = a.clone()
        entry = _Pending(
            next(_SEQ), a if collecting and backpropagated else None, x.device, collecting, alias
        )
        if self.on_layer_forward is not None:
            with _dispatching(entry):
                self.on_layer_forward(self.name, a, self.emitted_type, self.emitted_kwargs)
        if not backpropagated:
            return
        if collecting:
            with self.lock:
                self.buffer["pending"].append(entry)
            if self.on_forward is not None:
                self.on_forward(self.name)
        out.register_hook(lambda grad: self._grad_hook(entry, grad))
        if self.target_sink is not None:
            self.target_sink.add(out)

    def _grad_hook(self, entry: _Pending, grad: torch.Tensor) -> None:
        buffered = entry.collecting and self.gate()
        if buffered and not self._claim(entry):
            self._discard_orphan()
            return
        self._check_input_unchanged(entry)
        g = grad.detach()
        if self.logra_at_forward:
            g = self._project_gradient(g)
        g = self._offload(g)
        if self.on_layer_backward is not None:
            with _dispatching(entry):
                self.on_layer_backward(self.name, g, self.emitted_type, self.emitted_kwargs)
        if not buffered:
            return
        with self.lock:
            self.buffer["captures"].append(self._capture(entry, g))
        if self.on_backward is not None:
            self.on_backward(self.name)

    def _claim(self, entry: _Pending) -> bool:
        """Take ``entry`` off the pending forwards; ``False`` if it is not (or no longer) there."""
        with self.lock:
            pending = self.buffer["pending"]
            index = next((i for i, e in enumerate(pending) if e is entry), None)
            if index is None:
                return False
            pending.pop(index)
            return True

    def _discard_orphan(self) -> None:
        """Warn about a backward fire without an unconsumed forward and tell the owner.

        Its ``grad_output`` is neither buffered nor given to ``on_layer_backward``.
        """
        warnings.warn(
            f"Discarding a backward fire on layer {self.name!r}: there is no matching forward "
            "capture (its forward was already consumed by an earlier backward, or the capture "
            "state was cleared since). A typical cause is a repeated backward over a retained "
            "graph (loss.backward(retain_graph=True) followed by another backward inside "
            "collect()). This is not a normal forward+backward step: nothing is recorded for it.",
            UserWarning,
            stacklevel=2,
        )
        if self.on_orphan is not None:
            self.on_orphan(self.name)

    def _check_input_unchanged(self, entry: _Pending) -> None:
        """``RuntimeError`` if an aliased input was edited in place since the forward."""
        if entry.alias is not None and entry.alias._version != entry.version:
            raise RuntimeError(
                f"Layer {self.name!r}: its input was modified in place after the layer's forward "
                "and before its backward, so the captured activation no longer equals the "
                "forward input. Use an out-of-place op (x = x * s instead of x.mul_(s)) on "
                "tensors a hooked layer has consumed."
            )

    # ---- processing

    def _project_activation(self, a: torch.Tensor) -> torch.Tensor:
        _, proj = self._proj_args()
        include_bias = proj.pop("include_bias", True)
        return project_activation(
            a, self.layer_type, self.projector, self.module_kwargs, include_bias, **proj
        )

    def _project_gradient(self, g: torch.Tensor) -> torch.Tensor:
        _, proj = self._proj_args()
        proj.pop("include_bias", None)
        return project_gradient(g, self.layer_type, self.projector, self.module_kwargs, **proj)

    def _decide(self, auto: Callable[[], bool]) -> bool:
        """Whether to materialize; ``"auto"`` is decided once per layer and step."""
        if self.capture_style != "auto":
            return self.capture_style == "materialized"
        if self.name not in self.decisions:
            self.decisions[self.name] = auto()
        return self.decisions[self.name]

    def _capture(self, entry: _Pending, g: torch.Tensor) -> Capture:
        a = entry.activation
        if a.ndim == 1 and _is_integer(a):  # unbatched (positional) ids: batch of 1
            batch_axis = 0 if self.batch_first else 1
            a, g = a.unsqueeze(batch_axis), g.unsqueeze(batch_axis)
        if self.logra_at_forward:
            return self._final_factors(entry, Factorized(a, g, None, self.batch_first))
        raw = Factorized(a, g, self.module_kwargs, self.batch_first)
        if self.preconditioning:
            return self._dense(entry, self._preconditioned(raw))
        if self.projection is not None:
            return self._projected(entry, raw)
        if self._decide(lambda: auto_materialize(raw, self.layer_type)):
            return self._dense(entry, materialize(raw, self.layer_type))
        indexing = "batch_token" if a.ndim >= 3 or _is_integer(a) else "batch"
        return Capture(entry.seq, entry.device, raw, "factorized", self.layer_type, indexing)

    @property
    def preconditioning(self) -> bool:
        """Whether captures go through the preconditioner now (one is set and enabled)."""
        return self.preconditioner is not None and bool(
            getattr(self.preconditioner, "enabled", True)
        )

    def _preconditioned(self, raw: Factorized) -> torch.Tensor:
        """The preconditioner's map of the per-sample gradient on the captured coordinates.

        The preconditioner receives ``(B, k)`` dense rows in materialize layout:
        the whole layer (``k = d``) when unprojected or before a ``"dense"``
        projection (which it applies after the map), the ``k = proj_dim`` mask
        coordinates gathered from the factors under ``"mask"``.
        """
        style, proj = self._proj_args()
        if self.projection is not None and style == "mask":
            entries = mask_factorized(raw, self.layer_type, self.projector, **proj)
        else:
            include_bias = bool(proj.get("include_bias", True))
            entries = materialize(raw, self.layer_type, include_bias=include_bias)
        return self.preconditioner(self.name, entries, self.projection)

    def _final_factors(self, entry: _Pending, final: Any) -> Capture:
        """Projected (``module_kwargs=None``) factors, kept or materialized per capture style."""
        a = final.as_batch_first().activation
        seq_len = a.shape[1] if a.ndim == 3 else 1
        k_a, k_g = a.shape[-1], final.pre_activation_grad.shape[-1]
        if self._decide(lambda: should_materialize("auto", seq_len, k_a, k_g)):
            return self._dense(entry, materialize(final, "nn.Linear"))
        indexing = "batch_token" if seq_len > 1 else "batch"
        return Capture(entry.seq, entry.device, final, "factorized", "nn.Linear", indexing)

    def _projected(self, entry: _Pending, raw: Any) -> Capture:
        style, proj = self._proj_args()
        capture_style = self.capture_style
        if capture_style == "auto" and self.name in self.decisions:
            capture_style = "materialized" if self.decisions[self.name] else "factorized"
        payload, is_factorized = project_layer(
            raw, self.layer_type, self.projector, style=style, capture_style=capture_style, **proj
        )
        self.decisions.setdefault(self.name, not is_factorized)
        if not is_factorized:
            return self._dense(entry, payload)
        a_p, g_p = payload
        final = Factorized(a_p, g_p, None, True)
        indexing = "batch_token" if a_p.ndim == 3 and a_p.shape[1] > 1 else "batch"
        return Capture(entry.seq, entry.device, final, "factorized", "nn.Linear", indexing)

    def _dense(self, entry: _Pending, dense: torch.Tensor) -> Capture:
        return Capture(entry.seq, entry.device, dense, "materialized", self.layer_type, "batch")


def auto_materialize(f: Any, layer_type: str) -> bool:
    """``"auto"`` capture rule for unprojected factors (embeddings always stay factorized).

    Reads only shapes (:func:`effective_dims`), so meta factors work (the run plan).
    """
    if is_embedding(layer_type):
        return False
    _, seq_len, k_in, k_out = effective_dims(f.as_batch_first(), layer_type)
    return should_materialize("auto", seq_len, k_in + 1, k_out)

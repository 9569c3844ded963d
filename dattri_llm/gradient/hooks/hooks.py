"""Low-level hook registration: per-sample factor capture, parameter gradients, invasive forwards.

``linear_io`` capture: a forward hook stores the layer input ``input[0]`` and
registers a tensor hook on the layer output, which stores ``grad_output[0]``
when the backward reaches it. Each backward is thereby paired with exactly the
forward that produced it (the LIFO-per-device pairing of the contract, made
exact); forwards whose output never receives a gradient stay pending and are
discarded by the owner (gradient checkpointing recomputes, detached branches).
A further gradient for a forward already consumed (a repeated backward over a
retained graph) is discarded with a ``UserWarning`` and reported to the owner.

Buffers (plain dicts, see :data:`LayerBuffer` / :data:`ParamGradBuffer`):

* ``LayerBuffer`` of one layer: ``"layer_type"`` (declared or detected type),
  ``"module_kwargs"``, ``"pending"`` (forward entries awaiting their backward)
  and ``"captures"`` (list of :class:`Capture`, in backward order).
* ``ParamGradBuffer`` of one layer: ``{param_name: batch-level grad or None}``.

Hugging Face ``Conv1D`` is recognised lazily from ``sys.modules`` (a model
that contains one has already imported it), so importing this module never
imports ``transformers``; ``HF_Conv1D`` is resolved by the module
``__getattr__``.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dattri_llm.gradient.gradient import Factorized
from dattri_llm.gradient.ops.dot import effective_dims
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.gradient.ops.projection import (
    CAPTURE_STYLES,
    DattriProjector,
    mask_factorized,
    project_activation,
    project_gradient,
    project_layer,
    should_materialize,
)
from dattri_llm.gradient.ops.types import (
    ALL_LAYER_TYPES,
    canonical_class_name,
    is_conv,
    is_conv_transpose,
    is_embedding,
    is_linear,
    is_norm,
)
from dattri_llm.options import CaptureStyle

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

LayerBuffer = dict
ParamGradBuffer = dict

_HF_CONV1D_MODULE = "transformers.pytorch_utils"


def _hf_conv1d() -> type | None:
    """HF ``Conv1D`` if ``transformers`` is already imported, else ``None`` (never imports it)."""
    module = sys.modules.get(_HF_CONV1D_MODULE)
    if module is None and "transformers" in sys.modules:
        try:
            module = importlib.import_module(_HF_CONV1D_MODULE)
        except ImportError:
            return None
    return getattr(module, "Conv1D", None)


def __getattr__(name: str) -> Any:
    if name == "HF_Conv1D":
        return _hf_conv1d()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- capability


def _torch_capable_classes() -> tuple[type, ...]:
    classes: list[type] = [
        nn.Embedding,
        nn.EmbeddingBag,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.Linear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
    ]
    if hasattr(nn, "RMSNorm"):
        classes.append(nn.RMSNorm)
    return tuple(classes)


_TORCH_CAPABLE = _torch_capable_classes()


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


def _is_linear_io_capable(module: nn.Module) -> bool:
    """Whether ``module``'s type is one whose gradient factorizes for ``linear_io`` capture.

    Decided by ``isinstance`` against the capable classes (``capture.md`` §1, less
    ``nn.Bilinear``, whose gradient needs both inputs), never by name. The one
    test every hook-assignment path uses.
    """
    if isinstance(module, _TORCH_CAPABLE):
        return True
    conv1d = _hf_conv1d()
    return conv1d is not None and isinstance(module, conv1d)


def is_invasive_capable(module: nn.Module) -> bool:
    """Whether ``module`` can take the invasive forward (exactly ``nn.Linear`` instances)."""
    return isinstance(module, nn.Linear)


def owns_trainable_params(module: nn.Module) -> bool:
    """Whether ``module`` directly (``recurse=False``) owns a parameter with ``requires_grad``."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


def unwrap_model(model: nn.Module) -> nn.Module:
    """``model.module`` for DataParallel / DDP / FSDP wrappers, else ``model``."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def detect_layer_type(module: nn.Module) -> str:
    """Canonical type of ``module``: its own class name, or the nearest supported base class."""
    own = canonical_class_name(module)
    if own in ALL_LAYER_TYPES:
        return own
    for cls in type(module).__mro__[1:]:
        name = (
            f"nn.{cls.__name__}"
            if cls.__module__.startswith("torch.nn")
            else (f"{cls.__module__}.{cls.__name__}")
        )
        if name in ALL_LAYER_TYPES:
            return name
    return own


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


# --------------------------------------------------------------------------- linear_io


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
    if isinstance(out.grad_fn, _InputGradOnlyLinear._backward_cls):
        return False
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return x.dtype == torch.get_autocast_dtype(device_type) and (
            is_linear(layer_type) or is_conv(layer_type) or is_conv_transpose(layer_type)
        )
    return True


def _always() -> bool:
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
        gate: Callable[[], bool] = _always,
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
        # set by HookManager._collect_backward_targets: backpropagated outputs go here
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
        if self._decide(lambda: _auto_materialize(raw, self.layer_type)):
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


def _auto_materialize(f: Any, layer_type: str) -> bool:
    """``"auto"`` capture rule for unprojected factors (embeddings always stay factorized)."""
    if is_embedding(layer_type):
        return False
    _, seq_len, k_in, k_out = effective_dims(f.as_batch_first(), layer_type)
    return should_materialize("auto", seq_len, k_in + 1, k_out)


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
        names = [n for n, m in modules.items() if _is_linear_io_capable(m) or n in type_overrides]
    else:
        names = list(layer_names)
    selected: dict[str, nn.Module] = {}
    for name in names:
        if name not in modules:
            raise ValueError(f"Layer {name!r} is not a module of the model (named_modules()).")
        module = modules[name]
        if not _is_linear_io_capable(module) and name not in type_overrides:
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


# --------------------------------------------------------------------------- param_grad


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
        gate: Callable[[], bool] = _always,
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
        [n for n, m in modules.items() if _is_linear_io_capable(m)]
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


def remove_hooks(handles: list) -> None:
    """Remove every handle (hook handles or zero-argument revert callables) and clear the list."""
    for handle in handles:
        if callable(handle) and not hasattr(handle, "remove"):
            handle()
        else:
            handle.remove()
    handles.clear()


# --------------------------------------------------------------------------- invasive


class _InputGradOnlyLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns only the input gradient (no weight/bias grads)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.input_dtype = x.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
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
            return _InputGradOnlyLinear.apply(x, module.weight, module.bias)
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

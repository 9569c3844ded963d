"""What each hooked layer captures per record, read off the model without running it.

The hooked layers are the ones :func:`resolve_hook_assignments` gives for the
hook config (no forward pass: ``default_hook_assignment`` needs one, so the
plan uses the selector resolution, default ``linear_io=REGISTER_ALL`` as the
gradient streamer does). Their input and output shapes come from one forward
on the ``meta`` device (``torch.func.functional_call`` with meta copies of the
parameters and buffers: nothing is allocated or computed), which also shows
which layers run at all and which see a batch-shared input (GPT-2's position
embedding). The capture route is the library's own rule
(:func:`~dattri_llm.gradient.hooks.layer_capture.auto_materialize` and
:func:`~dattri_llm.gradient.ops.projection.should_materialize`) applied to meta
factors, and dense widths are :func:`~dattri_llm.gradient.ops.materialize.materialize`
of those meta factors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from dattri_llm.gradient.hooks.config import (
    LINEAR_IO,
    REGISTER_ALL,
    HookManagerConfig,
    resolve_hook_assignments,
)
from dattri_llm.gradient.hooks.layer_capture import auto_materialize
from dattri_llm.gradient.hooks.layers import owns_trainable_params
from dattri_llm.gradient.hooks.linear_io import layer_projection
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.dot import effective_dims
from dattri_llm.gradient.ops.materialize import materialize, materialized_width_estimate
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.gradient.ops.projection import should_materialize
from dattri_llm.gradient.ops.types import detect_layer_type, is_conv, is_embedding, is_linear
from dattri_llm.utils.wrappers import unwrap_model

__all__ = [
    "TRACE_BATCH",
    "LayerPlan",
    "activation_bytes",
    "default_plan_config",
    "plan_layers",
]

TRACE_BATCH = 2  # batch of the meta forward: a layer that sees batch 1 shares its input


@dataclass(frozen=True)
class LayerPlan:
    """One hooked layer's capture, as the plan predicts it.

    Attributes:
        name: ``named_modules()`` path.
        layer_type: the canonical type string (``"nn.Linear"``, ...).
        family: the hook family (``"linear_io"``).
        shape: ``(d_in, d_out)`` as the routing rule reads them
            (:func:`effective_dims`; embeddings ``(num_embeddings, E)``).
        has_bias: whether the layer has a bias.
        route: ``"factorized"`` or ``"materialized"`` (what the capture buffers).
        projection: the layer's projection settings, ``None`` when unprojected.
        stored_shape: per record: factorized ``((T, k_a), (T, k_g))`` (one
            ``()``-free axis for 2-D inputs), materialized ``((width,),)``.
        bytes_per_record: payload bytes one sample adds to a block.
        shared_bytes: bytes a block holds whatever its batch (an input shared by
            the batch, e.g. position ids: captured with batch 1), else 0.
        curvature_dims: ``(d_in [+1 bias], d_out)`` of the K-FAC factors for a
            factorized linear/conv capture, else ``None`` (the layer is not
            Kronecker-preconditioned).
    """

    name: str
    layer_type: str
    family: str
    shape: tuple[int, int]
    has_bias: bool
    route: str
    projection: dict | None
    stored_shape: tuple[tuple[int, ...], ...]
    bytes_per_record: int
    shared_bytes: int
    curvature_dims: tuple[int, int] | None

    def block_bytes(self, batch: int) -> int:
        """Payload bytes of this layer in a block of ``batch`` records."""
        return batch * self.bytes_per_record + self.shared_bytes


def default_plan_config() -> HookManagerConfig:
    """The gradient streamer's default: ``HookManagerConfig(linear_io=REGISTER_ALL)``."""
    return HookManagerConfig(linear_io=REGISTER_ALL)


def _meta_state(root: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta copies of every parameter and buffer (floating ones in ``dtype``)."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in [*root.named_parameters(), *root.named_buffers()]:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        state[name] = torch.empty(tensor.shape, dtype=kind, device="meta")
    return state


@contextmanager
def _no_pad_token(root: nn.Module) -> Iterator[None]:
    """``config.pad_token_id`` set to ``None`` for the meta forward, then restored.

    Given ``input_ids`` alone, ``transformers`` looks for the pad token among
    them (to warn about a missing attention mask), which a meta tensor cannot
    answer; passing an all-ones mask instead fails the same way in the mask
    construction. The pad token plays no other part in a causal LM's forward.
    """
    config = getattr(root, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        yield
        return
    config.pad_token_id = None
    try:
        yield
    finally:
        config.pad_token_id = pad


def _trace(
    root: nn.Module, names: list[str], seq_len: int, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (meta input, meta output)}`` of one meta forward of ``input_ids (2, T)``.

    Layers that do not run are absent. ``ValueError`` when the model does not
    run on ``input_ids`` alone (not a causal LM).
    """
    modules = dict(root.named_modules())
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str):  # noqa: ANN202 - a forward hook
        def record(_module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
                seen.setdefault(name, (x, out))

        return record

    handles = [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in names]
    ids = torch.zeros(TRACE_BATCH, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), _no_pad_token(root):
            torch.func.functional_call(
                root, _meta_state(root, dtype), (), {"input_ids": ids}, strict=False
            )
    except Exception as err:  # noqa: BLE001 - any failure of a foreign forward
        raise ValueError(
            f"plan_run: the meta forward of {type(root).__name__} on input_ids of shape "
            f"{(TRACE_BATCH, seq_len)} failed ({type(err).__name__}: {err}); the plan needs a "
            "model that runs on input_ids alone (a causal language model)."
        ) from err
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _per_record(meta: torch.Tensor, batch: int) -> tuple[int, int, tuple[int, ...]]:
    """``(bytes per record, shared bytes, per-record shape)`` of a batch-first meta tensor."""
    if meta.ndim and meta.shape[0] == batch:
        per = math.prod(meta.shape[1:]) * meta.element_size()
        return per, 0, tuple(meta.shape[1:])
    return 0, meta.numel() * meta.element_size(), tuple(meta.shape[1:])


def _sized(*tensors: torch.Tensor) -> tuple[int, int, tuple[tuple[int, ...], ...]]:
    per = shared = 0
    shapes = []
    for tensor in tensors:
        p, s, shape = _per_record(tensor, TRACE_BATCH)
        per, shared = per + p, shared + s
        shapes.append(shape)
    return per, shared, tuple(shapes)


def _dense(batch: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(batch, width, dtype=dtype, device="meta")


def _projected_payload(
    raw: Factorized, layer_type: str, proj: dict, capture_style: str, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], str]:
    """Meta payload of a projected capture (``proj_dim`` on both logra sides)."""
    style = proj.get("style", "logra")
    k = int(proj["proj_dim"])
    batch = raw.activation.shape[0]
    if style in ("dense", "mask"):
        return (_dense(batch, k, dtype),), "materialized"
    b, seq, _k_in, _k_out = effective_dims(raw, layer_type)
    two_d = is_linear(layer_type) and raw.activation.ndim == 2
    shape = (b, k) if two_d else (b, seq, k)
    if should_materialize(capture_style, seq if not two_d else 1, k, k):
        return (_dense(batch, k * k, dtype),), "materialized"
    side = torch.empty(shape, dtype=dtype, device="meta")
    return (side, side), "factorized"


def _materialized(raw: Factorized, layer_type: str, dtype: torch.dtype) -> torch.Tensor:
    """Meta ``(B, width)`` of the dense capture (embeddings: ``num_embeddings·E``)."""
    if is_embedding(layer_type):
        width = materialized_width_estimate(raw, layer_type)
        return _dense(raw.activation.shape[0], width, dtype)
    return materialize(raw, layer_type)


def _layer(
    name: str,
    module: nn.Module,
    config: HookManagerConfig,
    traced: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
) -> LayerPlan:
    layer_type = config.layer_types.get(name) or detect_layer_type(module)
    kwargs = dict(config.module_kwargs.get(name) or extract_module_kwargs(module, layer_type))
    x, out = traced
    raw = Factorized(x, out, kwargs, True)
    _b, _s, d_in, d_out = effective_dims(raw, layer_type)
    has_bias = bool(kwargs.get("has_bias"))
    proj = layer_projection(config.projection_kwargs, name)
    style = config.capture_style
    if proj is not None:
        payload, route = _projected_payload(raw, layer_type, proj, style, dtype)
    elif style == "materialized" or (style == "auto" and auto_materialize(raw, layer_type)):
        payload, route = (_materialized(raw, layer_type, dtype),), "materialized"
    else:
        payload, route = (x, out), "factorized"
    per, shared, shapes = _sized(*payload)
    curvature = None
    if (is_linear(layer_type) or is_conv(layer_type)) and proj is None:
        curvature = (d_in + int(has_bias), d_out)
    elif proj is not None and route == "factorized":
        curvature = (int(proj["proj_dim"]), int(proj["proj_dim"]))
    return LayerPlan(
        name=name,
        layer_type=layer_type,
        family=LINEAR_IO,
        shape=(int(d_in), int(d_out)),
        has_bias=has_bias,
        route=route,
        projection=proj,
        stored_shape=shapes,
        bytes_per_record=per,
        shared_bytes=shared,
        curvature_dims=curvature,
    )


def plan_layers(
    model: nn.Module,
    config: HookManagerConfig | None,
    *,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[LayerPlan], list[str]]:
    """Per-layer capture plans of ``model`` under ``config`` and the notes the plan makes.

    Args:
        model: the model (any device, meta included); nothing of it is run
            outside the meta device.
        config: the hook config (``None``: :func:`default_plan_config`).
        seq_len: tokens per record ``T``.
        dtype: the floating dtype of parameters and activations.

    Returns:
        ``(layers, notes)``: one :class:`LayerPlan` per hooked ``linear_io``
        layer that runs, in ``named_modules()`` order; notes name the layers
        left out (``param_grad`` layers, frozen layers, layers that do not run).
    """
    config = default_plan_config() if config is None else config
    root = unwrap_model(model)
    modules = dict(root.named_modules())
    assignments = resolve_hook_assignments(root, config)
    notes: list[str] = []
    others = sorted(n for n, family in assignments.items() if family != LINEAR_IO)
    if others:
        notes.append(f"not planned (hooked as param_grad / invasive_linear_io): {others}")
    names = [n for n, family in assignments.items() if family == LINEAR_IO]
    if not config.include_frozen:
        frozen = [n for n in names if not owns_trainable_params(modules[n])]
        if frozen:
            notes.append(f"frozen layers, not hooked: {frozen}")
        names = [n for n in names if n not in frozen]
    traced = _trace(root, names, seq_len, dtype)
    idle = [n for n in names if n not in traced]
    if idle:
        notes.append(f"hooked layers that do not run on input_ids, left out: {idle}")
    layers = [_layer(n, modules[n], config, traced[n], dtype) for n in names if n in traced]
    shared = [layer.name for layer in layers if layer.shared_bytes]
    if shared:
        notes.append(
            f"layers with a batch-shared input (one copy per block, not per record): {shared}"
        )
    return layers, notes


def _root_tensor(tensor: torch.Tensor) -> torch.Tensor:
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


def activation_bytes(
    model: nn.Module, *, batch: int, seq_len: int, dtype: torch.dtype = torch.float32
) -> tuple[int, int]:
    """``(saved, largest)``: bytes autograd saves for one batch's backward, and the largest one.

    One meta forward of ``input_ids`` and ``labels`` of shape ``(batch, seq_len)``
    (``input_ids`` alone when the model takes no ``labels``) with meta
    parameters that require gradients, under
    ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for the
    backward is counted once (views by their base), parameters (and views of
    them) excluded. Nothing is allocated. ``(0, 0)`` when the forward fails.
    """
    root = unwrap_model(model)
    state = _meta_state(root, dtype)
    params = {name for name, _ in root.named_parameters()}
    for name in params:
        if state[name].is_floating_point():
            state[name].requires_grad_(True)
    param_ids = {id(state[name]) for name in params}
    saved: dict[int, tuple[torch.Tensor, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = _root_tensor(tensor)
        if id(base) not in param_ids and id(base) not in saved:
            saved[id(base)] = (base, base.numel() * base.element_size())
        return tensor

    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    for kwargs in ({"input_ids": ids, "labels": ids}, {"input_ids": ids}):
        saved.clear()
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
                _no_pad_token(root),
            ):
                torch.func.functional_call(root, state, (), kwargs, strict=False)
        except Exception:  # noqa: BLE001, S112 - a foreign forward; try without labels
            continue
        sizes = [size for _, size in saved.values()]
        return sum(sizes), max(sizes, default=0)
    return 0, 0

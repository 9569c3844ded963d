"""Gradient data model: factorized/materialized per-sample gradients of several layers.

A :class:`Gradient` holds one training step's per-sample gradients for a set of
layers. Each layer is either *factorized* (a :class:`Factorized` pair of the
layer input ``a`` and output gradient ``g``; the per-sample weight gradient is
``dW_i = Σ_t g_it a_itᵀ``) or *materialized* (a dense ``(B, d)`` or ``(B, T, d)``
tensor in the layout of :func:`dattri_llm.gradient.ops.materialize.materialize`).
Batch-level parameter gradients (layer type ``"param_grad_layers"``) are stored
parameter-shaped, without a sample axis.

A layer whose batch size is 1 while the block's batch size is larger is a
*broadcast* layer (e.g. a positional embedding shared by every sample): its
single row stands for every sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import InitVar, dataclass, field
from typing import Literal

import torch

from dattri_llm.gradient.ops.dot import cross_dot_per_token, grad_norm_sq, layerwise_cross_dot
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.projection import DattriProjector, project_layer
from dattri_llm.gradient.ops.types import (
    ALL_LAYER_TYPES,
    PARAM_GRAD_TYPES,
    is_conv,
    is_conv_transpose,
    is_embedding,
    is_norm,
)

__all__ = [
    "Factorized",
    "Gradient",
    "GradientData",
    "GradientRecord",
    "GradientRepresentation",
    "GradientShapeError",
    "Indexing",
    "base_layer_name",
]

GradientRepresentation = Literal["materialized", "factorized"]
Indexing = Literal["batch", "batch_token"]

_REPRESENTATIONS = ("materialized", "factorized")
_INDEXINGS = ("batch", "batch_token")
_SIMILARITY_METRICS = ("dot", "cosine")
_SIMILARITY_REDUCES = ("none", "all")
_ROUTING_MODES = ("auto", "factorized", "materialized")
_DIMS = ("batch", "token")
_HASH_PREFIX = 16
# Kernel errors re-raised with the layer name prefixed (exact types only: subclasses
# may have other constructors).
_PREFIXED_ERRORS = (ValueError, TypeError, NotImplementedError)


class GradientShapeError(ValueError, RuntimeError):
    """Two blocks' payloads of one layer disagree in shape (e.g. feature width).

    Both a ``ValueError`` (our errors for bad arguments) and a ``RuntimeError``
    (what ``torch.cat`` raises in the reference design), so either ``except``
    clause catches it.
    """


def base_layer_name(name: str) -> str:
    """Strip a virtual-invocation suffix: ``"lin@2" -> "lin"``; names without ``"@"`` unchanged."""
    return name.split("@", 1)[0]


@contextmanager
def _naming_layer(op: str, name: str) -> Iterator[None]:
    """Re-raise a kernel's ``ValueError``/``TypeError``/``NotImplementedError`` inside the
    block with ``"Gradient.<op>: layer '<name>': "`` prefixed, so the message names the layer."""
    try:
        yield
    except _PREFIXED_ERRORS as error:
        if type(error) not in _PREFIXED_ERRORS:
            raise
        raise type(error)(f"Gradient.{op}: layer {name!r}: {error}") from error


def _pinning_available() -> bool:
    """Whether page-locked host memory can be allocated (an accelerator is present)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available()


def _pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` pinned if it is an unpinned CPU tensor and pinning is possible, else itself."""
    if tensor.device.type != "cpu" or not _pinning_available() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def _moved(
    tensor: torch.Tensor,
    device: torch.device | str | torch.dtype | None,
    dtype: torch.dtype | None,
    non_blocking: bool,
) -> torch.Tensor:
    """``tensor`` on ``device``, cast to ``dtype`` only if it is floating (ids stay integer).

    A dtype given as ``device`` (``to(torch.bfloat16)``, as for tensors) is the ``dtype``.
    """
    if isinstance(device, torch.dtype):
        if dtype is not None:
            raise TypeError(
                f"to(): got a dtype ({device}) as device and dtype={dtype}; pass one dtype."
            )
        device, dtype = None, device
    cast = dtype if tensor.is_floating_point() else None
    return tensor.to(device=device, dtype=cast, non_blocking=non_blocking)


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True, eq=False)
class Factorized:
    """Factorized per-sample gradient of one layer: its input and output gradient.

    Batch-first shapes: linear family ``a:(B,[T,]D_in)``, ``g:(B,[T,]D_out)``; conv
    ``a:(N,C_in,*spatial_in)``, ``g:(N,C_out,*spatial_out)``; embedding ``a:(B,T)``
    integer ids, ``g:(B,T,E)``; embedding-bag ``a:(B,T)``, ``g:(B,E)``; norms ``a``
    and ``g`` shaped like the normalised input. ``module_kwargs=None`` marks *final*
    factors (already preprocessed/projected; kernels use them as given).
    ``batch_first=False`` marks a sequence-first ``(T, B, ...)`` capture.
    """

    activation: torch.Tensor
    pre_activation_grad: torch.Tensor
    module_kwargs: dict | None = field(default=None, repr=False)
    batch_first: bool = True

    def _with_factors(self, activation: torch.Tensor, grad: torch.Tensor) -> Factorized:
        """Copy with new factors, same ``module_kwargs`` and ``batch_first``."""
        return Factorized(activation, grad, self.module_kwargs, self.batch_first)

    def to(
        self,
        device: torch.device | str | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> Factorized:
        """Copy with both factors moved; floating factors cast to ``dtype``.

        Integer factors (embedding token ids) keep their dtype: a 16-bit float
        cannot hold ids above 256 exactly. ``to(torch.bfloat16)`` means
        ``to(dtype=torch.bfloat16)``, as for tensors.
        """
        return self._with_factors(
            _moved(self.activation, device, dtype, non_blocking),
            _moved(self.pre_activation_grad, device, dtype, non_blocking),
        )

    def pin_memory(self) -> Factorized:
        """Copy whose unpinned CPU factors are pinned; other factors pass through (idempotent).

        Without an accelerator, page-locked memory cannot be allocated and the
        factors pass through unchanged.
        """
        return self._with_factors(_pin(self.activation), _pin(self.pre_activation_grad))

    @property
    def nbytes(self) -> int:
        """Bytes of both factors."""
        return _tensor_nbytes(self.activation) + _tensor_nbytes(self.pre_activation_grad)

    @property
    def batch_axis(self) -> int:
        """Axis of the samples in both factors: 0 batch-first, 1 sequence-first."""
        return 0 if self.batch_first else 1

    @property
    def token_axis(self) -> int:
        """Axis of the tokens in both factors: 1 batch-first, 0 sequence-first."""
        return 1 if self.batch_first else 0

    def as_batch_first(self) -> Factorized:
        """``self`` if batch-first, else a copy with axes 0 and 1 of both factors swapped."""
        if self.batch_first:
            return self
        return Factorized(
            self.activation.transpose(0, 1),
            self.pre_activation_grad.transpose(0, 1),
            self.module_kwargs,
            True,
        )


GradientData = torch.Tensor | Factorized


def _layer_batch(value: GradientData) -> int:
    """Per-sample count of one layer's payload (factor batch axis, or dense dim 0)."""
    if isinstance(value, Factorized):
        return value.activation.shape[value.batch_axis]
    return value.shape[0]


def _index_axis(tensor: torch.Tensor, axis: int, index: object) -> torch.Tensor:
    """``tensor`` indexed by ``index`` along ``axis`` (other axes whole)."""
    return tensor[(slice(None),) * axis + (index,)]


def _as_axis_index(index: int | Sequence[int] | torch.Tensor | slice) -> object:
    """An index that keeps the indexed axis: an ``int`` becomes a one-element list."""
    if isinstance(index, bool):
        raise TypeError(f"Gradient.slice: index must be an int, sequence or tensor, got {index!r}.")
    if isinstance(index, int):
        return [index]
    if isinstance(index, torch.Tensor):
        return index.reshape(1) if index.ndim == 0 else index
    if isinstance(index, slice):
        return index
    return list(index)


def _selected_count(
    index: int | Sequence[int] | torch.Tensor | slice, axis_index: object, batch: int
) -> int:
    """Rows a batch ``index`` selects from a block of ``batch`` samples, range-checked.

    Raises:
        IndexError: an index value outside ``[-batch, batch)`` or a boolean mask
            whose length is not ``batch``.
    """
    if isinstance(axis_index, slice):
        return len(range(batch)[axis_index])
    if isinstance(axis_index, torch.Tensor) and axis_index.dtype == torch.bool:
        if axis_index.shape != (batch,):
            raise IndexError(
                f"Gradient.slice: boolean mask of shape {tuple(axis_index.shape)} does not "
                f"match the block batch size {batch}."
            )
        return int(axis_index.sum())
    values = axis_index.tolist() if isinstance(axis_index, torch.Tensor) else axis_index
    outside = [v for v in values if not -batch <= v < batch]
    if outside:
        raise IndexError(
            f"Gradient.slice: batch index {index!r} has values {outside} outside the block "
            f"batch size {batch} (valid: -{batch} .. {batch - 1})."
        )
    return len(values)


def _index_factors(f: Factorized, axis: int, index: object) -> Factorized:
    """``f`` with both factors indexed by ``index`` along ``axis``."""
    return f._with_factors(
        _index_axis(f.activation, axis, index), _index_axis(f.pre_activation_grad, axis, index)
    )


def _slice_batch(
    value: GradientData, axis_index: object, repeats: int | None, int_index: bool
) -> GradientData:
    """One layer's payload at the selected batch rows.

    A batch-1 (broadcast) layer keeps its row for an ``int`` index and repeats
    it ``repeats`` times otherwise; others are indexed by ``axis_index``.
    """
    axis = value.batch_axis if isinstance(value, Factorized) else 0
    if _layer_batch(value) == 1 and repeats is not None:
        if int_index:
            return value
        device = value.activation.device if isinstance(value, Factorized) else value.device
        axis_index = torch.zeros(repeats, dtype=torch.long, device=device)
    if isinstance(value, Factorized):
        return _index_factors(value, axis, axis_index)
    return _index_axis(value, axis, axis_index)


def _pad_axis(tensor: torch.Tensor, axis: int, length: int, value: float) -> torch.Tensor:
    """``tensor`` right-padded with ``value`` along ``axis`` to ``length``."""
    missing = length - tensor.shape[axis]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=axis)


def _activation_pad_value(f: Factorized) -> int | float:
    """Pad value of an activation: the layer's ``padding_idx`` (else 0) for integer ids, else 0."""
    if f.activation.is_floating_point() or f.activation.is_complex():
        return 0.0
    padding_idx = (f.module_kwargs or {}).get("padding_idx")
    return 0 if padding_idx is None else int(padding_idx)


def _has_token_axis(f: Factorized, layer_type: str) -> bool:
    """Whether both factors share a token axis that padding/token slicing may touch."""
    if is_conv(layer_type) or is_conv_transpose(layer_type) or layer_type == "nn.EmbeddingBag":
        return False
    if layer_type in (
        "nn.GroupNorm",
        "nn.InstanceNorm1d",
        "nn.InstanceNorm2d",
        "nn.InstanceNorm3d",
    ):
        return False
    if layer_type == "nn.Embedding":
        return f.activation.ndim == 2
    return f.activation.ndim >= 3


def _check_factor_shapes(name: str, layer_type: str, f: Factorized) -> None:
    """Raise ``ValueError`` if the factors of layer ``name`` are inconsistent for its type."""
    a, g = f.activation, f.pre_activation_grad
    if layer_type == "nn.EmbeddingBag":
        ok = a.ndim == 2 and g.ndim == 2 and a.shape[0] == g.shape[0]
        rule = "a (B, T) and g (B, E) both 2-D with equal batch"
    elif layer_type == "nn.Embedding":
        ok = a.ndim == 2 and g.ndim == 3 and a.shape == g.shape[:2]
        rule = "a (B, T) integer ids and g (B, T, E) with a.shape == g.shape[:2]"
    elif is_norm(layer_type):
        ok = a.shape == g.shape
        rule = "a and g shaped like the normalised input (a.shape == g.shape)"
    elif is_conv(layer_type) or is_conv_transpose(layer_type):
        ok = a.ndim >= 2 and g.ndim >= 2 and a.shape[f.batch_axis] == g.shape[f.batch_axis]
        rule = "a (N, C_in, *spatial) and g (N, C_out, *spatial) with equal batch N"
    else:
        ok = a.shape[:-1] == g.shape[:-1]
        rule = "a (B, [T,] D_in) and g (B, [T,] D_out) with a.shape[:-1] == g.shape[:-1]"
    if not ok:
        raise ValueError(
            f"Gradient: layer {name!r} ({layer_type}) has inconsistent factors: activation "
            f"{tuple(a.shape)}, pre_activation_grad {tuple(g.shape)}; expected {rule}."
        )


def _norm_features(f: Factorized, layer_type: str) -> int:
    """Number of normalised features (parameter length) of a norm layer."""
    kwargs = f.module_kwargs or {}
    if layer_type in ("nn.LayerNorm", "nn.RMSNorm"):
        shape = kwargs.get("normalized_shape")
        return math.prod(shape) if shape is not None else f.activation.shape[-1]
    if layer_type == "nn.GroupNorm":
        return kwargs.get("num_channels", f.activation.shape[1])
    return kwargs.get("num_features", f.activation.shape[1])


def _materialized_width_estimate(f: Factorized, layer_type: str) -> int:
    """Materialized width ``d`` per the estimate rule (bias ignored).

    Norms ``d_in``; embeddings ``vocab·E``; conv ``C_out·C_in/groups·Πkernel``;
    conv-transpose ``C_in·C_out/groups·Πkernel``; otherwise ``D_in·D_out``.
    """
    a, g = f.activation, f.pre_activation_grad
    kwargs = f.module_kwargs
    if is_norm(layer_type):
        return _norm_features(f, layer_type)
    if is_embedding(layer_type):
        vocab = (kwargs or {}).get("num_embeddings")
        if vocab is None:
            vocab = int(a.max().item()) + 1 if a.numel() else 0
        return vocab * g.shape[-1]
    if kwargs is not None and (is_conv(layer_type) or is_conv_transpose(layer_type)):
        kernel = math.prod(kwargs["kernel_size"])
        groups = kwargs.get("groups", 1)
        if is_conv(layer_type):
            return g.shape[1] * (a.shape[1] // groups) * kernel
        return a.shape[1] * (g.shape[1] // groups) * kernel
    return a.shape[-1] * g.shape[-1]


def _weighted_mean(x1: torch.Tensor, x2: torch.Tensor, w1: int, w2: int) -> torch.Tensor:
    """``(w1·x1 + w2·x2) / (w1 + w2)``."""
    return (x1 * w1 + x2 * w2) / (w1 + w2)


def _pad_dense_tokens(t1: torch.Tensor, t2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad the token axis (dim 1) of two ``(B, T, d)`` tensors with 0 to a common length."""
    length = max(t1.shape[1], t2.shape[1])
    return _pad_axis(t1, 1, length, 0.0), _pad_axis(t2, 1, length, 0.0)


def _pad_factor_tokens(
    f1: Factorized, f2: Factorized, layer_type: str
) -> tuple[Factorized, Factorized]:
    """Right-pad the shorter token axis of two factorized payloads (g with 0, a per dtype)."""
    if not _has_token_axis(f1, layer_type):
        return f1, f2
    axis = f1.token_axis
    length = max(f1.activation.shape[axis], f2.activation.shape[axis])

    def padded(f: Factorized) -> Factorized:
        return f._with_factors(
            _pad_axis(f.activation, axis, length, _activation_pad_value(f)),
            _pad_axis(f.pre_activation_grad, axis, length, 0.0),
        )

    return padded(f1), padded(f2)


def _cat_checked(
    name: str, what: str, x1: torch.Tensor, x2: torch.Tensor, axis: int
) -> torch.Tensor:
    """Concatenate along ``axis``; other axes must agree (:class:`GradientShapeError`)."""
    same_rest = x1.ndim == x2.ndim and all(
        x1.shape[d] == x2.shape[d] for d in range(x1.ndim) if d != axis
    )
    if not same_rest:
        raise GradientShapeError(
            f"Gradient.concatenate: layer {name!r} {what} shapes {tuple(x1.shape)} and "
            f"{tuple(x2.shape)} differ outside axis {axis}; both blocks must come from the same "
            "layer configuration (token axes are padded only for sequence layers)."
        )
    return torch.cat([x1, x2], dim=axis)


@dataclass(frozen=True, eq=False)
class Gradient:
    """One training step's per-sample gradients for several layers.

    Attributes:
        representation: ``{layer: "factorized" | "materialized"}``.
        data: ``{layer: Factorized | Tensor}``; dense payloads are ``(B, d)``
            (``"batch"``) or ``(B, T, d)`` (``"batch_token"``); a ``param_grad``
            payload is the parameter-shaped batch-level gradient.
        layer_types: ``{layer: canonical type string | "param_grad_layers"}``.
        indexing: ``{layer: "batch" | "batch_token"}``, completed after
            construction (missing → ``"batch"``).
        validate_on_init: call :meth:`validate` in ``__post_init__``.
    """

    representation: dict[str, GradientRepresentation]
    data: dict[str, GradientData]
    layer_types: dict[str, str]
    indexing: dict[str, Indexing] = field(default_factory=dict)
    validate_on_init: InitVar[bool] = True

    def __post_init__(self, validate_on_init: bool) -> None:
        """Complete ``indexing`` for every layer of ``data`` and optionally validate."""
        indexing = dict(self.indexing)
        for name in self.data:
            indexing.setdefault(name, "batch")
        object.__setattr__(self, "indexing", indexing)
        if validate_on_init:
            self.validate()

    def __repr__(self) -> str:
        """Compact summary: one entry per layer with representation, type and shapes."""
        parts = []
        for name, value in self.data.items():
            if isinstance(value, Factorized):
                shape = (
                    f"a{tuple(value.activation.shape)} g{tuple(value.pre_activation_grad.shape)}"
                )
            else:
                shape = f"{tuple(value.shape)}"
            parts.append(
                f"{name!r}: {self.representation.get(name)} {self.layer_types.get(name)} "
                f"{self.indexing.get(name)} {shape}"
            )
        return "Gradient({" + ", ".join(parts) + "})"

    # ------------------------------------------------------------------ helpers

    def _is_param_grad(self, name: str) -> bool:
        """Whether layer ``name`` holds a batch-level parameter gradient."""
        return self.layer_types.get(name) == PARAM_GRAD_TYPES

    def _layer_batches(self) -> dict[str, int]:
        """``{layer: sample count}`` over non-``param_grad`` layers."""
        return {
            name: _layer_batch(value)
            for name, value in self.data.items()
            if not self._is_param_grad(name)
        }

    def _block_batch(self) -> int | None:
        """Largest per-layer sample count, or ``None`` when only ``param_grad`` layers exist."""
        batches = self._layer_batches()
        return max(batches.values()) if batches else None

    def _is_broadcast(self, name: str, block_batch: int | None) -> bool:
        """Whether layer ``name`` has batch 1 while the block batch is larger."""
        if self._is_param_grad(name) or block_batch is None:
            return False
        return _layer_batch(self.data[name]) == 1 and block_batch > 1

    def _derive(
        self,
        data: dict[str, GradientData],
        representation: dict[str, GradientRepresentation] | None = None,
        indexing: dict[str, Indexing] | None = None,
        layer_types: dict[str, str] | None = None,
        validate: bool = False,
    ) -> Gradient:
        """New block over ``data``; unspecified metadata is copied from ``self`` for its layers."""
        return Gradient(
            representation=representation or {n: self.representation[n] for n in data},
            data=data,
            layer_types=layer_types or {n: self.layer_types[n] for n in data},
            indexing=indexing or {n: self.indexing[n] for n in data},
            validate_on_init=validate,
        )

    def _map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Gradient:
        """New block with ``fn`` applied to every tensor (both factors of factorized layers)."""
        data: dict[str, GradientData] = {}
        for name, value in self.data.items():
            if isinstance(value, Factorized):
                data[name] = value._with_factors(
                    fn(value.activation), fn(value.pre_activation_grad)
                )
            else:
                data[name] = fn(value)
        return self._derive(data)

    # --------------------------------------------------------------- validation

    def validate(self) -> None:
        """Check payload kinds, factor shapes, ranks and batch-size agreement.

        Raises:
            ValueError: empty ``data``; a layer without ``representation`` or
                ``layer_types`` entry, or with an unknown representation/indexing;
                inconsistent factor shapes; a dense non-``param_grad``
                ``"batch_token"`` layer that is not 3-D; a 0-D per-sample tensor;
                non-``param_grad`` layers disagreeing on batch size (batch-1
                broadcast layers exempt).
            TypeError: a ``"factorized"`` layer that is not a :class:`Factorized`
                (or whose factors are not tensors), or a ``"materialized"`` one
                that is not a tensor.
        """
        if not self.data:
            raise ValueError("Gradient: data is empty; a gradient block needs at least one layer.")
        for name, value in self.data.items():
            self._validate_layer(name, value)
        self._validate_batch_sizes()

    def _validate_layer(self, name: str, value: object) -> None:
        """Validate one layer's metadata and payload."""
        representation = self.representation.get(name)
        if representation is None:
            raise ValueError(
                f"Gradient: layer {name!r} has no representation entry; set representation"
                f"[{name!r}] to 'factorized' or 'materialized'."
            )
        if representation not in _REPRESENTATIONS:
            raise ValueError(
                f"Gradient: layer {name!r} has representation {representation!r}; it must be "
                f"one of {_REPRESENTATIONS}."
            )
        layer_type = self.layer_types.get(name)
        if layer_type is None:
            raise ValueError(
                f"Gradient: layer {name!r} has no layer_types entry; set it to the canonical "
                f"layer type (e.g. 'nn.Linear') or {PARAM_GRAD_TYPES!r}."
            )
        if self.indexing[name] not in _INDEXINGS:
            raise ValueError(
                f"Gradient: layer {name!r} has indexing {self.indexing[name]!r}; it must be one "
                f"of {_INDEXINGS}."
            )
        if representation == "factorized":
            self._validate_factorized(name, layer_type, value)
        else:
            self._validate_dense(name, layer_type, value)

    def _validate_factorized(self, name: str, layer_type: str, value: object) -> None:
        """Validate a ``"factorized"`` payload."""
        if not isinstance(value, Factorized):
            raise TypeError(
                f"Gradient: layer {name!r} is marked 'factorized' but holds a "
                f"{type(value).__name__}; wrap the factors in Factorized(a, g, ...) or mark the "
                "layer 'materialized'."
            )
        if layer_type not in ALL_LAYER_TYPES:
            raise ValueError(
                f"Gradient: factorized layer {name!r} has layer type {layer_type!r}, which no "
                f"kernel knows; it must be one of {sorted(ALL_LAYER_TYPES)} (a materialized "
                "payload may carry any label)."
            )
        for label, factor in (
            ("activation", value.activation),
            ("pre_activation_grad", value.pre_activation_grad),
        ):
            if not isinstance(factor, torch.Tensor):
                raise TypeError(
                    f"Gradient: layer {name!r} factor {label} is a {type(factor).__name__}; "
                    "factors must be tensors."
                )
            if factor.ndim == 0:
                raise ValueError(
                    f"Gradient: layer {name!r} factor {label} is 0-D; factors need a batch axis."
                )
        _check_factor_shapes(name, layer_type, value)

    def _validate_dense(self, name: str, layer_type: str, value: object) -> None:
        """Validate a ``"materialized"`` payload."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"Gradient: layer {name!r} is marked 'materialized' but holds a "
                f"{type(value).__name__}; store a (B, d) or (B, T, d) tensor or mark it "
                "'factorized'."
            )
        if layer_type == PARAM_GRAD_TYPES:
            return
        if value.ndim == 0:
            raise ValueError(
                f"Gradient: layer {name!r} holds a 0-D tensor; a materialized payload is (B, d) "
                "or (B, T, d)."
            )
        if self.indexing[name] == "batch_token" and value.ndim != 3:
            raise ValueError(
                f"Gradient: layer {name!r} is 'batch_token' but its tensor has shape "
                f"{tuple(value.shape)}; a per-token payload is (B, T, d) — reshape it or use "
                "indexing 'batch'."
            )

    def _validate_batch_sizes(self) -> None:
        """Non-``param_grad`` layers must agree on batch size (batch-1 layers exempt)."""
        batches = self._layer_batches()
        distinct = {b for b in batches.values() if b != 1}
        if len(distinct) > 1:
            detail = ", ".join(f"{n!r}: {b}" for n, b in batches.items())
            raise ValueError(
                f"Gradient: layers disagree on batch size ({detail}); every per-sample layer "
                "must have the same batch size (or 1 for a broadcast layer)."
            )

    # --------------------------------------------------------------- properties

    @property
    def layer_names(self) -> set[str]:
        """Names of the layers in ``data``."""
        return set(self.data)

    @property
    def batch_size(self) -> int:
        """Largest per-layer sample count over non-``param_grad`` layers.

        Raises:
            ValueError: only ``param_grad`` layers exist.
        """
        block_batch = self._block_batch()
        if block_batch is None:
            raise ValueError(
                f"Gradient.batch_size: layers {sorted(self.data)} are all batch-level "
                f"{PARAM_GRAD_TYPES!r} gradients without a sample axis."
            )
        return block_batch

    @property
    def token_dim(self) -> dict[str, int | None]:
        """``{layer: T}`` for ``"batch_token"`` layers, ``None`` for the others."""
        dims: dict[str, int | None] = {}
        for name, value in self.data.items():
            if self.indexing[name] != "batch_token":
                dims[name] = None
            elif isinstance(value, Factorized):
                dims[name] = value.activation.shape[value.token_axis]
            else:
                dims[name] = value.shape[1]
        return dims

    def _first_tensor(self) -> torch.Tensor:
        """The first layer's payload (activation for a factorized layer)."""
        if not self.data:
            raise ValueError("Gradient: data is empty; it has no device or dtype.")
        value = next(iter(self.data.values()))
        return value.activation if isinstance(value, Factorized) else value

    @property
    def device(self) -> torch.device:
        """Device of the first layer's payload (activation for factorized)."""
        return self._first_tensor().device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the first layer's payload (activation for factorized)."""
        return self._first_tensor().dtype

    @property
    def nbytes(self) -> int:
        """Bytes of all payloads as stored."""
        return sum(
            value.nbytes if isinstance(value, Factorized) else _tensor_nbytes(value)
            for value in self.data.values()
        )

    @property
    def materialized_nbytes(self) -> int:
        """Estimated bytes of :meth:`materialize`'s result, without computing it.

        Dense layers as stored; factorized norm ``B·d_in·itemsize``; embedding
        ``B·vocab·E·itemsize``; otherwise ``B·d_in·d_out·itemsize`` (conv:
        ``d_in = C_in/groups·Πkernel``), with the gradient factor's itemsize.
        The bias column is not counted.
        """
        total = 0
        for name, value in self.data.items():
            if not isinstance(value, Factorized):
                total += _tensor_nbytes(value)
                continue
            f = value.as_batch_first()
            width = _materialized_width_estimate(f, self.layer_types[name])
            total += f.activation.shape[0] * width * f.pre_activation_grad.element_size()
        return total

    # ------------------------------------------------------------ conversions

    def map_layers(
        self,
        fn: Callable[[str, GradientData, str], GradientData | None],
        *,
        layers: Iterable[str] | None = None,
        consume: bool = False,
    ) -> Gradient:
        """Convert selected layers with ``fn(name, value, layer_type)``.

        A returned :class:`Factorized` stays ``"factorized"`` (indexing kept); a
        tensor becomes ``"materialized"`` with indexing ``"batch"``; ``None`` drops
        the layer. Unselected layers pass through. The result is not validated.

        Args:
            fn: per-layer conversion.
            layers: names to convert (``None`` = all; names not in the block are ignored).
            consume: remove each selected layer from *this* block's ``data`` as it is
                converted (frees memory early; this block must not be used afterwards).
        """
        selected = set(self.data) if layers is None else set(layers)
        representation: dict[str, GradientRepresentation] = {}
        data: dict[str, GradientData] = {}
        indexing: dict[str, Indexing] = {}
        layer_types: dict[str, str] = {}
        for name in list(self.data):
            value = self.data[name]
            if name in selected:
                value = fn(name, value, self.layer_types[name])
                if consume:
                    del self.data[name]
                if value is None:
                    continue
                if isinstance(value, Factorized):
                    representation[name], indexing[name] = "factorized", self.indexing[name]
                elif isinstance(value, torch.Tensor):
                    representation[name], indexing[name] = "materialized", "batch"
                else:
                    raise TypeError(
                        f"Gradient.map_layers: fn returned a {type(value).__name__} for layer "
                        f"{name!r}; return a Factorized, a tensor or None."
                    )
            else:
                representation[name], indexing[name] = (
                    self.representation[name],
                    self.indexing[name],
                )
            data[name] = value
            layer_types[name] = self.layer_types[name]
        return Gradient(representation, data, layer_types, indexing, validate_on_init=False)

    def clone(self) -> Gradient:
        """Deep copy of every payload (metadata dicts copied too)."""
        cloned = self._map_tensors(torch.Tensor.clone)
        for name, value in cloned.data.items():
            if isinstance(value, Factorized) and value.module_kwargs is not None:
                cloned.data[name] = Factorized(
                    value.activation,
                    value.pre_activation_grad,
                    dict(value.module_kwargs),
                    value.batch_first,
                )
        return cloned

    def to(
        self,
        device: torch.device | str | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> Gradient:
        """Every payload moved; floating payloads cast to ``dtype``, integer ones kept.

        As :meth:`Factorized.to`: integer factors (embedding token ids) keep their dtype.
        """
        return self._map_tensors(lambda t: _moved(t, device, dtype, non_blocking))

    def pin_memory(self) -> Gradient:
        """Unpinned CPU payloads pinned (no-op without an accelerator)."""
        return self._map_tensors(_pin)

    def materialize(self) -> Gradient:
        """``self`` if nothing is factorized; else factorized layers become dense ``(B, d)``.

        Converted layers are ``"materialized"`` with indexing ``"batch"`` and keep
        their layer type (``ops.materialize``). Kernel errors are re-raised with the
        layer name prefixed.
        """
        factorized = [n for n, r in self.representation.items() if r == "factorized"]
        if not factorized:
            return self

        def materialize_one(name: str, value: GradientData, layer_type: str) -> torch.Tensor:
            with _naming_layer("materialize", name):
                return materialize(value, layer_type)

        return self.map_layers(materialize_one, layers=factorized)

    def project(
        self,
        projector: DattriProjector | Callable | None,
        proj_kwargs: dict[str, dict],
        *,
        capture_style: str = "factorized",
    ) -> Gradient:
        """Post-hoc projection of each configured layer (see ``projection.md``).

        The config of a layer is ``proj_kwargs.get(name, proj_kwargs.get("__default__"))``;
        layers with neither, and ``param_grad`` layers (no sample axis), pass through.
        ``"logra"`` layers that stay factorized become final
        ``Factorized(a_p, g_p, module_kwargs=None)`` relabelled ``"nn.Linear"``
        (indexing kept); dense results keep their type and get ``"batch"`` indexing.

        Args:
            projector: projector factory, ``DattriProjector`` or ``None`` (dattri default).
            proj_kwargs: ``{layer | "__default__": {"proj_dim": ..., "style": ..., ...}}``.
            capture_style: ``"factorized"``, ``"materialized"`` or ``"auto"`` for logra results.

        Raises:
            ValueError, TypeError, NotImplementedError: from the kernels, prefixed with
                the layer name (e.g. ``"logra"`` requested for a norm layer).
        """
        default = proj_kwargs.get("__default__")
        configs = {
            name: proj_kwargs.get(name, default)
            for name in self.data
            if not self._is_param_grad(name) and proj_kwargs.get(name, default) is not None
        }
        shared_projector = DattriProjector.coerce(projector)
        relabelled: set[str] = set()

        def project_one(name: str, value: GradientData, layer_type: str) -> GradientData:
            config = dict(configs[name])
            style = config.pop("style", "logra")
            with _naming_layer("project", name):
                payload, is_factorized = project_layer(
                    value,
                    layer_type,
                    shared_projector,
                    style=style,
                    capture_style=capture_style,
                    **config,
                )
            if not is_factorized:
                return payload
            relabelled.add(name)
            return Factorized(payload[0], payload[1], module_kwargs=None)

        projected = self.map_layers(project_one, layers=configs)
        for name in relabelled:
            projected.layer_types[name] = "nn.Linear"
        return projected

    def select_layers(
        self, layer_names: str | Iterable[str], include_derived: bool = False
    ) -> Gradient:
        """Restrict to ``layer_names`` (``include_derived`` also pulls in ``name@k`` layers).

        Raises:
            KeyError: a requested name matches no layer.
        """
        names = [layer_names] if isinstance(layer_names, str) else list(layer_names)
        wanted = set(names)
        selected = [
            n
            for n in self.data
            if n in wanted or (include_derived and base_layer_name(n) in wanted)
        ]
        found = set(selected) | {base_layer_name(n) for n in selected}
        missing = [n for n in names if n not in found]
        if missing:
            raise KeyError(
                f"Gradient.select_layers: unknown layers {missing}; available layers: "
                f"{sorted(self.data)}."
            )
        return self._derive({n: self.data[n] for n in selected})

    # ------------------------------------------------------------ concatenation

    def _check_same_structure(self, other: Gradient) -> None:
        """Same layer sets, representations, indexing, layer types, payload kinds and layouts."""
        if set(self.data) != set(other.data):
            raise ValueError(
                "Gradient.concatenate: layer sets differ; only in self: "
                f"{sorted(set(self.data) - set(other.data))}, only in other: "
                f"{sorted(set(other.data) - set(self.data))}. Use select_layers to align them."
            )
        for name in self.data:
            for label, mine, theirs in (
                ("representation", self.representation, other.representation),
                ("indexing", self.indexing, other.indexing),
                ("layer type", self.layer_types, other.layer_types),
            ):
                if mine[name] != theirs[name]:
                    raise ValueError(
                        f"Gradient.concatenate: layer {name!r} {label} differs: "
                        f"{mine[name]!r} vs {theirs[name]!r}."
                    )
            v1, v2 = self.data[name], other.data[name]
            if isinstance(v1, Factorized) != isinstance(v2, Factorized):
                raise TypeError(
                    f"Gradient.concatenate: layer {name!r} payloads differ in kind: "
                    f"{type(v1).__name__} vs {type(v2).__name__}."
                )
            if isinstance(v1, Factorized) and v1.batch_first != v2.batch_first:
                raise ValueError(
                    f"Gradient.concatenate: layer {name!r} batch_first differs: "
                    f"{v1.batch_first} vs {v2.batch_first}; call as_batch_first() on both."
                )

    def concatenate(self, other: Gradient, dim: Literal["batch", "token"] = "batch") -> Gradient:
        """Concatenate two blocks along the batch or the token axis.

        Batch: the shorter token axis of sequence layers is right-padded (``g`` and
        float activations with 0, integer ids with the layer's ``padding_idx``, else
        0). Broadcast layers (batch 1 while the block batch is larger) must be
        broadcast on both sides and merge into their batch-size-weighted mean
        ``(B₁·r₁ + B₂·r₂)/(B₁+B₂)`` (factorized with identical activations: mean of
        ``g``; otherwise both sides materialized). Batch-level ``param_grad``
        layers are summed (the gradient of the combined batch).
        Token: every layer must be ``"batch_token"`` with equal batch sizes.

        Raises:
            ValueError: layer sets, representations, indexing, layer types,
                ``batch_first`` flags or non-token shapes differ; invalid ``dim``;
                token rules violated; a layer broadcast on one side only.
            TypeError: payload kinds differ.
        """
        _check_choice("concatenate", "dim", dim, _DIMS)
        self._check_same_structure(other)
        if dim == "token":
            return self._concatenate_tokens(other)
        return self._concatenate_batch(other)

    def _concatenate_tokens(self, other: Gradient) -> Gradient:
        """Token-axis concatenation of two blocks with identical structure."""
        not_token = [n for n in self.data if self.indexing[n] != "batch_token"]
        if not_token:
            raise ValueError(
                f"Gradient.concatenate(dim='token'): layers {not_token} are not 'batch_token'; "
                "drop them with select_layers first."
            )
        data: dict[str, GradientData] = {}
        for name, v1 in self.data.items():
            v2 = other.data[name]
            if _layer_batch(v1) != _layer_batch(v2):
                raise ValueError(
                    f"Gradient.concatenate(dim='token'): layer {name!r} batch sizes differ: "
                    f"{_layer_batch(v1)} vs {_layer_batch(v2)}."
                )
            if isinstance(v1, Factorized):
                self._require_token_axis(name, v1, "concatenate(dim='token')")
                axis = v1.token_axis
                data[name] = v1._with_factors(
                    _cat_checked(name, "activation", v1.activation, v2.activation, axis),
                    _cat_checked(
                        name,
                        "pre_activation_grad",
                        v1.pre_activation_grad,
                        v2.pre_activation_grad,
                        axis,
                    ),
                )
            else:
                data[name] = _cat_checked(name, "tensor", v1, v2, 1)
        return self._derive(data, validate=True)

    def _require_token_axis(self, name: str, f: Factorized, op: str) -> None:
        """Raise ``ValueError`` if layer ``name``'s factors have no shared token axis."""
        layer_type = self.layer_types[name]
        if not _has_token_axis(f, layer_type):
            raise ValueError(
                f"Gradient.{op}: layer {name!r} ({layer_type}, activation "
                f"{tuple(f.activation.shape)}, pre_activation_grad "
                f"{tuple(f.pre_activation_grad.shape)}) has no token axis shared by both factors; "
                "exclude it with select_layers."
            )

    def _concatenate_batch(self, other: Gradient) -> Gradient:
        """Batch-axis concatenation of two blocks with identical structure."""
        batch1, batch2 = self._block_batch(), other._block_batch()
        representation = dict((n, self.representation[n]) for n in self.data)
        indexing = dict((n, self.indexing[n]) for n in self.data)
        data: dict[str, GradientData] = {}
        for name, v1 in self.data.items():
            v2 = other.data[name]
            layer_type = self.layer_types[name]
            if self._is_param_grad(name):
                data[name] = self._sum_param_grads(name, v1, v2)
            elif self._is_broadcast(name, batch1) or other._is_broadcast(name, batch2):
                merged = self._merge_broadcast(name, v1, v2, batch1, batch2)
                if isinstance(v1, Factorized) and not isinstance(merged, Factorized):
                    representation[name], indexing[name] = "materialized", "batch"
                data[name] = merged
            elif isinstance(v1, Factorized):
                f1, f2 = _pad_factor_tokens(v1, v2, layer_type)
                axis = f1.batch_axis
                data[name] = f1._with_factors(
                    _cat_checked(name, "activation", f1.activation, f2.activation, axis),
                    _cat_checked(
                        name,
                        "pre_activation_grad",
                        f1.pre_activation_grad,
                        f2.pre_activation_grad,
                        axis,
                    ),
                )
            else:
                if self.indexing[name] == "batch_token":
                    v1, v2 = _pad_dense_tokens(v1, v2)
                data[name] = _cat_checked(name, "tensor", v1, v2, 0)
        return self._derive(data, representation, indexing, validate=True)

    @staticmethod
    def _sum_param_grads(name: str, g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """Sum of two batch-level parameter gradients of one parameter."""
        if g1.shape != g2.shape:
            raise GradientShapeError(
                f"Gradient.concatenate: param_grad layer {name!r} shapes differ: "
                f"{tuple(g1.shape)} vs {tuple(g2.shape)}; both blocks must hold the same "
                "parameter."
            )
        return g1 + g2

    def _merge_broadcast(
        self,
        name: str,
        v1: GradientData,
        v2: GradientData,
        batch1: int,
        batch2: int,
    ) -> GradientData:
        """Batch-size-weighted mean of a broadcast layer's single rows."""
        if _layer_batch(v1) != 1 or _layer_batch(v2) != 1:
            raise ValueError(
                f"Gradient.concatenate: layer {name!r} is broadcast (batch 1) on one side only "
                f"(batch {_layer_batch(v1)} in a block of {batch1} vs {_layer_batch(v2)} in a "
                f"block of {batch2}); a broadcast layer must be broadcast in both blocks."
            )
        layer_type = self.layer_types[name]
        if isinstance(v1, Factorized):
            a1, a2 = v1.activation, v2.activation
            g1, g2 = v1.pre_activation_grad, v2.pre_activation_grad
            if a1.shape == a2.shape and g1.shape == g2.shape and torch.equal(a1, a2):
                return v1._with_factors(a1, _weighted_mean(g1, g2, batch1, batch2))
            v1, v2 = materialize(v1, layer_type), materialize(v2, layer_type)
        elif self.indexing[name] == "batch_token":
            v1, v2 = _pad_dense_tokens(v1, v2)
        if v1.shape != v2.shape:  # a width-1 row is refused too, never broadcast
            raise GradientShapeError(
                f"Gradient.concatenate: broadcast layer {name!r} rows differ in shape: "
                f"{tuple(v1.shape)} vs {tuple(v2.shape)}; both blocks must come from the same "
                "layer configuration."
            )
        return _weighted_mean(v1, v2, batch1, batch2)

    # ------------------------------------------------------- reduction/indexing

    def aggregate(self, dim: str = "token") -> Gradient:
        """Sum the token axis of every ``"batch_token"`` layer; all indexing becomes ``"batch"``.

        Factorized ``"batch_token"`` layers are materialized (``ops.materialize``
        sums tokens); dense ones are summed over dim 1.

        Raises:
            NotImplementedError: ``dim`` other than ``"token"``.
        """
        if dim != "token":
            raise NotImplementedError(
                f"Gradient.aggregate: dim must be one of ('token',) (the chain rule sums over "
                f"tokens), got {dim!r}."
            )
        representation = dict((n, self.representation[n]) for n in self.data)
        data: dict[str, GradientData] = {}
        for name, value in self.data.items():
            if self.indexing[name] == "batch_token":
                if isinstance(value, Factorized):
                    with _naming_layer("aggregate", name):
                        value = materialize(value, self.layer_types[name])
                    representation[name] = "materialized"
                else:
                    value = value.sum(dim=1)
            data[name] = value
        return self._derive(data, representation, {n: "batch" for n in data})

    def slice(
        self,
        dim: Literal["batch", "token"],
        index: int | Sequence[int] | torch.Tensor | slice,
    ) -> Gradient:
        """Index the batch or token axis of every layer.

        Per-sample layers use ordinary torch indexing; an ``int`` keeps the axis
        (length 1). ``dim="batch"``: index values are checked against the block's
        batch size first; a layer of batch 1 (broadcast) keeps its row for an
        ``int`` and repeats it once per selected entry otherwise (``n`` identical
        rows, no longer broadcast; an empty selection gives 0 rows). ``param_grad``
        layers pass through. Factorized layers slice both factors (batch axis 1
        for sequence-first captures).

        Raises:
            ValueError: ``dim`` not one of ``("batch", "token")``; ``dim="token"``
                with a layer that is not ``"batch_token"`` or whose factors have no
                shared token axis.
            IndexError: a batch index outside ``[-B, B)`` for the block batch ``B``,
                or a boolean mask whose length is not ``B``.
            TypeError: a ``bool`` index.
        """
        _check_choice("slice", "dim", dim, _DIMS)
        if dim == "token":
            self._require_all_batch_token()
        axis_index = _as_axis_index(index)
        block_batch = self._block_batch()
        repeats = None
        if dim == "batch" and block_batch is not None:
            repeats = _selected_count(index, axis_index, block_batch)
        data: dict[str, GradientData] = {}
        for name, value in self.data.items():
            if self._is_param_grad(name):
                data[name] = value
            elif dim == "batch":
                data[name] = _slice_batch(value, axis_index, repeats, isinstance(index, int))
            elif isinstance(value, Factorized):
                self._require_token_axis(name, value, "slice(dim='token')")
                data[name] = _index_factors(value, value.token_axis, axis_index)
            else:
                data[name] = _index_axis(value, 1, axis_index)
        return self._derive(data)

    def _require_all_batch_token(self) -> None:
        """``ValueError`` naming the non-``param_grad`` layers that are not ``"batch_token"``."""
        not_token = [
            n for n in self.data if self.indexing[n] != "batch_token" and not self._is_param_grad(n)
        ]
        if not_token:
            raise ValueError(
                f"Gradient.slice(dim='token'): layers {not_token} are not 'batch_token'; "
                "drop them with select_layers first."
            )

    # --------------------------------------------------------------- similarity

    def _norms_sq(self, layers: Iterable[str], mode: str) -> dict[str, torch.Tensor]:
        """``{layer: (B,) ‖dW_i‖²}``: dense per-token payloads summed over tokens first,
        a ``param_grad`` payload counted as one row (as ``ops.layerwise_cross_dot`` does)."""
        norms = {}
        for name in layers:
            value = self.data[name]
            if isinstance(value, Factorized):
                norms[name] = grad_norm_sq(value, self.layer_types[name], mode=mode)
                continue
            if self._is_param_grad(name):
                rows = value.reshape(1, -1)
            elif self.indexing[name] == "batch_token":
                rows = value.sum(dim=1)
            else:
                rows = value.reshape(value.shape[0], -1)
            norms[name] = rows.square().sum(dim=-1)
        return norms

    def similarity(
        self,
        other: Gradient,
        metric: Literal["dot", "cosine"] = "dot",
        reduce: Literal["none", "all"] = "none",
        mode: Literal["auto", "factorized", "materialized"] = "auto",
        eps: float = 1e-8,
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """Cross-gram ``K[i, j] = <dW_i, dW_j>`` of every layer present in both blocks.

        ``metric="cosine"`` divides by ``(‖dW_i‖ + eps)(‖dW_j‖ + eps)``: per layer
        for ``reduce="none"``, whole-model norms ``sqrt(Σ_layers ‖·‖²)`` for
        ``reduce="all"``. All routing modes are exact.

        Returns:
            ``{layer: (b_self, b_other)}`` in ``self``'s layer order, each side at the
            layer's own batch size (a broadcast layer counts 1: ``(1, B_other)``,
            ``(B_self, 1)`` or ``(1, 1)``); or for ``reduce="all"`` the layer-summed
            ``(B_self, B_other)`` tensor (broadcast layers expanded).

        Raises:
            ValueError: invalid ``metric``/``reduce``/``mode``; ``reduce="all"`` with
                no shared layer.
        """
        _check_choice("similarity", "metric", metric, _SIMILARITY_METRICS)
        _check_choice("similarity", "reduce", reduce, _SIMILARITY_REDUCES)
        _check_choice("similarity", "mode", mode, _ROUTING_MODES)
        shared = [name for name in self.data if name in other.data]
        if not shared:
            if reduce == "all":
                raise ValueError(
                    f"Gradient.similarity: no shared layer (self: {sorted(self.data)}, other: "
                    f"{sorted(other.data)})."
                )
            return {}
        grams = layerwise_cross_dot(self, other, layers=shared, mode=mode, reduce="none")
        grams = {name: grams[name] for name in shared}
        if metric == "cosine":
            norms1, norms2 = self._norms_sq(shared, mode), other._norms_sq(shared, mode)
        if reduce == "none":
            if metric == "cosine":
                grams = {n: k / _norm_outer(norms1[n], norms2[n], eps) for n, k in grams.items()}
            return grams
        shape = (self._block_batch() or 1, other._block_batch() or 1)
        total = sum(k.expand(shape) for k in grams.values())
        if metric == "cosine":
            total = total / _norm_outer(
                sum(norms1.values()).expand(shape[0]), sum(norms2.values()).expand(shape[1]), eps
            )
        return total

    def similarity_per_token(
        self, other: Gradient, reduce: Literal["none", "all"] = "all"
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """Per-token-position contributions ``(B_self, T_self, B_other)`` to :meth:`similarity`.

        Scores the layers of ``self`` that are factorized and ``"batch_token"`` and
        present in ``other`` (factorized or dense) via ``ops.cross_dot_per_token``;
        summing over ``T`` gives the ``"dot"`` similarity of those layers.

        Raises:
            ValueError: invalid ``reduce``; ``reduce="all"`` with no such layer or
                layers disagreeing on ``T``.
        """
        _check_choice("similarity_per_token", "reduce", reduce, _SIMILARITY_REDUCES)
        layers = [
            name
            for name in self.data
            if self.representation[name] == "factorized"
            and self.indexing[name] == "batch_token"
            and name in other.data
        ]
        if not layers and reduce == "all":
            raise ValueError(
                "Gradient.similarity_per_token: no layer of self is factorized, 'batch_token' "
                f"and present in other (self: {sorted(self.data)}, other: {sorted(other.data)})."
            )
        scores = {
            name: cross_dot_per_token(self.data[name], other.data[name], self.layer_types[name])
            for name in layers
        }
        if reduce == "none":
            return scores
        token_lengths = {name: s.shape[1] for name, s in scores.items()}
        if len(set(token_lengths.values())) > 1:
            raise ValueError(
                f"Gradient.similarity_per_token: layers disagree on token length {token_lengths}; "
                "use reduce='none' or select layers of equal length."
            )
        shape = _broadcast_shape(list(scores.values()))
        return sum(s.expand(shape) for s in scores.values())


def _check_choice(method: str, label: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` if ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"Gradient.{method}: {label} must be one of {choices}, got {value!r}.")


def _broadcast_shape(tensors: list[torch.Tensor]) -> torch.Size:
    """Common broadcast shape of per-layer score tensors (batch-1 layers expand)."""
    return torch.broadcast_shapes(*(t.shape for t in tensors))


def _norm_outer(norm_sq1: torch.Tensor, norm_sq2: torch.Tensor, eps: float) -> torch.Tensor:
    """``(sqrt(n1)+eps)(sqrt(n2)+eps)ᵀ`` as a ``(B1, B2)`` denominator."""
    return torch.outer(norm_sq1.sqrt() + eps, norm_sq2.sqrt() + eps)


def _short_hash(input_hash: str | list[str]) -> str:
    """Repr of an identifier: first 16 characters, plus ``+N`` more for lists."""

    def prefix(h: str) -> str:
        return h[:_HASH_PREFIX] + ("..." if len(h) > _HASH_PREFIX else "")

    if not isinstance(input_hash, (list, tuple)):
        return prefix(str(input_hash))
    if not input_hash:
        return "[]"
    more = f"+{len(input_hash) - 1}" if len(input_hash) > 1 else ""
    return f"[{prefix(str(input_hash[0]))}{more}]"


@dataclass
class GradientRecord:
    """One captured step: per-sample identifiers plus the step's :class:`Gradient`.

    Attributes:
        step: capture-step counter (or a re-stamped optimizer-step/checkpoint label).
        input_hash: one identifier (per-sample record) or one per sample in batch order.
        gradient: the step's gradient block.
        sample_id_key: input field the identifiers were read from; ``None`` for content hashes.
    """

    step: int
    input_hash: str | list[str]
    gradient: Gradient
    sample_id_key: str | int | None = None

    def __repr__(self) -> str:
        """``GradientRecord(step=0, input_hash=[62224d8cfb5e8b41...+1])``."""
        return f"GradientRecord(step={self.step}, input_hash={_short_hash(self.input_hash)})"

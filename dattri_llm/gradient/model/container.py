"""The gradient container: one training step's per-sample gradients of several layers.

A :class:`Gradient` holds, per layer, a *factorized* payload (a
:class:`~dattri_llm.gradient.model.records.Factorized` pair ``(a, g)``; the per-sample
weight gradient is ``dW_i = Σ_t g_it a_itᵀ``) or a *materialized* dense ``(B, d)`` or
``(B, T, d)`` tensor in the layout of :func:`dattri_llm.gradient.ops.materialize.materialize`.
Batch-level parameter gradients (layer type ``"param_grad_layers"``) are stored
parameter-shaped, without a sample axis. A layer whose batch size is 1 while the block's
batch size is larger is a *broadcast* layer (e.g. a positional embedding shared by every
sample): its single row stands for every sample.

This module holds the container (construction, sizes, device and pinning, per-layer
conversions) and :class:`GradientRecord`. The checks of :meth:`Gradient.validate` are in
:mod:`~dattri_llm.gradient.model.validation`; selecting, slicing, concatenating and
aggregating blocks in the :class:`~dattri_llm.gradient.model.layout.GradientLayout`
mixin; the similarity maths in :mod:`dattri_llm.gradient.ops.similarity`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import InitVar, dataclass, field
from typing import Literal

import torch

from dattri_llm.gradient.model.layout import GradientLayout
from dattri_llm.gradient.model.records import (
    _SPEC_MODULE,
    Factorized,
    GradientData,
    GradientRepresentation,
    Indexing,
    _layer_batch,
    _moved,
    _naming_layer,
    _pin,
    _tensor_nbytes,
)
from dattri_llm.gradient.model.validation import validate_batch_sizes, validate_layer
from dattri_llm.gradient.ops.materialize import materialize, materialized_width_estimate
from dattri_llm.gradient.ops.projection import project_layer
from dattri_llm.gradient.ops.projector import DattriProjector
from dattri_llm.gradient.ops.similarity import block_similarity, block_similarity_per_token
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES

_HASH_PREFIX = 16


@dataclass(frozen=True, eq=False)
class Gradient(GradientLayout):
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
            validate_layer(self, name, value)
        validate_batch_sizes(self._layer_batches())

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
            width = materialized_width_estimate(f, self.layer_types[name])
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

    # --------------------------------------------------------------- similarity

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
        return block_similarity(self, other, metric, reduce, mode, eps)

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
        return block_similarity_per_token(self, other, reduce)


# Stores pickle this class by its public path (set after the decorator, see records.py).
Gradient.__module__ = _SPEC_MODULE


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


GradientRecord.__module__ = _SPEC_MODULE

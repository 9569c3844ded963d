"""The layers, batch and token axes of a gradient block: select, slice, concatenate, aggregate.

:class:`GradientLayout` is a mixin of :class:`~dattri_llm.gradient.gradient.Gradient`
holding the methods that index, pad and combine a block along its batch and token
axes, with the per-payload helpers they use. It reads the host's fields (``data``,
``representation``, ``indexing``, ``layer_types``) and its helpers ``_derive``,
``_is_param_grad``, ``_block_batch`` and ``_is_broadcast``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import torch

from dattri_llm.gradient.model.records import (
    Factorized,
    GradientData,
    GradientShapeError,
    _check_choice,
    _layer_batch,
    _naming_layer,
    base_layer_name,
)
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import is_conv, is_conv_transpose

if TYPE_CHECKING:
    from typing_extensions import Self

_DIMS = ("batch", "token")


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


def _cat_factors(name: str, f1: Factorized, f2: Factorized, axis: int) -> Factorized:
    """Both factors of ``f1`` and ``f2`` concatenated along ``axis`` (:func:`_cat_checked`)."""
    return f1._with_factors(
        _cat_checked(name, "activation", f1.activation, f2.activation, axis),
        _cat_checked(
            name, "pre_activation_grad", f1.pre_activation_grad, f2.pre_activation_grad, axis
        ),
    )


def _uniform_batch(block: GradientLayout) -> bool:
    """Whether every layer of ``block`` holds one row per sample of the same batch."""
    batches = set()
    for name, value in block.data.items():
        if block._is_param_grad(name):
            return False
        batches.add(_layer_batch(value))
    return len(batches) <= 1


def _cat_padded(
    tensors: list[torch.Tensor], axis: int, token_axis: int | None, pads: list[float]
) -> torch.Tensor | None:
    """``tensors`` right-padded on ``token_axis`` (each with its pad value), cat on ``axis``.

    ``None`` when their other axes disagree (the pairwise concatenation raises then).
    """
    if token_axis is not None:
        length = max(t.shape[token_axis] for t in tensors)
        tensors = [_pad_axis(t, token_axis, length, pad) for t, pad in zip(tensors, pads)]
    first = tensors[0]
    for t in tensors[1:]:
        if t.ndim != first.ndim or any(
            t.shape[d] != first.shape[d] for d in range(t.ndim) if d != axis
        ):
            return None
    return torch.cat(tensors, dim=axis)


def concatenate_batches(blocks: Sequence[GradientLayout]) -> GradientLayout | None:
    """``blocks`` batch-concatenated in one copy per payload, as pairwise concatenation gives it.

    For blocks of one structure whose every layer holds one row per sample
    (no ``param_grad``, no broadcast layer): each payload is one ``torch.cat``
    of the (token-padded) pieces, where concatenating pairwise copies every row
    once per level of pairing. Returns ``None`` for anything else (differing
    structures or shapes, broadcast or ``param_grad`` layers), which the
    pairwise :meth:`GradientLayout.concatenate` handles (or refuses).
    """
    first = blocks[0]
    for block in blocks:
        if not _uniform_batch(block):
            return None
        if block is not first:
            try:
                first._check_same_structure(block)
            except (ValueError, TypeError):
                return None
    data: dict[str, GradientData] = {}
    for name, value in first.data.items():
        values = [block.data[name] for block in blocks]
        layer_type = first.layer_types[name]
        if isinstance(value, Factorized):
            token = {_has_token_axis(f, layer_type) for f in values}
            if len(token) != 1:
                return None
            token_axis = value.token_axis if token.pop() else None
            activation = _cat_padded(
                [f.activation for f in values],
                value.batch_axis,
                token_axis,
                [_activation_pad_value(f) for f in values],
            )
            grad = _cat_padded(
                [f.pre_activation_grad for f in values],
                value.batch_axis,
                token_axis,
                [0.0] * len(values),
            )
            if activation is None or grad is None:
                return None
            data[name] = value._with_factors(activation, grad)
        else:
            token_axis = 1 if first.indexing[name] == "batch_token" else None
            joined = _cat_padded(values, 0, token_axis, [0.0] * len(values))
            if joined is None:
                return None
            data[name] = joined
    representation = {name: first.representation[name] for name in first.data}
    indexing = {name: first.indexing[name] for name in first.data}
    return first._derive(data, representation, indexing, validate=True)


class GradientLayout:
    """Mixin of ``Gradient``: select layers, slice, concatenate and aggregate a block."""

    def select_layers(
        self, layer_names: str | Iterable[str], include_derived: bool = False
    ) -> Self:
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

    def _check_same_structure(self, other: Self) -> None:
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

    def concatenate(self, other: Self, dim: Literal["batch", "token"] = "batch") -> Self:
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

    def _concatenate_tokens(self, other: Self) -> Self:
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
                data[name] = _cat_factors(name, v1, v2, v1.token_axis)
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

    def _concatenate_batch(self, other: Self) -> Self:
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
                data[name] = _cat_factors(name, f1, f2, f1.batch_axis)
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

    def aggregate(self, dim: str = "token") -> Self:
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
    ) -> Self:
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

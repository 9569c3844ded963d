"""State-free pieces of online data selection: option checks, scoring, choice, exact removal.

Used by :class:`~dattri_llm.gradient.callbacks.data_selection_callback.DataSelectionCallback`.
Removal works on the captured factors: the weighted sum ``Σ_i w_i dW_i`` of one
layer is formed directly in the parameter's shape (one GEMM for linear layers,
a scatter-add for embeddings) and subtracted from ``param.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.model.records import Factorized, base_layer_name
from dattri_llm.gradient.ops.materialize import materialize_factors
from dattri_llm.gradient.ops.types import (
    PARAM_GRAD_TYPES,
    is_conv,
    is_conv_transpose,
    is_embedding,
)

TARGETS = ("batch", "fixed", "val_loader")
SCORE_MODES = ("ghost", "materialized")
THRESHOLD_MODES = ("hard", "bottom_fraction", "negative_bottom_fraction")
_SCORING_DEFAULTS: dict[str, Any] = {"score_mode": "ghost"}
_SELECTION_DEFAULTS: dict[str, Any] = {
    "threshold": 0.0,
    "threshold_mode": "hard",
    "layer_wise": False,
}
HF_CONV1D_TYPE = "transformers.pytorch_utils.Conv1D"
FSDP_WRAPPED_SEGMENT = "_fsdp_wrapped_module"
# Bias gradients sum ``g`` over every axis but the channel axis: dim 1 for these.
_CHANNEL_FIRST_NORMS = frozenset(
    {"nn.GroupNorm", "nn.InstanceNorm1d", "nn.InstanceNorm2d", "nn.InstanceNorm3d"}
)


# ----------------------------------------------------------------------------- options


def _with_defaults(kind: str, given: Mapping[str, Any] | None, defaults: dict) -> dict:
    """``defaults`` updated by ``given`` (unknown key: ``ValueError``; non-dict: ``TypeError``)."""
    if given is None:
        return dict(defaults)
    if not isinstance(given, Mapping):
        raise TypeError(
            f"DataSelectionCallback: {kind} must be a dict, got {type(given).__name__}."
        )
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"DataSelectionCallback: unknown {kind} keys {unknown}; allowed keys are "
            f"{sorted(defaults)}."
        )
    return {**defaults, **given}


def scoring_options(scoring_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validated ``{"score_mode": ...}`` (``ValueError`` for an unknown key or mode)."""
    options = _with_defaults("scoring_kwargs", scoring_kwargs, _SCORING_DEFAULTS)
    if options["score_mode"] not in SCORE_MODES:
        raise ValueError(
            f"DataSelectionCallback: scoring_kwargs['score_mode'] must be one of {SCORE_MODES}, "
            f"got {options['score_mode']!r}."
        )
    return options


def selection_options(selection_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validated ``{"threshold", "threshold_mode", "layer_wise"}`` with their defaults.

    Raises:
        ValueError: unknown key or threshold mode; a fraction mode with a threshold
            outside ``[0, 1)``.
        TypeError: a non-numeric threshold or a non-bool ``layer_wise``.
    """
    options = _with_defaults("selection_kwargs", selection_kwargs, _SELECTION_DEFAULTS)
    threshold, mode = options["threshold"], options["threshold_mode"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(
            f"DataSelectionCallback: selection_kwargs['threshold'] must be a float, got "
            f"{threshold!r}."
        )
    if mode not in THRESHOLD_MODES:
        raise ValueError(
            f"DataSelectionCallback: selection_kwargs['threshold_mode'] must be one of "
            f"{THRESHOLD_MODES}, got {mode!r}."
        )
    if mode != "hard" and not 0.0 <= threshold < 1.0:
        raise ValueError(
            f"DataSelectionCallback: threshold_mode {mode!r} drops a fraction of the batch, so "
            f"selection_kwargs['threshold'] must be in [0, 1), got {threshold}."
        )
    if not isinstance(options["layer_wise"], bool):
        raise TypeError(
            "DataSelectionCallback: selection_kwargs['layer_wise'] must be a bool, got "
            f"{options['layer_wise']!r}."
        )
    options["threshold"] = float(threshold)
    return options


# ----------------------------------------------------------------------------- scoring


def sample_layers(gradient: Gradient) -> list[str]:
    """Layers of ``gradient`` that carry a sample axis (every layer but ``param_grad`` ones)."""
    return [n for n in gradient.data if gradient.layer_types[n] != PARAM_GRAD_TYPES]


def layer_scores(
    gradient: Gradient, target: Gradient | None, score_mode: str
) -> dict[str, torch.Tensor]:
    """``{layer: (B,)}`` with ``score[i] = <dW_i, Σ_j dW_target_j>`` (``target=None``: the batch).

    Broadcast layers (batch 1) are expanded to ``B``; ``param_grad`` layers are left out.
    """
    train = gradient.select_layers(sample_layers(gradient))
    if target is None:
        other = train
    else:
        other = target.select_layers(sample_layers(target)).to(train.device)
    mode = "materialized" if score_mode == "materialized" else "auto"
    grams = train.similarity(other, mode=mode, reduce="none")
    batch = train.batch_size
    return {name: gram.sum(dim=1).expand(batch) for name, gram in grams.items()}


def choose_samples(scores: torch.Tensor, threshold: float, threshold_mode: str) -> list[int]:
    """Sorted indices to drop from ``scores : (B,)`` under one threshold mode."""
    scores = scores.detach().reshape(-1)
    if threshold_mode == "hard":
        return sorted(torch.nonzero(scores < threshold).reshape(-1).tolist())
    count = round(scores.numel() * threshold)
    candidates = torch.argsort(scores, stable=True)[:count]
    if threshold_mode == "negative_bottom_fraction":
        candidates = candidates[scores[candidates] < 0]
    return sorted(candidates.tolist())


# ----------------------------------------------------------------------------- batches


def concatenate_batches(batches: Sequence[object]) -> object:
    """Join equally structured batches along their batch axis.

    Tensors are concatenated on dim 0; mappings key by key; lists and tuples
    item by item. A single batch is returned as is.

    Raises:
        ValueError: tensors whose non-batch dimensions differ, or mappings /
            sequences of different keys / lengths.
        TypeError: a leaf that is not a tensor, mapping, list or tuple.
    """
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        shapes = {tuple(b.shape[1:]) for b in batches}
        if len(shapes) > 1:
            raise ValueError(
                f"DataSelectionCallback: validation batches disagree on non-batch dimensions "
                f"{sorted(shapes)}; pad them to equal shapes (e.g. a fixed max_length)."
            )
        return torch.cat(list(batches), dim=0)
    if isinstance(first, Mapping):
        keys = [list(b.keys()) for b in batches]
        if any(k != keys[0] for k in keys):
            raise ValueError(
                f"DataSelectionCallback: validation batches have different keys {keys}."
            )
        return {key: concatenate_batches([b[key] for b in batches]) for key in keys[0]}
    if isinstance(first, (list, tuple)):
        if len({len(b) for b in batches}) > 1:
            raise ValueError("DataSelectionCallback: validation batches have different lengths.")
        return type(first)(concatenate_batches(list(items)) for items in zip(*batches))
    raise TypeError(
        f"DataSelectionCallback: cannot concatenate validation batches of type "
        f"{type(first).__name__} (val_targets_per_pass > 1 needs tensors, mappings or sequences)."
    )


# ----------------------------------------------------------------------------- removal


def removal_weights(
    batch: int,
    dropped: Iterable[int],
    renormalize: bool,
    *,
    n_dropped: int | None = None,
    n_total: int | None = None,
) -> torch.Tensor:
    """Per-sample weights ``(B,)`` of the contribution subtracted from ``param.grad``.

    Dropped samples weigh ``1``. With ``renormalize`` and ``0 < k < N`` kept
    samples weigh ``-k/(N-k)``, so that the result is the mean-loss gradient
    over the kept samples; ``k``/``N`` are the global drop / sample counts
    (default: this batch's).
    """
    index = list(dropped)
    weights = torch.zeros(batch, dtype=torch.float32)
    k = len(index) if n_dropped is None else n_dropped
    n = batch if n_total is None else n_total
    if renormalize and 0 < k < n:
        weights.fill_(-k / (n - k))
    weights[index] = 1.0
    return weights


def _float_factor(x: torch.Tensor) -> torch.Tensor:
    """Floating factors in float32 at least (autocast captures are 16-bit); ids unchanged."""
    if x.is_floating_point() and x.dtype not in (torch.float32, torch.float64):
        return x.float()
    return x


def _batch_first(f: Factorized) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-first ``(a, g)`` of one layer's factors (floating ones in float32 at least)."""
    f = f.as_batch_first()
    return _float_factor(f.activation), _float_factor(f.pre_activation_grad)


def _scaled(f: Factorized, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-first ``(a, w_i·g_i)`` of one layer's factors."""
    a, g = _batch_first(f)
    w = weights.to(device=g.device, dtype=g.dtype).reshape(-1, *([1] * (g.ndim - 1)))
    return a, g * w


def _weight_delta(a: torch.Tensor, g: torch.Tensor, layer_type: str, module_kwargs: dict | None):
    """``Σ_i dW_i`` (weights already folded into ``g``) in the normative flat layout ``(d,)``."""
    if layer_type == "nn.Linear" or layer_type == HF_CONV1D_TYPE or is_embedding(layer_type):
        if layer_type != "nn.EmbeddingBag":
            # Per-token layers: all samples' tokens form one sample (a single GEMM / scatter).
            lead = a.shape[: g.ndim - 1] if not is_embedding(layer_type) else a.shape
            a = a.reshape(1, math.prod(lead), *a.shape[len(lead) :])
            g = g.reshape(1, math.prod(lead), g.shape[-1])
    return materialize_factors(a, g, layer_type, module_kwargs, include_bias=False).sum(dim=0)


def _as_weight_shape(flat: torch.Tensor, shape: torch.Size, layer_type: str) -> torch.Tensor:
    """Map flat ``(..., d)`` weight gradients to ``(..., *shape)`` (HF ``Conv1D`` is transposed)."""
    lead = flat.shape[:-1]
    if layer_type == HF_CONV1D_TYPE:
        return flat.reshape(*lead, shape[1], shape[0]).transpose(-1, -2)
    return flat.reshape(*lead, *shape)


def _bias_delta(g: torch.Tensor, layer_type: str, *, per_sample: bool = False) -> torch.Tensor:
    """``Σ g`` over every axis but the channel one (dim 1 for conv and channel-first norms);
    ``per_sample`` keeps the batch axis too: ``(B, C)``."""
    channel = (
        1
        if is_conv(layer_type)
        or is_conv_transpose(layer_type)
        or layer_type in _CHANNEL_FIRST_NORMS
        else g.ndim - 1
    )
    kept = {channel, 0} if per_sample else {channel}
    dims = [d for d in range(g.ndim) if d not in kept]
    return g.sum(dim=dims) if dims else g


def _removal_params(
    module: nn.Module, shards: Mapping[int, ShardSlice] | None
) -> list[tuple[str, nn.Parameter, torch.Size]]:
    """``[(attr, param, full shape)]`` of the module's ``weight`` / ``bias`` to edit.

    Without ``shards``: those holding a gradient. With ``shards`` (FSDP): every
    trainable one, whether or not this rank holds part of its gradient, so that
    all ranks build the same list for the collective.
    """
    out = []
    for attr in ("weight", "bias"):
        param = getattr(module, attr, None)
        if not isinstance(param, torch.Tensor):
            continue
        if shards is None:
            if param.grad is not None:
                out.append((attr, param, param.shape))
        elif param.requires_grad:
            if id(param) not in shards:
                raise NotImplementedError(
                    f"DataSelectionCallback: parameter {attr!r} of {type(module).__name__} is not "
                    "managed by an FSDP FlatParameter (ignored or unflattened); its gradient "
                    "shard cannot be located."
                )
            out.append((attr, param, shards[id(param)].shape))
    return out


def layer_deltas(
    f: Factorized,
    layer_type: str,
    module: nn.Module,
    weights: torch.Tensor,
    shards: Mapping[int, ShardSlice] | None = None,
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """``[(param, Σ_i w_i ∂L_i/∂param)]`` for the module's ``weight`` and ``bias``.

    Deltas have the parameter's full shape; ``shards`` (FSDP, see
    :func:`fsdp_shard_slices`) supplies it for sharded parameters.
    """
    a, g = _scaled(f, weights)
    out = []
    for attr, param, shape in _removal_params(module, shards):
        if attr == "weight":
            flat = _weight_delta(a, g, layer_type, f.module_kwargs)
            out.append((param, _as_weight_shape(flat, shape, layer_type)))
        else:
            out.append((param, _bias_delta(g, layer_type).reshape(shape)))
    return out


def sample_rows(
    f: Factorized, layer_type: str, module: nn.Module
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """``[(param, rows)]``: each sample's gradient of the module's ``weight`` / ``bias``.

    ``rows : (B, param.numel())`` float32 (at least), row ``i`` the flattened
    ``∂L_i/∂param`` in the parameter's own layout; only parameters holding a
    gradient. Materializes the layer's per-sample gradients (``B·numel`` numbers).
    """
    a, g = _batch_first(f)
    out = []
    for attr, param, shape in _removal_params(module, None):
        if attr == "weight":
            flat = materialize_factors(a, g, layer_type, f.module_kwargs, include_bias=False)
            rows = _as_weight_shape(flat, shape, layer_type)
        else:
            rows = _bias_delta(g, layer_type, per_sample=True)
        out.append((param, rows.reshape(rows.shape[0], -1)))
    return out


def removable_layers(record: GradientRecord, root: nn.Module) -> dict[str, nn.Module]:
    """``{layer: module}`` of the factorized, per-sample layers resolvable under ``root``.

    Names are matched with nested FSDP wrapper segments removed. Broadcast layers
    (batch 1 in a larger batch) and names that are no submodule of ``root`` are
    skipped.
    """
    gradient = record.gradient
    batch = gradient.batch_size
    modules = {_strip_wrappers(n): m for n, m in root.named_modules()}  # inner module wins
    out = {}
    for name in sorted(sample_layers(gradient)):
        value = gradient.data[name]
        if not isinstance(value, Factorized):
            continue
        if value.activation.shape[value.batch_axis] == 1 and batch > 1:
            continue
        module = modules.get(base_layer_name(name))
        if module is not None:
            out[name] = module
    return out


def _strip_wrappers(name: str) -> str:
    """``"blocks.0._fsdp_wrapped_module.fc"`` → ``"blocks.0.fc"`` (nested FSDP units)."""
    return ".".join(part for part in name.split(".") if part != FSDP_WRAPPED_SEGMENT)


def subtract(deltas: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """``param.grad -= delta`` for every pair (delta cast to the gradient's dtype/device)."""
    for param, delta in deltas:
        param.grad.sub_(delta.to(device=param.grad.device, dtype=param.grad.dtype))


# ----------------------------------------------------------------------------- FSDP shards


class ShardSlice(NamedTuple):
    """Where this rank's gradient shard of one parameter lies in the flattened full one.

    ``grad_shard = full.reshape(-1)[start:stop]``; ``start == stop`` when this rank
    holds none of it.
    """

    shape: torch.Size
    start: int
    stop: int


def fsdp_shard_slices(model: nn.Module) -> dict[int, ShardSlice]:
    """``{id(param): ShardSlice}`` of every original parameter of an FSDP1 model.

    Read from each unit's ``FlatParameter`` metadata (``_shapes``,
    ``_shard_param_infos``); parameters shared within a unit take their primary's
    slice.

    Raises:
        NotImplementedError: a unit built without ``use_orig_params=True``.
    """
    # optional dependency: torch.distributed.fsdp (absent from non-distributed builds)
    from torch.distributed.fsdp import FullyShardedDataParallel

    out: dict[int, ShardSlice] = {}
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        if not handle._use_orig_params:
            raise NotImplementedError(
                "DataSelectionCallback under FSDP needs FullyShardedDataParallel(..., "
                "use_orig_params=True): it edits each original parameter's gradient shard."
            )
        flat = handle.flat_param
        for param, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos):
            if info.in_shard:
                start, stop = info.intra_param_start_idx, info.intra_param_end_idx + 1
            else:
                start = stop = 0
            out[id(param)] = ShardSlice(torch.Size(shape), start, stop)
        for param, shared in zip(flat._shared_params or [], flat._shared_param_infos):
            primary = getattr(shared.prim_module, shared.prim_param_name)
            out[id(param)] = out[id(primary)]
    return out


def subtract_shards(
    deltas: list[tuple[nn.Parameter, torch.Tensor]], shards: Mapping[int, ShardSlice]
) -> None:
    """``param.grad -= delta.flatten()[start:stop]`` for every full-shape delta this rank holds."""
    for param, delta in deltas:
        piece = shards[id(param)]
        if param.grad is None or piece.start == piece.stop:
            continue
        local = delta.reshape(-1)[piece.start : piece.stop]
        param.grad.sub_(local.reshape(param.grad.shape).to(param.grad.device, param.grad.dtype))

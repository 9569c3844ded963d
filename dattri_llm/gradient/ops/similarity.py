"""The similarity of two gradient blocks, behind ``Gradient.similarity`` / ``similarity_per_token``.

Per-layer cross-Grams come from :func:`~dattri_llm.gradient.ops.dot.layerwise_cross_dot`
(per token from :func:`~dattri_llm.gradient.ops.dot.cross_dot_per_token`); this module
adds what the two ``Gradient`` methods do on top: their argument checks, the layers the
blocks share, cosine normalisation by per-layer or whole-model norms, and the layer sum.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from dattri_llm.gradient.model.records import Factorized, GradientBlock, _check_choice
from dattri_llm.gradient.ops.dot import (
    _ROUTING_MODES,
    cross_dot_per_token,
    grad_norm_sq,
    layerwise_cross_dot,
)
from dattri_llm.gradient.ops.dot_blocks import _dense_rows, _sum_broadcast

_SIMILARITY_METRICS = ("dot", "cosine")
_SIMILARITY_REDUCES = ("none", "all")


def _norms_sq(block: GradientBlock, layers: Iterable[str], mode: str) -> dict[str, torch.Tensor]:
    """``{layer: (B,) ‖dW_i‖²}`` of the rows ``ops.layerwise_cross_dot`` contracts: dense
    per-token payloads summed over tokens first, a ``param_grad`` payload one row."""
    norms = {}
    for name in layers:
        value = block.data[name]
        if isinstance(value, Factorized):
            norms[name] = grad_norm_sq(value, block.layer_types[name], mode=mode)
        else:
            norms[name] = _dense_rows(block, name).square().sum(dim=-1)
    return norms


def _norm_outer(norm_sq1: torch.Tensor, norm_sq2: torch.Tensor, eps: float) -> torch.Tensor:
    """``(sqrt(n1)+eps)(sqrt(n2)+eps)ᵀ`` as a ``(B1, B2)`` denominator."""
    return torch.outer(norm_sq1.sqrt() + eps, norm_sq2.sqrt() + eps)


def _rows(block: GradientBlock) -> int:
    """Rows of ``block`` in a layer-summed result: its batch size, at least 1."""
    try:
        return block.batch_size or 1
    except ValueError:  # only batch-level param_grad layers: one row
        return 1


def block_similarity(
    block: GradientBlock,
    other: GradientBlock,
    metric: Literal["dot", "cosine"] = "dot",
    reduce: Literal["none", "all"] = "none",
    mode: Literal["auto", "factorized", "materialized"] = "auto",
    eps: float = 1e-8,
) -> dict[str, torch.Tensor] | torch.Tensor:
    """``Gradient.similarity``: cross-Grams ``<dW_i, dW_j>`` of the layers in both blocks.

    ``metric="cosine"`` divides by ``(‖dW_i‖ + eps)(‖dW_j‖ + eps)``: per layer for
    ``reduce="none"``, whole-model norms for ``reduce="all"``, whose sum is
    ``(B_block, B_other)`` (broadcast layers expanded). See the method for the contract.
    """
    _check_choice("similarity", "metric", metric, _SIMILARITY_METRICS)
    _check_choice("similarity", "reduce", reduce, _SIMILARITY_REDUCES)
    _check_choice("similarity", "mode", mode, _ROUTING_MODES)
    shared = [name for name in block.data if name in other.data]
    if not shared:
        if reduce == "all":
            raise ValueError(
                f"Gradient.similarity: no shared layer (self: {sorted(block.data)}, other: "
                f"{sorted(other.data)})."
            )
        return {}
    grams = layerwise_cross_dot(block, other, layers=shared, mode=mode, reduce="none")
    grams = {name: grams[name] for name in shared}
    if metric == "cosine":
        norms1, norms2 = _norms_sq(block, shared, mode), _norms_sq(other, shared, mode)
    if reduce == "none":
        if metric == "cosine":
            grams = {n: k / _norm_outer(norms1[n], norms2[n], eps) for n, k in grams.items()}
        return grams
    shape = (_rows(block), _rows(other))
    total = sum(k.expand(shape) for k in grams.values())
    if metric == "cosine":
        total = total / _norm_outer(
            sum(norms1.values()).expand(shape[0]), sum(norms2.values()).expand(shape[1]), eps
        )
    return total


def block_similarity_per_token(
    block: GradientBlock, other: GradientBlock, reduce: Literal["none", "all"] = "all"
) -> dict[str, torch.Tensor] | torch.Tensor:
    """``Gradient.similarity_per_token``: ``(B_block, T_block, B_other)`` per-token scores.

    Scores the layers of ``block`` that are factorized and ``"batch_token"`` and present in
    ``other``; ``reduce="all"`` sums them (all must agree on ``T``).
    """
    _check_choice("similarity_per_token", "reduce", reduce, _SIMILARITY_REDUCES)
    layers = [
        name
        for name in block.data
        if block.representation[name] == "factorized"
        and block.indexing[name] == "batch_token"
        and name in other.data
    ]
    if not layers and reduce == "all":
        raise ValueError(
            "Gradient.similarity_per_token: no layer of self is factorized, 'batch_token' "
            f"and present in other (self: {sorted(block.data)}, other: {sorted(other.data)})."
        )
    scores = {
        name: cross_dot_per_token(block.data[name], other.data[name], block.layer_types[name])
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
    return _sum_broadcast(scores, "Gradient.similarity_per_token")

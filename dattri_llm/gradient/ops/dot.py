"""Inner products between per-sample gradients, with FLOP-aware routing.

Every kernel computes exact Frobenius inner products ``<dW1_i, dW2_j>`` of
per-sample weight gradients. Three layer families have their own math
(``preprocess_factors`` brings raw captures into these forms):

* **outer** (linear, conv, conv-transpose, and any final factors): ``a : (B, S, K)``,
  ``g : (B, S, D)``, ``dW_i = Σ_s g_s a_sᵀ``. Two exact routes:
  ``"factorized"`` (ghost) ``Σ_{s,t} <a1_s, a2_t><g1_s, g2_t>`` by blocked GEMMs over
  flattened token rows, and ``"materialized"`` (contract tokens into ``(B, D·K)``, then
  one GEMM). ``"auto"`` picks the cheaper route by the FLOP model of
  :func:`maybe_use_materialized_gram` / :func:`maybe_use_materialized_norm`.
* **norm** (LayerNorm, RMSNorm, GroupNorm, InstanceNorm): ``a, g : (B, S, d)``,
  ``dW_i = Σ_s a_s ⊙ g_s``; positions are always contracted first (``mode`` ignored).
* **embedding** (Embedding, EmbeddingBag): ``a : (B, T)`` integer ids, ``g : (B, T, E)``,
  ``dW_i`` = scatter-add of the rows of ``g`` at the ids. Only ids present on both sides
  contribute, so each side is scatter-added into the rows of the *shared* ids and the
  compact tables are contracted (``mode`` ignored).

Intermediates are computed in blocks of at most ``_BLOCK_ELEMENTS`` elements, so memory
stays bounded for long sequences and large batches. Floating operands are cast to the
compute dtype of :mod:`dattri_llm.gradient.ops.dtypes` (promoted operand dtype by default).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dattri_llm.gradient.ops.dtypes import align
from dattri_llm.gradient.ops.types import (
    ALL_LAYER_TYPES,
    PARAM_GRAD_TYPES,
    is_conv,
    is_conv_transpose,
    is_embedding,
    is_norm,
)

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import Factorized, Gradient
    from dattri_llm.options import DotReduce, RoutingMode
    from dattri_llm.utils.cache import TensorCache

_ROUTING_MODES = ("auto", "factorized", "materialized")
_REDUCTIONS = ("sum", "none")
# Largest intermediate (elements) one block of a kernel may allocate: 64 MiB in float32.
_BLOCK_ELEMENTS = 1 << 24
# Side-1 token rows a ghost block aims to hold, so side-2 chunks are not made too small.
_MIN_GHOST_ROWS = 256


# --------------------------------------------------------------------------- routing


def maybe_use_materialized_gram(
    B1: int, B2: int, S: int, K: int, D: int, kappa: float = 1.0
) -> bool:
    """Whether a cross-Gram is cheaper materialized than factorized.

    ``cost_F = B1·B2·S²·(D+K)`` (ghost contraction over token pairs) against
    ``cost_M = (B1+B2)·S·D·K + B1·B2·D·K`` (contract tokens, then one GEMM); returns
    ``kappa·cost_F >= cost_M``. ``kappa`` scales the factorized cost (e.g. to reflect
    measured GEMM efficiency); ties go to the materialized route.
    """
    return _prefers_materialized_gram(B1, S, B2, S, K, D, kappa)


def maybe_use_materialized_norm(S: int, K: int, D: int) -> bool:
    """Whether per-sample squared norms are cheaper materialized: ``S·(D+K) >= D·K``."""
    return S * (D + K) >= D * K


def _prefers_materialized_gram(
    B1: int, S1: int, B2: int, S2: int, K: int, D: int, kappa: float = 1.0
) -> bool:
    """:func:`maybe_use_materialized_gram` for sides with different token counts.

    ``cost_F = B1·B2·S1·S2·(D+K)``, ``cost_M = (B1·S1 + B2·S2)·D·K + B1·B2·D·K``; equal to
    the published formula when ``S1 == S2``.
    """
    cost_f = B1 * B2 * S1 * S2 * (D + K)
    cost_m = (B1 * S1 + B2 * S2) * D * K + B1 * B2 * D * K
    return kappa * cost_f >= cost_m


def _prefers_materialized_per_token(B1: int, S1: int, B2: int, S2: int, K: int, D: int) -> bool:
    """Per-token cross-Gram routing: ghost ``B1·S1·B2·S2·(D+K)`` against materializing
    side 2 (``B2·S2·D·K``) and applying it to every side-1 token (``B1·S1·B2·D·K``)."""
    cost_f = B1 * S1 * B2 * S2 * (D + K)
    cost_m = B2 * S2 * D * K + B1 * S1 * B2 * D * K
    return cost_f >= cost_m


def effective_dims(f: Factorized, layer_type: str) -> tuple[int, int, int, int]:
    """Routing dimensions ``(B, S, K, D)`` of a factorized layer from raw shapes (no compute).

    Final factors (``module_kwargs is None``), linear and norm layers:
    ``(B, Π a.shape[1:-1], a.shape[-1], g.shape[-1])``; conv ``(B, Π g.shape[2:],
    C_in·Πkernel, C_out)``; conv-transpose ``(B, Π a.shape[2:], C_in, C_out·Πkernel)``;
    embedding ``(B, Π a.shape[1:], num_embeddings, E)`` (the one-hot input width).
    The bias ``+1`` is ignored.
    """
    f = f.as_batch_first()
    a, g, kwargs = f.activation, f.pre_activation_grad, f.module_kwargs
    batch = a.shape[0]
    if kwargs is not None and is_conv(layer_type):
        return (
            batch,
            math.prod(g.shape[2:]),
            a.shape[1] * math.prod(kwargs["kernel_size"]),
            g.shape[1],
        )
    if kwargs is not None and is_conv_transpose(layer_type):
        return (
            batch,
            math.prod(a.shape[2:]),
            a.shape[1],
            g.shape[1] * math.prod(kwargs["kernel_size"]),
        )
    if kwargs is not None and is_embedding(layer_type):
        return batch, math.prod(a.shape[1:]), kwargs["num_embeddings"], g.shape[-1]
    return batch, math.prod(a.shape[1:-1]), a.shape[-1], g.shape[-1]


# --------------------------------------------------------------------------- validation


def _check_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is a routing mode."""
    if mode not in _ROUTING_MODES:
        raise ValueError(
            f"mode={mode!r} is not a routing mode; it must be one of {_ROUTING_MODES}."
        )


def _check_reduce(reduce: str) -> None:
    """Raise ``ValueError`` unless ``reduce`` is ``"sum"`` or ``"none"``."""
    if reduce not in _REDUCTIONS:
        raise ValueError(f"reduce={reduce!r} is invalid; it must be one of {_REDUCTIONS}.")


def _family(layer_type: str, fn: str) -> str:
    """``"outer"``, ``"norm"`` or ``"embedding"``; ``ValueError`` for unknown types."""
    if layer_type == PARAM_GRAD_TYPES:
        raise ValueError(
            f"{fn}: layer type {PARAM_GRAD_TYPES!r} has no factors; its payload is a dense "
            "batch-level gradient, use cross_dot with dense tensors instead."
        )
    if layer_type not in ALL_LAYER_TYPES:
        raise ValueError(
            f"{fn}: unknown layer type {layer_type!r}; it must be one of {sorted(ALL_LAYER_TYPES)}."
        )
    if is_norm(layer_type):
        return "norm"
    if is_embedding(layer_type):
        return "embedding"
    return "outer"


def _shape(x: Tensor) -> tuple[int, ...]:
    """Shape as a plain tuple for error messages."""
    return tuple(x.shape)


def _check_side(a: Tensor, g: Tensor, layer_type: str, family: str, fn: str, side: str):
    """Validate one side's preprocessed factors and return them as ``(B, S, ·)``.

    Embedding sides come back unchanged (``(B, T)`` ids, ``(B, T, E)``).
    """
    where = f"{fn}({layer_type}): {side} activation {_shape(a)} and output gradient {_shape(g)}"
    if family == "embedding":
        if a.dim() != 2 or g.dim() != 3 or a.shape != g.shape[:2]:
            raise ValueError(
                f"{where} do not match; expected preprocessed ids a:(B, T) and g:(B, T, E) "
                "(pass module_kwargs to preprocess raw captures)."
            )
        if a.is_floating_point() or a.is_complex():
            raise TypeError(f"{where}: token ids must be an integer tensor, got {a.dtype}.")
        return a, g
    if a.dim() < 2 or a.dim() != g.dim() or a.shape[:-1] != g.shape[:-1]:
        raise ValueError(
            f"{where} do not match; expected a:(B, [T,] K) and g:(B, [T,] D) with the same "
            "batch and token axes (same rank)."
        )
    if family == "norm" and a.shape != g.shape:
        raise ValueError(
            f"{where} differ; a normalization layer's preprocessed factors are elementwise "
            "and must have the same shape."
        )
    batch = a.shape[0]
    return a.reshape(batch, -1, a.shape[-1]), g.reshape(batch, -1, g.shape[-1])


def _check_widths(a1, g1, a2, g2, layer_type: str, family: str, fn: str) -> None:
    """Raise ``ValueError`` when the two sides' factor widths differ (ids have none)."""
    same_a = family == "embedding" or a1.shape[-1] == a2.shape[-1]
    if same_a and g1.shape[-1] == g2.shape[-1]:
        return
    raise ValueError(
        f"{fn}({layer_type}): side-1 factors a{_shape(a1)}, g{_shape(g1)} and side-2 factors "
        f"a{_shape(a2)}, g{_shape(g2)} have different widths. Both sides must come from the same "
        "layer with the same preprocessing and projection: a projected side (final factors, "
        "module_kwargs=None) cannot be compared with an unprojected one, and include_bias must "
        "agree."
    )


def _check_aligned_batch(x1: Tensor, x2: Tensor, layer_type: str, fn: str) -> None:
    """Raise ``ValueError`` unless both sides have the same batch size."""
    if x1.shape[0] != x2.shape[0]:
        raise ValueError(
            f"{fn}({layer_type}): aligned dot needs equal batch sizes, got side 1 "
            f"{_shape(x1)} and side 2 {_shape(x2)}; use cross_dot for a (B1, B2) matrix."
        )


def _checked_pair(a1, g1, a2, g2, layer_type: str, fn: str):
    """Family plus validated, dtype-aligned ``(a1, g1, a2, g2)`` of two preprocessed sides."""
    family = _family(layer_type, fn)
    a1, g1 = _check_side(a1, g1, layer_type, family, fn, "side-1")
    a2, g2 = _check_side(a2, g2, layer_type, family, fn, "side-2")
    _check_widths(a1, g1, a2, g2, layer_type, family, fn)
    return (family, *align(a1, g1, a2, g2))


def _checked_single(a: Tensor, g: Tensor, layer_type: str, fn: str):
    """Family plus validated, dtype-aligned ``(a, g)`` of one preprocessed side."""
    family = _family(layer_type, fn)
    a, g = _check_side(a, g, layer_type, family, fn, "the")
    return (family, *align(a, g))


# --------------------------------------------------------------------------- outer family


def _outer_materialize(a: Tensor, g: Tensor) -> Tensor:
    """Per-sample ``Σ_s g_s a_sᵀ`` flattened: ``(B, S, K), (B, S, D) -> (B, D·K)``."""
    return torch.bmm(g.transpose(1, 2), a).reshape(a.shape[0], -1)


def _samples_per_block(per_sample: int, total: int) -> int:
    """How many samples of ``per_sample`` elements fit one block (at least 1, at most total)."""
    return max(1, min(total, _BLOCK_ELEMENTS // max(1, per_sample)))


def _outer_ghost_blocks(a1: Tensor, g1: Tensor, a2: Tensor, g2: Tensor):
    """Yield ``(rows, j0, contrib)`` blocks of the token-level ghost contraction.

    ``contrib : (R, n)`` holds ``Σ_t <a1_r, a2_jt><g1_r, g2_jt>`` for the side-1 token rows
    ``rows`` (a slice of the flattened ``B1·S1`` rows) and side-2 samples ``j0..j0+n``.
    """
    b1, s1, _ = a1.shape
    b2, s2, _ = a2.shape
    a1f, g1f = a1.reshape(b1 * s1, -1), g1.reshape(b1 * s1, -1)
    n_rows = b1 * s1
    cols = _samples_per_block(s2 * min(n_rows, _MIN_GHOST_ROWS), b2)
    for j0 in range(0, b2, cols):
        a2c = a2[j0 : j0 + cols].reshape(-1, a2.shape[-1])
        g2c = g2[j0 : j0 + cols].reshape(-1, g2.shape[-1])
        n = a2c.shape[0] // s2
        step = _samples_per_block(a2c.shape[0], n_rows)
        for r0 in range(0, n_rows, step):
            rows = slice(r0, min(r0 + step, n_rows))
            prod = a1f[rows] @ a2c.T
            prod.mul_(g1f[rows] @ g2c.T)
            yield rows, j0, prod.view(-1, n, s2).sum(-1)


def _outer_ghost_cross(a1: Tensor, g1: Tensor, a2: Tensor, g2: Tensor) -> Tensor:
    """Ghost cross-Gram ``(B1, B2)`` of outer-family factors."""
    b1, s1, _ = a1.shape
    out = a1.new_zeros(b1, a2.shape[0])
    if s1 == 0 or a2.shape[1] == 0:
        return out
    owner = torch.arange(b1, device=a1.device).repeat_interleave(s1)
    for rows, j0, contrib in _outer_ghost_blocks(a1, g1, a2, g2):
        out[:, j0 : j0 + contrib.shape[1]].index_add_(0, owner[rows], contrib)
    return out


def _outer_ghost_per_token(a1: Tensor, g1: Tensor, a2: Tensor, g2: Tensor) -> Tensor:
    """Ghost per-token cross-Gram ``(B1, S1, B2)`` of outer-family factors."""
    b1, s1, _ = a1.shape
    out = a1.new_zeros(b1 * s1, a2.shape[0])
    if s1 > 0 and a2.shape[1] > 0:
        for rows, j0, contrib in _outer_ghost_blocks(a1, g1, a2, g2):
            out[rows, j0 : j0 + contrib.shape[1]] = contrib
    return out.view(b1, s1, -1)


def _outer_materialized_cross(
    a1: Tensor, g1: Tensor, a2: Tensor, g2: Tensor, same: bool = False
) -> Tensor:
    """Materialized cross-Gram ``(B1, B2)``: side 2 held whole, side 1 in sample blocks.

    ``same=True`` (a self Gram) materializes once.
    """
    m2 = _outer_materialize(a2, g2)
    if same:
        return m2 @ m2.T
    out = m2.new_empty(a1.shape[0], m2.shape[0])
    step = _samples_per_block(m2.shape[1], a1.shape[0])
    for i0 in range(0, a1.shape[0], step):
        rows = slice(i0, i0 + step)
        out[rows] = _outer_materialize(a1[rows], g1[rows]) @ m2.T
    return out


def _outer_ghost_aligned(a1: Tensor, g1: Tensor, a2: Tensor, g2: Tensor) -> Tensor:
    """Aligned ghost dot ``(B,)``: ``Σ_{s,t} <a1_is, a2_it><g1_is, g2_it>`` per sample."""
    b, s1, _ = a1.shape
    s2 = a2.shape[1]
    out = a1.new_zeros(b)
    n = _samples_per_block(s1 * s2, b)
    tokens = s1 if n > 1 else max(1, min(s1, _BLOCK_ELEMENTS // max(1, s2)))
    for i0 in range(0, b, n):
        i = slice(i0, i0 + n)
        a2t, g2t = a2[i].transpose(1, 2), g2[i].transpose(1, 2)
        for t0 in range(0, s1, tokens):
            t = slice(t0, t0 + tokens)
            prod = torch.bmm(a1[i, t], a2t)
            prod.mul_(torch.bmm(g1[i, t], g2t))
            out[i] += prod.sum((1, 2))
    return out


def _outer_materialized_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    """Materialized ``‖dW_i‖²`` ``(B,)`` in sample blocks."""
    out = a.new_empty(a.shape[0])
    step = _samples_per_block(a.shape[-1] * g.shape[-1], a.shape[0])
    for i0 in range(0, a.shape[0], step):
        rows = slice(i0, i0 + step)
        out[rows] = _outer_materialize(a[rows], g[rows]).square().sum(-1)
    return out


def _outer_dense_per_token(a1: Tensor, g1: Tensor, m2: Tensor) -> Tensor:
    """Per-token contributions ``g1_rᵀ M2_j a1_r`` ``(B1, S1, B2)``; ``m2 : (B2, D, K)``."""
    b1, s1, k = a1.shape
    b2, d, _ = m2.shape
    a1f, g1f = a1.reshape(b1 * s1, k), g1.reshape(b1 * s1, d)
    m2f = m2.reshape(b2 * d, k)
    out = a1.new_empty(b1 * s1, b2)
    step = _samples_per_block(b2 * d, b1 * s1)
    for r0 in range(0, b1 * s1, step):
        rows = slice(r0, r0 + step)
        projected = (a1f[rows] @ m2f.T).view(-1, b2, d)
        out[rows] = torch.einsum("rjd,rd->rj", projected, g1f[rows])
    return out.view(b1, s1, b2)


# --------------------------------------------------------------------------- norm family


def _norm_materialize(a: Tensor, g: Tensor) -> Tensor:
    """Norm-family per-sample gradient ``Σ_s a_s ⊙ g_s``: ``(B, S, d) -> (B, d)``."""
    return torch.einsum("bsd,bsd->bd", a, g)


# --------------------------------------------------------------------------- embedding family


def _id_positions(ids: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """Index of every id in the sorted ``keys`` and whether the id is one of them."""
    if keys.numel() == 0:
        return torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    pos = torch.searchsorted(keys, ids).clamp_(max=keys.numel() - 1)
    return pos, keys[pos] == ids


def _scatter_rows(pos: Tensor, hit: Tensor, g: Tensor, k0: int, k1: int) -> Tensor:
    """Scatter-add ``g`` rows whose key index is in ``[k0, k1)``: ``(B, k1-k0, E)``."""
    b, t, e = g.shape
    keep = hit & (pos >= k0) & (pos < k1)
    sample = torch.arange(b, device=g.device).unsqueeze(1).expand(b, t)
    flat = sample[keep] * (k1 - k0) + (pos[keep] - k0)
    out = g.new_zeros(b * (k1 - k0), e)
    out.index_add_(0, flat, g[keep])
    return out.view(b, k1 - k0, e)


def _shared_ids(ids1: Tensor, ids2: Tensor) -> Tensor:
    """Sorted ids present on both sides (only these rows of ``dW`` overlap)."""
    u1 = torch.unique(ids1)
    return u1[torch.isin(u1, ids2)]


def _embedding_contract(ids1, g1, ids2, g2, keys: Tensor, combine) -> Tensor:
    """Scatter both sides into key blocks and ``combine(W1, W2)`` summed over blocks.

    ``W : (B, k, E)`` holds each sample's ``dW`` rows for the block's keys.
    """
    pos1, hit1 = _id_positions(ids1, keys)
    pos2, hit2 = _id_positions(ids2, keys)
    per_key = (g1.shape[0] + g2.shape[0]) * g1.shape[-1]
    step = _samples_per_block(per_key, max(1, keys.numel()))
    total = None
    for k0 in range(0, keys.numel(), step):
        k1 = min(k0 + step, keys.numel())
        part = combine(_scatter_rows(pos1, hit1, g1, k0, k1), _scatter_rows(pos2, hit2, g2, k0, k1))
        total = part if total is None else total + part
    return total


def _embedding_cross(ids1: Tensor, g1: Tensor, ids2: Tensor, g2: Tensor) -> Tensor:
    """Embedding cross-Gram ``(B1, B2)`` over the ids both sides share."""
    total = _embedding_contract(
        ids1,
        g1,
        ids2,
        g2,
        _shared_ids(ids1, ids2),
        lambda w1, w2: w1.flatten(1) @ w2.flatten(1).T,
    )
    return g1.new_zeros(g1.shape[0], g2.shape[0]) if total is None else total


def _embedding_aligned(ids1: Tensor, g1: Tensor, ids2: Tensor, g2: Tensor) -> Tensor:
    """Aligned embedding dot ``(B,)``."""
    total = _embedding_contract(
        ids1, g1, ids2, g2, _shared_ids(ids1, ids2), lambda w1, w2: (w1 * w2).sum((1, 2))
    )
    return g1.new_zeros(g1.shape[0]) if total is None else total


def _embedding_norm_sq(ids: Tensor, g: Tensor) -> Tensor:
    """Embedding ``‖dW_i‖²`` ``(B,)``: one side scattered onto its own ids."""
    keys = torch.unique(ids)
    pos, hit = _id_positions(ids, keys)
    step = _samples_per_block(g.shape[0] * g.shape[-1], max(1, keys.numel()))
    out = g.new_zeros(g.shape[0])
    for k0 in range(0, keys.numel(), step):
        out += _scatter_rows(pos, hit, g, k0, min(k0 + step, keys.numel())).square().sum((1, 2))
    return out


def _embedding_table_per_token(pos1: Tensor, hit1: Tensor, g1: Tensor, table: Tensor) -> Tensor:
    """``<g1_it, table_j[pos1_it]>`` for hit tokens (else 0): ``(B1, T1, B2)``.

    ``table : (B2, U, E)`` rows indexed by ``pos1``.
    """
    b1, t1, e = g1.shape
    b2 = table.shape[0]
    out = g1.new_zeros(b1 * t1, b2)
    rows = hit1.reshape(-1).nonzero().squeeze(1)
    pos, gf = pos1.reshape(-1), g1.reshape(-1, e)
    step = _samples_per_block(b2 * e, max(1, rows.numel()))
    for r0 in range(0, rows.numel(), step):
        r = rows[r0 : r0 + step]
        out[r] = torch.einsum("jre,re->rj", table[:, pos[r]], gf[r])
    return out.view(b1, t1, b2)


def _embedding_per_token(ids1: Tensor, g1: Tensor, ids2: Tensor, g2: Tensor) -> Tensor:
    """Embedding per-token cross-Gram ``(B1, T1, B2)``: side 2 scattered onto shared ids."""
    keys = _shared_ids(ids1, ids2)
    pos2, hit2 = _id_positions(ids2, keys)
    pos1, hit1 = _id_positions(ids1, keys)
    table = _scatter_rows(pos2, hit2, g2, 0, keys.numel())
    return _embedding_table_per_token(pos1, hit1, g1, table)


# --------------------------------------------------------------------------- preprocessed kernels


def cross_gram(
    a1: Tensor,
    g1: Tensor,
    a2: Tensor,
    g2: Tensor,
    layer_type: str,
    mode: RoutingMode = "auto",
) -> Tensor:
    """Cross-Gram ``K[i, j] = <dW1_i, dW2_j>`` ``(B1, B2)`` of **preprocessed** factors.

    Outer family ``a : (B, [S,] K)``, ``g : (B, [S,] D)`` (extra token axes folded); the
    sides may differ in token count. ``mode`` routes the outer family (``"auto"`` uses the
    FLOP model, generalised to ``S1 != S2``); norm and embedding layers ignore it.
    """
    _check_mode(mode)
    same = a1 is a2 and g1 is g2
    family, a1, g1, a2, g2 = _checked_pair(a1, g1, a2, g2, layer_type, "cross_gram")
    if family == "norm":
        return _norm_materialize(a1, g1) @ _norm_materialize(a2, g2).T
    if family == "embedding":
        return _embedding_cross(a1, g1, a2, g2)
    if _use_materialized_gram(a1, g1, a2, g2, mode):
        return _outer_materialized_cross(a1, g1, a2, g2, same)
    return _outer_ghost_cross(a1, g1, a2, g2)


def _use_materialized_gram(a1: Tensor, g1: Tensor, a2: Tensor, g2: Tensor, mode: str) -> bool:
    """Route of an outer-family cross-Gram on ``(B, S, ·)`` factors."""
    if mode != "auto":
        return mode == "materialized"
    b1, s1, k = a1.shape
    b2, s2, _ = a2.shape
    return _prefers_materialized_gram(b1, s1, b2, s2, k, g1.shape[-1])


def cross_gram_per_token(a1: Tensor, g1: Tensor, a2: Tensor, g2: Tensor, layer_type: str) -> Tensor:
    """Per-token cross-Gram ``(B1, T1, B2)`` of **preprocessed** factors.

    Entry ``[i, t, j]`` is token ``t`` of sample ``i``'s contribution to
    ``<dW1_i, dW2_j>``; summing over ``t`` gives :func:`cross_gram`. The outer family
    routes by FLOPs between the ghost contraction and materializing side 2.
    """
    family, a1, g1, a2, g2 = _checked_pair(a1, g1, a2, g2, layer_type, "cross_gram_per_token")
    if family == "norm":
        return (a1 * g1) @ _norm_materialize(a2, g2).T
    if family == "embedding":
        return _embedding_per_token(a1, g1, a2, g2)
    b1, s1, k = a1.shape
    b2, s2, _ = a2.shape
    if _prefers_materialized_per_token(b1, s1, b2, s2, k, g1.shape[-1]):
        m2 = _outer_materialize(a2, g2).view(b2, g2.shape[-1], k)
        return _outer_dense_per_token(a1, g1, m2)
    return _outer_ghost_per_token(a1, g1, a2, g2)


def cross_gram_per_token_dense(a1: Tensor, g1: Tensor, m2: Tensor, layer_type: str) -> Tensor:
    """Per-token cross-Gram ``(B1, T1, B2)`` of preprocessed side 1 against a dense side 2.

    ``m2 : (B2, d)`` is in the :func:`materialize` layout: ``(D, K)`` row-major for
    linear/conv, ``(K, D)`` for conv-transpose, ``d`` for norms, ``(vocab, E)`` for
    embeddings.
    """
    fn = "cross_gram_per_token_dense"
    family, a1, g1 = _checked_single(a1, g1, layer_type, fn)
    if m2.dim() != 2:
        raise ValueError(f"{fn}({layer_type}): dense side must be (B2, d), got {_shape(m2)}.")
    a1, g1, m2 = align(a1, g1, m2)
    if family == "norm":
        _check_dense_width(m2, g1.shape[-1], layer_type, fn, f"g{_shape(g1)}")
        return (a1 * g1) @ m2.T
    if family == "embedding":
        return _embedding_dense_per_token(a1, g1, m2, layer_type, fn)
    d, k = g1.shape[-1], a1.shape[-1]
    _check_dense_width(m2, d * k, layer_type, fn, f"a{_shape(a1)}, g{_shape(g1)}")
    if is_conv_transpose(layer_type):
        m2 = m2.view(-1, k, d).transpose(1, 2)
    return _outer_dense_per_token(a1, g1, m2.view(-1, d, k))


def _check_dense_width(m: Tensor, width: int, layer_type: str, fn: str, factors: str) -> None:
    """Raise ``ValueError`` unless the dense side is ``width`` wide."""
    if m.shape[-1] != width:
        raise ValueError(
            f"{fn}({layer_type}): dense side {_shape(m)} is not {width} wide as the factors "
            f"{factors} require; both sides must be the same layer with the same projection "
            "and include_bias."
        )


def _embedding_dense_per_token(ids: Tensor, g: Tensor, m2: Tensor, layer_type: str, fn: str):
    """Per-token contributions of embedding factors against dense ``(B2, vocab·E)`` rows."""
    e = g.shape[-1]
    if m2.shape[-1] % e != 0:
        raise ValueError(
            f"{fn}({layer_type}): dense side {_shape(m2)} is not a multiple of the embedding "
            f"width E={e} of g{_shape(g)}; expected (B2, num_embeddings·E)."
        )
    vocab = m2.shape[-1] // e
    _check_id_range(ids, vocab, layer_type, fn)
    hit = torch.ones_like(ids, dtype=torch.bool)
    return _embedding_table_per_token(ids, hit, g, m2.view(m2.shape[0], vocab, e))


def _check_id_range(ids: Tensor, vocab: int, layer_type: str, fn: str) -> None:
    """Raise ``ValueError`` if a token id is negative or ``>= vocab``."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{fn}({layer_type}): token ids of {_shape(ids)} span [{int(ids.min())}, "
            f"{int(ids.max())}] but the embedding has {vocab} rows; check num_embeddings and "
            "that the ids were captured from this layer."
        )


# --------------------------------------------------------------------------- raw-factor kernels


def _prepare(a, g, layer_type: str, module_kwargs: dict | None, include_bias: bool, fn: str):
    """Preprocess raw batch-first factors (identity for final factors)."""
    if module_kwargs is None:
        return a, g
    from dattri_llm.gradient.ops.preprocess import preprocess_factors

    a, g = preprocess_factors(a, g, layer_type, module_kwargs, include_bias)
    vocab = module_kwargs.get("num_embeddings")
    if is_embedding(layer_type) and vocab is not None:
        _check_id_range(a, vocab, layer_type, fn)
    return a, g


def cross_dot_factors(
    a1: Tensor,
    g1: Tensor,
    a2: Tensor,
    g2: Tensor,
    layer_type: str,
    module_kwargs1: dict | None = None,
    module_kwargs2: dict | None = None,
    include_bias: bool = True,
    mode: RoutingMode = "auto",
) -> Tensor:
    """``K[i, j] = <dW1_i, dW2_j>`` ``(B1, B2)`` from raw batch-first factors of one layer."""
    _check_mode(mode)
    a1, g1 = _prepare(a1, g1, layer_type, module_kwargs1, include_bias, "cross_dot_factors")
    a2, g2 = _prepare(a2, g2, layer_type, module_kwargs2, include_bias, "cross_dot_factors")
    return cross_gram(a1, g1, a2, g2, layer_type, mode)


def pairwise_dot_factors(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
    mode: RoutingMode = "auto",
) -> Tensor:
    """Self Gram ``(B, B)`` of one batch's raw factors (preprocessed and materialized once)."""
    _check_mode(mode)
    a, g = _prepare(a, g, layer_type, module_kwargs, include_bias, "pairwise_dot_factors")
    return cross_gram(a, g, a, g, layer_type, mode)


def dot_factors(
    a1: Tensor,
    g1: Tensor,
    a2: Tensor,
    g2: Tensor,
    layer_type: str,
    module_kwargs1: dict | None = None,
    module_kwargs2: dict | None = None,
    include_bias: bool = True,
) -> Tensor:
    """Aligned dots ``<dW1_i, dW2_i>`` ``(B,)`` (outer family always by ghost contraction)."""
    fn = "dot_factors"
    a1, g1 = _prepare(a1, g1, layer_type, module_kwargs1, include_bias, fn)
    a2, g2 = _prepare(a2, g2, layer_type, module_kwargs2, include_bias, fn)
    family, a1, g1, a2, g2 = _checked_pair(a1, g1, a2, g2, layer_type, fn)
    _check_aligned_batch(a1, a2, layer_type, fn)
    if family == "norm":
        return (_norm_materialize(a1, g1) * _norm_materialize(a2, g2)).sum(-1)
    if family == "embedding":
        return _embedding_aligned(a1, g1, a2, g2)
    return _outer_ghost_aligned(a1, g1, a2, g2)


def grad_norm_sq_factors(
    a: Tensor,
    g: Tensor,
    layer_type: str,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
    mode: RoutingMode = "auto",
) -> Tensor:
    """Per-sample squared norms ``‖dW_i‖²`` ``(B,)``.

    ``"auto"`` routes the outer family by :func:`maybe_use_materialized_norm`.
    """
    _check_mode(mode)
    fn = "grad_norm_sq_factors"
    a, g = _prepare(a, g, layer_type, module_kwargs, include_bias, fn)
    family, a, g = _checked_single(a, g, layer_type, fn)
    if family == "norm":
        return _norm_materialize(a, g).square().sum(-1)
    if family == "embedding":
        return _embedding_norm_sq(a, g)
    materialized = mode == "materialized" or (
        mode == "auto" and maybe_use_materialized_norm(a.shape[1], a.shape[-1], g.shape[-1])
    )
    if materialized:
        return _outer_materialized_norm_sq(a, g)
    return _outer_ghost_aligned(a, g, a, g)


# --------------------------------------------------------------------------- Factorized wrappers


def _require_factorized(f: Any, fn: str, layer_type: str) -> Factorized:
    """Return ``f`` batch-first, or raise ``TypeError`` if it is not a ``Factorized``."""
    if isinstance(f, Tensor) or not hasattr(f, "as_batch_first"):
        raise TypeError(
            f"{fn}({layer_type}) needs a Factorized gradient, got {type(f).__name__}; "
            "use cross_dot / grad_norm_sq for dense tensors."
        )
    return f.as_batch_first()


def _as_dense(x: Factorized | Tensor, layer_type: str, include_bias: bool) -> Tensor:
    """``(B, d)`` rows of a dense tensor (reshaped) or a materialized ``Factorized``."""
    if isinstance(x, Tensor):
        if x.dim() == 0:
            raise ValueError(f"dense gradient of layer type {layer_type!r} must have a batch axis.")
        return x.reshape(x.shape[0], -1)
    from dattri_llm.gradient.ops.materialize import materialize

    return materialize(x, layer_type, include_bias)


def dot(f1: Factorized, f2: Factorized, layer_type: str, include_bias: bool = True) -> Tensor:
    """Aligned dots ``<dW1_i, dW2_i>`` ``(B,)`` of two ``Factorized`` gradients."""
    f1 = _require_factorized(f1, "dot", layer_type)
    f2 = _require_factorized(f2, "dot", layer_type)
    return dot_factors(
        f1.activation,
        f1.pre_activation_grad,
        f2.activation,
        f2.pre_activation_grad,
        layer_type,
        f1.module_kwargs,
        f2.module_kwargs,
        include_bias,
    )


def pairwise_dot(
    f: Factorized, layer_type: str, include_bias: bool = True, mode: RoutingMode = "auto"
) -> Tensor:
    """Self Gram ``(B, B)`` of a ``Factorized`` gradient."""
    f = _require_factorized(f, "pairwise_dot", layer_type)
    return pairwise_dot_factors(
        f.activation, f.pre_activation_grad, layer_type, f.module_kwargs, include_bias, mode
    )


def grad_norm_sq(
    f: Factorized | Tensor,
    layer_type: str,
    include_bias: bool = True,
    mode: RoutingMode = "auto",
) -> Tensor:
    """Per-sample ``‖dW_i‖²`` ``(B,)``; a dense ``(B, ...)`` tensor gives its row sum of squares."""
    _check_mode(mode)
    if isinstance(f, Tensor):
        (dense,) = align(_as_dense(f, layer_type, include_bias))
        return dense.square().sum(-1)
    f = f.as_batch_first()
    return grad_norm_sq_factors(
        f.activation, f.pre_activation_grad, layer_type, f.module_kwargs, include_bias, mode
    )


def cross_dot(
    f1: Factorized | Tensor,
    f2: Factorized | Tensor,
    layer_type: str,
    include_bias: bool = True,
    mode: RoutingMode = "auto",
) -> Tensor:
    """Cross-Gram ``(B1, B2)`` of two gradients of one layer.

    Two ``Factorized`` sides use :func:`cross_dot_factors` (routed by ``mode``). If either
    side is a dense ``(B, d)`` tensor, the other is materialized and one GEMM is used.
    """
    _check_mode(mode)
    if isinstance(f1, Tensor) or isinstance(f2, Tensor):
        return _dense_cross(
            _as_dense(f1, layer_type, include_bias),
            _as_dense(f2, layer_type, include_bias),
            layer_type,
            "cross_dot",
        )
    f1, f2 = f1.as_batch_first(), f2.as_batch_first()
    return cross_dot_factors(
        f1.activation,
        f1.pre_activation_grad,
        f2.activation,
        f2.pre_activation_grad,
        layer_type,
        f1.module_kwargs,
        f2.module_kwargs,
        include_bias,
        mode,
    )


def _dense_cross(m1: Tensor, m2: Tensor, layer_type: str, fn: str) -> Tensor:
    """``m1 @ m2ᵀ`` after checking both ``(B, d)`` sides have the same width."""
    if m1.shape[-1] != m2.shape[-1]:
        raise ValueError(
            f"{fn}({layer_type}): side 1 is {_shape(m1)} and side 2 is {_shape(m2)} "
            "(per-sample widths differ); both sides must be the same layer in the same "
            "materialize layout, projection and include_bias."
        )
    m1, m2 = align(m1, m2)
    return m1 @ m2.T


def cross_dot_per_token(
    f1: Factorized, f2: Factorized | Tensor, layer_type: str, include_bias: bool = True
) -> Tensor:
    """Per-token contributions ``(B1, T1, B2)`` of side 1's tokens; ``Σ_t`` gives :func:`cross_dot`.

    ``T1`` is side 1's preprocessed position count (conv: output positions). Side 2 may be
    dense ``(B2, d)`` in the :func:`materialize` layout.
    """
    fn = "cross_dot_per_token"
    f1 = _require_factorized(f1, fn, layer_type)
    a1, g1 = _prepare(
        f1.activation, f1.pre_activation_grad, layer_type, f1.module_kwargs, include_bias, fn
    )
    if isinstance(f2, Tensor):
        return cross_gram_per_token_dense(
            a1, g1, _as_dense(f2, layer_type, include_bias), layer_type
        )
    f2 = f2.as_batch_first()
    a2, g2 = _prepare(
        f2.activation, f2.pre_activation_grad, layer_type, f2.module_kwargs, include_bias, fn
    )
    return cross_gram_per_token(a1, g1, a2, g2, layer_type)


# --------------------------------------------------------------------------- Gradient blocks


def _shared_layers(train: Gradient, test: Gradient, layers: Iterable[str] | None) -> list[str]:
    """Layer names in both blocks (train order), restricted to ``layers`` when given."""
    wanted = None if layers is None else ({layers} if isinstance(layers, str) else set(layers))
    return [n for n in train.data if n in test.data and (wanted is None or n in wanted)]


def _dense_rows(block: Gradient, name: str) -> Tensor:
    """A dense layer payload as ``(B, d)`` rows.

    ``"batch_token"`` payloads ``(B, T, d)`` are summed over tokens; a ``param_grad``
    payload (batch-level, no sample axis) is one broadcast row.
    """
    x = block.data[name]
    if block.layer_types[name] == PARAM_GRAD_TYPES:
        return x.reshape(1, -1)
    if block.indexing.get(name) == "batch_token" and x.dim() == 3:
        return x.sum(1)
    return x.reshape(x.shape[0], -1)


def _factorized_types_agree(train: Gradient, test: Gradient, name: str) -> str:
    """The shared layer type of a layer factorized on both sides (``ValueError`` if they differ)."""
    t1, t2 = train.layer_types[name], test.layer_types[name]
    if t1 != t2:
        raise ValueError(
            f"layer {name!r} is {t1!r} in the train block but {t2!r} in the test block; "
            "both sides of an inner product must be captured (and projected) the same way."
        )
    return t1


def _materialized_train(train: Gradient, name: str, dense_cache: TensorCache | None) -> Tensor:
    """Train layer ``name`` materialized ``(B, d)``, via ``dense_cache`` when given."""
    from dattri_llm.gradient.ops.materialize import materialize

    layer_type = train.layer_types[name]
    if dense_cache is None:
        return materialize(train.data[name], layer_type)
    cached = dense_cache.get(name)
    if cached is None:
        cached = materialize(train.data[name], layer_type)
        dense_cache.put(name, cached)
    return cached


def _layer_cross_dot(
    train: Gradient, test: Gradient, name: str, mode: str, dense_cache: TensorCache | None
) -> Tensor:
    """``(B_train, B_test)`` cross-Gram of one shared layer, routed by representation."""
    x1, x2 = train.data[name], test.data[name]
    if not isinstance(x1, Tensor) and not isinstance(x2, Tensor):
        return cross_dot(x1, x2, _factorized_types_agree(train, test, name), mode=mode)
    if isinstance(x1, Tensor):
        m1 = _dense_rows(train, name)
    else:
        m1 = _materialized_train(train, name, dense_cache)
    m2 = (
        _dense_rows(test, name)
        if isinstance(x2, Tensor)
        else _as_dense(x2, test.layer_types[name], True)
    )
    return _dense_cross(m1, m2, train.layer_types[name], "layerwise_cross_dot")


def _named(name: str, fn, *args):
    """``fn(*args)``, prefixing the layer name to a ``ValueError``/``TypeError`` message."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as err:
        if repr(name) in str(err):
            raise
        raise type(err)(f"layer {name!r}: {err}") from err


def _sum_broadcast(per_layer: dict[str, Tensor], fn: str) -> Tensor:
    """Sum per-layer results, expanding batch-1 (broadcast) layers on axes 0 and last."""
    first = next(iter(per_layer.values()))
    shape = list(first.shape)
    for m in per_layer.values():
        shape[0], shape[-1] = max(shape[0], m.shape[0]), max(shape[-1], m.shape[-1])
    dtype = first.dtype
    for m in per_layer.values():
        dtype = torch.promote_types(dtype, m.dtype)
    total = first.new_zeros(shape, dtype=dtype)
    for name, m in per_layer.items():
        if m.shape[0] not in (1, shape[0]) or m.shape[-1] not in (1, shape[-1]):
            raise ValueError(
                f"{fn}: layer {name!r} gives {_shape(m)} but other layers give {tuple(shape)}; "
                "layers must share batch sizes (or have batch size 1 to broadcast)."
            )
        total += m
    return total


def layerwise_cross_dot(
    train: Gradient,
    test: Gradient,
    *,
    layers: Iterable[str] | None = None,
    mode: RoutingMode = "auto",
    dense_cache: TensorCache | None = None,
    reduce: DotReduce = "sum",
) -> Tensor | dict[str, Tensor]:
    """Cross-Gram of two gradient blocks over their shared layers.

    Layers absent from either block (or not in ``layers``) are skipped. A factorized train
    layer compared with a dense test layer is materialized, through ``dense_cache`` (a
    ``TensorCache`` scoped to the train block, keyed by layer name) when given; dense
    ``"batch_token"`` payloads are summed over tokens. ``reduce="sum"`` returns
    ``(B_train, B_test)`` summed over layers (batch-1 broadcast layers expanded);
    ``"none"`` returns ``{layer: matrix}`` as computed per layer.
    """
    _check_mode(mode)
    _check_reduce(reduce)
    names = _shared_layers(train, test, layers)
    if not names and reduce == "sum":
        raise ValueError(
            f"layerwise_cross_dot: no shared layer (train {sorted(train.data)}, test "
            f"{sorted(test.data)}, requested {layers}); capture the same layers on both sides."
        )
    per_layer = {
        name: _named(name, _layer_cross_dot, train, test, name, mode, dense_cache) for name in names
    }
    if reduce == "none":
        return per_layer
    return _sum_broadcast(per_layer, "layerwise_cross_dot")


def _layer_cross_dot_per_token(train: Gradient, test: Gradient, name: str) -> Tensor:
    """``(B_train, T, B_test)`` per-token cross-Gram of one shared layer."""
    fn = "layerwise_cross_dot_per_token"
    x1 = train.data[name]
    if isinstance(x1, Tensor) or train.indexing.get(name) != "batch_token":
        raise ValueError(
            f"{fn}: train layer {name!r} must be factorized with 'batch_token' indexing to "
            f"score tokens, got {train.representation.get(name)!r}/"
            f"{train.indexing.get(name)!r}; keep its factors (capture_style='factorized')."
        )
    layer_type = train.layer_types[name]
    x2 = test.data[name]
    if isinstance(x2, Tensor):
        return cross_dot_per_token(x1, _dense_rows(test, name), layer_type)
    return cross_dot_per_token(x1, x2, _factorized_types_agree(train, test, name))


def layerwise_cross_dot_per_token(
    train: Gradient,
    test: Gradient,
    *,
    layers: Iterable[str] | None = None,
    reduce: DotReduce = "sum",
) -> Tensor | dict[str, Tensor]:
    """Per-token cross-Gram ``(B_train, T_train, B_test)`` of two blocks over shared layers.

    Every scored train layer must be factorized and ``"batch_token"``; test layers may be
    factorized or dense. ``reduce="sum"`` sums layers (all must agree on ``T``);
    ``"none"`` returns ``{layer: (B_train, T, B_test)}``.
    """
    _check_reduce(reduce)
    fn = "layerwise_cross_dot_per_token"
    names = _shared_layers(train, test, layers)
    if not names:
        raise ValueError(
            f"{fn}: no shared layer (train {sorted(train.data)}, test {sorted(test.data)}, "
            f"requested {layers}); capture the same layers on both sides."
        )
    per_layer = {
        name: _named(name, _layer_cross_dot_per_token, train, test, name) for name in names
    }
    if reduce == "none":
        return per_layer
    lengths = {name: m.shape[1] for name, m in per_layer.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"{fn}: layers disagree on the token count T {lengths}; use reduce='none' or "
            "select layers with the same T."
        )
    return _sum_broadcast(per_layer, fn)

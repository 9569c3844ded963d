"""The exact inner-product kernels of the three layer families, on preprocessed operands.

Outer family (ghost contraction over token pairs, or materialize then one GEMM), norm
family (positions contracted first) and embedding family (scatter-add onto the shared
ids), plus the dense route and the checks of the operands before them. Every kernel
works in blocks of at most ``_BLOCK_ELEMENTS`` intermediate elements. The public
routing and API around these kernels is :mod:`dattri_llm.gradient.ops.dot`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.dtypes import align
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import (
    ALL_LAYER_TYPES,
    PARAM_GRAD_TYPES,
    is_embedding,
    is_norm,
)

# Largest intermediate (elements) one block of a kernel may allocate: 64 MiB in float32.
_BLOCK_ELEMENTS = 1 << 24
# Side-1 token rows a ghost block aims to hold, so side-2 chunks are not made too small.
_MIN_GHOST_ROWS = 256


# --------------------------------------------------------------------------- operand checks


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


def _check_dense_width(m: Tensor, width: int, layer_type: str, fn: str, factors: str) -> None:
    """Raise ``ValueError`` unless the dense side is ``width`` wide."""
    if m.shape[-1] != width:
        raise ValueError(
            f"{fn}({layer_type}): dense side {_shape(m)} is not {width} wide as the factors "
            f"{factors} require; both sides must be the same layer with the same projection "
            "and include_bias."
        )


def _check_id_range(ids: Tensor, vocab: int, layer_type: str, fn: str) -> None:
    """Raise ``ValueError`` if a token id is negative or ``>= vocab``."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{fn}({layer_type}): token ids of {_shape(ids)} span [{int(ids.min())}, "
            f"{int(ids.max())}] but the embedding has {vocab} rows; check num_embeddings and "
            "that the ids were captured from this layer."
        )


def _require_factorized(f: Any, fn: str, layer_type: str) -> Factorized:
    """Return ``f`` batch-first, or raise ``TypeError`` if it is not a ``Factorized``."""
    if isinstance(f, Tensor) or not hasattr(f, "as_batch_first"):
        raise TypeError(
            f"{fn}({layer_type}) needs a Factorized gradient, got {type(f).__name__}; "
            "use cross_dot / grad_norm_sq for dense tensors."
        )
    return f.as_batch_first()


# --------------------------------------------------------------------------- dense operands


def _as_dense(x: Factorized | Tensor, layer_type: str, include_bias: bool) -> Tensor:
    """``(B, d)`` rows of a dense tensor (reshaped) or a materialized ``Factorized``."""
    if isinstance(x, Tensor):
        if x.dim() == 0:
            raise ValueError(f"dense gradient of layer type {layer_type!r} must have a batch axis.")
        return x.reshape(x.shape[0], -1)
    return materialize(x, layer_type, include_bias)


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

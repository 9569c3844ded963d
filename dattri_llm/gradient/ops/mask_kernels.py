"""The two exact routes of a ``"mask"`` projection of factorized layers, and their cost rule.

Gather the kept entries straight from the factors (`_gather_outer`), or materialize the
layer in sample chunks and index it (`_materialized_outer_entries`,
`_materialized_embedding_entries`); `_prefers_materialized_mask` picks the cheaper one.
The public mask functions are in :mod:`dattri_llm.gradient.ops.projection`.
"""

from __future__ import annotations

import torch

# Output elements per chunk of the mask gather (bounds the (B, S, chunk) temporaries), and
# per sample chunk of the materialize-then-index mask route (bounds the (b, D·K) block).
_MASK_GATHER_ELEMENTS = 2**24
# Mask routing constants, measured on CPU (one thread, float32): one gathered multiply-add
# (`_gather_outer`) costs about as much as 300 multiply-adds of the token-contracting GEMM
# and as 20 element writes of the materialized block.
_MASK_GEMM_SPEEDUP = 300.0
_MASK_WRITE_SPEEDUP = 20.0


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sum 16-bit products in float32; wider dtypes in themselves."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def _gather_outer(
    a: torch.Tensor, g: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """``out[b, j] = Σ_s g[b, s, rows_j] · a[b, s, cols_j]`` without forming ``g ⊗ a``.

    ``a : (B, S, K)``, ``g : (B, S, D)`` → ``(B, P)``; chunked over ``P`` to
    bound the ``(B, S, chunk)`` temporaries; 16-bit inputs accumulate in float32.
    """
    batch, tokens = a.shape[0], a.shape[1]
    accumulate = _accumulation_dtype(a.dtype)
    chunk = max(1, _MASK_GATHER_ELEMENTS // max(1, batch * tokens))
    parts = []
    for start in range(0, rows.numel(), chunk):
        r, c = rows[start : start + chunk], cols[start : start + chunk]
        parts.append((g[:, :, r] * a[:, :, c]).sum(dim=1, dtype=accumulate))
    return torch.cat(parts, dim=1).to(a.dtype)


def _prefers_materialized_mask(tokens: int, width: int, proj_dim: int, gemm: bool) -> bool:
    """Whether reading ``proj_dim`` of a layer's ``width`` coordinates is cheaper materialized.

    Per sample, gathering costs ``tokens·proj_dim`` gathered multiply-adds; materializing
    then indexing costs ``tokens·width`` GEMM multiply-adds (``gemm``: outer-family layers;
    an embedding scatter-adds ``tokens·E`` entries instead, counted in ``width`` by the
    caller) plus ``width + proj_dim`` element writes, each scaled to gathered multiply-adds
    by the measured `_MASK_GEMM_SPEEDUP` / `_MASK_WRITE_SPEEDUP`. Ties go to materializing.
    """
    cost_gather = tokens * proj_dim
    cost_materialize = (width + proj_dim) / _MASK_WRITE_SPEEDUP
    if gemm:
        cost_materialize += tokens * width / _MASK_GEMM_SPEEDUP
    return cost_gather >= cost_materialize


def _sample_chunks(batch: int, width: int) -> list[slice]:
    """Sample slices whose ``(chunk, width)`` dense blocks stay within ``_MASK_GATHER_ELEMENTS``."""
    step = max(1, _MASK_GATHER_ELEMENTS // max(1, width))
    return [slice(start, start + step) for start in range(0, batch, step)]


def _materialized_outer_entries(
    a: torch.Tensor, g: torch.Tensor, idx: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """``idx`` entries of ``Σ_s g_sᵀ a_s`` (``transposed``: ``Σ_s a_sᵀ g_s``) → ``(B, P)``.

    ``a : (B, S, K)``, ``g : (B, S, D)``; samples are materialized in chunks (one GEMM
    each, 16-bit inputs in float32) and indexed, so the dense block stays bounded.
    """
    accumulate = _accumulation_dtype(a.dtype)
    left, right = (a, g) if transposed else (g, a)
    parts = []
    for rows in _sample_chunks(a.shape[0], left.shape[-1] * right.shape[-1]):
        dense = torch.bmm(left[rows].transpose(1, 2).to(accumulate), right[rows].to(accumulate))
        parts.append(dense.reshape(dense.shape[0], -1)[:, idx].to(a.dtype))
    return torch.cat(parts)


def _materialized_embedding_entries(
    ids: torch.Tensor, g: torch.Tensor, vocab: int, idx: torch.Tensor
) -> torch.Tensor:
    """``idx`` entries of the scatter-added ``(B, V·E)`` table, built in sample chunks."""
    ids = ids.reshape(ids.shape[0], -1)
    g = g.reshape(g.shape[0], -1, g.shape[-1])
    accumulate = _accumulation_dtype(g.dtype)
    parts = []
    for rows in _sample_chunks(g.shape[0], vocab * g.shape[-1]):
        values = g[rows].to(accumulate)
        table = values.new_zeros(values.shape[0], vocab, values.shape[-1])
        table.scatter_add_(1, ids[rows].unsqueeze(-1).expand_as(values), values)
        parts.append(table.reshape(table.shape[0], -1)[:, idx].to(g.dtype))
    return torch.cat(parts)

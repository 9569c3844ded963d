"""Low-rank per-sample gradient records (LoRIF's storage format).

A layer whose per-sample gradient is a matrix ``dW_i`` of shape ``(d_out', d_in')``
(linear family and convolutions, raw or after a ``"logra"`` projection) can be
stored as its top-``c`` singular triplets: ``dW_i ≈ Σ_{t<c} σ_t u_t v_tᵀ``. A
:class:`LowRank` payload holds them as *final factors* with ``c`` rows per
sample, ``pre_activation_grad = U·diag(σ) : (B, c, d_out')`` and
``activation = V : (B, c, d_in')``, so ``dW_i = Σ_t g_t a_tᵀ`` exactly as for
any other final factors. Every consumer of factorized gradients therefore
reads it unchanged: ``materialize`` gives the rank-``c`` matrix, and the routed
inner products of ``ops.dot`` compute ``Σ_{s,t} <a1_s, a2_t><g1_s, g2_t>`` —
``O(c²(d_out' + d_in'))`` per pair — or materialize when the cost model says
dense is cheaper (:func:`low_rank_cross_dot`).

What a low-rank record is *not* is a pair of layer input and output gradient:
methods that need those (K-FAC covariances) must refuse it
(:func:`require_raw_factors`).

The factors are computed per sample from the factorized form: the
``(d_out', d_in')`` matrix ``Σ_t g_t a_tᵀ`` is formed (in sample chunks) and
decomposed; nothing larger than that matrix per sample is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.dot import cross_dot
from dattri_llm.gradient.ops.preprocess import preprocess_factorized
from dattri_llm.gradient.ops.types import is_conv, is_linear

__all__ = [
    "LowRank",
    "check_low_rank",
    "has_matrix_form",
    "is_low_rank",
    "low_rank_cross_dot",
    "low_rank_factors",
    "low_rank_gradient",
    "low_rank_of",
    "require_raw_factors",
]

# Largest chunk of per-sample matrices decomposed at once (elements): 64 MiB in float32.
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True, eq=False)
class LowRank(Factorized):
    """Rank-``c`` factors of per-sample gradient matrices, as final factors with ``c`` rows.

    ``pre_activation_grad : (B, c, d_out')`` holds ``σ_t u_t``, ``activation :
    (B, c, d_in')`` holds ``v_t``; ``dW_i = Σ_t g_it a_itᵀ``. ``module_kwargs``
    is always ``None`` (final factors). Copies made by slicing, moving and
    concatenating stay :class:`LowRank`.
    """

    def _with_factors(self, activation: torch.Tensor, grad: torch.Tensor) -> LowRank:
        """Copy with new factors (still a :class:`LowRank`)."""
        return LowRank(activation, grad, None, self.batch_first)

    @property
    def rank(self) -> int:
        """``c``: the number of stored singular triplets per sample."""
        return self.activation.shape[self.token_axis]


# Stores pickle this class by its public path (set after the decorator, see model/records.py).
LowRank.__module__ = "dattri_llm.gradient.lowrank"


def is_low_rank(value: object) -> bool:
    """Whether a layer payload is a :class:`LowRank` record."""
    return isinstance(value, LowRank)


def check_low_rank(rank: object, what: str = "low_rank") -> int | None:
    """``rank`` checked: ``None`` or an ``int >= 1`` (else ``ValueError`` / ``TypeError``)."""
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{what} must be an int >= 1 or None (full rank), got {rank!r}.")
    if rank < 1:
        raise ValueError(
            f"{what} must be >= 1 (the number of singular triplets kept per sample and layer), "
            f"got {rank}; pass None to keep the full-rank gradients."
        )
    return rank


def has_matrix_form(value: object, layer_type: str) -> bool:
    """Whether a payload can be stored low-rank: factorized linear-family or conv factors.

    Dense payloads, norms, embeddings, ``nn.Bilinear`` and transposed
    convolutions are stored as captured.
    """
    if not isinstance(value, Factorized) or isinstance(value, LowRank):
        return False
    return (is_linear(layer_type) and layer_type != "nn.Bilinear") or is_conv(layer_type)


def _top_triplets(matrices: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(σ·U, V)`` of the top ``rank`` triplets: ``(n, rank, d_out)``, ``(n, rank, d_in)``.

    Missing triplets (``rank > min(d_out, d_in)``) are zero rows.
    """
    u, s, vh = torch.linalg.svd(matrices, full_matrices=False)
    kept = min(rank, s.shape[-1])
    left = (u[..., :kept] * s[..., None, :kept]).transpose(1, 2)
    right = vh[:, :kept]
    if kept < rank:
        pad = rank - kept
        left = torch.cat([left, left.new_zeros(left.shape[0], pad, left.shape[2])], dim=1)
        right = torch.cat([right, right.new_zeros(right.shape[0], pad, right.shape[2])], dim=1)
    return left, right


def low_rank_factors(a: torch.Tensor, g: torch.Tensor, rank: int) -> LowRank:
    """Rank-``rank`` record of ``dW_i = Σ_t g_it a_itᵀ`` from preprocessed factors.

    Args:
        a: ``(B, [T,] d_in')`` preprocessed (or final) activations.
        g: ``(B, [T,] d_out')`` preprocessed (or final) output gradients.
        rank: ``c >= 1``.

    Returns:
        A :class:`LowRank` with factors ``(B, c, d_out')``, ``(B, c, d_in')`` in
        ``g``'s dtype; the SVD runs in at least float32. Samples are decomposed
        in chunks of at most 2²⁴ matrix elements.
    """
    rank = check_low_rank(rank)
    batch = a.shape[0]
    a3 = a.reshape(batch, -1, a.shape[-1])
    g3 = g.reshape(batch, -1, g.shape[-1])
    work = torch.promote_types(torch.promote_types(a.dtype, g.dtype), torch.float32)
    per_sample = a3.shape[-1] * g3.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // max(1, per_sample))
    lefts, rights = [], []
    for start in range(0, batch, step):
        rows = slice(start, start + step)
        matrices = torch.bmm(g3[rows].transpose(1, 2).to(work), a3[rows].to(work))
        left, right = _top_triplets(matrices, rank)
        lefts.append(left)
        rights.append(right)
    if not lefts:
        empty = a3.new_zeros(0, rank, a3.shape[-1]).to(g.dtype)
        return LowRank(empty, g3.new_zeros(0, rank, g3.shape[-1]))
    return LowRank(torch.cat(rights).to(g.dtype), torch.cat(lefts).to(g.dtype))


def low_rank_of(value: Factorized, layer_type: str, rank: int) -> LowRank:
    """Rank-``rank`` record of one factorized layer (raw factors are preprocessed first)."""
    a, g = preprocess_factorized(value, layer_type)
    return low_rank_factors(a, g, rank)


def low_rank_gradient(block: Gradient, rank: int) -> Gradient:
    """``block`` with every matrix-form layer (:func:`has_matrix_form`) stored at rank ``rank``.

    Converted layers are ``"factorized"`` with indexing ``"batch"`` (the ``c``
    axis is not a token axis) and keep their layer type. A layer already
    :class:`LowRank` must have ``rank`` triplets (else ``ValueError``); other
    layers pass through.
    """
    rank = check_low_rank(rank)
    convert = []
    for name, value in block.data.items():
        if is_low_rank(value) and value.rank != rank:
            raise ValueError(
                f"layer {name!r} is stored at rank c={value.rank}, but rank {rank} was "
                "requested; low-rank records of different c cannot be mixed (re-capture the "
                f"store with low_rank={rank})."
            )
        if has_matrix_form(value, block.layer_types[name]):
            convert.append(name)
    if not convert:
        return block
    converted = block.map_layers(
        lambda _name, value, layer_type: low_rank_of(value, layer_type, rank), layers=convert
    )
    for name in convert:
        converted.indexing[name] = "batch"
    return converted


def low_rank_cross_dot(
    r1: LowRank | torch.Tensor,
    r2: LowRank | torch.Tensor,
    layer_type: str = "nn.Linear",
    mode: str = "auto",
) -> torch.Tensor:
    """Cross-Gram ``<dW1_i, dW2_j>`` ``(B1, B2)`` of two low-rank records (or dense rows).

    In factored form ``Σ_{s,t} <v1_s, v2_t><σu1_s, σu2_t>`` costs
    ``c1·c2·(d_out' + d_in')`` per pair; ``mode="auto"`` materializes instead
    when ``ops.maybe_use_materialized_gram``'s cost model prefers it
    (``"factorized"`` / ``"materialized"`` force a route). Both routes are exact.
    """
    return cross_dot(r1, r2, layer_type, mode=mode)


def require_raw_factors(block: Gradient, method: str) -> None:
    """``ValueError`` if a layer of ``block`` is a low-rank record (not layer factors).

    For methods that read the factors as a layer's input and output gradient
    (K-FAC covariances ``E[a aᵀ]``, ``E[g gᵀ]``): a low-rank record's factors
    are singular vectors of the per-sample gradient, and covariances of them
    would be silently wrong.
    """
    low = sorted(name for name, value in block.data.items() if is_low_rank(value))
    if low:
        raise ValueError(
            f"{method} needs each layer's input and output-gradient factors, but layers {low} "
            "hold low-rank records (rank-c singular factors of the per-sample gradient, from a "
            "store written with low_rank=c); their covariances are not K-FAC's. Capture a "
            "store without low_rank for this method, or use LoRIFAttributor / TracIn on it."
        )

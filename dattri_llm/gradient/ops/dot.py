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

This module holds the routing rule and the public functions, per layer and per block.
The family kernels and the checks of their operands are in
:mod:`~dattri_llm.gradient.ops.dot_kernels`, how blocks are read (shared layers, dense
rows, layer sums) in :mod:`~dattri_llm.gradient.ops.dot_blocks`, and the similarity maths
of ``Gradient.similarity`` in :mod:`~dattri_llm.gradient.ops.similarity`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import Tensor

from dattri_llm.gradient.model.records import Factorized, GradientBlock
from dattri_llm.gradient.ops.dot_blocks import (
    _dense_rows,
    _factorized_types_agree,
    _named,
    _shared_layers,
    _sum_broadcast,
    _sum_layers,
)
from dattri_llm.gradient.ops.dot_kernels import (
    _as_dense,
    _check_aligned_batch,
    _check_dense_width,
    _check_id_range,
    _checked_pair,
    _checked_single,
    _dense_cross,
    _embedding_aligned,
    _embedding_cross,
    _embedding_dense_per_token,
    _embedding_norm_sq,
    _embedding_per_token,
    _norm_materialize,
    _outer_dense_per_token,
    _outer_ghost_aligned,
    _outer_ghost_cross,
    _outer_ghost_per_token,
    _outer_materialize,
    _outer_materialized_cross,
    _outer_materialized_norm_sq,
    _require_factorized,
    _shape,
)
from dattri_llm.gradient.ops.dtypes import align
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.preprocess import preprocess_factors
from dattri_llm.gradient.ops.types import is_conv, is_conv_transpose, is_embedding

if TYPE_CHECKING:
    from dattri_llm.options import DotReduce, RoutingMode
    from dattri_llm.utils.cache import TensorCache

_ROUTING_MODES = ("auto", "factorized", "materialized")
_REDUCTIONS = ("sum", "none")


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


# --------------------------------------------------------------------------- raw-factor kernels


def _prepare(a, g, layer_type: str, module_kwargs: dict | None, include_bias: bool, fn: str):
    """Preprocess raw batch-first factors (identity for final factors)."""
    if module_kwargs is None:
        return a, g
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


def _materialized_train(train: GradientBlock, name: str, dense_cache: TensorCache | None) -> Tensor:
    """Train layer ``name`` materialized ``(B, d)``, via ``dense_cache`` when given."""
    layer_type = train.layer_types[name]
    if dense_cache is None:
        return materialize(train.data[name], layer_type)
    cached = dense_cache.get(name)
    if cached is None:
        cached = materialize(train.data[name], layer_type)
        dense_cache.put(name, cached)
    return cached


def _layer_cross_dot(
    train: GradientBlock, test: GradientBlock, name: str, mode: str, dense_cache: TensorCache | None
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


def layerwise_cross_dot(
    train: GradientBlock,
    test: GradientBlock,
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

    def layer(name: str) -> Tensor:
        return _named(name, _layer_cross_dot, train, test, name, mode, dense_cache)

    if reduce == "none":
        return {name: layer(name) for name in names}
    return _sum_layers(names, layer, "layerwise_cross_dot")


def _layer_cross_dot_per_token(train: GradientBlock, test: GradientBlock, name: str) -> Tensor:
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
    train: GradientBlock,
    test: GradientBlock,
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

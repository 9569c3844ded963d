"""FLOP routing (ops/dot.py): the predicates' exact formulas, boundaries and dispatch."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from dattri_llm.gradient.gradient import Factorized
from dattri_llm.gradient.ops.dot import (
    cross_gram,
    effective_dims,
    grad_norm_sq_factors,
    maybe_use_materialized_gram,
    maybe_use_materialized_norm,
)

dot_module = importlib.import_module("dattri_llm.gradient.ops.dot")


def reference_gram_rule(B1, B2, S, K, D, kappa=1.0):
    cost_factorized = B1 * B2 * S**2 * (D + K)
    cost_materialized = (B1 + B2) * S * D * K + B1 * B2 * D * K
    return kappa * cost_factorized >= cost_materialized


GRID = list(
    itertools.product([1, 3, 8], [1, 16], [1, 2, 7, 64, 512, 2048], [1, 4, 64, 1024], [4, 1024])
)


@pytest.mark.parametrize("kappa", [1.0, 0.25, 3.0])
def test_gram_predicate_matches_formula_on_grid(kappa):
    decisions = set()
    for B1, B2, S, K, D in GRID:
        got = maybe_use_materialized_gram(B1, B2, S, K, D, kappa)
        assert got == reference_gram_rule(B1, B2, S, K, D, kappa), (B1, B2, S, K, D, kappa)
        decisions.add(got)
    assert decisions == {True, False}  # the grid spans both regimes


@pytest.mark.parametrize(
    "dims", [(2, 2, 1, 1, 1), (4, 4, 2, 4, 4), (3, 3, 3, 6, 6), (1, 3, 6, 8, 8)]
)
def test_gram_boundary_cost_tie_goes_materialized(dims):
    B1, B2, S, K, D = dims
    assert B1 * B2 * S**2 * (D + K) == (B1 + B2) * S * D * K + B1 * B2 * D * K
    assert maybe_use_materialized_gram(B1, B2, S, K, D) is True
    # one token fewer makes the factorized route strictly cheaper
    assert maybe_use_materialized_gram(B1, B2, S - 1, K, D) is False


def test_gram_argument_order_and_paper_example():
    # (B1, B2, S, K, D): S is the third argument
    assert maybe_use_materialized_gram(1, 1, 2, 1024, 1024) is False
    assert maybe_use_materialized_gram(1, 1, 1024, 2, 2) is True
    assert maybe_use_materialized_gram(8, 16, 512, 4096, 4096) is True
    assert maybe_use_materialized_gram(1, 1, 2048, 1024, 1024) is True
    assert maybe_use_materialized_gram(8, 1, 32, 1024, 1024) is False


def test_norm_predicate_formula_and_boundary():
    for S, K, D in itertools.product([1, 2, 3, 5, 512], [1, 4, 6, 1024], [1, 4, 6, 1024]):
        assert maybe_use_materialized_norm(S, K, D) == (S * (D + K) >= D * K)
    assert maybe_use_materialized_norm(2, 4, 4) is True  # 2·8 == 16
    assert maybe_use_materialized_norm(3, 6, 6) is True  # 3·12 == 36
    assert maybe_use_materialized_norm(1, 4, 4) is False
    assert maybe_use_materialized_norm(511, 1024, 1024) is False
    assert maybe_use_materialized_norm(512, 1024, 1024) is True


def _recording(monkeypatch, names):
    calls = []
    for name in names:
        original = getattr(dot_module, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dot_module, name, wrapper)
    return calls


def _factors(B, S, K, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, K, generator=gen), torch.randn(B, S, D, generator=gen)


@pytest.mark.parametrize(
    "B1, S1, B2, S2, K, D",
    [(2, 1, 3, 1, 6, 5), (2, 9, 3, 9, 2, 2), (1, 3, 2, 8, 4, 4), (2, 1, 2, 3, 8, 8)],
)
def test_auto_dispatch_follows_cost_model(monkeypatch, B1, S1, B2, S2, K, D):
    calls = _recording(monkeypatch, ["_outer_materialized_cross", "_outer_ghost_cross"])
    a1, g1 = _factors(B1, S1, K, D, 1)
    a2, g2 = _factors(B2, S2, K, D, 2)
    results = {
        m: cross_gram(a1, g1, a2, g2, "nn.Linear", m)
        for m in ("auto", "factorized", "materialized")
    }
    cost_f = B1 * B2 * S1 * S2 * (D + K)
    cost_m = (B1 * S1 + B2 * S2) * D * K + B1 * B2 * D * K
    expected_auto = "_outer_materialized_cross" if cost_f >= cost_m else "_outer_ghost_cross"
    assert calls == [expected_auto, "_outer_ghost_cross", "_outer_materialized_cross"]
    if S1 == S2:
        assert (expected_auto == "_outer_materialized_cross") == maybe_use_materialized_gram(
            B1, B2, S1, K, D
        )
    torch.testing.assert_close(results["factorized"], results["materialized"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["auto"], results["materialized"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S, K, D", [(1, 8, 8), (4, 8, 8), (5, 8, 8), (2, 3, 40)])
def test_norm_auto_dispatch(monkeypatch, S, K, D):
    calls = _recording(monkeypatch, ["_outer_materialized_norm_sq", "_outer_ghost_aligned"])
    a, g = _factors(3, S, K, D)
    auto = grad_norm_sq_factors(a, g, "nn.Linear")
    expected = "_outer_materialized_norm_sq" if S * (D + K) >= D * K else "_outer_ghost_aligned"
    assert calls == [expected]
    reference = torch.einsum("bsd,bsk->bdk", g, a).square().sum((1, 2))
    torch.testing.assert_close(auto, reference, rtol=1e-5, atol=1e-5)


def test_norm_and_embedding_ignore_mode(monkeypatch):
    calls = _recording(monkeypatch, ["_outer_materialized_cross", "_outer_ghost_cross"])
    a, g = _factors(2, 3, 4, 4)
    ids = torch.tensor([[1, 2, 1], [3, 1, 0]])
    for mode in ("auto", "factorized", "materialized"):
        cross_gram(a, g, a, g, "nn.LayerNorm", mode)
        cross_gram(ids, g, ids, g, "nn.Embedding", mode)
    assert calls == []


def test_effective_dims_per_layer_type():
    lin_kw = {"has_bias": True}
    assert effective_dims(
        Factorized(torch.zeros(4, 7, 5), torch.zeros(4, 7, 3), lin_kw), "nn.Linear"
    ) == (4, 7, 5, 3)
    assert effective_dims(
        Factorized(torch.zeros(4, 5), torch.zeros(4, 3), lin_kw), "nn.Linear"
    ) == (4, 1, 5, 3)
    assert effective_dims(
        Factorized(torch.zeros(4, 2, 7, 5), torch.zeros(4, 2, 7, 3), lin_kw), "nn.Linear"
    ) == (4, 14, 5, 3)
    conv_kw = {
        "has_bias": True,
        "kernel_size": (2, 3),
        "stride": (1, 1),
        "padding": (0, 0),
        "dilation": (1, 1),
        "groups": 2,
    }
    conv = Factorized(torch.zeros(2, 4, 6, 6), torch.zeros(2, 8, 5, 4), conv_kw)
    assert effective_dims(conv, "nn.Conv2d") == (2, 20, 4 * 6, 8)
    convt_kw = {
        "has_bias": False,
        "kernel_size": (3,),
        "stride": (2,),
        "padding": (0,),
        "dilation": (1,),
        "groups": 1,
    }
    convt = Factorized(torch.zeros(2, 4, 6), torch.zeros(2, 5, 13), convt_kw)
    assert effective_dims(convt, "nn.ConvTranspose1d") == (2, 6, 4, 15)
    norm = Factorized(
        torch.zeros(3, 7, 6),
        torch.zeros(3, 7, 6),
        {"has_bias": True, "normalized_shape": (6,), "eps": 1e-5},
    )
    assert effective_dims(norm, "nn.LayerNorm") == (3, 7, 6, 6)
    emb_kw = {"has_bias": False, "num_embeddings": 50, "padding_idx": None}
    emb = Factorized(torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, 4), emb_kw)
    assert effective_dims(emb, "nn.Embedding") == (3, 7, 50, 4)
    final = Factorized(torch.zeros(2, 9, 8), torch.zeros(2, 9, 6))  # projected: as given
    assert effective_dims(final, "nn.Conv2d") == (2, 9, 8, 6)
    seq_first = Factorized(torch.zeros(7, 4, 5), torch.zeros(7, 4, 3), lin_kw, batch_first=False)
    assert effective_dims(seq_first, "nn.Linear") == (4, 7, 5, 3)

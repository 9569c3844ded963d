"""Mask routing: gathering from the factors and materializing-then-indexing give the same entries.

Reference entries are the ``torch.func`` per-sample gradients laid out by hand
(``projection_helpers``), indexed at the mask coordinates.
"""

from __future__ import annotations

import pytest
import torch
from projection_helpers import capture_factors, reference_grads, reference_layout
from torch import nn

from dattri_llm.gradient.ops import mask_kernels, projection
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.gradient.ops.projection import DattriProjector, mask_factors


def _ids(vocab, batch, tokens):
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(5))


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7))


def _conv1d():
    transformers = pytest.importorskip("transformers")
    return transformers.pytorch_utils.Conv1D(4, 5), "transformers.pytorch_utils.Conv1D"


LAYERS = {
    "linear": (lambda: (nn.Linear(5, 4), "nn.Linear"), lambda: _randn(3, 6, 5)),
    "hf_conv1d": (_conv1d, lambda: _randn(3, 6, 5)),
    "embedding": (lambda: (nn.Embedding(11, 4), "nn.Embedding"), lambda: _ids(11, 3, 7)),
    "conv2d": (
        lambda: (nn.Conv2d(4, 6, 3, padding=1, stride=2), "nn.Conv2d"),
        lambda: _randn(2, 4, 5, 5),
    ),
    "conv_transpose1d": (
        lambda: (nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1), "nn.ConvTranspose1d"),
        lambda: _randn(2, 3, 5),
    ),
}


def _case(name):
    torch.manual_seed(0)
    make_module, make_x = LAYERS[name]
    module, layer_type = make_module()
    x = make_x()
    a, g = capture_factors(module, x)
    grads = reference_grads(module, x)
    if layer_type.endswith("Conv1D"):  # HF Conv1D is reported (out, in): its weight transposed
        w = grads["weight"].transpose(1, 2)
        ref = torch.cat([w, grads["bias"].unsqueeze(-1)], dim=2).reshape(w.shape[0], -1)
    else:
        ref = reference_layout(module, grads)
    return a, g, layer_type, extract_module_kwargs(module, layer_type), ref


def _forced(monkeypatch, materialize: bool) -> None:
    monkeypatch.setattr(projection, "_prefers_materialized_mask", lambda *args: materialize)


@pytest.mark.parametrize("name", list(LAYERS))
def test_both_routes_give_the_reference_entries(name, monkeypatch):
    a, g, layer_type, kwargs, ref = _case(name)
    k = max(1, ref.shape[1] // 3)
    idx = DattriProjector().mask_indices(ref.shape[1], proj_dim=k, proj_seed=2, device="cpu")
    results = {}
    for materialize in (False, True):
        _forced(monkeypatch, materialize)
        results[materialize] = mask_factors(a, g, layer_type, None, kwargs, proj_dim=k, proj_seed=2)
        torch.testing.assert_close(results[materialize], ref[:, idx], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[True], results[False], rtol=1e-6, atol=1e-7)


def test_materialized_route_chunks_samples(monkeypatch):
    """A sample chunk smaller than the batch gives the same entries (bounded dense block)."""
    a, g, layer_type, kwargs, ref = _case("linear")
    idx = DattriProjector().mask_indices(ref.shape[1], proj_dim=9, proj_seed=1, device="cpu")
    _forced(monkeypatch, True)
    monkeypatch.setattr(mask_kernels, "_MASK_GATHER_ELEMENTS", ref.shape[1])  # one sample a chunk
    got = mask_factors(a, g, layer_type, None, kwargs, proj_dim=9, proj_seed=1)
    torch.testing.assert_close(got, ref[:, idx], rtol=1e-5, atol=1e-6)
    a, g, layer_type, kwargs, ref = _case("embedding")
    idx = DattriProjector().mask_indices(ref.shape[1], proj_dim=9, proj_seed=1, device="cpu")
    got = mask_factors(a, g, layer_type, None, kwargs, proj_dim=9, proj_seed=1)
    torch.testing.assert_close(got, ref[:, idx], rtol=1e-5, atol=1e-6)


def _route_taken(monkeypatch, a, g, layer_type, kwargs, proj_dim) -> str:
    """Which route ``mask_factors`` takes (spying on the two implementations)."""
    taken = []
    for name in ("_materialized_outer_entries", "_materialized_embedding_entries"):
        original = getattr(projection, name)
        monkeypatch.setattr(
            projection,
            name,
            lambda *args, _f=original: taken.append("materialized") or _f(*args),
        )
    mask_factors(a, g, layer_type, None, kwargs, proj_dim=proj_dim)
    return taken[0] if taken else "gather"


@pytest.mark.parametrize(
    ("tokens", "proj_dim", "route"),
    [
        (1, 8, "gather"),  # few coordinates: gathering them is cheapest
        (1, 64, "gather"),
        (64, 8, "gather"),
        (1, 4096, "materialized"),  # every coordinate: writing the block once is cheaper
        (64, 1024, "materialized"),  # many tokens: one GEMM beats S gathers per entry
        (64, 4096, "materialized"),
    ],
)
def test_auto_route_follows_the_cost_rule_on_a_grid(monkeypatch, tokens, proj_dim, route):
    d, k = 64, 64  # width D·K = 4096 (no bias)
    a, g = _randn(2, tokens, k), _randn(2, tokens, d)
    assert _route_taken(monkeypatch, a, g, "nn.Linear", None, proj_dim) == route


@pytest.mark.parametrize(
    ("tokens", "proj_dim", "route"), [(4, 8, "gather"), (64, 2048, "materialized")]
)
def test_embedding_auto_route(monkeypatch, tokens, proj_dim, route):
    vocab, width = 64, 32
    ids = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(0))
    g = _randn(2, tokens, width)
    kwargs = {"num_embeddings": vocab}
    assert _route_taken(monkeypatch, ids, g, "nn.Embedding", kwargs, proj_dim) == route


def test_cost_rule_formula():
    """Gather ``S·p`` against ``S·D·K/300 + (D·K + p)/20`` (GEMM term for outer layers only)."""
    rule = projection._prefers_materialized_mask
    # S = 64, D·K = 4096: 64·p >= 873.8 + 204.8 + p/20  ⇔  p >= 16.87
    assert not rule(64, 4096, 16, True) and rule(64, 4096, 17, True)
    # no GEMM term: p >= (4096 + p)/20  ⇔  p >= 215.6
    assert not rule(1, 4096, 215, False) and rule(1, 4096, 216, False)

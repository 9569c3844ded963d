"""Tests of the gradient data model (Factorized, Gradient, GradientRecord).

Ground truth: per-sample gradients from torch.func (tests/reference.py), laid
out in the normative materialize layout, and dense Gram matrices built from them.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from reference import call, per_sample_param_grads
from torch import nn

from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    base_layer_name,
)
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs

D_IN, D_OUT, VOCAB, EMB = 4, 3, 7, 3
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
}


# ----------------------------------------------------------------------------- helpers


def _capture(layer: nn.Module, inp: torch.Tensor, r: torch.Tensor, layer_type: str) -> Factorized:
    """Factors of ``layer`` for the loss ``(layer(inp) * r).sum()``: input and output grad."""
    out = layer(inp)
    (g,) = torch.autograd.grad((out * r).sum(), out)
    return Factorized(inp, g.detach(), extract_module_kwargs(layer, layer_type))


def _reference(layer: nn.Module, inp: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """torch.func per-sample gradient ``(B, d)`` in materialize layout (bias last column)."""

    def loss_of_sample(mod, params, sample):
        return (call(mod, params, sample[0]) * sample[1]).sum()

    grads = per_sample_param_grads(layer, loss_of_sample, (inp, r))
    weight = grads["weight"]
    if "bias" in grads:
        weight = torch.cat([weight, grads["bias"].unsqueeze(-1)], dim=-1)
    return weight.reshape(inp.shape[0], -1)


def linear_case(batch, tokens, seed, dtype=torch.float32):
    """(Factorized, reference (B, d)) for an nn.Linear on 3-D input ``(B, T, D_IN)``."""
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(D_IN, D_OUT).to(dtype)
    x = torch.randn(batch, tokens, D_IN, generator=gen, dtype=torch.float64).to(dtype)
    r = torch.randn(batch, tokens, D_OUT, generator=gen, dtype=torch.float64).to(dtype)
    ref_layer = nn.Linear(D_IN, D_OUT).double() if dtype == torch.bfloat16 else layer
    ref_x, ref_r = (x.double(), r.double()) if dtype == torch.bfloat16 else (x, r)
    return _capture(layer, x, r, "nn.Linear"), _reference(ref_layer, ref_x, ref_r)


def embedding_case(batch, tokens, seed, padding_idx=None, dtype=torch.float32):
    """(Factorized, reference (B, V·E)) for an nn.Embedding on ids ``(B, T)``."""
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Embedding(VOCAB, EMB, padding_idx=padding_idx).to(dtype)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=gen)
    r = torch.randn(batch, tokens, EMB, generator=gen, dtype=torch.float64).to(dtype)
    ref_layer = nn.Embedding(VOCAB, EMB, padding_idx=padding_idx).double()
    ref_r = r.double() if dtype == torch.bfloat16 else r
    ref_layer = ref_layer if dtype == torch.bfloat16 else layer
    return _capture(layer, ids, r, "nn.Embedding"), _reference(ref_layer, ids, ref_r)


def block(**layers) -> Gradient:
    """Gradient of factorized layers ``name=(Factorized, layer_type)`` (all batch_token)."""
    return Gradient(
        {n: "factorized" for n in layers},
        {n: f for n, (f, _) in layers.items()},
        {n: t for n, (_, t) in layers.items()},
        {n: "batch_token" for n in layers},
    )


def two_layer_block(batch, tokens, seed, dtype=torch.float32):
    """(Gradient with 'lin' and 'emb', {layer: reference (B, d)})."""
    lin, lin_ref = linear_case(batch, tokens, seed, dtype)
    emb, emb_ref = embedding_case(batch, tokens, seed + 100, dtype=dtype)
    grad = block(lin=(lin, "nn.Linear"), emb=(emb, "nn.Embedding"))
    return grad, {"lin": lin_ref, "emb": emb_ref}


def dense_block(tensors: dict, indexing: str = "batch", layer_type: str = "nn.Linear") -> Gradient:
    """Gradient of materialized layers."""
    return Gradient(
        {n: "materialized" for n in tensors},
        dict(tensors),
        {n: layer_type for n in tensors},
        {n: indexing for n in tensors},
    )


# ------------------------------------------------------------------------ base name


def test_base_layer_name():
    assert base_layer_name("lin@2") == "lin"
    assert base_layer_name("a.b@3@x") == "a.b"
    assert base_layer_name("model.lin") == "model.lin"
    assert base_layer_name("") == ""


# ------------------------------------------------------------------------ Factorized


def test_factorized_is_frozen_identity_equal_and_hides_kwargs_in_repr():
    a, g = torch.ones(2, 3), torch.ones(2, 4)
    f1, f2 = Factorized(a, g, {"has_bias": True}), Factorized(a, g, {"has_bias": True})
    assert f1 == f1 and f1 != f2
    with pytest.raises(dataclasses.FrozenInstanceError):
        f1.activation = a
    assert "has_bias" not in repr(f1) and "batch_first=True" in repr(f1)


def test_factorized_to_keeps_integer_factors_and_metadata():
    kw = {"has_bias": False, "num_embeddings": 5, "padding_idx": None}
    f = Factorized(torch.tensor([[1, 2]]), torch.ones(1, 2, 3), kw, batch_first=False)
    moved = f.to(dtype=torch.float64)
    assert moved.activation.dtype == torch.int64  # token ids are never cast
    assert torch.equal(moved.activation, f.activation)
    assert moved.pre_activation_grad.dtype == torch.float64
    assert moved.module_kwargs is kw and moved.batch_first is False
    kept = f.to("cpu")
    assert kept.activation.dtype == torch.int64 and kept is not f


def test_factorized_nbytes_and_pin_memory():
    f = Factorized(torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 5, dtype=torch.float16))
    assert f.nbytes == 2 * 3 * 8 + 2 * 5 * 2
    pinned = f.pin_memory()
    if torch.cuda.is_available():
        assert pinned.activation.is_pinned() and pinned.pin_memory().activation.is_pinned()
    else:  # no accelerator: page-locked memory unavailable, factors pass through
        assert pinned.activation is f.activation


def test_as_batch_first_swaps_axes_0_and_1():
    a, g = torch.randn(5, 2, 4), torch.randn(5, 2, 3)
    f = Factorized(a, g, None, batch_first=False)
    bf = f.as_batch_first()
    assert bf.batch_first and bf.activation.shape == (2, 5, 4)
    assert torch.equal(bf.pre_activation_grad, g.transpose(0, 1))
    assert bf.as_batch_first() is bf


# ----------------------------------------------------------------- construction / validation


def test_indexing_completed_without_mutating_caller_dict():
    f, _ = linear_case(2, 3, 0)
    indexing: dict = {}
    grad = Gradient({"lin": "factorized"}, {"lin": f}, {"lin": "nn.Linear"}, indexing)
    assert grad.indexing == {"lin": "batch"} and indexing == {}


def test_validate_rejects_empty_data():
    with pytest.raises(ValueError, match="empty"):
        Gradient({}, {}, {})


def test_validate_rejects_missing_representation_and_layer_type():
    f, _ = linear_case(2, 3, 0)
    with pytest.raises(ValueError, match="'lin'.*representation"):
        Gradient({}, {"lin": f}, {"lin": "nn.Linear"})
    with pytest.raises(ValueError, match="'lin'.*layer_types"):
        Gradient({"lin": "factorized"}, {"lin": f}, {})
    with pytest.raises(ValueError, match="'lin'.*representation 'dense'"):
        Gradient({"lin": "dense"}, {"lin": f}, {"lin": "nn.Linear"})
    with pytest.raises(ValueError, match="'lin'.*indexing 'tokens'"):
        Gradient({"lin": "factorized"}, {"lin": f}, {"lin": "nn.Linear"}, {"lin": "tokens"})


def test_validate_rejects_wrong_payload_kinds():
    f, _ = linear_case(2, 3, 0)
    with pytest.raises(TypeError, match="'lin'.*'factorized'.*Tensor"):
        Gradient({"lin": "factorized"}, {"lin": torch.ones(2, 3)}, {"lin": "nn.Linear"})
    with pytest.raises(TypeError, match="'lin'.*'materialized'.*Factorized"):
        Gradient({"lin": "materialized"}, {"lin": f}, {"lin": "nn.Linear"})
    with pytest.raises(TypeError, match="'lin'.*pre_activation_grad"):
        Gradient(
            {"lin": "factorized"}, {"lin": Factorized(torch.ones(2, 3), None)}, {"lin": "nn.Linear"}
        )


def test_validate_rejects_unknown_layer_type_of_factorized_layer():
    f, _ = linear_case(2, 3, 0)
    with pytest.raises(ValueError, match=r"'lin'.*'Linear'.*nn\.Linear"):
        Gradient({"lin": "factorized"}, {"lin": f}, {"lin": "Linear"})
    # A dense payload's type is only a label: any string is accepted.
    dense = Gradient({"x": "materialized"}, {"x": torch.ones(2, 3)}, {"x": "mylib.MyLayer"})
    assert dense.layer_types["x"] == "mylib.MyLayer"


@pytest.mark.parametrize(
    ("layer_type", "a", "g"),
    [
        ("nn.Linear", torch.ones(2, 3, 4), torch.ones(2, 5, 6)),
        ("nn.Embedding", torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, 6)),
        ("nn.Embedding", torch.ones(2, 3, 1, dtype=torch.long), torch.ones(2, 3, 6)),
        ("nn.EmbeddingBag", torch.ones(2, 3, dtype=torch.long), torch.ones(3, 6)),
        ("nn.EmbeddingBag", torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, 6)),
        ("nn.Conv2d", torch.ones(2, 3, 5, 5), torch.ones(3, 4, 3, 3)),
        ("nn.LayerNorm", torch.ones(2, 3, 4), torch.ones(2, 3, 5)),
    ],
)
def test_validate_rejects_inconsistent_factor_shapes(layer_type, a, g):
    f = Factorized(a, g, None)
    with pytest.raises(
        ValueError,
        match=re.escape(f"'layer' ({layer_type})") + ".*" + re.escape(str(tuple(a.shape))),
    ):
        Gradient({"layer": "factorized"}, {"layer": f}, {"layer": layer_type})


def test_validate_accepts_consistent_factor_shapes_of_each_family():
    layers = {
        "lin": Factorized(torch.ones(2, 4), torch.ones(2, 3)),
        "emb": Factorized(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, 3)),
        "bag": Factorized(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 3)),
        "conv": Factorized(torch.ones(2, 3, 6, 6), torch.ones(2, 4, 4, 4)),
        "norm": Factorized(torch.ones(2, 5, 3), torch.ones(2, 5, 3)),
    }
    types = {
        "lin": "nn.Linear",
        "emb": "nn.Embedding",
        "bag": "nn.EmbeddingBag",
        "conv": "nn.Conv2d",
        "norm": "nn.LayerNorm",
    }
    grad = Gradient({n: "factorized" for n in layers}, layers, types)
    assert grad.batch_size == 2


def test_validate_rejects_bad_dense_ranks():
    with pytest.raises(ValueError, match="'d'.*'batch_token'.*\\(2, 6\\)"):
        dense_block({"d": torch.ones(2, 6)}, indexing="batch_token")
    with pytest.raises(ValueError, match="'d'.*0-D"):
        dense_block({"d": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="'f'.*activation is 0-D"):
        Gradient(
            {"f": "factorized"},
            {"f": Factorized(torch.tensor(1.0), torch.tensor(1.0))},
            {"f": "nn.Linear"},
        )


def test_validate_batch_size_agreement_with_broadcast_and_param_grad_exempt():
    with pytest.raises(ValueError, match="'a': 2.*'b': 3"):
        dense_block({"a": torch.ones(2, 4), "b": torch.ones(3, 4)})
    grad = Gradient(
        {"a": "materialized", "pos": "materialized", "p.weight": "materialized"},
        {"a": torch.ones(3, 4), "pos": torch.ones(1, 4), "p.weight": torch.ones(5, 7)},
        {"a": "nn.Linear", "pos": "nn.Embedding", "p.weight": "param_grad_layers"},
    )
    assert grad.batch_size == 3


def test_validate_on_init_false_skips_validation():
    grad = Gradient({}, {"x": torch.ones(2)}, {}, validate_on_init=False)
    with pytest.raises(ValueError):
        grad.validate()


# ------------------------------------------------------------------------- properties


def test_properties_batch_token_dim_device_dtype_nbytes():
    lin, _ = linear_case(3, 5, 0)
    seq_first = Factorized(torch.ones(6, 3, 4), torch.ones(6, 3, 2), None, batch_first=False)
    grad = Gradient(
        {"lin": "factorized", "sf": "factorized", "d": "materialized", "pos": "materialized"},
        {"lin": lin, "sf": seq_first, "d": torch.ones(3, 2, 8), "pos": torch.ones(1, 8)},
        {"lin": "nn.Linear", "sf": "nn.Linear", "d": "nn.Linear", "pos": "nn.Linear"},
        {"lin": "batch_token", "sf": "batch_token", "d": "batch_token"},
    )
    assert grad.layer_names == {"lin", "sf", "d", "pos"}
    assert grad.batch_size == 3
    assert grad.token_dim == {"lin": 5, "sf": 6, "d": 2, "pos": None}
    assert grad.device == torch.device("cpu") and grad.dtype == torch.float32
    assert grad.nbytes == 4 * (3 * 5 * D_IN + 3 * 5 * D_OUT + 6 * 3 * 4 + 6 * 3 * 2 + 48 + 8)


def test_batch_size_raises_with_only_param_grad_layers():
    grad = Gradient({"w": "materialized"}, {"w": torch.ones(3, 3)}, {"w": "param_grad_layers"})
    with pytest.raises(ValueError, match="param_grad_layers"):
        _ = grad.batch_size


def test_materialized_nbytes_estimates_without_computing():
    lin, _ = linear_case(3, 5, 0)
    emb, _ = embedding_case(3, 5, 1)
    no_vocab = Factorized(torch.tensor([[0, 4, 2]]), torch.ones(1, 3, 2), None)
    norm = Factorized(
        torch.ones(3, 5, 6), torch.ones(3, 5, 6), {"has_bias": True, "normalized_shape": (6,)}
    )
    grad = Gradient(
        {n: "factorized" for n in ("lin", "emb", "nv", "norm")} | {"d": "materialized"},
        {"lin": lin, "emb": emb, "nv": no_vocab, "norm": norm, "d": torch.ones(3, 11)},
        {
            "lin": "nn.Linear",
            "emb": "nn.Embedding",
            "nv": "nn.Embedding",
            "norm": "nn.LayerNorm",
            "d": "nn.Linear",
        },
        validate_on_init=False,
    )
    expected = 4 * (3 * D_IN * D_OUT + 3 * VOCAB * EMB + 1 * 5 * 2 + 3 * 6 + 3 * 11)
    assert grad.materialized_nbytes == expected


# ------------------------------------------------------------------------- map_layers


def test_map_layers_kinds_selection_and_drop():
    grad, _ = two_layer_block(2, 3, 0)
    seen = []

    def fn(name, value, layer_type):
        seen.append((name, layer_type))
        return torch.zeros(2, 5) if name == "lin" else None

    out = grad.map_layers(fn, layers=["lin", "emb", "absent"])
    assert sorted(seen) == [("emb", "nn.Embedding"), ("lin", "nn.Linear")]
    assert out.layer_names == {"lin"}
    assert out.representation == {"lin": "materialized"} and out.indexing == {"lin": "batch"}

    kept = grad.map_layers(lambda n, v, t: v, layers=["lin"])
    assert kept.representation["lin"] == "factorized" and kept.indexing["lin"] == "batch_token"
    assert kept.data["emb"] is grad.data["emb"] and "emb" in grad.data

    with pytest.raises(TypeError, match="'lin'"):
        grad.map_layers(lambda n, v, t: 3, layers=["lin"])


def test_map_layers_consume_removes_converted_layers_from_source():
    grad, _ = two_layer_block(2, 3, 0)
    out = grad.map_layers(lambda n, v, t: v, layers=["lin"], consume=True)
    assert "lin" not in grad.data and "emb" in grad.data
    assert out.layer_names == {"lin", "emb"}


# ---------------------------------------------------------- clone / to / pin / materialize


def test_clone_to_and_pin_memory():
    grad, _ = two_layer_block(2, 3, 0)
    cloned = grad.clone()
    cloned.data["lin"].activation.add_(1.0)
    assert not torch.equal(cloned.data["lin"].activation, grad.data["lin"].activation)
    assert cloned.data["emb"].module_kwargs == grad.data["emb"].module_kwargs
    assert cloned.data["emb"].module_kwargs is not grad.data["emb"].module_kwargs

    double = grad.to(dtype=torch.float64)
    assert double.data["lin"].pre_activation_grad.dtype == torch.float64
    assert double.indexing == grad.indexing and double.layer_types == grad.layer_types

    pinned = grad.pin_memory()
    assert pinned.layer_names == grad.layer_names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_materialize_matches_torch_func_per_sample_grads(dtype):
    grad, refs = two_layer_block(3, 4, 0, dtype)
    dense = grad.materialize()
    assert dense.representation == {"lin": "materialized", "emb": "materialized"}
    assert dense.indexing == {"lin": "batch", "emb": "batch"}
    for name, ref in refs.items():
        torch.testing.assert_close(dense.data[name], ref, **TOL[dtype])
    assert dense.materialize() is dense


def test_materialize_bf16_close_to_fp64_reference():
    grad, refs = two_layer_block(3, 4, 0, torch.bfloat16)
    dense = grad.materialize()
    for name, ref in refs.items():
        err = (dense.data[name].double() - ref).norm() / ref.norm()
        assert err < 2e-2, (name, float(err))


# ---------------------------------------------------------------------- select_layers


def test_select_layers_with_derived_and_unknown():
    lin, _ = linear_case(2, 3, 0)
    lin2, _ = linear_case(2, 3, 1)
    emb, _ = embedding_case(2, 3, 2)
    grad = block(
        lin=(lin, "nn.Linear"), **{"lin@2": (lin2, "nn.Linear")}, emb=(emb, "nn.Embedding")
    )
    assert grad.select_layers(["lin"]).layer_names == {"lin"}
    assert grad.select_layers("lin", include_derived=True).layer_names == {"lin", "lin@2"}
    assert grad.select_layers(["lin@2"]).layer_names == {"lin@2"}
    with pytest.raises(KeyError, match="missing"):
        grad.select_layers(["emb", "missing"])


# ----------------------------------------------------------------------- concatenate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_concatenate_batch_pads_tokens_and_matches_materialized(dtype):
    g1, r1 = two_layer_block(2, 3, 0, dtype)
    g2, r2 = two_layer_block(3, 5, 10, dtype)
    cat = g1.concatenate(g2)
    assert cat.batch_size == 5 and cat.token_dim == {"lin": 5, "emb": 5}
    lin = cat.data["lin"]
    assert torch.all(lin.activation[:2, 3:] == 0) and torch.all(
        lin.pre_activation_grad[:2, 3:] == 0
    )
    dense = cat.materialize()
    for name in ("lin", "emb"):
        expected = torch.cat([r1[name], r2[name]])
        torch.testing.assert_close(dense.data[name], expected, **TOL[dtype])


def test_concatenate_batch_pads_integer_ids_with_padding_idx():
    e1, r1 = embedding_case(2, 2, 0, padding_idx=5)
    e2, r2 = embedding_case(1, 4, 1, padding_idx=5)
    cat = block(emb=(e1, "nn.Embedding")).concatenate(block(emb=(e2, "nn.Embedding")))
    assert torch.all(cat.data["emb"].activation[:2, 2:] == 5)
    torch.testing.assert_close(
        cat.materialize().data["emb"], torch.cat([r1, r2]), **TOL[torch.float32]
    )


def test_concatenate_batch_dense_token_padding_and_param_grad_sum():
    d1, d2 = torch.randn(2, 3, 4), torch.randn(1, 5, 4)
    p1, p2 = torch.randn(4, 4), torch.randn(4, 4)

    def make(d, p):
        return Gradient(
            {"d": "materialized", "w": "materialized"},
            {"d": d, "w": p},
            {"d": "nn.Linear", "w": "param_grad_layers"},
            {"d": "batch_token"},
        )

    cat = make(d1, p1).concatenate(make(d2, p2))
    assert cat.data["d"].shape == (3, 5, 4)
    torch.testing.assert_close(cat.data["d"][:2, :3], d1)
    assert torch.all(cat.data["d"][:2, 3:] == 0)
    torch.testing.assert_close(cat.data["w"], p1 + p2)


def test_concatenate_broadcast_layers_weighted_mean():
    # factorized broadcast layer with identical activations: g averaged, stays factorized
    a = torch.randn(1, 4, D_IN)
    pos1 = Factorized(a, torch.randn(1, 4, D_OUT), {"has_bias": True})
    pos2 = Factorized(a.clone(), torch.randn(1, 4, D_OUT), {"has_bias": True})
    lin1, _ = linear_case(3, 4, 0)
    lin2, _ = linear_case(2, 4, 1)
    b1 = block(lin=(lin1, "nn.Linear"), pos=(pos1, "nn.Linear"))
    b2 = block(lin=(lin2, "nn.Linear"), pos=(pos2, "nn.Linear"))
    cat = b1.concatenate(b2)
    assert cat.batch_size == 5 and cat.representation["pos"] == "factorized"
    expected = (3 * materialize(pos1, "nn.Linear") + 2 * materialize(pos2, "nn.Linear")) / 5
    torch.testing.assert_close(materialize(cat.data["pos"], "nn.Linear"), expected)

    # different activations: both sides materialized first
    pos3 = Factorized(torch.randn(1, 4, D_IN), torch.randn(1, 4, D_OUT), {"has_bias": True})
    b3 = block(lin=(lin2, "nn.Linear"), pos=(pos3, "nn.Linear"))
    cat = b1.concatenate(b3)
    assert cat.representation["pos"] == "materialized" and cat.indexing["pos"] == "batch"
    expected = (3 * materialize(pos1, "nn.Linear") + 2 * materialize(pos3, "nn.Linear")) / 5
    torch.testing.assert_close(cat.data["pos"], expected)

    # dense broadcast layer
    d1 = dense_block({"x": torch.randn(3, 4), "pos": torch.randn(1, 4)})
    d2 = dense_block({"x": torch.randn(2, 4), "pos": torch.randn(1, 4)})
    torch.testing.assert_close(
        d1.concatenate(d2).data["pos"], (3 * d1.data["pos"] + 2 * d2.data["pos"]) / 5
    )


def test_concatenate_broadcast_on_one_side_only_raises():
    d1 = dense_block({"x": torch.randn(3, 4), "pos": torch.randn(1, 4)})
    d2 = dense_block({"x": torch.randn(2, 4), "pos": torch.randn(2, 4)})
    with pytest.raises(ValueError, match="'pos'.*broadcast"):
        d1.concatenate(d2)


def test_concatenate_structure_mismatches_raise():
    g1, _ = two_layer_block(2, 3, 0)
    g2, _ = two_layer_block(2, 3, 1)
    with pytest.raises(ValueError, match="layer sets differ"):
        g1.concatenate(g2.select_layers(["lin"]))
    with pytest.raises(ValueError, match="'lin' representation"):
        g1.concatenate(g2.map_layers(lambda n, v, t: materialize(v, t), layers=["lin"]))
    other = Gradient(
        g2.representation, g2.data, g2.layer_types, {"lin": "batch", "emb": "batch_token"}
    )
    with pytest.raises(ValueError, match="'lin' indexing"):
        g1.concatenate(other)
    other = Gradient(g2.representation, g2.data, {"lin": "nn.Conv1d", "emb": "nn.Embedding"},
                     g2.indexing, validate_on_init=False)  # fmt: skip
    with pytest.raises(ValueError, match="'lin' layer type"):
        g1.concatenate(other)
    bad_kind = Gradient(g2.representation, {**g2.data, "lin": torch.ones(2, 15)}, g2.layer_types,
                        g2.indexing, validate_on_init=False)  # fmt: skip
    with pytest.raises(TypeError, match="'lin'"):
        g1.concatenate(bad_kind)
    seq_first = g2.data["lin"]
    seq_first = Factorized(
        seq_first.activation.transpose(0, 1),
        seq_first.pre_activation_grad.transpose(0, 1),
        seq_first.module_kwargs,
        batch_first=False,
    )
    flipped = Gradient(
        g2.representation, {**g2.data, "lin": seq_first}, g2.layer_types, g2.indexing
    )
    with pytest.raises(ValueError, match="'lin' batch_first"):
        g1.concatenate(flipped)
    with pytest.raises(ValueError, match="dim"):
        g1.concatenate(g2, dim="layer")
    d1, d2 = dense_block({"d": torch.ones(2, 4)}), dense_block({"d": torch.ones(2, 5)})
    with pytest.raises(ValueError, match="'d'.*\\(2, 4\\).*\\(2, 5\\)"):
        d1.concatenate(d2)


def test_concatenate_token_sums_gradients():
    g1, r1 = two_layer_block(2, 3, 0)
    g2, r2 = two_layer_block(2, 4, 7)
    cat = g1.concatenate(g2, dim="token")
    assert cat.batch_size == 2 and cat.token_dim == {"lin": 7, "emb": 7}
    dense = cat.materialize()
    for name in ("lin", "emb"):
        torch.testing.assert_close(dense.data[name], r1[name] + r2[name], **TOL[torch.float32])


def test_concatenate_token_requirements():
    g1, _ = two_layer_block(2, 3, 0)
    g3, _ = two_layer_block(3, 3, 1)
    with pytest.raises(ValueError, match="'lin' batch sizes differ: 2 vs 3"):
        g1.concatenate(g3, dim="token")
    d = dense_block({"d": torch.ones(2, 4)})
    with pytest.raises(ValueError, match="not 'batch_token'"):
        d.concatenate(d, dim="token")


def test_concatenate_seq_first_factors_along_batch_axis_1():
    def seq_first(batch, tokens, seed):
        f, ref = linear_case(batch, tokens, seed)
        sf = Factorized(
            f.activation.transpose(0, 1), f.pre_activation_grad.transpose(0, 1),
            f.module_kwargs, batch_first=False,
        )  # fmt: skip
        return block(lin=(sf, "nn.Linear")), ref

    (b1, r1), (b2, r2) = seq_first(2, 3, 0), seq_first(1, 5, 1)
    cat = b1.concatenate(b2)
    assert cat.data["lin"].activation.shape == (5, 3, D_IN) and cat.batch_size == 3
    torch.testing.assert_close(cat.materialize().data["lin"], torch.cat([r1, r2]))


# ------------------------------------------------------------------------- aggregate


def test_aggregate_sums_tokens_and_equals_materialize():
    grad, refs = two_layer_block(3, 4, 0)
    dense_tokens = torch.randn(3, 4, 6)
    grad = Gradient(
        {**grad.representation, "d": "materialized", "plain": "materialized"},
        {**grad.data, "d": dense_tokens, "plain": torch.randn(3, 2)},
        {**grad.layer_types, "d": "nn.Linear", "plain": "nn.Linear"},
        {**grad.indexing, "d": "batch_token"},
    )
    agg = grad.aggregate()
    assert set(agg.indexing.values()) == {"batch"}
    assert set(agg.representation.values()) == {"materialized"}
    for name, ref in refs.items():
        torch.testing.assert_close(agg.data[name], ref, **TOL[torch.float32])
    torch.testing.assert_close(agg.data["d"], dense_tokens.sum(1))
    assert agg.data["plain"] is grad.data["plain"]
    with pytest.raises(NotImplementedError, match="batch"):
        grad.aggregate("batch")


def test_aggregate_keeps_batch_indexed_factorized_layers():
    lin, _ = linear_case(2, 3, 0)
    grad = Gradient({"lin": "factorized"}, {"lin": lin}, {"lin": "nn.Linear"})
    assert grad.aggregate().data["lin"] is lin


# ----------------------------------------------------------------------------- slice


@pytest.mark.parametrize("index", [1, -1, [2, 0], (0, 2), torch.tensor([1, 2]), slice(0, 2)])
def test_slice_batch_matches_indexed_materialization(index):
    grad, refs = two_layer_block(3, 4, 0)
    pos = torch.randn(1, 5)
    wpar = torch.randn(2, 2)
    grad = Gradient(
        {**grad.representation, "pos": "materialized", "w": "materialized"},
        {**grad.data, "pos": pos, "w": wpar},
        {**grad.layer_types, "pos": "nn.Embedding", "w": "param_grad_layers"},
        grad.indexing,
    )
    sliced = grad.slice("batch", index)
    rows = [index] if isinstance(index, int) else list(index) if isinstance(index, tuple) else index
    dense = sliced.materialize()
    for name, ref in refs.items():
        torch.testing.assert_close(dense.data[name], ref[rows], **TOL[torch.float32])
    assert sliced.data["w"] is wpar
    if isinstance(index, int):
        assert sliced.data["pos"] is pos
        assert sliced.batch_size == 1 and sliced.data["lin"].activation.ndim == 3
    else:  # compat.md §6: the broadcast row is repeated once per selected index
        torch.testing.assert_close(sliced.data["pos"], torch.cat([pos] * len(ref[rows])))


def test_slice_token_partitions_sum_to_whole():
    grad, refs = two_layer_block(2, 5, 0)
    first, rest = grad.slice("token", [0, 1]), grad.slice("token", torch.tensor([2, 3, 4]))
    assert first.token_dim == {"lin": 2, "emb": 2}
    for name, ref in refs.items():
        total = first.materialize().data[name] + rest.materialize().data[name]
        torch.testing.assert_close(total, ref, **TOL[torch.float32])
    one = grad.slice("token", 3)
    assert one.token_dim == {"lin": 1, "emb": 1}


def test_slice_seq_first_and_errors():
    f, ref = linear_case(3, 4, 0)
    sf = Factorized(
        f.activation.transpose(0, 1), f.pre_activation_grad.transpose(0, 1), f.module_kwargs, False
    )
    grad = block(lin=(sf, "nn.Linear"))
    torch.testing.assert_close(grad.slice("batch", [2]).materialize().data["lin"], ref[[2]])
    assert grad.slice("token", [0, 1]).data["lin"].activation.shape == (2, 3, D_IN)
    with pytest.raises(ValueError, match="dim"):
        grad.slice("layer", 0)
    d = dense_block({"d": torch.ones(2, 4)})
    with pytest.raises(ValueError, match="'d'.*not 'batch_token'"):
        d.slice("token", 0)
    conv = Gradient(
        {"c": "factorized"},
        {"c": Factorized(torch.ones(2, 3, 5), torch.ones(2, 4, 3), None)},
        {"c": "nn.Conv1d"},
        {"c": "batch_token"},
    )
    with pytest.raises(ValueError, match="'c'.*no token axis"):
        conv.slice("token", 0)


# ------------------------------------------------------------------------- similarity


def _cosine(k, n1, n2, eps=1e-8):
    return k / torch.outer(n1 + eps, n2 + eps)


@pytest.mark.parametrize("mode", ["auto", "factorized", "materialized"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_similarity_matches_dense_gram_of_torch_func_grads(mode, dtype):
    train, rt = two_layer_block(3, 4, 0, dtype)
    test, rs = two_layer_block(2, 6, 50, dtype)
    tol = TOL[dtype]
    per_layer = train.similarity(test, mode=mode)
    assert set(per_layer) == {"lin", "emb"}
    for name in per_layer:
        torch.testing.assert_close(per_layer[name], rt[name] @ rs[name].T, **tol)

    total = train.similarity(test, reduce="all", mode=mode)
    torch.testing.assert_close(total, sum(rt[n] @ rs[n].T for n in rt), **tol)

    cos = train.similarity(test, metric="cosine", mode=mode)
    for name in cos:
        expected = _cosine(rt[name] @ rs[name].T, rt[name].norm(dim=1), rs[name].norm(dim=1))
        torch.testing.assert_close(cos[name], expected, **tol)

    cos_all = train.similarity(test, metric="cosine", reduce="all", mode=mode)
    full_t, full_s = torch.cat([rt["lin"], rt["emb"]], 1), torch.cat([rs["lin"], rs["emb"]], 1)
    expected = _cosine(full_t @ full_s.T, full_t.norm(dim=1), full_s.norm(dim=1))
    torch.testing.assert_close(cos_all, expected, **tol)


def test_similarity_bf16_close_to_fp64_reference():
    train, rt = two_layer_block(3, 4, 0, torch.bfloat16)
    test, rs = two_layer_block(2, 6, 50, torch.bfloat16)
    total = train.similarity(test, reduce="all")
    expected = sum(rt[n] @ rs[n].T for n in rt)
    assert (total.double() - expected).norm() / expected.norm() < 3e-2


def test_similarity_mixed_dense_broadcast_and_param_grad_layers():
    train, rt = two_layer_block(3, 4, 0)
    test, rs = two_layer_block(2, 4, 50)
    test = test.materialize()
    pos_t, pos_s = torch.randn(1, 5), torch.randn(1, 5)

    def extend(grad, pos):
        return Gradient(
            {**grad.representation, "pos": "materialized"},
            {**grad.data, "pos": pos},
            {**grad.layer_types, "pos": "nn.Embedding"},
            grad.indexing,
        )

    train, test = extend(train, pos_t), extend(test, pos_s)
    total = train.similarity(test, reduce="all", mode="materialized")
    expected = sum(rt[n] @ rs[n].T for n in rt) + pos_t @ pos_s.T
    torch.testing.assert_close(total, expected, **TOL[torch.float32])
    per_layer = train.similarity(test, metric="cosine")
    assert per_layer["pos"].shape == (1, 1)  # compat.md §6: broadcast on both sides, no expansion
    torch.testing.assert_close(
        per_layer["pos"], _cosine(pos_t @ pos_s.T, pos_t.norm(dim=1), pos_s.norm(dim=1))
    )


def test_similarity_errors_and_no_shared_layers():
    g1, _ = two_layer_block(2, 3, 0)
    other = dense_block({"x": torch.ones(2, 4)})
    for kwargs in ({"metric": "l2"}, {"reduce": "sum"}, {"mode": "fast"}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            g1.similarity(g1, **kwargs)
    assert g1.similarity(other) == {}
    with pytest.raises(ValueError, match="no shared layer"):
        g1.similarity(other, reduce="all")


def test_similarity_per_token_sums_to_similarity():
    train, _ = two_layer_block(3, 5, 0)
    test, _ = two_layer_block(2, 4, 50)
    per_token = train.similarity_per_token(test, reduce="none")
    per_layer = train.similarity(test)
    for name, scores in per_token.items():
        assert scores.shape == (3, 5, 2)
        torch.testing.assert_close(scores.sum(1), per_layer[name], **TOL[torch.float32])
    total = train.similarity_per_token(test)
    torch.testing.assert_close(
        total.sum(1), train.similarity(test, reduce="all"), **TOL[torch.float32]
    )
    dense_test = test.materialize()
    torch.testing.assert_close(train.similarity_per_token(dense_test), total, **TOL[torch.float32])


def test_similarity_per_token_errors():
    train, _ = two_layer_block(3, 5, 0)
    with pytest.raises(ValueError, match="reduce"):
        train.similarity_per_token(train, reduce="sum")
    dense = train.materialize()
    assert dense.similarity_per_token(train, reduce="none") == {}
    with pytest.raises(ValueError, match="no layer"):
        dense.similarity_per_token(train)
    short, _ = two_layer_block(3, 2, 1)
    mixed = Gradient(
        {"lin": "factorized", "emb": "factorized"},
        {"lin": train.data["lin"], "emb": short.data["emb"]},
        train.layer_types,
        train.indexing,
    )
    with pytest.raises(ValueError, match="token length"):
        mixed.similarity_per_token(train)


# --------------------------------------------------------------------------- project


def test_project_styles_defaults_and_pass_through():
    grad, refs = two_layer_block(3, 4, 0)
    grad = Gradient(
        {**grad.representation, "w": "materialized"},
        {**grad.data, "w": torch.randn(2, 2)},
        {**grad.layer_types, "w": "param_grad_layers"},
        grad.indexing,
    )
    logra = grad.project(None, {"lin": {"proj_dim": 2}})
    lin = logra.data["lin"]
    assert isinstance(lin, Factorized) and lin.module_kwargs is None
    assert logra.layer_types["lin"] == "nn.Linear" and logra.indexing["lin"] == "batch_token"
    assert lin.activation.shape == (3, 4, 2) and lin.pre_activation_grad.shape == (3, 4, 2)
    assert logra.data["emb"] is grad.data["emb"] and logra.data["w"] is grad.data["w"]

    emb_cfg = {"style": "logra", "proj_dim": 2}
    relabelled = grad.project(None, {"__default__": emb_cfg})
    assert relabelled.layer_types["emb"] == "nn.Linear"

    mask = grad.project(None, {"__default__": {"style": "mask", "proj_dim": 5}})
    assert mask.representation["lin"] == "materialized" and mask.indexing["lin"] == "batch"
    assert mask.layer_types["lin"] == "nn.Linear" and mask.layer_types["emb"] == "nn.Embedding"
    from dattri_llm.gradient.ops.projection import mask_coordinates

    for name, ref in refs.items():
        idx = mask_coordinates({"__default__": {"style": "mask", "proj_dim": 5}}, name,
                               ref.shape[1], None)  # fmt: skip
        torch.testing.assert_close(mask.data[name], ref[:, idx], **TOL[torch.float32])
    assert mask.data["w"] is grad.data["w"]


def test_project_logra_preserves_inner_products_of_projected_factors():
    train, _ = two_layer_block(3, 4, 0)
    test, _ = two_layer_block(2, 4, 9)
    cfg = {"lin": {"proj_dim": 3, "proj_seed": 4}}
    pt, ps = train.project(None, cfg), test.project(None, cfg)
    dense_t, dense_s = pt.materialize().data["lin"], ps.materialize().data["lin"]
    torch.testing.assert_close(pt.similarity(ps)["lin"], dense_t @ dense_s.T, **TOL[torch.float32])


def test_project_materialized_capture_style():
    grad, _ = two_layer_block(3, 4, 0)
    cfg = {"lin": {"proj_dim": 2}}
    fact, dense = grad.project(None, cfg), grad.project(None, cfg, capture_style="materialized")
    assert dense.representation["lin"] == "materialized" and dense.indexing["lin"] == "batch"
    torch.testing.assert_close(dense.data["lin"], materialize(fact.data["lin"], "nn.Linear"))


def test_project_and_materialize_errors_name_the_layer():
    gen = torch.Generator().manual_seed(0)
    norm = nn.LayerNorm(D_IN)
    x = torch.randn(2, 3, D_IN, generator=gen)
    r = torch.randn(2, 3, D_IN, generator=gen)
    grad = block(ln=(_capture(norm, x, r, "nn.LayerNorm"), "nn.LayerNorm"))
    with pytest.raises(ValueError, match=r"Gradient\.project: layer 'ln':.*'logra'.*nn\.LayerNorm"):
        grad.project(None, {"ln": {"proj_dim": 2}})
    dense = grad.project(None, {"ln": {"style": "dense", "proj_dim": 2}})
    assert dense.data["ln"].shape == (2, 2)

    emb, _ = embedding_case(2, 3, 0)
    bare = block(emb=(Factorized(emb.activation, emb.pre_activation_grad, None), "nn.Embedding"))
    with pytest.raises(ValueError, match=r"Gradient\.materialize: layer 'emb':.*module_kwargs"):
        bare.materialize()
    with pytest.raises(ValueError, match=r"Gradient\.aggregate: layer 'emb':.*module_kwargs"):
        bare.aggregate()


# ------------------------------------------------------------------------ GradientRecord


def test_gradient_record_repr_and_mutability():
    grad, _ = two_layer_block(2, 3, 0)
    h = "62224d8cfb5e8b41" + "a" * 48
    record = GradientRecord(0, [h, "b" * 64], grad)
    assert repr(record) == "GradientRecord(step=0, input_hash=[62224d8cfb5e8b41...+1])"
    assert (
        repr(GradientRecord(3, h, grad)) == "GradientRecord(step=3, input_hash=62224d8cfb5e8b41...)"
    )
    assert repr(GradientRecord(1, [h], grad, "id")) == (
        "GradientRecord(step=1, input_hash=[62224d8cfb5e8b41...])"
    )
    assert repr(GradientRecord(1, ["17"], grad, "id")) == "GradientRecord(step=1, input_hash=[17])"
    record.step = 5
    assert record.step == 5 and record.sample_id_key is None

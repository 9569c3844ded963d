"""Inner products (ops/dot.py) against torch.func per-sample gradients.

Every layer case (tests/dot_helpers.py) compares the kernels with the dense Gram of the
reference per-sample gradients (float64), for every routing mode, in float64 (1e-10),
float32 (1e-5, relative to the largest entry) and bfloat16 (relative Frobenius error
< 3e-2; factors are rounded to bf16 before the kernel).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from dot_helpers import CASE_IDS, assert_matches, cast, layer_case

from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops.dot import (
    cross_dot,
    cross_dot_factors,
    cross_dot_per_token,
    cross_gram,
    cross_gram_per_token,
    cross_gram_per_token_dense,
    dot,
    dot_factors,
    grad_norm_sq,
    grad_norm_sq_factors,
    layerwise_cross_dot,
    layerwise_cross_dot_per_token,
    pairwise_dot,
    pairwise_dot_factors,
)
from dattri_llm.gradient.ops.dtypes import compute_dtype
from dattri_llm.gradient.ops.preprocess import preprocess_factors
from dattri_llm.utils.cache import TensorCache

# the module itself (the ops package re-exports a function named ``dot``)
dot_module = importlib.import_module("dattri_llm.gradient.ops.dot")
kernels_module = importlib.import_module("dattri_llm.gradient.ops.dot_kernels")
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
MODES = ["auto", "factorized", "materialized"]


def side(case_id: str, k: int, dtype: torch.dtype = torch.float64) -> Factorized:
    case = layer_case(case_id)
    s = case.sides[k]
    return Factorized(cast(s.a, dtype), cast(s.g, dtype), module_kwargs=case.module_kwargs)


def dense(case_id: str, k: int, include_bias: bool = True) -> torch.Tensor:
    s = layer_case(case_id).sides[k]
    return s.dense if include_bias else s.dense_weight_only


# --------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_routed_kernels_match_reference(case_id, dtype, mode):
    """cross_dot (bias folded or not), pairwise_dot and grad_norm_sq in every mode."""
    lt = layer_case(case_id).layer_type
    f1, f2 = side(case_id, 0, dtype), side(case_id, 1, dtype)
    for include_bias in (True, False):
        expected = dense(case_id, 0, include_bias) @ dense(case_id, 1, include_bias).T
        assert_matches(cross_dot(f1, f2, lt, include_bias, mode), expected, dtype)
    gram = dense(case_id, 0) @ dense(case_id, 0).T
    assert_matches(pairwise_dot(f1, lt, mode=mode), gram, dtype)
    assert_matches(grad_norm_sq(f1, lt, mode=mode), gram.diagonal(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case_id", CASE_IDS)
class TestAlignedAndDense:
    def test_dot_aligned(self, case_id, dtype):
        lt = layer_case(case_id).layer_type
        got = dot(side(case_id, 0, dtype), side(case_id, 2, dtype), lt)
        assert_matches(got, (dense(case_id, 0) * dense(case_id, 2)).sum(-1), dtype)

    def test_cross_dot_with_dense_side(self, case_id, dtype):
        lt = layer_case(case_id).layer_type
        d1, d2 = dense(case_id, 0).to(dtype), dense(case_id, 1).to(dtype)
        expected = dense(case_id, 0) @ dense(case_id, 1).T
        assert_matches(cross_dot(side(case_id, 0, dtype), d2, lt), expected, dtype)
        assert_matches(cross_dot(d1, side(case_id, 1, dtype), lt), expected, dtype)
        assert_matches(cross_dot(d1, d2, lt), expected, dtype)

    def test_grad_norm_sq_dense(self, case_id, dtype):
        lt = layer_case(case_id).layer_type
        got = grad_norm_sq(dense(case_id, 0).to(dtype), lt)
        assert_matches(got, dense(case_id, 0).square().sum(-1), dtype)

    @pytest.mark.parametrize("route", ["ghost", "materialized"])
    def test_per_token_sums_to_gram(self, case_id, dtype, route, monkeypatch):
        monkeypatch.setattr(
            dot_module, "_prefers_materialized_per_token", lambda *dims: route == "materialized"
        )
        lt = layer_case(case_id).layer_type
        expected = dense(case_id, 0) @ dense(case_id, 1).T
        factorized = cross_dot_per_token(side(case_id, 0, dtype), side(case_id, 1, dtype), lt)
        against_dense = cross_dot_per_token(
            side(case_id, 0, dtype), dense(case_id, 1).to(dtype), lt
        )
        assert factorized.shape[::2] == expected.shape
        assert_matches(factorized.sum(1), expected, dtype)
        assert_matches(against_dense.sum(1), expected, dtype)
        assert_matches(factorized, against_dense.double(), dtype)


@pytest.mark.parametrize("route", ["ghost", "materialized"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(
    "case_id", [c for c in CASE_IDS if layer_case(c).sides[0].per_token_dense is not None]
)
def test_per_token_entries_match_per_token_reference(case_id, dtype, route, monkeypatch):
    """Token t's entry is <grad of token t's loss term, dW2_j> (independent reference)."""
    monkeypatch.setattr(
        dot_module, "_prefers_materialized_per_token", lambda *dims: route == "materialized"
    )
    case = layer_case(case_id)
    expected = case.sides[0].per_token_dense @ dense(case_id, 1).T
    got = cross_dot_per_token(side(case_id, 0, dtype), side(case_id, 1, dtype), case.layer_type)
    assert_matches(got, expected, dtype)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_factor_functions_match_wrappers(case_id):
    """The *_factors functions on raw factors and the preprocessed kernels agree with truth."""
    case = layer_case(case_id)
    lt, kw = case.layer_type, case.module_kwargs
    (a1, g1), (a2, g2) = [(s.a, s.g) for s in case.sides[:2]]
    expected = dense(case_id, 0) @ dense(case_id, 1).T
    assert_matches(cross_dot_factors(a1, g1, a2, g2, lt, kw, kw), expected, torch.float64)
    p1, p2 = preprocess_factors(a1, g1, lt, kw), preprocess_factors(a2, g2, lt, kw)
    assert_matches(cross_gram(*p1, *p2, lt), expected, torch.float64)
    assert_matches(cross_gram_per_token(*p1, *p2, lt).sum(1), expected, torch.float64)
    assert_matches(
        cross_gram_per_token_dense(*p1, dense(case_id, 1), lt).sum(1), expected, torch.float64
    )
    gram = dense(case_id, 0) @ dense(case_id, 0).T
    assert_matches(pairwise_dot_factors(a1, g1, lt, kw), gram, torch.float64)
    assert_matches(grad_norm_sq_factors(a1, g1, lt, kw), gram.diagonal(), torch.float64)
    a3, g3 = case.sides[2].a, case.sides[2].g
    aligned = (dense(case_id, 0) * dense(case_id, 2)).sum(-1)
    assert_matches(dot_factors(a1, g1, a3, g3, lt, kw, kw), aligned, torch.float64)


# --------------------------------------------------------------------------- blocking


@pytest.mark.parametrize("block", [1, 7, 60])
@pytest.mark.parametrize(
    "case_id",
    [
        "linear3d-bias",
        "conv2d_grouped_dilated-bias",
        "conv_transpose1d-bias",
        "embedding",
        "layer_norm-bias",
    ],
)
def test_tiny_blocks_give_the_same_result(case_id, block, monkeypatch):
    """Chunked loops (samples, token rows, side-2 columns, id blocks) are exact."""
    monkeypatch.setattr(kernels_module, "_BLOCK_ELEMENTS", block)
    monkeypatch.setattr(kernels_module, "_MIN_GHOST_ROWS", 2)
    lt = layer_case(case_id).layer_type
    f1, f2, f3 = side(case_id, 0), side(case_id, 1), side(case_id, 2)
    gram = dense(case_id, 0) @ dense(case_id, 1).T
    for mode in MODES:
        assert_matches(cross_dot(f1, f2, lt, mode=mode), gram, torch.float64)
        assert_matches(
            pairwise_dot(f1, lt, mode=mode), dense(case_id, 0) @ dense(case_id, 0).T, torch.float64
        )
        assert_matches(
            grad_norm_sq(f1, lt, mode=mode), dense(case_id, 0).square().sum(-1), torch.float64
        )
    assert_matches(dot(f1, f3, lt), (dense(case_id, 0) * dense(case_id, 2)).sum(-1), torch.float64)
    for route in (True, False):
        monkeypatch.setattr(dot_module, "_prefers_materialized_per_token", lambda *d, r=route: r)
        assert_matches(cross_dot_per_token(f1, f2, lt).sum(1), gram, torch.float64)
        assert_matches(cross_dot_per_token(f1, dense(case_id, 1), lt).sum(1), gram, torch.float64)


# --------------------------------------------------------------------------- conventions


def test_sequence_first_factors_are_made_batch_first():
    f1, f2 = side("linear3d-bias", 0), side("linear3d-bias", 1)
    seq_first = Factorized(
        f1.activation.transpose(0, 1),
        f1.pre_activation_grad.transpose(0, 1),
        module_kwargs=f1.module_kwargs,
        batch_first=False,
    )
    expected = dense("linear3d-bias", 0) @ dense("linear3d-bias", 1).T
    for mode in MODES:
        assert_matches(cross_dot(seq_first, f2, "nn.Linear", mode=mode), expected, torch.float64)
    assert_matches(cross_dot_per_token(seq_first, f2, "nn.Linear").sum(1), expected, torch.float64)


def test_compute_dtype_policy_and_promotion():
    f32, f64 = side("linear3d-bias", 0, torch.float32), side("linear3d-bias", 1, torch.float64)
    assert cross_dot(f32, f64, "nn.Linear").dtype == torch.float64
    assert (
        cross_dot(f32, side("linear3d-bias", 1, torch.float32), "nn.Linear").dtype == torch.float32
    )
    with compute_dtype("float64"):
        got = cross_dot(f32, side("linear3d-bias", 1, torch.float32), "nn.Linear")
    assert got.dtype == torch.float64
    emb = side("embedding", 0, torch.bfloat16)
    assert grad_norm_sq(emb, "nn.Embedding").dtype == torch.bfloat16


def test_final_factors_are_used_as_given():
    """module_kwargs=None: factors are final (e.g. projected) and the outer formula applies."""
    gen = torch.Generator().manual_seed(0)
    a1, g1 = (
        torch.randn(3, 4, 6, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, 5, generator=gen, dtype=torch.float64),
    )
    a2, g2 = (
        torch.randn(2, 7, 6, generator=gen, dtype=torch.float64),
        torch.randn(2, 7, 5, generator=gen, dtype=torch.float64),
    )
    m1 = torch.einsum("bsd,bsk->bdk", g1, a1).reshape(3, -1)
    m2 = torch.einsum("bsd,bsk->bdk", g2, a2).reshape(2, -1)
    for mode in MODES:
        got = cross_dot(Factorized(a1, g1), Factorized(a2, g2), "nn.Conv2d", mode=mode)
        torch.testing.assert_close(got, m1 @ m2.T, rtol=1e-12, atol=1e-12)


def test_embedding_sides_with_no_shared_ids_give_zeros():
    g = torch.ones(2, 3, 4)
    f1 = Factorized(
        torch.tensor([[1, 2, 3], [1, 1, 1]]),
        g,
        module_kwargs={"has_bias": False, "num_embeddings": 9, "padding_idx": None},
    )
    f2 = Factorized(
        torch.tensor([[4, 5, 6], [7, 8, 8]]),
        g,
        module_kwargs={"has_bias": False, "num_embeddings": 9, "padding_idx": None},
    )
    assert torch.equal(cross_dot(f1, f2, "nn.Embedding"), torch.zeros(2, 2))
    assert torch.equal(cross_dot_per_token(f1, f2, "nn.Embedding"), torch.zeros(2, 3, 2))
    assert torch.equal(dot(f1, f2, "nn.Embedding"), torch.zeros(2))
    # repeated ids within a sample add up before squaring: ‖3·1‖² = 9·4
    assert grad_norm_sq(f1, "nn.Embedding").tolist() == [12.0, 36.0]


# --------------------------------------------------------------------------- validation


LINEAR_KW = {"has_bias": True}


def _rand(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def test_invalid_mode_raises():
    f = Factorized(_rand(2, 3, 4), _rand(2, 3, 5))
    for call in (
        lambda: cross_dot(f, f, "nn.Linear", mode="fast"),
        lambda: pairwise_dot(f, "nn.Linear", mode="fast"),
        lambda: grad_norm_sq(f, "nn.Linear", mode="fast"),
        lambda: cross_gram(
            f.activation,
            f.pre_activation_grad,
            f.activation,
            f.pre_activation_grad,
            "nn.Linear",
            mode="fast",
        ),
    ):
        with pytest.raises(ValueError, match="mode='fast'"):
            call()


def test_width_mismatch_names_layer_and_shapes():
    with pytest.raises(ValueError, match=r"nn\.Linear.*\(2, 3, 4\).*\(2, 3, 6\)"):
        cross_gram(_rand(2, 3, 4), _rand(2, 3, 5), _rand(2, 3, 6), _rand(2, 3, 5), "nn.Linear")
    with pytest.raises(ValueError, match="different widths"):
        cross_gram(_rand(2, 4), _rand(2, 5), _rand(2, 4), _rand(2, 6), "nn.Linear")


def test_rank_and_batch_mismatch_on_one_side():
    with pytest.raises(ValueError, match=r"nn\.Linear.*\(2, 3, 4\).*\(2, 5\)"):
        cross_gram(_rand(2, 3, 4), _rand(2, 5), _rand(2, 3, 4), _rand(2, 3, 5), "nn.Linear")
    with pytest.raises(ValueError, match=r"side-2 activation \(3, 3, 4\).*\(2, 3, 5\)"):
        cross_gram(_rand(2, 3, 4), _rand(2, 3, 5), _rand(3, 3, 4), _rand(2, 3, 5), "nn.Linear")
    with pytest.raises(ValueError, match="elementwise"):
        cross_gram(_rand(2, 3, 4), _rand(2, 3, 5), _rand(2, 3, 4), _rand(2, 3, 5), "nn.LayerNorm")
    with pytest.raises(ValueError, match="equal batch sizes"):
        dot(side("linear3d-bias", 0), side("linear3d-bias", 1), "nn.Linear")


def test_projected_against_unprojected_raises():
    raw = side("linear3d-bias", 0)  # preprocessed to K = 5 + 1
    projected = Factorized(_rand(2, 3, 3), _rand(2, 3, 2))  # final factors (module_kwargs=None)
    with pytest.raises(ValueError, match="projected side"):
        cross_dot(raw, projected, "nn.Linear")
    # include_bias must agree too: final factors of width 5 vs preprocessed 5 + 1
    final = Factorized(raw.activation, raw.pre_activation_grad)
    with pytest.raises(ValueError, match=r"a\(3, 4, 6\).*a\(3, 4, 5\)"):
        cross_dot(raw, final, "nn.Linear")


def test_dense_side_of_wrong_width_raises():
    f = side("linear3d-bias", 0)
    with pytest.raises(ValueError, match=r"cross_dot\(nn\.Linear\).*\(3, 24\).*\(2, 23\)"):
        cross_dot(f, _rand(2, 23), "nn.Linear")
    with pytest.raises(ValueError, match=r"\(2, 23\) is not 24 wide"):
        cross_dot_per_token(f, _rand(2, 23), "nn.Linear")


def test_unknown_layer_type_and_param_grad_raise():
    f = Factorized(_rand(2, 4), _rand(2, 5))
    with pytest.raises(ValueError, match="unknown layer type 'nn.Foo'.*nn.Linear"):
        cross_dot(f, f, "nn.Foo")
    with pytest.raises(ValueError, match="param_grad_layers"):
        grad_norm_sq(f, "param_grad_layers")
    with pytest.raises(TypeError, match="needs a Factorized"):
        pairwise_dot(_rand(2, 4), "nn.Linear")


def test_embedding_id_errors():
    kw = {"has_bias": False, "num_embeddings": 5, "padding_idx": None}
    with pytest.raises(ValueError, match=r"nn\.Embedding.*\[0, 7\].*5"):
        cross_dot_factors(
            torch.tensor([[0, 7]]),
            _rand(1, 2, 3),
            torch.tensor([[1, 2]]),
            _rand(1, 2, 3),
            "nn.Embedding",
            kw,
            kw,
        )
    with pytest.raises(TypeError, match="integer"):
        cross_gram(_rand(1, 2), _rand(1, 2, 3), _rand(1, 2), _rand(1, 2, 3), "nn.Embedding")
    with pytest.raises(ValueError, match="multiple of the embedding width"):
        cross_gram_per_token_dense(
            torch.tensor([[0, 1]]), _rand(1, 2, 3), _rand(2, 10), "nn.Embedding"
        )


# --------------------------------------------------------------------------- Gradient blocks

BLOCK_CASES = {"lin": "linear3d-bias", "emb": "embedding", "ln": "layer_norm-bias"}


def _block(k: int, dense_layers=(), extra=None) -> Gradient:
    data, reps, types, indexing = {}, {}, {}, {}
    for name, case_id in BLOCK_CASES.items():
        types[name] = layer_case(case_id).layer_type
        indexing[name] = "batch_token"
        if name in dense_layers:
            data[name], reps[name], indexing[name] = dense(case_id, k), "materialized", "batch"
        else:
            data[name], reps[name] = side(case_id, k), "factorized"
    for name, (value, rep, lt, idx) in (extra or {}).items():
        data[name], reps[name], types[name], indexing[name] = value, rep, lt, idx
    return Gradient(representation=reps, data=data, layer_types=types, indexing=indexing)


def _expected_sum(names=BLOCK_CASES) -> torch.Tensor:
    return sum(dense(BLOCK_CASES[n], 0) @ dense(BLOCK_CASES[n], 1).T for n in names)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dense_test", [(), ("lin", "ln"), ("emb",)])
def test_layerwise_cross_dot_matches_reference(mode, dense_test):
    train, test = _block(0), _block(1, dense_layers=dense_test)
    got = layerwise_cross_dot(train, test, mode=mode)
    assert_matches(got, _expected_sum(), torch.float64)
    per_layer = layerwise_cross_dot(train, test, mode=mode, reduce="none")
    assert set(per_layer) == set(BLOCK_CASES)
    for name, case_id in BLOCK_CASES.items():
        assert_matches(per_layer[name], dense(case_id, 0) @ dense(case_id, 1).T, torch.float64)
    only = layerwise_cross_dot(train, test, layers=["lin", "missing"], mode=mode)
    assert_matches(only, _expected_sum(["lin"]), torch.float64)


def test_layerwise_cross_dot_dense_train_and_batch_token_dense_test():
    train = _block(0, dense_layers=("lin",))
    lin = layer_case("linear3d-bias")
    tokens = lin.sides[1]
    # a dense "batch_token" test layer: per-token gradients (B, T, d) whose token sum is dW
    per_token = torch.einsum(
        "btd,btk->btdk", tokens.g, torch.cat([tokens.a, torch.ones_like(tokens.a[..., :1])], -1)
    )
    test = _block(
        1, extra={"lin": (per_token.flatten(2), "materialized", "nn.Linear", "batch_token")}
    )
    assert_matches(layerwise_cross_dot(train, test), _expected_sum(), torch.float64)


def test_layerwise_cross_dot_uses_dense_cache():
    train, test = _block(0), _block(1, dense_layers=("lin",))
    with TensorCache("memory") as cache:
        layerwise_cross_dot(train, test, dense_cache=cache)
        assert set(cache.keys()) == {"lin"}
        assert_matches(cache.get("lin"), dense("linear3d-bias", 0), torch.float64)
        cache.put("lin", torch.zeros_like(cache.get("lin")))  # fetched, not recomputed
        got = layerwise_cross_dot(train, test, dense_cache=cache)
    assert_matches(got, _expected_sum(["emb", "ln"]), torch.float64)


def test_layerwise_cross_dot_expands_broadcast_layers():
    emb = layer_case("embedding")
    first = emb.sides[0]  # a batch-1 (broadcast) embedding layer on the train side
    pos_train = Factorized(first.a[:1], first.g[:1], module_kwargs=emb.module_kwargs)
    bias_train, bias_test = (
        torch.arange(4.0, dtype=torch.float64),
        torch.ones(4, dtype=torch.float64),
    )
    train = _block(
        0,
        extra={
            "pos": (pos_train, "factorized", "nn.Embedding", "batch_token"),
            "bias": (bias_train, "materialized", "param_grad_layers", "batch"),
        },
    )
    test = _block(
        1,
        extra={
            "pos": (side("embedding", 1), "factorized", "nn.Embedding", "batch_token"),
            "bias": (bias_test, "materialized", "param_grad_layers", "batch"),
        },
    )
    pos_row = first.dense[:1] @ dense("embedding", 1).T  # (1, B_test)
    got = layerwise_cross_dot(train, test)
    assert_matches(got, _expected_sum() + pos_row + 6.0, torch.float64)
    per_layer = layerwise_cross_dot(train, test, reduce="none")
    assert per_layer["pos"].shape == (1, 2) and per_layer["bias"].shape == (1, 1)


def test_layerwise_cross_dot_errors():
    train, test = _block(0), _block(1)
    with pytest.raises(ValueError, match="reduce='all'"):
        layerwise_cross_dot(train, test, reduce="all")
    with pytest.raises(ValueError, match="mode="):
        layerwise_cross_dot(train, test, mode="dense")
    with pytest.raises(ValueError, match="no shared layer"):
        layerwise_cross_dot(train, test, layers=["missing"])
    assert layerwise_cross_dot(train, test, layers=["missing"], reduce="none") == {}
    relabelled = Gradient(
        representation={"lin": "factorized"},
        data={"lin": side("linear3d-bias", 1)},
        layer_types={"lin": "transformers.pytorch_utils.Conv1D"},
    )
    with pytest.raises(ValueError, match="'lin' is 'nn.Linear' in the train block"):
        layerwise_cross_dot(train, relabelled)
    projected = Gradient(
        representation={"lin": "factorized"},
        data={"lin": Factorized(_rand(2, 3, 3), _rand(2, 3, 2))},
        layer_types={"lin": "nn.Linear"},
    )
    with pytest.raises(ValueError, match=r"layer 'lin': cross_gram\(nn\.Linear\).*\(3, 4, 6\)"):
        layerwise_cross_dot(train, projected)
    dense_test = Gradient(
        representation={"lin": "materialized"},
        data={"lin": _rand(2, 7)},
        layer_types={"lin": "nn.Linear"},
    )
    with pytest.raises(ValueError, match=r"layer 'lin':.*\(3, 24\).*\(2, 7\)"):
        layerwise_cross_dot(train, dense_test)


@pytest.mark.parametrize("dense_test", [(), ("lin", "emb", "ln")])
def test_layerwise_cross_dot_per_token(dense_test):
    train, test = _block(0), _block(1, dense_layers=dense_test)
    got = layerwise_cross_dot_per_token(train, test)
    assert got.shape == (3, 4, 2)
    assert_matches(got.sum(1), _expected_sum(), torch.float64)
    expected = sum(
        layer_case(c).sides[0].per_token_dense @ dense(c, 1).T for c in BLOCK_CASES.values()
    )
    assert_matches(got, expected, torch.float64)
    per_layer = layerwise_cross_dot_per_token(train, test, reduce="none")
    assert_matches(sum(per_layer.values()), expected, torch.float64)


def test_layerwise_cross_dot_per_token_errors():
    train, test = _block(0), _block(1)
    with pytest.raises(ValueError, match="reduce="):
        layerwise_cross_dot_per_token(train, test, reduce="mean")
    with pytest.raises(ValueError, match="no shared layer"):
        layerwise_cross_dot_per_token(train, test, layers=["missing"])
    with pytest.raises(ValueError, match="'lin' must be factorized"):
        layerwise_cross_dot_per_token(_block(0, dense_layers=("lin",)), test)
    conv_id = "conv2d_grouped_dilated-bias"
    conv = {"conv": (side(conv_id, 0), "factorized", "nn.Conv2d", "batch_token")}
    conv_test = {"conv": (side(conv_id, 1), "factorized", "nn.Conv2d", "batch_token")}
    train, test = _block(0, extra=conv), _block(1, extra=conv_test)
    with pytest.raises(ValueError, match="disagree on the token count"):
        layerwise_cross_dot_per_token(train, test)
    per_layer = layerwise_cross_dot_per_token(train, test, reduce="none")
    assert per_layer["conv"].shape == (3, 2 * 6 * 3, 2)  # groups × output positions

"""Layer types, dtype policy, extract_module_kwargs and the preprocess_factors contract."""

from __future__ import annotations

import pickle

import pytest
import torch
from ops_helpers import capture_io
from torch import nn

from dattri_llm.gradient.ops import dtypes, types
from dattri_llm.gradient.ops.materialize import materialize_factors
from dattri_llm.gradient.ops.preprocess import (
    extract_module_kwargs,
    preprocess_factorized,
    preprocess_factors,
    to_3d,
)

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ghost_gram(a1, g1, a2, g2):
    """Σ_{t,s} <a1_t, a2_s><g1_t, g2_s> over preprocessed token factors → (B1, B2)."""
    return torch.einsum("itk,jsk,itd,jsd->ij", to_3d(a1), to_3d(a2), to_3d(g1), to_3d(g2))


# --------------------------------------------------------------------------- types


def test_type_sets_and_predicates():
    assert types.LINEAR_TYPES == {
        "nn.Linear",
        "nn.Bilinear",
        "nn.NonDynamicallyQuantizableLinear",
        "transformers.pytorch_utils.Conv1D",
    }
    assert types.ALL_LAYER_TYPES == (
        types.LINEAR_TYPES
        | types.CONV_TYPES
        | types.CONV_TRANSPOSE_TYPES
        | types.NORM_TYPES
        | types.EMBEDDING_TYPES
    )
    assert len(types.ALL_LAYER_TYPES) == 4 + 3 + 3 + 6 + 2
    assert isinstance(types.ALL_LAYER_TYPES, frozenset)
    assert types.PARAM_GRAD_TYPES == "param_grad_layers"
    assert types.is_linear("transformers.pytorch_utils.Conv1D")
    assert types.is_conv("nn.Conv3d") and not types.is_conv("nn.ConvTranspose3d")
    assert types.is_conv_transpose("nn.ConvTranspose1d")
    assert types.is_norm("nn.RMSNorm") and not types.is_norm("nn.BatchNorm2d")
    assert types.is_embedding("nn.EmbeddingBag")
    eligible = {t for t in types.ALL_LAYER_TYPES if types.is_kfac_eligible(t)}
    assert eligible == types.LINEAR_TYPES | types.CONV_TYPES | types.CONV_TRANSPOSE_TYPES


def test_canonical_class_name():
    from transformers.pytorch_utils import Conv1D

    class Custom(nn.Linear):
        pass

    assert types.canonical_class_name(nn.Linear(2, 2)) == "nn.Linear"
    mha = nn.MultiheadAttention(4, 2)
    assert types.canonical_class_name(mha.out_proj) == "nn.NonDynamicallyQuantizableLinear"
    assert types.canonical_class_name(Conv1D(3, 2)) == "transformers.pytorch_utils.Conv1D"
    assert types.canonical_class_name(Custom(2, 2)) == f"{__name__}.Custom"


# --------------------------------------------------------------------------- dtypes


@pytest.fixture(autouse=True)
def _restore_policy():
    previous = dtypes.get_compute_dtype()
    yield
    dtypes.set_compute_dtype(previous)


def test_policy_set_get_and_aliases():
    assert dtypes.get_compute_dtype() == "auto"
    for name, dtype in [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float64", torch.float64),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        (torch.float64, torch.float64),
    ]:
        dtypes.set_compute_dtype(name)
        assert dtypes.get_compute_dtype() == dtype
    assert dtypes.set_compute_dtype("auto") == torch.float64
    assert dtypes.get_compute_dtype() == "auto"


@pytest.mark.parametrize("bad", ["float128", "int8", "", torch.int32, 32, None])
def test_policy_invalid_raises(bad):
    with pytest.raises(ValueError, match="compute dtype policy"):
        dtypes.set_compute_dtype(bad)
    assert dtypes.get_compute_dtype() == "auto"


def test_policy_context_manager_restores_even_on_error():
    with dtypes.compute_dtype("bf16"):
        assert dtypes.get_compute_dtype() == torch.bfloat16
        with dtypes.compute_dtype(torch.float64):
            assert dtypes.get_compute_dtype() == torch.float64
        assert dtypes.get_compute_dtype() == torch.bfloat16
    assert dtypes.get_compute_dtype() == "auto"
    with pytest.raises(RuntimeError), dtypes.compute_dtype("float64"):
        raise RuntimeError("boom")
    assert dtypes.get_compute_dtype() == "auto"


def test_resolve_as_float_align():
    bf, f32, f64 = torch.ones(2, dtype=torch.bfloat16), torch.ones(2), torch.ones(2).double()
    ids = torch.arange(3)
    assert dtypes.resolve(bf) == torch.bfloat16
    assert dtypes.resolve(bf, f32) == torch.float32
    assert dtypes.resolve(bf, ids, None) == torch.bfloat16
    assert dtypes.resolve(ids) == torch.float32
    assert dtypes.resolve() == torch.float32
    assert dtypes.resolve(bf, minimum=torch.float32) == torch.float32
    assert dtypes.resolve(f64, minimum=torch.float32) == torch.float64
    out = dtypes.as_float(bf, ids, f32)
    assert [t.dtype for t in out] == [torch.float32] * 3
    aligned = dtypes.align(bf, ids, None, f32)
    assert aligned[0].dtype == torch.float32 and aligned[1] is ids and aligned[2] is None
    with dtypes.compute_dtype("bf16"):
        assert dtypes.resolve(f64) == torch.bfloat16
        assert dtypes.align(f64)[0].dtype == torch.bfloat16
        assert dtypes.as_float(ids, minimum=torch.float32)[0].dtype == torch.float32


# --------------------------------------------------------------------------- extract_module_kwargs


def test_extract_module_kwargs_keys_and_picklable():
    from transformers.pytorch_utils import Conv1D

    cases = {
        "nn.Linear": (nn.Linear(3, 2, bias=False), {"has_bias": False}),
        "transformers.pytorch_utils.Conv1D": (Conv1D(3, 2), {"has_bias": True}),
        "nn.Embedding": (
            nn.Embedding(7, 3, padding_idx=-2),
            {"has_bias": False, "num_embeddings": 7, "padding_idx": 5},
        ),
        "nn.EmbeddingBag": (
            nn.EmbeddingBag(7, 3, mode="sum"),
            {"has_bias": False, "num_embeddings": 7, "mode": "sum", "padding_idx": None},
        ),
        "nn.Conv2d": (
            nn.Conv2d(4, 2, (3, 1), stride=2, padding="valid", dilation=(1, 2), groups=2),
            {
                "has_bias": True,
                "kernel_size": (3, 1),
                "stride": (2, 2),
                "padding": "valid",
                "dilation": (1, 2),
                "groups": 2,
            },
        ),
        "nn.ConvTranspose1d": (
            nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, bias=False),
            {
                "has_bias": False,
                "kernel_size": (3,),
                "stride": (2,),
                "padding": (1,),
                "dilation": (1,),
                "groups": 1,
            },
        ),
        "nn.LayerNorm": (
            nn.LayerNorm(4, eps=1e-3, bias=False),
            {"has_bias": False, "normalized_shape": (4,), "eps": 1e-3},
        ),
        "nn.RMSNorm": (
            nn.RMSNorm([2, 3]),
            {"has_bias": False, "normalized_shape": (2, 3), "eps": None},
        ),
        "nn.GroupNorm": (
            nn.GroupNorm(2, 4),
            {"has_bias": True, "num_groups": 2, "num_channels": 4, "eps": 1e-5},
        ),
        "nn.InstanceNorm2d": (
            nn.InstanceNorm2d(3, affine=True),
            {"has_bias": True, "num_features": 3, "eps": 1e-5},
        ),
    }
    for layer_type, (module, expected) in cases.items():
        kwargs = extract_module_kwargs(module, layer_type)
        assert kwargs == expected, layer_type
        assert pickle.loads(pickle.dumps(kwargs)) == kwargs


@pytest.mark.parametrize(
    ("module", "layer_type", "match"),
    [
        (nn.Embedding(5, 2, scale_grad_by_freq=True), "nn.Embedding", "scale_grad_by_freq"),
        (nn.EmbeddingBag(5, 2, scale_grad_by_freq=True), "nn.EmbeddingBag", "scale_grad_by_freq"),
        (nn.Conv1d(2, 2, 3, padding=1, padding_mode="circular"), "nn.Conv1d", "circular"),
        (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "nn.Conv2d", "reflect"),
        (
            nn.InstanceNorm1d(3, track_running_stats=True),
            "nn.InstanceNorm1d",
            "track_running_stats",
        ),
    ],
)
def test_extract_module_kwargs_unsupported(module, layer_type, match):
    with pytest.raises(NotImplementedError, match=f"{layer_type}.*{match}"):
        extract_module_kwargs(module, layer_type)


def test_extract_module_kwargs_bad_type():
    with pytest.raises(ValueError, match="nn.BatchNorm1d.*must be one of"):
        extract_module_kwargs(nn.BatchNorm1d(3), "nn.BatchNorm1d")
    with pytest.raises(TypeError, match="Linear.*nn.Conv2d.*kernel_size"):
        extract_module_kwargs(nn.Linear(2, 2), "nn.Conv2d")


# --------------------------------------------------------------------------- contract shapes


def test_identity_without_module_kwargs():
    a, g = _x(2, 3), _x(2, 4)
    a2, g2 = preprocess_factors(a, g, "nn.Linear")
    assert a2 is a and g2 is g


def test_to_3d():
    assert to_3d(_x(2, 5)).shape == (2, 1, 5)
    assert to_3d(_x(2, 3, 5)).shape == (2, 3, 5)
    assert to_3d(_x(2, 3, 4, 5)).shape == (2, 3, 4, 5)


def test_linear_shapes():
    kw = {"has_bias": True}
    a, g = preprocess_factors(_x(2, 3), _x(2, 4), "nn.Linear", kw)
    assert a.shape == (2, 4) and g.shape == (2, 4) and torch.all(a[:, -1] == 1)
    a, g = preprocess_factors(_x(2, 5, 3), _x(2, 5, 4), "nn.Linear", kw, include_bias=False)
    assert a.shape == (2, 5, 3)
    a, g = preprocess_factors(_x(2, 5, 2, 3), _x(2, 5, 2, 4), "nn.Linear", kw)
    assert a.shape == (2, 10, 4) and g.shape == (2, 10, 4)


def test_conv_shapes_and_group_blocks():
    module = nn.Conv2d(4, 6, 3, padding=1, groups=2)
    a, g, _ = capture_io(module, (_x(2, 4, 5, 5),))
    a_p, g_p = preprocess_factors(a, g, "nn.Conv2d", extract_module_kwargs(module, "nn.Conv2d"))
    assert a_p.shape == (2, 2 * 25, 2 * 9 + 1)
    assert g_p.shape == (2, 2 * 25, 6)
    assert torch.all(g_p[:, :25, 3:] == 0) and torch.all(g_p[:, 25:, :3] == 0)
    assert torch.all(a_p[..., -1] == 1)


def test_conv_transpose_shapes_and_bias_block():
    module = nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2)
    a, g, _ = capture_io(module, (_x(2, 4, 5),))
    kw = extract_module_kwargs(module, "nn.ConvTranspose1d")
    a_p, g_p = preprocess_factors(a, g, "nn.ConvTranspose1d", kw)
    assert a_p.shape == (2, 2 * 5 + 1, 4 + 1)
    assert g_p.shape == (2, 2 * 5 + 1, 3 * 3 + 6)
    assert torch.all(a_p[:, :5, 2:] == 0) and torch.all(a_p[:, 5:10, :2] == 0)
    assert torch.all(a_p[:, -1] == torch.tensor([0.0, 0, 0, 0, 1]))
    torch.testing.assert_close(g_p[:, -1, 9:], g.sum(-1))
    a_n, g_n = preprocess_factors(a, g, "nn.ConvTranspose1d", kw, include_bias=False)
    assert a_n.shape == (2, 10, 4) and g_n.shape == (2, 10, 9)


def test_norm_shapes():
    kw = {"has_bias": True, "normalized_shape": (4,), "eps": 1e-5}
    a, g = preprocess_factors(_x(2, 3, 5, 4), _x(2, 3, 5, 4), "nn.LayerNorm", kw)
    assert a.shape == (2, 15, 8) and g.shape == (2, 15, 8)
    torch.testing.assert_close(a[..., 4:], torch.ones(2, 15, 4))
    kw = {"has_bias": False, "num_groups": 2, "num_channels": 4, "eps": 1e-5}
    a, g = preprocess_factors(_x(2, 4, 3, 2), _x(2, 4, 3, 2), "nn.GroupNorm", kw)
    assert a.shape == (2, 6, 4) and g.shape == (2, 6, 4)


def test_rmsnorm_default_eps_follows_torch_for_bf16():
    x = torch.full((1, 4), 0.05, dtype=torch.bfloat16)  # mean(x²) ≪ bf16 eps: eps choice matters
    kw = {"has_bias": False, "normalized_shape": (4,), "eps": None}
    a, _ = preprocess_factors(x, torch.ones_like(x), "nn.RMSNorm", kw)
    torch.testing.assert_close(a.reshape(1, 4), nn.functional.rms_norm(x, (4,)))


def test_embedding_padding_and_bag_scaling():
    ids = torch.tensor([[1, 0, 2], [0, 0, 3]])
    g = _x(2, 3, 4)
    _, g_p = preprocess_factors(
        ids, g, "nn.Embedding", {"has_bias": False, "num_embeddings": 5, "padding_idx": 0}
    )
    assert torch.all(g_p[ids == 0] == 0)
    torch.testing.assert_close(g_p[ids != 0], g[ids != 0])
    g_bag = _x(2, 4)
    kw = {"has_bias": False, "num_embeddings": 5, "mode": "mean", "padding_idx": 0}
    a_p, g_p = preprocess_factors(ids, g_bag, "nn.EmbeddingBag", kw)
    assert a_p.shape == (2, 3) and g_p.shape == (2, 3, 4)
    torch.testing.assert_close(g_p[0, 0], g_bag[0] / 2)
    torch.testing.assert_close(g_p[1, 2], g_bag[1])
    assert torch.all(g_p[1, :2] == 0)
    kw["padding_idx"] = None
    _, g_p = preprocess_factors(ids, g_bag, "nn.EmbeddingBag", kw)
    torch.testing.assert_close(g_p[1, 1], g_bag[1] / 3)


def test_preprocess_factorized_uses_batch_first_view():
    class SeqFirst:
        def __init__(self):
            self.activation, self.pre_activation_grad = _x(5, 2, 3), _x(5, 2, 4)
            self.module_kwargs = {"has_bias": True}

        def as_batch_first(self):
            out = SeqFirst.__new__(SeqFirst)
            out.activation = self.activation.transpose(0, 1)
            out.pre_activation_grad = self.pre_activation_grad.transpose(0, 1)
            out.module_kwargs = self.module_kwargs
            return out

    a, g = preprocess_factorized(SeqFirst(), "nn.Linear")
    assert a.shape == (2, 5, 4) and g.shape == (2, 5, 4)
    a, _ = preprocess_factorized(SeqFirst(), "nn.Linear", include_bias=False)
    assert a.shape == (2, 5, 3)


# --------------------------------------------------------------------------- ghost exactness


@pytest.mark.parametrize(
    ("module", "shape", "layer_type"),
    [
        (nn.Conv1d(4, 6, 3, padding=2, dilation=2, groups=2), (3, 4, 7), "nn.Conv1d"),
        (nn.Conv2d(3, 6, 2, stride=2, groups=3), (3, 3, 4, 4), "nn.Conv2d"),
        (nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2), (3, 4, 4), "nn.ConvTranspose1d"),
        (nn.ConvTranspose2d(2, 4, 2, padding=1, groups=2), (3, 2, 3, 3), "nn.ConvTranspose2d"),
    ],
)
def test_token_pair_gram_equals_materialized_gram(module, shape, layer_type):
    """Generic ghost contraction on preprocessed factors is exact (no cross-group terms)."""
    module = module.double()
    a, g, _ = capture_io(module, (_x(*shape).double(),))
    kw = extract_module_kwargs(module, layer_type)
    a_p, g_p = preprocess_factors(a, g, layer_type, kw)
    dense = materialize_factors(a, g, layer_type, kw)
    ghost = _ghost_gram(a_p, g_p, a_p, g_p)
    torch.testing.assert_close(ghost, dense @ dense.T, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- errors


def test_unknown_layer_type_lists_valid_names():
    with pytest.raises(ValueError, match=r"nn\.Foo.*nn\.Conv1d"):
        preprocess_factors(_x(2, 3), _x(2, 3), "nn.Foo", {"has_bias": False})
    with pytest.raises(ValueError, match="param_grad_layers"):
        materialize_factors(_x(2, 3), _x(2, 3), "param_grad_layers")


def test_non_tensor_and_0d_factors():
    with pytest.raises(TypeError, match=r"nn\.Linear.*list"):
        preprocess_factors([1.0], _x(2, 3), "nn.Linear", {"has_bias": False})
    with pytest.raises(TypeError, match=r"nn\.Linear.*module_kwargs.*tuple"):
        preprocess_factors(_x(2, 3), _x(2, 3), "nn.Linear", (True,))
    with pytest.raises(ValueError, match=r"nn\.Linear.*batch axis"):
        preprocess_factors(torch.tensor(1.0), _x(2, 3), "nn.Linear", {"has_bias": False})


@pytest.mark.parametrize(
    ("layer_type", "a", "g", "kw", "match"),
    [
        ("nn.Linear", _x(3, 4), _x(2, 5), {"has_bias": True}, r"nn\.Linear.*\(3, 4\).*\(2, 5\)"),
        ("nn.Linear", _x(2, 3, 4), _x(2, 5), {"has_bias": True}, r"nn\.Linear.*\(2, 3, 4\)"),
        ("nn.Linear", _x(4), _x(5), {"has_bias": True}, r"nn\.Linear.*\(4,\)"),
        (
            "nn.Conv2d",
            _x(2, 3, 5),
            _x(2, 4, 3),
            {
                "has_bias": True,
                "kernel_size": (3, 3),
                "stride": (1, 1),
                "padding": (0, 0),
                "dilation": (1, 1),
            },
            r"nn\.Conv2d.*\(2, 3, 5\).*add a batch axis",
        ),
        (
            "nn.Conv1d",
            _x(2, 3, 9),
            _x(2, 4, 7),
            {
                "has_bias": True,
                "kernel_size": (3,),
                "stride": (2,),
                "padding": (0,),
                "dilation": (1,),
            },
            r"nn\.Conv1d.*\(4,\).*\(7,\)",
        ),
        (
            "nn.Conv1d",
            _x(2, 3, 9),
            _x(3, 4, 7),
            {
                "has_bias": True,
                "kernel_size": (3,),
                "stride": (1,),
                "padding": (0,),
                "dilation": (1,),
            },
            r"nn\.Conv1d.*batch size.*\(2, 3, 9\).*\(3, 4, 7\)",
        ),
        (
            "nn.Conv1d",
            _x(2, 3, 9),
            _x(2, 4, 7),
            {
                "has_bias": True,
                "kernel_size": (3,),
                "stride": (1,),
                "padding": (0,),
                "dilation": (1,),
                "groups": 2,
            },
            r"nn\.Conv1d.*groups=2",
        ),
        ("nn.Conv1d", _x(2, 3, 9), _x(2, 4, 7), {"has_bias": True}, r"nn\.Conv1d.*kernel_size"),
        (
            "nn.LayerNorm",
            _x(2, 3, 5),
            _x(2, 3, 5),
            {"has_bias": True, "normalized_shape": (4,), "eps": 1e-5},
            r"nn\.LayerNorm.*\(2, 3, 5\).*\(4,\)",
        ),
        (
            "nn.LayerNorm",
            _x(2, 3, 4),
            _x(2, 4, 4),
            {"has_bias": True, "normalized_shape": (4,), "eps": 1e-5},
            r"nn\.LayerNorm.*same shape",
        ),
        (
            "nn.GroupNorm",
            _x(2, 5, 3),
            _x(2, 5, 3),
            {"has_bias": True, "num_groups": 2, "num_channels": 4, "eps": 1e-5},
            r"nn\.GroupNorm.*\(2, 5, 3\)",
        ),
        (
            "nn.Embedding",
            torch.zeros(2, 3, dtype=torch.long),
            _x(2, 4, 5),
            {"has_bias": False, "num_embeddings": 5, "padding_idx": None},
            r"nn\.Embedding.*\(2, 3\).*\(2, 4, 5\)",
        ),
        (
            "nn.EmbeddingBag",
            torch.zeros(2, 3, dtype=torch.long),
            _x(3, 4),
            {"has_bias": False, "num_embeddings": 5, "mode": "sum", "padding_idx": None},
            r"nn\.EmbeddingBag.*batch size",
        ),
    ],
)
def test_bad_shapes_raise_value_error(layer_type, a, g, kw, match):
    with pytest.raises(ValueError, match=match):
        materialize_factors(a, g, layer_type, kw)


def test_float_ids_raise_type_error():
    kw = {"has_bias": False, "num_embeddings": 5, "padding_idx": None}
    with pytest.raises(TypeError, match=r"nn\.Embedding.*integer"):
        preprocess_factors(_x(2, 3), _x(2, 3, 4), "nn.Embedding", kw)


def test_embedding_bag_unsupported_modes():
    kw = {"has_bias": False, "num_embeddings": 5, "mode": "max", "padding_idx": None}
    with pytest.raises(NotImplementedError, match=r"nn\.EmbeddingBag.*'max'"):
        preprocess_factors(torch.zeros(2, 3, dtype=torch.long), _x(2, 4), "nn.EmbeddingBag", kw)
    kw["mode"] = "sum"
    with pytest.raises(NotImplementedError, match=r"nn\.EmbeddingBag.*\(6,\).*offsets"):
        preprocess_factors(torch.zeros(6, dtype=torch.long), _x(2, 4), "nn.EmbeddingBag", kw)


def test_conv_unknown_padding_string():
    kw = {
        "has_bias": False,
        "kernel_size": (3,),
        "stride": (1,),
        "padding": "full",
        "dilation": (1,),
    }
    with pytest.raises(ValueError, match=r"nn\.Conv1d.*'full'"):
        preprocess_factors(_x(2, 3, 9), _x(2, 4, 7), "nn.Conv1d", kw)


def test_bilinear_refuses_single_input_factors():
    with pytest.raises(NotImplementedError, match=r"nn\.Bilinear.*both inputs"):
        preprocess_factors(_x(2, 3), _x(2, 4), "nn.Bilinear", {"has_bias": True})

"""materialize_factors / materialize against torch.func per-sample gradients, every layer type."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import (
    bf16_and_fp32_copies,
    capture_io,
    cast_inputs,
    expected_layout,
    reference_grads,
    relative_error,
)
from torch import nn

from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.materialize import materialize, materialize_factors
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")

BF16_REL_TOL = 2e-2  # relative Frobenius error of bf16 capture+materialize vs the fp32 reference
TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _ids(high, *shape):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(2))


def _hf_conv1d(bias):
    from transformers.pytorch_utils import Conv1D

    return Conv1D(5, 4)  # always has a bias


# name -> (factory(bias) -> module, inputs, layer_type, use the backward loop as reference)
CASES = {
    "linear_2d": (lambda b: nn.Linear(4, 3, bias=b), lambda: (_x(3, 4),), "nn.Linear", False),
    "linear_3d": (lambda b: nn.Linear(4, 3, bias=b), lambda: (_x(3, 5, 4),), "nn.Linear", False),
    "linear_4d": (lambda b: nn.Linear(4, 3, bias=b), lambda: (_x(2, 3, 2, 4),), "nn.Linear", False),
    "hf_conv1d": (_hf_conv1d, lambda: (_x(3, 6, 4),), "transformers.pytorch_utils.Conv1D", False),
    "conv1d_stride_pad": (
        lambda b: nn.Conv1d(4, 6, 3, stride=2, padding=1, bias=b),
        lambda: (_x(3, 4, 9),),
        "nn.Conv1d",
        False,
    ),
    "conv1d_same_dilated_grouped": (
        lambda b: nn.Conv1d(4, 6, 4, padding="same", dilation=2, groups=2, bias=b),
        lambda: (_x(3, 4, 9),),
        "nn.Conv1d",
        False,
    ),
    "conv2d_mixed": (
        lambda b: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), bias=b),
        lambda: (_x(2, 3, 7, 6),),
        "nn.Conv2d",
        False,
    ),
    "conv2d_depthwise_valid": (
        lambda b: nn.Conv2d(4, 8, 3, padding="valid", groups=4, bias=b),
        lambda: (_x(2, 4, 5, 5),),
        "nn.Conv2d",
        False,
    ),
    "conv2d_same_even_kernel": (
        lambda b: nn.Conv2d(2, 3, (2, 4), padding="same", bias=b),
        lambda: (_x(2, 2, 4, 5),),
        "nn.Conv2d",
        False,
    ),
    "conv3d_grouped": (
        lambda b: nn.Conv3d(4, 6, 2, stride=(1, 2, 1), padding=1, groups=2, bias=b),
        lambda: (_x(2, 4, 3, 4, 3),),
        "nn.Conv3d",
        False,
    ),
    "convT1d_output_padding": (
        lambda b: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, bias=b),
        lambda: (_x(3, 4, 5),),
        "nn.ConvTranspose1d",
        False,
    ),
    "convT1d_grouped_dilated": (
        lambda b: nn.ConvTranspose1d(4, 6, 3, dilation=2, groups=2, bias=b),
        lambda: (_x(3, 4, 5),),
        "nn.ConvTranspose1d",
        False,
    ),
    "convT2d_mixed": (
        lambda b: nn.ConvTranspose2d(
            3, 4, (3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2), bias=b
        ),
        lambda: (_x(2, 3, 4, 3),),
        "nn.ConvTranspose2d",
        False,
    ),
    "convT2d_output_padding_ge_stride": (
        lambda b: nn.ConvTranspose2d(4, 2, 2, dilation=3, output_padding=2, groups=2, bias=b),
        lambda: (_x(2, 4, 3, 4),),
        "nn.ConvTranspose2d",
        False,
    ),
    "convT2d_depthwise": (
        lambda b: nn.ConvTranspose2d(3, 3, 3, stride=2, padding=1, groups=3, bias=b),
        lambda: (_x(2, 3, 3, 3),),
        "nn.ConvTranspose2d",
        False,
    ),
    "convT3d_grouped": (
        lambda b: nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2, bias=b),
        lambda: (_x(2, 4, 2, 3, 2),),
        "nn.ConvTranspose3d",
        False,
    ),
    "layernorm_3d": (
        lambda b: nn.LayerNorm(6, bias=b),
        lambda: (_x(3, 5, 6) * 2 + 1,),
        "nn.LayerNorm",
        False,
    ),
    "layernorm_2d_input": (
        lambda b: nn.LayerNorm(6, bias=b),
        lambda: (_x(3, 6),),
        "nn.LayerNorm",
        False,
    ),
    "layernorm_multi_dim_shape": (
        lambda b: nn.LayerNorm((3, 4), eps=1e-3, bias=b),
        lambda: (_x(2, 2, 5, 3, 4),),
        "nn.LayerNorm",
        False,
    ),
    "rmsnorm_default_eps": (lambda b: nn.RMSNorm(6), lambda: (_x(3, 5, 6),), "nn.RMSNorm", False),
    "rmsnorm_eps": (
        lambda b: nn.RMSNorm((2, 3), eps=0.1),
        lambda: (_x(3, 4, 2, 3),),
        "nn.RMSNorm",
        False,
    ),
    "groupnorm": (
        lambda b: nn.GroupNorm(2, 6, affine=True),
        lambda: (_x(3, 6, 4, 3),),
        "nn.GroupNorm",
        False,
    ),
    "groupnorm_no_spatial": (
        lambda b: nn.GroupNorm(3, 6),
        lambda: (_x(3, 6),),
        "nn.GroupNorm",
        False,
    ),
    "instancenorm1d": (
        lambda b: nn.InstanceNorm1d(4, affine=True),
        lambda: (_x(3, 4, 7),),
        "nn.InstanceNorm1d",
        False,
    ),
    "instancenorm2d": (
        lambda b: nn.InstanceNorm2d(3, affine=True, eps=1e-2),
        lambda: (_x(2, 3, 4, 5),),
        "nn.InstanceNorm2d",
        False,
    ),
    "instancenorm3d": (
        lambda b: nn.InstanceNorm3d(2, affine=True),
        lambda: (_x(2, 2, 3, 2, 4),),
        "nn.InstanceNorm3d",
        False,
    ),
    "embedding": (lambda b: nn.Embedding(11, 4), lambda: (_ids(11, 3, 6),), "nn.Embedding", False),
    "embedding_padding_idx": (
        lambda b: nn.Embedding(11, 4, padding_idx=0),
        lambda: (_ids(3, 3, 8),),
        "nn.Embedding",
        False,
    ),
    "embedding_negative_padding_idx": (
        lambda b: nn.Embedding(5, 4, padding_idx=-1),
        lambda: (_ids(5, 3, 8),),
        "nn.Embedding",
        False,
    ),
    "embeddingbag_sum": (
        lambda b: nn.EmbeddingBag(9, 4, mode="sum"),
        lambda: (_ids(9, 3, 5),),
        "nn.EmbeddingBag",
        True,
    ),
    "embeddingbag_mean": (
        lambda b: nn.EmbeddingBag(9, 4, mode="mean"),
        lambda: (_ids(9, 3, 5),),
        "nn.EmbeddingBag",
        True,
    ),
    "embeddingbag_mean_padding_idx": (
        lambda b: nn.EmbeddingBag(4, 3, mode="mean", padding_idx=1),
        lambda: (torch.tensor([[1, 1, 1, 1], [0, 1, 2, 1], [3, 2, 1, 0]]),),
        "nn.EmbeddingBag",
        True,
    ),
    "embeddingbag_sum_padding_idx": (
        lambda b: nn.EmbeddingBag(4, 3, mode="sum", padding_idx=2),
        lambda: (_ids(4, 3, 6),),
        "nn.EmbeddingBag",
        True,
    ),
}

# cases whose module has no bias-free variant (the bias flag is ignored): run once
NO_BIAS_OPTION = {"hf_conv1d", "rmsnorm_default_eps", "rmsnorm_eps", "groupnorm"}
NO_BIAS_OPTION |= {n for n in CASES if n.startswith(("groupnorm", "instancenorm", "embedding"))}
BIAS_VARIANTS = [
    pytest.param(name, bias, id=f"{name}-{'bias' if bias else 'nobias'}")
    for name in sorted(CASES)
    for bias in (True, False)
    if bias or name not in NO_BIAS_OPTION
]


def _build(name, bias):
    factory, make_inputs, layer_type, loop = CASES[name]
    torch.manual_seed(0)
    module = factory(bias)
    with torch.no_grad():  # non-trivial affine parameters (norm defaults are 1 / 0)
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module, make_inputs(), layer_type, loop


def _materialize_module(module, inputs, layer_type, include_bias=True, **kw):
    a, g, r = capture_io(module, inputs)
    got = materialize_factors(
        a, g, layer_type, extract_module_kwargs(module, layer_type), include_bias, **kw
    )
    return got, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("name", "bias"), BIAS_VARIANTS)
def test_materialize_matches_per_sample_grads(name, bias, dtype):
    module, inputs, layer_type, loop = _build(name, bias)
    module = module.to(dtype)
    inputs = cast_inputs(inputs, dtype)
    got, r = _materialize_module(module, inputs, layer_type)
    expected = expected_layout(layer_type, reference_grads(module, inputs, r, loop=loop))
    assert got.dtype == dtype
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOLS[dtype])


@pytest.mark.parametrize("name", sorted(CASES))
def test_materialize_bf16_close_to_fp32_reference(name):
    module, inputs, layer_type, loop = _build(name, True)
    low, low_inputs, high, high_inputs = bf16_and_fp32_copies(module, inputs)
    got, r = _materialize_module(low, low_inputs, layer_type)
    expected = expected_layout(layer_type, reference_grads(high, high_inputs, r.float(), loop))
    assert got.dtype == torch.bfloat16
    assert relative_error(got, expected) < BF16_REL_TOL


@pytest.mark.parametrize(
    "name", [n for n in sorted(CASES) if CASES[n][2].startswith(("nn.Linear", "nn.Conv"))]
)
def test_include_bias_false_drops_bias(name):
    module, inputs, layer_type, loop = _build(name, True)
    got, r = _materialize_module(module, inputs, layer_type, include_bias=False)
    grads = reference_grads(module, inputs, r, loop=loop)
    expected = expected_layout(layer_type, grads, include_bias=False)
    torch.testing.assert_close(got, expected, **TOLS[torch.float32])


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in sorted(CASES)
        if CASES[n][2] in ("nn.LayerNorm", "nn.RMSNorm", "nn.GroupNorm", "nn.InstanceNorm2d")
    ],
)
def test_norm_per_token_sums_to_total(name):
    module, inputs, layer_type, _ = _build(name, True)
    total, _ = _materialize_module(module, inputs, layer_type)
    per_token, _ = _materialize_module(module, inputs, layer_type, per_token=True)
    n, d = total.shape
    assert per_token.shape[0] == n and per_token.shape[1] % d == 0
    # per-token layout is (B, S, d'): d' = [x̂_s ⊙ g_s, g_s]; sum over S gives the total
    torch.testing.assert_close(per_token.reshape(n, -1, d).sum(1), total, rtol=1e-5, atol=1e-5)


def test_layernorm_without_affine_has_no_bias_block():
    module = nn.LayerNorm(6, elementwise_affine=False)
    a, g, _ = capture_io(module, (_x(2, 3, 6).requires_grad_(),))
    kwargs = extract_module_kwargs(module, "nn.LayerNorm")
    assert kwargs["has_bias"] is False
    assert materialize_factors(a, g, "nn.LayerNorm", kwargs).shape == (2, 6)


def test_unbatched_instance_norm_is_one_sample():
    module = nn.InstanceNorm1d(3, affine=True)
    x = _x(3, 7)
    a, g, r = capture_io(module, (x,))
    got = materialize_factors(
        a, g, "nn.InstanceNorm1d", extract_module_kwargs(module, "nn.InstanceNorm1d")
    )
    (module(x) * r).sum().backward()
    torch.testing.assert_close(got[0], torch.cat([module.weight.grad, module.bias.grad]))


def test_embedding_1d_input_is_one_sample():
    module = nn.Embedding(7, 3)
    ids = torch.tensor([0, 3, 3, 6])
    a, g, r = capture_io(module, (ids,))
    got = materialize_factors(a, g, "nn.Embedding", extract_module_kwargs(module, "nn.Embedding"))
    (module(ids) * r).sum().backward()
    assert got.shape == (1, 21)
    torch.testing.assert_close(got[0], module.weight.grad.reshape(-1))


def test_embedding_requires_module_kwargs():
    with pytest.raises(ValueError, match=r"nn\.Embedding.*module_kwargs"):
        materialize_factors(_ids(5, 2, 3), _x(2, 3, 4), "nn.Embedding")


@pytest.mark.parametrize("bad_id", [5, -1])
def test_embedding_out_of_range_id_raises(bad_id):
    ids = torch.tensor([[0, 1, bad_id]])
    kwargs = {"has_bias": False, "num_embeddings": 5, "padding_idx": None}
    with pytest.raises(ValueError, match=r"nn\.Embedding.*\(1, 3\).*num_embeddings=5"):
        materialize_factors(ids, _x(1, 3, 4), "nn.Embedding", kwargs)


def test_final_factors_used_as_given():
    a, g = _x(2, 3, 4), _x(2, 3, 5)
    got = materialize_factors(a, g, "nn.Linear")
    torch.testing.assert_close(got, torch.einsum("bsd,bsk->bdk", g, a).reshape(2, -1))
    got_t = materialize_factors(a, g, "nn.ConvTranspose2d")
    torch.testing.assert_close(got_t, torch.einsum("bsk,bsd->bkd", a, g).reshape(2, -1))
    got_norm = materialize_factors(a, a * 2, "nn.LayerNorm")
    torch.testing.assert_close(got_norm, (2 * a * a).sum(1))


def test_materialize_dense_reshapes():
    dense = _x(2, 3, 4)
    assert materialize(dense, "nn.Linear").shape == (2, 12)
    torch.testing.assert_close(materialize(dense, "nn.Linear"), dense.reshape(2, 12))


class _SeqFirst:
    """Minimal Factorized stand-in holding sequence-first factors."""

    def __init__(self, activation, grad, module_kwargs):
        self.activation, self.pre_activation_grad = activation, grad
        self.module_kwargs, self.batch_first = module_kwargs, False

    def as_batch_first(self):
        out = _SeqFirst(
            self.activation.transpose(0, 1),
            self.pre_activation_grad.transpose(0, 1),
            self.module_kwargs,
        )
        out.batch_first = True
        return out


def test_materialize_factorized_uses_batch_first_and_module_kwargs():
    module = nn.Linear(4, 3)
    x = _x(2, 5, 4)
    a, g, r = capture_io(module, (x,))
    f = _SeqFirst(a.transpose(0, 1), g.transpose(0, 1), extract_module_kwargs(module, "nn.Linear"))
    expected = expected_layout("nn.Linear", reference_grads(module, (x,), r))
    torch.testing.assert_close(materialize(f, "nn.Linear"), expected, rtol=1e-5, atol=1e-5)
    no_bias = materialize(f, "nn.Linear", include_bias=False)
    assert no_bias.shape == (2, 12)


def test_real_factorized_if_available():
    gradient = pytest.importorskip("dattri_llm.gradient.gradient")
    module = nn.Conv1d(2, 3, 2)
    a, g, r = capture_io(module, (_x(2, 2, 5),))
    f = gradient.Factorized(a, g, extract_module_kwargs(module, "nn.Conv1d"))
    expected = expected_layout("nn.Conv1d", reference_grads(module, (a,), r))
    torch.testing.assert_close(materialize(f, "nn.Conv1d"), expected, rtol=1e-5, atol=1e-5)


def test_compute_dtype_policy_controls_result_dtype():
    module = nn.Linear(4, 3)
    a, g, _ = capture_io(module, (_x(2, 4),))
    kwargs = extract_module_kwargs(module, "nn.Linear")
    with dtypes.compute_dtype("float64"):
        assert materialize_factors(a, g, "nn.Linear", kwargs).dtype == torch.float64
    mixed = materialize_factors(a.bfloat16(), g, "nn.Linear", kwargs)
    assert mixed.dtype == torch.float32

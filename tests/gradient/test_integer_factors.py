"""Integer factors (embedding token ids) survive dtype casts and low-precision policies.

A 16-bit float holds integers exactly only up to 256, so casting a block that
carries token ids of a vocabulary of 1000 to bf16 would move gradient mass to
the wrong rows. Ground truth: per-sample gradients from torch.func
(tests/reference.py) in float64, laid out as ``(B, V·E)`` (weight rows by id).
"""

from __future__ import annotations

import pytest
import torch
from reference import call, per_sample_param_grads
from torch import nn

from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.gradient.ops.projection import DattriProjector, random_project

VOCAB, EMB, D_IN, D_OUT = 1000, 4, 5, 3
# Most ids above 256 are not representable in bf16 (257 -> 256, 999 -> 1000, ...).
IDS = torch.tensor(
    [[257, 999, 513, 3, 257], [771, 1, 997, 258, 259], [301, 303, 999, 998, 601]],
    dtype=torch.long,
)
BF16_REL_TOL = 2e-2

# torch.func has no batching rule for embedding_bag (a speed warning, not an error).
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    return float((value.double() - ref).norm() / ref.norm())


def _captured(layer: nn.Module, inp: torch.Tensor, r: torch.Tensor, layer_type: str):
    """Factors of ``layer`` for the loss ``(layer(inp) * r).sum()``: input and output grad."""
    out = layer(inp)
    (g,) = torch.autograd.grad((out * r).sum(), out)
    return Factorized(inp, g.detach(), extract_module_kwargs(layer, layer_type))


def _reference(layer: nn.Module, inp: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """torch.func per-sample gradient ``(B, d)`` of ``(layer(inp) * r).sum()`` in float64."""
    layer = layer.double()

    def loss_of_sample(mod, params, sample):
        return (call(mod, params, sample[0]) * sample[1]).sum()

    grads = per_sample_param_grads(layer, loss_of_sample, (inp, r.double()))
    weight = grads["weight"]
    if "bias" in grads:
        weight = torch.cat([weight, grads["bias"].unsqueeze(-1)], dim=-1)
    return weight.reshape(inp.shape[0], -1)


@pytest.fixture
def block_and_refs() -> tuple[Gradient, dict[str, torch.Tensor]]:
    """float32 block with an Embedding, an EmbeddingBag (ids > 256) and a Linear layer."""
    torch.manual_seed(0)
    batch, tokens = IDS.shape
    emb = nn.Embedding(VOCAB, EMB)
    bag = nn.EmbeddingBag(VOCAB, EMB, mode="sum")
    lin = nn.Linear(D_IN, D_OUT)
    x = torch.randn(batch, tokens, D_IN)
    r_emb, r_bag, r_lin = (
        torch.randn(batch, tokens, EMB),
        torch.randn(batch, EMB),
        torch.randn(batch, tokens, D_OUT),
    )
    data = {
        "emb": _captured(emb, IDS, r_emb, "nn.Embedding"),
        "bag": _captured(bag, IDS, r_bag, "nn.EmbeddingBag"),
        "lin": _captured(lin, x, r_lin, "nn.Linear"),
    }
    layer_types = {"emb": "nn.Embedding", "bag": "nn.EmbeddingBag", "lin": "nn.Linear"}
    grad = Gradient(
        {name: "factorized" for name in data},
        data,
        layer_types,
        {"emb": "batch_token", "bag": "batch", "lin": "batch_token"},
    )
    refs = {
        "emb": _reference(emb, IDS, r_emb),
        "bag": _reference(bag, IDS, r_bag),
        "lin": _reference(lin, x.double(), r_lin),
    }
    return grad, refs


def _rows_hit(dense: torch.Tensor) -> torch.Tensor:
    """``(B, V)`` mask of the embedding rows with a nonzero gradient."""
    return dense.reshape(dense.shape[0], VOCAB, EMB).ne(0).any(dim=-1)


def test_factorized_to_bf16_keeps_token_ids_exact(block_and_refs):
    grad, _ = block_and_refs
    ids_factor = grad.data["emb"]
    half = ids_factor.to(dtype=torch.bfloat16)
    assert half.activation.dtype == torch.long and torch.equal(half.activation, IDS)
    assert half.pre_activation_grad.dtype == torch.bfloat16
    assert half.module_kwargs is ids_factor.module_kwargs


def test_gradient_to_bf16_casts_floats_and_keeps_ids(block_and_refs):
    grad, _ = block_and_refs
    half = grad.to(torch.bfloat16)
    for name in ("emb", "bag"):
        assert half.data[name].activation.dtype == torch.long
        assert torch.equal(half.data[name].activation, IDS)
        assert half.data[name].pre_activation_grad.dtype == torch.bfloat16
    assert half.data["lin"].activation.dtype == torch.bfloat16
    assert half.data["lin"].pre_activation_grad.dtype == torch.bfloat16
    dense_half = grad.materialize().to(torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in dense_half.data.values())
    with pytest.raises(TypeError, match="pass one dtype"):
        grad.to(torch.bfloat16, dtype=torch.float16)


def test_materialize_after_bf16_cast_matches_torch_func(block_and_refs):
    grad, refs = block_and_refs
    dense = grad.to(torch.bfloat16).materialize()
    for name, ref in refs.items():
        assert _rel_err(dense.data[name], ref) < BF16_REL_TOL, name
    for name in ("emb", "bag"):  # gradient mass sits exactly on the rows of the true ids
        assert torch.equal(_rows_hit(dense.data[name]), _rows_hit(refs[name])), name


@pytest.mark.parametrize("metric", ["dot", "cosine"])
def test_similarity_after_bf16_cast_matches_reference(block_and_refs, metric):
    grad, refs = block_and_refs
    half = grad.to(torch.bfloat16)
    scores = half.similarity(grad, metric=metric, reduce="none")
    for name, ref in refs.items():
        expected = ref @ ref.T
        if metric == "cosine":
            norms = ref.norm(dim=1)
            expected = expected / (norms[:, None] * norms[None, :] + 1e-8)
        assert _rel_err(scores[name], expected) < BF16_REL_TOL, name


def _expected_projection(
    style: str, ref: torch.Tensor, projector: DattriProjector, proj_dim: int
) -> torch.Tensor:
    """Reference projection of the embedding gradient ``ref : (B, V·E)`` (seed 0)."""
    if style == "mask":
        idx = projector.mask_indices(VOCAB * EMB, proj_dim=proj_dim, proj_seed=0, device="cpu")
        return ref[:, idx]
    if style == "dense":
        matrix = projector.matrix(
            VOCAB * EMB, proj_dim=proj_dim, proj_seed=0, device="cpu", dtype=torch.float64
        )
        return ref @ matrix
    # logra: g side with seed 0, one-hot ids side with seed 1; dW' = P_gᵀ · dWᵀ · P_a
    p_g = projector.matrix(EMB, proj_dim=proj_dim, proj_seed=0, device="cpu", dtype=torch.float64)
    p_a = projector.matrix(VOCAB, proj_dim=proj_dim, proj_seed=1, device="cpu", dtype=torch.float64)
    weights = ref.reshape(-1, VOCAB, EMB)
    return (p_g.T @ weights.transpose(1, 2) @ p_a).reshape(ref.shape[0], -1)


@pytest.mark.parametrize(("style", "proj_dim"), [("mask", 2000), ("dense", 16), ("logra", 8)])
@pytest.mark.parametrize("cast", [True, False], ids=["cast-bf16", "uncast"])
def test_projection_under_forced_bf16_policy_uses_exact_ids(block_and_refs, style, proj_dim, cast):
    grad, refs = block_and_refs
    source = grad.to(torch.bfloat16) if cast else grad
    projector = DattriProjector(random_project)
    config = {"emb": {"style": style, "proj_dim": proj_dim}}
    with dtypes.compute_dtype("bf16"):
        projected = source.select_layers(["emb"]).project(
            projector, config, capture_style="materialized"
        )
    value = projected.data["emb"]
    assert isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16
    expected = _expected_projection(style, refs["emb"], projector, proj_dim)
    assert expected.ne(0).sum(dim=1).min() > 0  # the check sees nonzero coordinates
    assert _rel_err(value, expected) < BF16_REL_TOL


def _summing_factory(feature, feature_batch_size, proj_dim, proj_seed=0, device="cpu", **kw):
    """A projector whose every output is the sum of the input features (matrix of ones)."""
    return lambda x: x.sum(dim=1, keepdim=True).expand(-1, proj_dim)


def test_apply_projects_integer_input_exactly_under_forced_bf16():
    ids = torch.tensor([[257, -256], [999, -997]])  # exact sums 1 and 2; bf16 input gives 0 and 4
    with dtypes.compute_dtype("bf16"):
        out = DattriProjector(_summing_factory).apply(ids, proj_dim=2)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor([[1.0, 1.0], [2.0, 2.0]], dtype=torch.bfloat16))

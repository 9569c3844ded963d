"""compat.md §4 and §7: inverse ops on singular input, accumulator layer-type names.

Expectations are explicit: literal values from the contract, ``torch.linalg.inv``
of the damped matrix, explicit covariances (``kfac_helpers``) and torch.func
per-sample gradients (``ops_helpers``).
"""

from __future__ import annotations

import pytest
import torch
from kfac_helpers import conv_case, conv_rows, covariances, linear_case, linear_rows
from ops_helpers import expected_layout, reference_grads
from torch import nn

from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops.kronecker import (
    FisherAccumulator,
    KroneckerAccumulator,
    LayerFisherAccumulator,
    LayerKroneckerAccumulator,
    check_damped_curvature,
    dense_inverse,
    sym_inverse,
)
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs

INVERSES = [sym_inverse, dense_inverse]
INF = float("inf")


def _spd(size: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(size, size + 2, generator=gen, dtype=torch.float64)
    return m @ m.T


def _inv(matrix: torch.Tensor, damping: float) -> torch.Tensor:
    """Explicit ``(M + damping·I)⁻¹`` in float32."""
    m = matrix.float()
    return torch.linalg.inv(m + damping * torch.eye(m.shape[0]))


# ----------------------------------------------------------------- §4 inverse ops


@pytest.mark.parametrize("fn", INVERSES)
def test_singular_matrix_at_zero_damping_gives_non_finite_result(fn):
    ones = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    assert torch.equal(fn(ones), torch.tensor([[INF, -INF], [-INF, INF]]))
    assert fn(torch.zeros(3, 3)).isnan().all()
    assert fn(torch.zeros(3, 3), 0.0).shape == (3, 3)


@pytest.mark.parametrize("fn", INVERSES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_inverse_is_float32_damped_inverse(fn, dtype):
    spd = _spd(5).to(dtype)
    got = fn(spd, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _inv(spd, 0.25), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fn", INVERSES)
def test_negative_damping_is_accepted(fn):
    m = torch.diag(torch.tensor([3.0, 5.0, 9.0]))
    torch.testing.assert_close(fn(m, -1.0), _inv(m, -1.0))


def test_sym_inverse_reads_the_lower_triangle_only():
    lower = torch.tril(_spd(4).float())
    garbage_upper = lower + torch.triu(torch.full((4, 4), 7.0), diagonal=1)
    symmetric = lower + torch.tril(lower, diagonal=-1).T
    torch.testing.assert_close(sym_inverse(garbage_upper, 0.1), _inv(symmetric, 0.1))


def test_dense_inverse_falls_back_to_sym_inverse_when_not_positive_definite():
    indefinite = torch.diag(torch.tensor([1.0, -2.0, 4.0]))  # cholesky: LinAlgError
    torch.testing.assert_close(dense_inverse(indefinite), _inv(indefinite, 0.0))
    torch.testing.assert_close(dense_inverse(indefinite, 0.5), _inv(indefinite, 0.5))


def test_dense_inverse_falls_back_on_any_runtime_error(monkeypatch):
    calls = []
    eigh = torch.linalg.eigh

    def failing_cholesky(matrix):
        raise RuntimeError("device kernel failed")

    def counting_eigh(matrix):
        calls.append(matrix.shape)
        return eigh(matrix)

    monkeypatch.setattr(torch.linalg, "cholesky", failing_cholesky)
    monkeypatch.setattr(torch.linalg, "eigh", counting_eigh)
    spd = _spd(4)
    torch.testing.assert_close(dense_inverse(spd, 0.1), _inv(spd, 0.1), rtol=1e-4, atol=1e-4)
    assert calls == [(4, 4)]


def test_check_damped_curvature_flags_what_the_ops_no_longer_refuse():
    singular = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match=r"singular.*damping=0\.0"):
        check_damped_curvature(singular, 0.0, "sym_inverse")
    rank_deficient = _spd(6)[:, :3] @ _spd(6)[:3, :]  # rank 3, round-off eigenvalues
    with pytest.raises(ValueError, match="singular"):
        check_damped_curvature(rank_deficient, 0.0, "dense_inverse")
    check_damped_curvature(singular, 0.1, "sym_inverse")  # damped: positive definite
    with pytest.raises(ValueError, match="square"):
        check_damped_curvature(torch.ones(2, 3), 0.1, "sym_inverse")


# ------------------------------------------------------- §7 layer-type names


def test_linear_alias_is_nn_linear_with_bias_column():
    _, x, r, _ = linear_case(torch.float64)
    acc = LayerKroneckerAccumulator()
    acc.update(x, r, "linear", {"has_bias": True})
    A, G = acc.result()
    A_ref, G_ref = covariances(*linear_rows(x, r))  # ones column: A is (6, 6)
    assert A.shape == (6, 6)
    torch.testing.assert_close(A, A_ref)
    torch.testing.assert_close(G, G_ref)
    no_bias = LayerKroneckerAccumulator()
    no_bias.update(x, r, "linear", {"has_bias": False})
    a_rows = linear_rows(x, r)[0][:, :-1]  # no ones column: A is (5, 5)
    torch.testing.assert_close(no_bias.result()[0], a_rows.T @ a_rows / a_rows.shape[0])


def test_conv2d_alias_in_kronecker_and_fisher_accumulators():
    module, x, r, grads = conv_case(torch.float64)
    kw = extract_module_kwargs(module, "nn.Conv2d")
    kron = LayerKroneckerAccumulator()
    kron.update(x, r, "conv2d", kw)
    for got, expected in zip(kron.result(), covariances(*conv_rows(module, x, r))):
        torch.testing.assert_close(got, expected)
    fisher = LayerFisherAccumulator()
    fisher.update(x, r, "conv2d", kw)
    torch.testing.assert_close(fisher.result(), grads.T @ grads / grads.shape[0])


def test_norm_and_embedding_aliases_in_fisher_accumulator():
    torch.manual_seed(0)
    norm = nn.LayerNorm(4).double()
    x, r = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    fisher = LayerFisherAccumulator()
    fisher.update(x, r, "layernorm", extract_module_kwargs(norm, "nn.LayerNorm"))
    grads = expected_layout("nn.LayerNorm", reference_grads(norm, (x,), r))
    torch.testing.assert_close(fisher.result(), grads.T @ grads / 3)

    emb = nn.Embedding(6, 2).double()
    ids, r = torch.randint(0, 6, (3, 4)), torch.randn(3, 4, 2, dtype=torch.float64)
    fisher = LayerFisherAccumulator()
    fisher.update(ids, r, "embedding", extract_module_kwargs(emb, "nn.Embedding"))
    grads = expected_layout("nn.Embedding", reference_grads(emb, (ids,), r))
    torch.testing.assert_close(fisher.result(), grads.T @ grads / 3)


@pytest.mark.parametrize("alias", ["layernorm", "rmsnorm", "groupnorm", "embedding"])
def test_norm_and_embedding_aliases_have_no_kronecker_factorization(alias):
    a, g = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    with pytest.raises(NotImplementedError, match="no Kronecker factorization"):
        LayerKroneckerAccumulator().update(a, g, alias, {"has_bias": True})


@pytest.mark.parametrize("acc_cls", [LayerKroneckerAccumulator, LayerFisherAccumulator])
@pytest.mark.parametrize("name", ["Linear", "nn.linear", "dense", "conv1D", ""])
def test_unknown_layer_type_lists_accepted_names(acc_cls, name):
    a, g = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"must be one of .*'nn\.Linear'.*'linear'") as info:
        acc_cls().update(a, g, name, {"has_bias": True})
    assert repr(name) in str(info.value)


def _without_has_bias(layer_type: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Factors of ``layer_type`` and its module kwargs minus ``"has_bias"``."""
    if layer_type == "conv2d":
        module, x, r, _ = conv_case(torch.float64)
        kwargs = extract_module_kwargs(module, "nn.Conv2d")
    else:
        x, r = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        kwargs = extract_module_kwargs(nn.LayerNorm(4), "nn.LayerNorm")
    del kwargs["has_bias"]
    return x, r, kwargs


@pytest.mark.parametrize("acc_cls", [LayerKroneckerAccumulator, LayerFisherAccumulator])
@pytest.mark.parametrize("layer_type", ["nn.Linear", "linear", "conv2d", "nn.LayerNorm"])
def test_module_kwargs_without_has_bias_raise_key_error(acc_cls, layer_type):
    x, r, kwargs = _without_has_bias(layer_type)
    with pytest.raises(KeyError, match="has_bias"):
        acc_cls().update(x, r, layer_type, kwargs)


def test_accumulators_keep_float32_buffers_and_refuse_empty_results():
    _, x, r, _ = linear_case(torch.float32)
    acc = LayerKroneckerAccumulator()
    acc.update(x.bfloat16(), r.bfloat16(), "linear", {"has_bias": True})
    assert acc.a_sum.dtype == torch.float32 and acc.g_sum.dtype == torch.float32
    for empty in (LayerKroneckerAccumulator(), LayerFisherAccumulator()):
        with pytest.raises(RuntimeError, match="nothing accumulated"):
            empty.result()


def test_fisher_embedding_needs_num_embeddings():
    ids, g = torch.randint(0, 6, (2, 3)), torch.randn(2, 3, 2)
    for kwargs in ({"has_bias": False}, None):
        with pytest.raises(ValueError, match="num_embeddings"):
            LayerFisherAccumulator().update(ids, g, "nn.Embedding", kwargs)


def test_block_accumulators_accept_aliases_and_check_layers():
    _, x, r, grads = linear_case(torch.float64)
    kw = {"has_bias": True}
    block = Gradient(
        {"fc": "factorized", "dense": "materialized"},
        {"fc": Factorized(x, r, kw), "dense": grads[:, :7]},
        {"fc": "linear", "dense": "my-label"},
        {"fc": "batch_token"},
        validate_on_init=False,  # Gradient.validate wants canonical factorized types
    )
    kron = KroneckerAccumulator()
    kron.update(block, ["fc"])
    for got, expected in zip(kron.result()["fc"], covariances(*linear_rows(x, r))):
        torch.testing.assert_close(got, expected)
    with pytest.raises(TypeError, match="'dense' is materialized"):
        kron.update(block, ["dense"])
    with pytest.raises(KeyError, match="'absent'.*not in the gradient block"):
        kron.update(block, ["absent"])

    fisher = FisherAccumulator(max_params=30)
    fisher.update(block, ["fc", "dense", "absent"])
    assert fisher.skipped == {}
    torch.testing.assert_close(fisher.result()["fc"], grads.T @ grads / 3)
    torch.testing.assert_close(fisher.result()["dense"], grads[:, :7].T @ grads[:, :7] / 3)
    narrow = FisherAccumulator(max_params=10)
    narrow.update(block, ["fc", "dense"])
    assert narrow.skipped == {"fc": 20} and set(narrow.result()) == {"dense"}
    unknown = Gradient(block.representation, block.data, {"fc": "dense", "dense": "x"},
                       block.indexing, validate_on_init=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"'fc'.*must be one of"):
        FisherAccumulator().update(unknown, ["fc"])

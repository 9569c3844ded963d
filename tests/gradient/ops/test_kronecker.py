"""K-FAC / EK-FAC / Fisher kernels against explicit dense references (kfac_helpers)."""

from __future__ import annotations

import pytest
import torch
from kfac_helpers import (
    conv_case,
    conv_rows,
    covariances,
    damped_inverse,
    ekfac_operator,
    kfac_operator,
    linear_case,
    linear_rows,
)
from ops_helpers import expected_layout, reference_grads, relative_error
from torch import nn

from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops.kronecker import (
    FisherAccumulator,
    KroneckerAccumulator,
    LayerFisherAccumulator,
    LayerKroneckerAccumulator,
    damping_for,
    dense_inverse,
    ekfac_materialize,
    ekfac_materialize_factors,
    ekfac_precondition,
    ekfac_rotation_prefers_factors,
    fim,
    fim_factors,
    kfac,
    kfac_cross,
    kfac_cross_factors,
    kfac_eigh,
    kfac_factors,
    kfac_precondition,
    kfac_precondition_materialized,
    mean_eigenvalue,
    sym_inverse,
)
from dattri_llm.gradient.ops.materialize import materialize_factors
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _case(kind: str, dtype: torch.dtype):
    """``(layer_type, module, x, r, grads, kwargs, explicit (A, G))``."""
    if kind == "linear":
        module, x, r, grads = linear_case(dtype)
        rows = linear_rows(x, r)
        layer_type = "nn.Linear"
    else:
        module, x, r, grads = conv_case(dtype)
        rows = conv_rows(module, x, r)
        layer_type = "nn.Conv2d"
    return layer_type, module, x, r, grads, extract_module_kwargs(module, layer_type), rows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_kfac_factors_match_explicit_covariances(kind, dtype):
    layer_type, _, x, r, _, kw, rows = _case(kind, dtype)
    A, G = kfac_factors(x, r, layer_type, kw)
    A_ref, G_ref = covariances(*rows)
    assert A.dtype == dtype and G.dtype == dtype
    torch.testing.assert_close(A, A_ref, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(G, G_ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_kfac_factors_drop_padding_rows_for_linear_only():
    _, x, r, _ = linear_case()
    A, _ = kfac_factors(x, r, "nn.Linear", {"has_bias": True})
    kept = int((r.reshape(-1, 4).abs().sum(1) > 0).sum())
    assert kept < 18
    torch.testing.assert_close(A[-1, -1], torch.tensor(1.0, dtype=A.dtype))  # ones column
    a_all = torch.cat([x, torch.ones_like(x[..., :1])], -1).reshape(-1, 6)
    assert not torch.allclose(A, a_all.T @ a_all / 18)


def test_kfac_factors_bf16_accumulate_in_float32():
    _, x, r, _ = linear_case(torch.float32)
    A, G = kfac_factors(x.bfloat16(), r.bfloat16(), "nn.Linear", {"has_bias": True})
    assert A.dtype == torch.float32
    A_ref, G_ref = covariances(*linear_rows(x.bfloat16().float(), r.bfloat16().float()))
    assert relative_error(A, A_ref) < 1e-5 and relative_error(G, G_ref) < 1e-5


def test_kfac_wrapper_and_2d_linear():
    module = nn.Linear(3, 2, bias=False).double()
    x, r = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    A, G = kfac(Factorized(x, r, {"has_bias": False}), "nn.Linear")
    torch.testing.assert_close(A, x.T @ x / 5)
    torch.testing.assert_close(G, r.T @ r / 5)
    assert module.weight.shape == (2, 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_kfac_cross_matches_dense_kronecker_operator(kind, dtype):
    layer_type, module, x, r, grads, kw, rows = _case(kind, dtype)
    A_ref, G_ref = covariances(*rows)
    damping = 0.05
    A, G = kfac_factors(x, r, layer_type, kw)
    A_inv, G_inv = damped_inverse(A, damping), damped_inverse(G, damping)
    x2, r2 = x.flip(0) * 0.5, r.flip(0).roll(1, 1)
    grads2 = expected_layout(layer_type, reference_grads(module, (x2,), r2))
    expected = grads @ kfac_operator(A_ref, G_ref, damping) @ grads2.T
    got = kfac_cross_factors(x, r, x2, r2, layer_type, A_inv, G_inv, kw, kw)
    torch.testing.assert_close(got, expected, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)
    got_f = kfac_cross(Factorized(x, r, kw), Factorized(x2, r2, kw), layer_type, A_inv, G_inv)
    torch.testing.assert_close(got_f, got)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_kfac_precondition_factorized_and_materialized_agree_with_dense(kind):
    layer_type, _, x, r, grads, kw, rows = _case(kind, torch.float64)
    A_ref, G_ref = covariances(*rows)
    A_inv, G_inv = damped_inverse(A_ref, 0.1), damped_inverse(G_ref, 0.1)
    expected = grads @ kfac_operator(A_ref, G_ref, 0.1)  # symmetric operator
    wa, wg = kfac_precondition(Factorized(x, r, kw), layer_type, A_inv, G_inv)
    torch.testing.assert_close(materialize_factors(wa, wg, layer_type), expected)
    torch.testing.assert_close(kfac_precondition_materialized(grads, A_inv, G_inv), expected)


def test_grouped_conv_kfac_shares_a_and_is_block_diagonal_in_g():
    """choices.md: one ``A`` over every group's patch rows, ``G`` block-diagonal per group."""
    gen = torch.Generator().manual_seed(3)
    groups, c_in, c_out = 2, 4, 6
    cg, og = c_in // groups, c_out // groups
    module = nn.Conv2d(c_in, c_out, 2, padding=1, stride=2, groups=groups).double()
    x = torch.randn(3, c_in, 5, 5, generator=gen, dtype=torch.float64)
    r = torch.randn(3, c_out, 3, 3, generator=gen, dtype=torch.float64)
    kw = extract_module_kwargs(module, "nn.Conv2d")
    A, G = kfac_factors(x, r, "nn.Conv2d", kw)
    a_rows, g_rows = [], []
    for j in range(groups):
        sub = nn.Conv2d(cg, og, 2, padding=1, stride=2).double()
        a_j, g_j = conv_rows(sub, x[:, j * cg : (j + 1) * cg], r[:, j * og : (j + 1) * og])
        g_full = g_j.new_zeros(g_j.shape[0], c_out)
        g_full[:, j * og : (j + 1) * og] = g_j
        a_rows.append(a_j)
        g_rows.append(g_full)
    A_ref, G_ref = covariances(torch.cat(a_rows), torch.cat(g_rows))
    torch.testing.assert_close(A, A_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(G, G_ref, rtol=1e-10, atol=1e-10)
    assert A.shape == (cg * 4 + 1, cg * 4 + 1)
    assert torch.count_nonzero(G[:og, og:]) == 0 and torch.count_nonzero(G[:og, :og]) > 0
    # The operator acts exactly on the compact per-group layout of the reference gradients.
    grads = expected_layout("nn.Conv2d", reference_grads(module, (x,), r))
    A_inv, G_inv = damped_inverse(A, 0.1), damped_inverse(G, 0.1)
    expected = grads @ kfac_operator(A_ref, G_ref, 0.1) @ grads.T
    got = kfac_cross_factors(x, r, x, r, "nn.Conv2d", A_inv, G_inv, kw, kw)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_conv_transpose_kfac_uses_activation_and_gradient_indices():
    torch.manual_seed(1)
    module = nn.ConvTranspose1d(2, 3, 3, stride=2).double()
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    r = torch.randn(module(x).shape, dtype=torch.float64)
    kw = extract_module_kwargs(module, "nn.ConvTranspose1d")
    grads = expected_layout("nn.ConvTranspose1d", reference_grads(module, (x,), r))
    A, G = kfac_factors(x, r, "nn.ConvTranspose1d", kw)
    A_inv, G_inv = damped_inverse(A, 0.1), damped_inverse(G, 0.1)
    op = torch.kron(A_inv, G_inv)  # layout (K_a, D_g) row-major
    expected = grads @ op @ grads.T
    got = kfac_cross_factors(x, r, x, r, "nn.ConvTranspose1d", A_inv, G_inv, kw, kw)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(kfac_precondition_materialized(grads, G_inv, A_inv), grads @ op)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_ekfac_matches_dense_eigenbasis_operator(kind, dtype):
    layer_type, _, x, r, grads, kw, rows = _case(kind, dtype)
    A_ref, G_ref = covariances(*rows)
    damping = 0.05
    expected = grads @ ekfac_operator(A_ref, G_ref, grads, damping) @ grads.T
    _, U_A, _, U_G = kfac_eigh(*kfac_factors(x, r, layer_type, kw))
    coords = ekfac_materialize_factors(x, r, layer_type, U_A, U_G, kw)
    lam = (coords**2).mean(dim=0)
    pre = ekfac_precondition(coords, U_A, U_G, lam + damping, layer_type)
    got = grads @ pre.T
    torch.testing.assert_close(got, expected, rtol=TOL[dtype] * 20, atol=TOL[dtype] * 20)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_ekfac_materialize_dense_equals_factorized(kind):
    layer_type, module, x, r, grads, kw, _ = _case(kind, torch.float64)
    assert module.bias is not None  # the factor route rotates the ones column separately
    _, U_A, _, U_G = kfac_eigh(*kfac_factors(x, r, layer_type, kw))
    from_factors = ekfac_materialize(Factorized(x, r, kw), layer_type, U_A, U_G)
    torch.testing.assert_close(ekfac_materialize(grads, layer_type, U_A, U_G), from_factors)


def test_ekfac_rotation_route_by_flops():
    # factors: S·(K²+D²); dense: K·D·(K+D)
    assert ekfac_rotation_prefers_factors(S=128, K=129, D=384)  # 20.9M <= 25.4M
    assert not ekfac_rotation_prefers_factors(S=1024, K=129, D=384)  # 168M > 25.4M
    assert ekfac_rotation_prefers_factors(S=2, K=2, D=2)  # tie: 16 = 16 goes to the factors
    assert not ekfac_rotation_prefers_factors(S=4, K=2, D=2)  # 32 > 16


def test_ekfac_with_kfac_eigenvalues_equals_undamped_kfac():
    layer_type, _, x, r, grads, kw, _ = _case("linear", torch.float64)
    A, G = kfac_factors(x, r, layer_type, kw)
    s_A, U_A, s_G, U_G = kfac_eigh(A, G)
    coords = ekfac_materialize(grads, layer_type, U_A, U_G)
    pre = ekfac_precondition(coords, U_A, U_G, torch.outer(s_G, s_A), layer_type)
    expected = kfac_precondition_materialized(grads, damped_inverse(A, 0.0), damped_inverse(G, 0.0))
    torch.testing.assert_close(pre, expected, rtol=1e-7, atol=1e-7)


def test_fim_matches_explicit():
    layer_type, _, x, r, grads, kw, _ = _case("linear", torch.float64)
    torch.testing.assert_close(fim_factors(x, r, layer_type, kw), grads.T @ grads / 3)
    torch.testing.assert_close(fim(Factorized(x, r, kw), layer_type), grads.T @ grads / 3)


def test_inverses_match_linalg_inv():
    torch.manual_seed(0)
    m = torch.randn(6, 4, dtype=torch.float64)
    spd = m @ m.T  # rank 4: singular
    for fn in (sym_inverse, dense_inverse):  # float32 whatever the input (compat.md §4)
        torch.testing.assert_close(fn(spd, 0.3), damped_inverse(spd, 0.3).float())
    assert sym_inverse(spd.float(), 0.3).dtype == torch.float32
    assert sym_inverse(spd.bfloat16(), 0.3).dtype == torch.float32
    with pytest.raises(ValueError, match=r"square"):
        sym_inverse(m)


def test_relative_damping_uses_mean_eigenvalue():
    m = torch.diag(torch.tensor([1.0, 2.0, 6.0]))
    assert mean_eigenvalue(m) == pytest.approx(3.0)
    assert damping_for(m, 0.1, relative=True) == pytest.approx(0.3)
    assert damping_for(m, 0.1) == pytest.approx(0.1)


def test_errors_name_layer_type_and_shapes():
    layer_type, _, x, r, _, kw, _ = _case("linear", torch.float64)
    with pytest.raises(NotImplementedError, match="nn.LayerNorm"):
        kfac_factors(
            x, x, "nn.LayerNorm", {"has_bias": True, "normalized_shape": (5,), "eps": 1e-5}
        )
    with pytest.raises(ValueError, match="no token row"):
        kfac_factors(x, torch.zeros_like(r), layer_type, kw)
    A_inv, G_inv = torch.eye(5, dtype=x.dtype), torch.eye(4, dtype=x.dtype)
    with pytest.raises(ValueError, match=r"K=6.*\(5, 5\)"):
        kfac_cross_factors(x, r, x, r, layer_type, A_inv, G_inv, kw, kw)
    with pytest.raises(ValueError, match="k_g=4"):
        kfac_precondition_materialized(torch.zeros(2, 30), A_inv, G_inv)
    with pytest.raises(ValueError, match="Unknown layer type"):
        kfac_factors(x, r, "nn.Foo", kw)


def test_layer_kronecker_accumulator_matches_concatenated_batches():
    layer_type, _, x, r, _, kw, _ = _case("linear", torch.float64)
    acc = LayerKroneckerAccumulator()
    acc.update(x[:1], r[:1], layer_type, kw)
    acc.update(x[1:], r[1:], layer_type, kw)
    acc.update(x[:1], torch.zeros_like(r[:1]), layer_type, kw)  # padding-only: no rows
    acc.all_reduce()
    A, G = kfac_factors(x, r, layer_type, kw)
    got_A, got_G = acc.result()
    torch.testing.assert_close(got_A, A)
    torch.testing.assert_close(got_G, G)
    cA, _ = acc.result(consume=True)
    torch.testing.assert_close(cA, A)
    with pytest.raises(RuntimeError, match="nothing accumulated"):
        acc.result()
    with pytest.raises(RuntimeError):
        LayerKroneckerAccumulator().all_reduce()


def test_fisher_accumulators():
    layer_type, _, x, r, grads, kw, _ = _case("linear", torch.float64)
    acc = LayerFisherAccumulator()
    acc.update(x[:2], r[:2], layer_type, kw)
    acc.update_from_grad(grads[2:])
    acc.all_reduce()
    torch.testing.assert_close(acc.result(), grads.T @ grads / 3)
    with pytest.raises(RuntimeError):
        LayerFisherAccumulator().result()

    block = Gradient(
        {"fc": "factorized", "dense": "materialized"},
        {"fc": Factorized(x, r, kw), "dense": grads[:, :7]},
        {"fc": layer_type, "dense": layer_type},
        {"fc": "batch_token"},
    )
    fisher = FisherAccumulator(max_params=10)
    fisher.update(block, ["fc", "dense"])
    assert fisher.skipped == {"fc": 20}
    torch.testing.assert_close(fisher.result()["dense"], grads[:, :7].T @ grads[:, :7] / 3)
    kron = KroneckerAccumulator()
    kron.update(block, ["fc"])
    torch.testing.assert_close(kron.result()["fc"][0], kfac_factors(x, r, layer_type, kw)[0])
    with pytest.raises(KeyError, match="'absent'"):  # compat.md §7: a missing name is an error
        kron.update(block, ["absent"])
    with pytest.raises(TypeError, match="'dense' is materialized"):
        kron.update(block, ["dense"])

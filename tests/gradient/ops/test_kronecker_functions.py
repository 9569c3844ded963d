"""Functions of a Kronecker curvature against dense matrices (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from dattri_llm.gradient.ops.kronecker import (
    eigenbasis_apply,
    kfac_eigenvalues,
    kfac_eigh,
    unrolled_propagator,
    unrolled_response,
)


def _spd(n: int, gen: torch.Generator) -> torch.Tensor:
    m = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return m @ m.T / n + 0.1 * torch.eye(n, dtype=torch.float64)


def _dense_function(h: torch.Tensor, fn) -> torch.Tensor:
    s, v = torch.linalg.eigh(h)
    return v @ torch.diag(fn(s)) @ v.T


@pytest.mark.parametrize(
    ("layer_type", "order"), [("nn.Linear", "GA"), ("nn.ConvTranspose2d", "AG")]
)
def test_eigenbasis_apply_is_dense_function(layer_type, order):
    gen = torch.Generator().manual_seed(0)
    k, d = 4, 3
    a_cov, g_cov = _spd(k, gen), _spd(d, gen)
    s_a, u_a, s_g, u_g = kfac_eigh(a_cov, g_cov)
    h = torch.kron(g_cov, a_cov) if order == "GA" else torch.kron(a_cov, g_cov)
    rows = torch.randn(5, k * d, generator=gen, dtype=torch.float64)
    lam = kfac_eigenvalues(s_a, s_g, layer_type)
    cases = [
        (lambda s: 1 / s, 1 / lam),
        (lambda s: torch.exp(-0.7 * s), unrolled_propagator(lam, 0.7)),
        (lambda s: (1 - torch.exp(-0.7 * s)) / s, unrolled_response(lam, 0.7)),
    ]
    for fn, values in cases:
        got = eigenbasis_apply(rows, u_a, u_g, values, layer_type)
        want = rows @ _dense_function(h, fn)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        eigenbasis_apply(rows, u_a, u_g, unrolled_propagator(lam, 0.7), layer_type),
        rows @ torch.linalg.matrix_exp(-0.7 * h),
        rtol=1e-10,
        atol=1e-12,
    )


def test_unrolled_response_limits():
    lam = torch.tensor([0.0, 1e-20, 1e-9, 0.5, 3.0, -1e-14], dtype=torch.float64)
    got = unrolled_response(lam, 2.0)
    want = torch.tensor(
        [2.0, 2.0, 2.0 * (1 - 1e-9), (1 - math.exp(-1.0)) / 0.5,
         (1 - math.exp(-6.0)) / 3.0, 2.0],
        dtype=torch.float64,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert torch.equal(unrolled_response(lam, 0.0), torch.zeros_like(lam))
    assert torch.equal(unrolled_propagator(lam, 0.0), torch.ones_like(lam))


def test_eigenbasis_apply_rejects_wrong_widths():
    u = torch.eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="eigenbasis_apply|ekfac_materialize"):
        eigenbasis_apply(torch.zeros(2, 9), u, u, torch.ones(8), "nn.Linear")
    with pytest.raises(ValueError, match="ekfac_materialize"):
        eigenbasis_apply(torch.zeros(2, 8), u, u, torch.ones(9), "nn.Linear")

"""CG, LiSSA and the direct solve against ``torch.linalg.solve`` on a tiny MLP's exact Hessian."""

from __future__ import annotations

import pytest
import torch

from dattri_llm.attribution.algorithm.ihvp import conjugate_gradient, direct_solve, lissa


def _mlp_hessian() -> tuple[torch.Tensor, callable]:
    """Exact fp64 Hessian ``(D, D)`` of a tiny MLP's mean loss and its row-wise HVP (torch.func)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen)
    w1 = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    w2 = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    theta = torch.cat([w1.reshape(-1), w2.reshape(-1)])

    def loss(t):
        a, b = t[:12].reshape(4, 3), t[12:].reshape(2, 4)
        return ((torch.tanh(x @ a.T) @ b.T - y.double()) ** 2).mean()

    def hvp(v):
        return torch.func.vmap(
            lambda row: torch.func.jvp(torch.func.grad(loss), (theta,), (row,))[1]
        )(v)

    return torch.func.hessian(loss)(theta), hvp


@pytest.mark.parametrize("rows", [1, 3])
def test_solvers_match_dense_solve(rows):
    h, hvp = _mlp_hessian()
    d = h.shape[0]
    b = torch.randn(rows, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    damping = 0.5 + max(0.0, -float(torch.linalg.eigvalsh(h).min()))  # H + λI positive definite
    expected = torch.linalg.solve(h + damping * torch.eye(d, dtype=h.dtype), b.T).T
    got = conjugate_gradient(hvp, b, damping=damping, max_iter=4 * d, tol=1e-12)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(direct_solve(hvp, b, damping=damping), expected)
    top = float(torch.linalg.eigvalsh(h + damping * torch.eye(d, dtype=h.dtype)).max())
    approx = lissa(hvp, b, damping=damping, scale=1.1 * top, depth=800)
    # LiSSA converges geometrically at rate 1 − λ_min/scale: a looser tolerance
    torch.testing.assert_close(approx, expected, rtol=1e-4, atol=1e-4)
    single = conjugate_gradient(hvp, b[0], damping=damping, max_iter=4 * d, tol=1e-12)
    torch.testing.assert_close(single, expected[0], rtol=1e-8, atol=1e-8)


def test_solver_errors():
    h, hvp = _mlp_hessian()
    b = torch.ones(h.shape[0], dtype=torch.float64)
    with pytest.raises(ValueError, match="damping"):
        conjugate_gradient(hvp, b, damping=-1.0)
    with pytest.raises(ValueError, match="positive definite"):
        conjugate_gradient(lambda v: -v, b, damping=0.0)
    with pytest.raises(ValueError, match="raise scale"):
        lissa(hvp, b, damping=1.0, scale=1e-3, depth=200)
    with pytest.raises(ValueError, match="shape"):
        lissa(hvp, torch.ones(1, 1, 1), damping=1.0)

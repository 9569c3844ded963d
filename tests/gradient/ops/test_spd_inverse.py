"""``checked_spd_inverse``: Cholesky inverse of a damped SPD matrix, refusal of the rest."""

from __future__ import annotations

import pytest
import torch

from dattri_llm.gradient.ops.kronecker import checked_spd_inverse


def spd(width: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(3 * width, width, generator=torch.Generator().manual_seed(seed))
    return x.T @ x / x.shape[0]


@pytest.mark.parametrize("damping", [1e-3, 0.5, 0.0])
def test_inverse_of_the_damped_matrix(damping):
    m = spd(6)
    expected = torch.linalg.inv(m.double() + damping * torch.eye(6, dtype=torch.float64))
    got = checked_spd_inverse(m, damping, "test")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_indefinite_damped_matrix_is_refused(damping):
    m = torch.diag(torch.tensor([2.0, 1.0, -1.0]))  # -1 + 0.5 < 0 still
    with pytest.raises(ValueError, match="not positive definite") as error:
        checked_spd_inverse(m, damping, "my_fn")
    assert "my_fn" in str(error.value)


def test_singular_undamped_matrix_is_refused():
    with pytest.raises(ValueError, match="singular"):
        checked_spd_inverse(torch.diag(torch.tensor([1.0, 0.0])), 0.0, "my_fn")

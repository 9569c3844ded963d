"""K-FAC covariance sums accumulated in lower-triangle panels equal full ``XᵀX`` products."""

from __future__ import annotations

import pytest
import torch

from dattri_llm.gradient.ops.kronecker import LayerKroneckerAccumulator
from dattri_llm.gradient.ops.kronecker_accumulators import (
    GRAM_PANEL,
    add_gram_lower_,
    symmetric_from_lower,
)


@pytest.mark.parametrize(
    "width", [1, GRAM_PANEL - 1, GRAM_PANEL, GRAM_PANEL + 1, 2 * GRAM_PANEL + 44]
)
def test_lower_panels_read_back_as_the_full_gram(width):
    gen = torch.Generator().manual_seed(width)
    first, second = (torch.randn(n, width, generator=gen, dtype=torch.float64) for n in (7, 5))
    total = torch.zeros(width, width, dtype=torch.float64)
    add_gram_lower_(total, first)
    add_gram_lower_(total, second)
    expected = first.T @ first + second.T @ second
    torch.testing.assert_close(symmetric_from_lower(total), expected)


def test_accumulator_over_panel_widths_matches_explicit_covariances():
    gen = torch.Generator().manual_seed(0)
    k, d = 2 * GRAM_PANEL + 3, GRAM_PANEL + 1  # several panels, one a single column
    batches = [
        (torch.randn(2, 3, k, generator=gen, dtype=torch.float64),
         torch.randn(2, 3, d, generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]  # fmt: skip
    acc = LayerKroneckerAccumulator()
    for a, g in batches:
        acc.update(a, g, "nn.Linear", None)
    a_rows = torch.cat([a.reshape(-1, k) for a, _ in batches])
    g_rows = torch.cat([g.reshape(-1, d) for _, g in batches])
    sums, rows = acc.partial_sums()
    assert rows == a_rows.shape[0]
    torch.testing.assert_close(sums[0], a_rows.T @ a_rows)
    torch.testing.assert_close(sums[1], g_rows.T @ g_rows)
    a_cov, g_cov = acc.result()
    torch.testing.assert_close(a_cov, a_rows.T @ a_rows / rows)
    torch.testing.assert_close(g_cov, g_rows.T @ g_rows / rows)
    assert torch.equal(a_cov, a_cov.T) and torch.equal(g_cov, g_cov.T)

"""The K-FAC accumulator's no-copy row paths equal masked float64 covariances.

The accumulator sums the activation Gram without the bias column (adding the
column sums instead), and subtracts dropped zero-gradient rows instead of
copying the kept ones; a batch with many dropped rows, or a dropped row with a
non-finite activation, is masked. Every path is checked against covariances
built from ``preprocess_factors`` with explicit row selection.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm.gradient.ops import extract_module_kwargs, preprocess_factors
from dattri_llm.gradient.ops.kronecker import LayerKroneckerAccumulator


def _reference(batches, layer_type, kwargs, include_bias, drop_zero_rows):
    """``(Σ a aᵀ / N, Σ g gᵀ / N)`` in float64 over the selected preprocessed rows."""
    a_all, g_all = [], []
    for a, g in batches:
        a_p, g_p = preprocess_factors(a.double(), g.double(), layer_type, kwargs, include_bias)
        a_rows, g_rows = a_p.reshape(-1, a_p.shape[-1]), g_p.reshape(-1, g_p.shape[-1])
        if drop_zero_rows:
            kept = g_rows.ne(0).any(dim=1)
            a_rows, g_rows = a_rows[kept], g_rows[kept]
        a_all.append(a_rows)
        g_all.append(g_rows)
    a_rows, g_rows = torch.cat(a_all), torch.cat(g_all)
    n = a_rows.shape[0]
    return a_rows.T @ a_rows / n, g_rows.T @ g_rows / n, n


def _linear_batch(gen, dropped_per_sample, t=16, k=6, d=5):
    """``a (2, t, k)``, ``g (2, t, d)`` with the last ``dropped_per_sample`` g rows zero."""
    a = torch.randn(2, t, k, generator=gen)
    g = torch.randn(2, t, d, generator=gen)
    if dropped_per_sample:
        g[:, t - dropped_per_sample :] = 0
    return a, g


def _accumulate(batches, layer_type, kwargs, include_bias):
    acc = LayerKroneckerAccumulator()
    for a, g in batches:
        acc.update(a, g, layer_type, kwargs, include_bias)
    return acc


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("include_bias", [True, False])
@pytest.mark.parametrize("dropped_per_sample", [0, 1, 3, 12, 16])  # none, subtract, mask, all
def test_linear_rows_match_masked_reference(bias, include_bias, dropped_per_sample):
    gen = torch.Generator().manual_seed(dropped_per_sample)
    kwargs = extract_module_kwargs(torch.nn.Linear(6, 5, bias=bias), "nn.Linear")
    batches = [_linear_batch(gen, dropped_per_sample), _linear_batch(gen, 1)]
    acc = _accumulate(batches, "nn.Linear", kwargs, include_bias)
    a_ref, g_ref, n = _reference(batches, "nn.Linear", kwargs, include_bias, True)
    a_cov, g_cov = acc.result()
    assert acc.rows == n
    assert a_cov.shape[0] == 6 + (bias and include_bias)
    torch.testing.assert_close(a_cov.double(), a_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_cov.double(), g_ref, rtol=1e-5, atol=1e-6)


def test_dropped_row_with_non_finite_activation_is_ignored():
    gen = torch.Generator().manual_seed(1)
    kwargs = extract_module_kwargs(torch.nn.Linear(6, 5), "nn.Linear")
    a, g = _linear_batch(gen, 1)
    a[0, -1, 2] = float("inf")  # a padding position whose g is zero
    a[1, -1, 0] = float("nan")
    acc = _accumulate([(a, g)], "nn.Linear", kwargs, True)
    a_ref, g_ref, _ = _reference([(a, g)], "nn.Linear", kwargs, True, True)
    a_cov, g_cov = acc.result()
    assert torch.isfinite(a_cov).all()
    torch.testing.assert_close(a_cov.double(), a_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_cov.double(), g_ref, rtol=1e-5, atol=1e-6)


def test_hf_conv1d_with_bias_matches_reference():
    transformers = pytest.importorskip("transformers")
    layer = transformers.pytorch_utils.Conv1D(5, 6)
    layer_type = "transformers.pytorch_utils.Conv1D"
    kwargs = extract_module_kwargs(layer, layer_type)
    gen = torch.Generator().manual_seed(2)
    batches = [_linear_batch(gen, 2)]
    a_cov, g_cov = _accumulate(batches, layer_type, kwargs, True).result()
    a_ref, g_ref, _ = _reference(batches, layer_type, kwargs, True, True)
    torch.testing.assert_close(a_cov.double(), a_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_cov.double(), g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "module",
    [
        torch.nn.Conv2d(4, 6, 3, padding=1),
        torch.nn.Conv2d(4, 6, 3, groups=2, bias=True),
        torch.nn.Conv1d(4, 6, 3, bias=False),
        torch.nn.ConvTranspose2d(4, 6, 3, stride=2),
    ],
    ids=["conv2d", "conv2d-grouped", "conv1d-nobias", "convtranspose2d"],
)
def test_conv_rows_keep_every_patch_and_match_reference(module):
    layer_type = f"nn.{type(module).__name__}"
    kwargs = extract_module_kwargs(module, layer_type)
    gen = torch.Generator().manual_seed(3)
    spatial = (5,) if isinstance(module, torch.nn.Conv1d) else (5, 5)
    x = torch.randn(2, 4, *spatial, generator=gen)
    out = module(x)
    g = torch.randn(out.shape, generator=gen)
    g[0] = 0  # zero patch rows are kept for conv
    batches = [(x, g)]
    a_cov, g_cov = _accumulate(batches, layer_type, kwargs, True).result()
    a_ref, g_ref, _ = _reference(batches, layer_type, kwargs, True, False)
    torch.testing.assert_close(a_cov.double(), a_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_cov.double(), g_ref, rtol=1e-5, atol=1e-5)

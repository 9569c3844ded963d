"""Low-rank gradient records (LoRIF storage): exactness, factored dots, the store option."""

from __future__ import annotations

import json

import pytest
import torch

from dattri_llm.gradient import storage_manager as sm
from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.lowrank import (
    LowRank,
    check_low_rank,
    low_rank_cross_dot,
    low_rank_factors,
    low_rank_gradient,
    require_raw_factors,
)
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.store import format as store_format


def _factors(batch: int, tokens: int, d_in: int, d_out: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, tokens, d_in, generator=gen, dtype=dtype)
    g = torch.randn(batch, tokens, d_out, generator=gen, dtype=dtype)
    return a, g


def _dense(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``Σ_t g_t a_tᵀ`` per sample, ``(B, d_out, d_in)`` (built here, not by the library)."""
    return torch.einsum("btd,btk->bdk", g, a)


def _block(a, g, layer_type="nn.Linear") -> Gradient:
    return Gradient({"l": "factorized"}, {"l": Factorized(a, g, None)}, {"l": layer_type})


def test_rank_c_record_of_rank_at_most_c_matrix_is_exact():
    a, g = _factors(4, 2, 7, 5, seed=0)  # rank <= 2 per sample
    record = low_rank_factors(a, g, 3)
    assert isinstance(record, LowRank) and record.rank == 3
    assert record.activation.shape == (4, 3, 7) and record.pre_activation_grad.shape == (4, 3, 5)
    torch.testing.assert_close(
        _dense(record.activation, record.pre_activation_grad), _dense(a, g), rtol=0, atol=1e-12
    )


def test_truncated_record_is_the_top_c_svd():
    a, g = _factors(3, 6, 5, 4, seed=1)
    record = low_rank_factors(a, g, 2)
    u, s, vh = torch.linalg.svd(_dense(a, g))
    expected = u[..., :2] @ torch.diag_embed(s[..., :2]) @ vh[:, :2]
    got = _dense(record.activation, record.pre_activation_grad)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["auto", "factorized", "materialized"])
def test_factored_inner_products_equal_dense_of_reconstruction(mode):
    r1 = low_rank_factors(*_factors(5, 4, 6, 3, seed=2), 2)
    r2 = low_rank_factors(*_factors(3, 4, 6, 3, seed=3), 3)
    m1 = _dense(r1.activation, r1.pre_activation_grad).reshape(5, -1)
    m2 = _dense(r2.activation, r2.pre_activation_grad).reshape(3, -1)
    torch.testing.assert_close(low_rank_cross_dot(r1, r2, mode=mode), m1 @ m2.T)


def test_low_rank_layers_survive_gradient_operations():
    block = low_rank_gradient(_block(*_factors(4, 3, 5, 4, seed=4)), 2)
    value = block.data["l"]
    assert isinstance(value, LowRank) and block.indexing["l"] == "batch"
    assert isinstance(block.slice("batch", [0, 2]).data["l"], LowRank)
    assert isinstance(block.concatenate(block).data["l"], LowRank)
    assert isinstance(block.to(torch.float32).data["l"], LowRank)
    expected = _dense(value.activation, value.pre_activation_grad).reshape(4, -1)
    torch.testing.assert_close(block.materialize().data["l"], expected)


def test_raw_linear_factors_are_preprocessed_with_bias():
    a, g = _factors(2, 3, 4, 3, seed=5)
    block = Gradient(
        {"l": "factorized"}, {"l": Factorized(a, g, {"has_bias": True})}, {"l": "nn.Linear"}
    )
    low = low_rank_gradient(block, 3).data["l"]
    with_bias = torch.cat([a, torch.ones(2, 3, 1, dtype=a.dtype)], dim=-1)
    torch.testing.assert_close(
        _dense(low.activation, low.pre_activation_grad), _dense(with_bias, g), atol=1e-12, rtol=0
    )


def test_rank_errors():
    with pytest.raises(ValueError, match="must be >= 1"):
        check_low_rank(0)
    with pytest.raises(ValueError, match="low_rank must be >= 1"):
        GradientStorageManager("unused", residency="memory", low_rank=0)
    block = low_rank_gradient(_block(*_factors(2, 3, 4, 3, seed=6)), 2)
    with pytest.raises(ValueError, match="rank c=2.*rank 3"):
        low_rank_gradient(block, 3)
    with pytest.raises(ValueError, match=r"layers \['l'\] hold low-rank records"):
        require_raw_factors(block, "K-FAC covariances")


# --------------------------------------------------------------------------- the store option


def _record(step: int, seed: int, batch: int = 3) -> GradientRecord:
    a, g = _factors(batch, 4, 6, 5, seed=seed, dtype=torch.float32)
    return GradientRecord(step, [f"s{step}_{i}" for i in range(batch)], _block(a, g))


@pytest.mark.parametrize("fmt", ["memmap", "pickle"])
def test_store_writes_rank_c_records_and_records_c(tmp_path, fmt):
    record = _record(0, seed=7)
    with GradientStorageManager(tmp_path, disk_format=fmt, low_rank=2) as store:
        store.save_bulk([record])
    assert json.loads((tmp_path / sm.SIDECAR_FILE).read_text())["low_rank"] == 2
    reopened = GradientStorageManager(tmp_path)
    assert reopened.low_rank == 2
    [got] = reopened.load_records(reopened.locations()[0])
    value = got.gradient.data["l"]
    assert isinstance(value, LowRank) and value.rank == 2
    original = record.gradient.data["l"]
    full = _dense(original.activation.double(), original.pre_activation_grad.double())
    u, s, vh = torch.linalg.svd(full)
    expected = u[..., :2] @ torch.diag_embed(s[..., :2]) @ vh[:, :2]
    torch.testing.assert_close(
        _dense(value.activation, value.pre_activation_grad).double(), expected, atol=1e-5, rtol=0
    )


def test_store_refuses_mixing_c(tmp_path):
    with GradientStorageManager(tmp_path / "c2", low_rank=2) as store:
        store.save_bulk([_record(0, seed=8)])
    with pytest.raises(ValueError, match="rank c=2; cannot add records of rank c=3"):
        GradientStorageManager(tmp_path / "c2", low_rank=3)
    reopened = GradientStorageManager(tmp_path / "c2")  # None adopts the stored c
    reopened.save_bulk([_record(1, seed=9)])
    assert all(
        isinstance(r.gradient.data["l"], LowRank) and r.gradient.data["l"].rank == 2
        for loc in reopened.locations()
        for r in reopened.load_records(loc)
    )
    with pytest.raises(ValueError, match="cannot add records of rank c=1"):
        reopened.declare_low_rank(1)
    full = GradientStorageManager(tmp_path / "full")
    full.save_bulk([_record(0, seed=10)])
    with pytest.raises(ValueError, match="already holds full-rank records"):
        GradientStorageManager(tmp_path / "full", low_rank=2)


def test_rank_directories_of_different_c_are_refused(tmp_path):
    for rank, c in ((0, 1), (1, 2)):
        with GradientStorageManager(tmp_path / f"rank_{rank}", low_rank=c) as store:
            store.save_bulk([_record(rank, seed=11 + rank)])
    with pytest.raises(ValueError, match="stores of different c cannot be mixed"):
        GradientStorageManager(tmp_path)


def test_store_killed_mid_write_stays_readable(tmp_path, monkeypatch):
    store = GradientStorageManager(tmp_path, low_rank=2)
    store.save_bulk([_record(0, seed=12)])
    real_write = store_format._BinLayout.write

    def killed(self, fh):
        fh.write(b"\0" * (self.size // 2))
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(store_format._BinLayout, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        store.save_bulk([_record(1, seed=13)])
    monkeypatch.setattr(store_format._BinLayout, "write", real_write)
    reopened = GradientStorageManager(tmp_path)
    assert reopened.low_rank == 2 and reopened.available_steps() == [0]
    [got] = reopened.load_records(reopened.locations()[0])
    assert isinstance(got.gradient.data["l"], LowRank)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

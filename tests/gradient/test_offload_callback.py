from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from store_helpers import assert_gradients_equal, assert_records_equal, make_gradient

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager


def record(step: int, batch: int = 2, tokens: int = 3) -> GradientRecord:
    ids = [f"s{step}_{i}" for i in range(batch)]
    return GradientRecord(step, ids, make_gradient("mixed", step, batch, tokens))


def groups_of(store: GradientStorageManager) -> list[list[GradientRecord]]:
    return [store.load_records(loc) for loc in store.locations()]


def test_is_a_hook_manager_callback(tmp_path):
    assert isinstance(OffloadCallback(1, GradientStorageManager(tmp_path)), HookManagerCallback)


def test_per_batch_flush_grouping(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    cb = OffloadCallback(2, store)
    records = [record(i) for i in range(5)]
    for r in records[:3]:
        cb.on_step_end(r)
    # third step arrived while two distinct steps were staged: they were written
    assert [r.step for r in cb.staged] == [2]
    assert [[r.step for r in g] for g in groups_of(store)] == [[0, 1]]
    staged = cb.staged
    staged.clear()  # a copy
    assert len(cb.staged) == 1
    for r in records[3:]:
        cb.on_step_end(r)
    cb.on_context_end()
    assert cb.staged == []
    groups = groups_of(store)
    assert [[r.step for r in g] for g in groups] == [[0, 1], [2, 3], [4]]
    for got, want in zip([r for g in groups for r in g], records):
        assert_records_equal(got, want)


def test_same_step_records_stay_in_one_group(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    cb = OffloadCallback(1, store)
    for step in (0, 0, 1, 1, 1):
        cb.on_step_end(record(step))
    cb.on_context_end()
    assert [[r.step for r in g] for g in groups_of(store)] == [[0, 0], [1, 1, 1]]


def test_per_sample_slicing(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    cb = OffloadCallback(1, store, recording_type="per_sample")
    whole = record(0, batch=3)
    cb.on_step_end(whole)
    assert [r.input_hash for r in cb.staged] == whole.input_hash
    cb.on_context_end()
    [group] = groups_of(store)
    assert len(group) == 3
    for i, got in enumerate(group):
        assert got.input_hash == whole.input_hash[i] and got.step == 0
        assert got.gradient.batch_size == 1
        assert_gradients_equal(got.gradient, whole.gradient.slice("batch", i))
    assert store.lookup_by_hash("s0_2") == [(0, 0)]


def pad_tokens(t: torch.Tensor, length: int, axis: int = 1) -> torch.Tensor:
    pad = [0, 0] * (t.ndim - axis - 1) + [0, length - t.shape[axis]]
    return F.pad(t, pad)


def test_accumulation_merges_windows_with_padding_and_restamps_steps(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    cb = OffloadCallback(1, store, gradient_accumulation_steps=2)
    micro = [record(10, batch=2, tokens=2), record(11, batch=1, tokens=3), record(12, tokens=2)]
    for r in micro:
        cb.on_step_end(r)
    assert [r.step for r in cb.staged] == [0]  # window of two merged, re-stamped
    cb.on_context_end()  # ragged trailing window merged and written
    first, second = [g[0] for g in groups_of(store)]
    assert (first.step, second.step) == (0, 1)
    assert first.input_hash == micro[0].input_hash + micro[1].input_hash
    assert second.input_hash == micro[2].input_hash
    assert store.gradient_accumulation_steps == 2
    a, b = micro[0].gradient, micro[1].gradient
    lin = first.gradient.data["lin"]
    assert lin.activation.shape == (3, 3, 4)
    assert torch.equal(
        lin.activation,
        torch.cat([pad_tokens(a.data["lin"].activation, 3), b.data["lin"].activation]),
    )
    assert torch.equal(
        lin.pre_activation_grad,
        torch.cat(
            [pad_tokens(a.data["lin"].pre_activation_grad, 3), b.data["lin"].pre_activation_grad]
        ),
    )
    emb = first.gradient.data["emb"].activation
    assert emb.dtype == torch.int64 and torch.equal(emb[:2, 2], torch.zeros(2, dtype=torch.int64))
    seq = first.gradient.data["seq"]  # sequence-first layer: batch axis 1, token axis 0
    assert torch.equal(
        seq.activation,
        torch.cat([pad_tokens(a.data["seq"].activation, 3, 0), b.data["seq"].activation], 1),
    )
    dense_tok = first.gradient.data["dense_tok"]
    assert torch.equal(
        dense_tok, torch.cat([pad_tokens(a.data["dense_tok"], 3), b.data["dense_tok"]])
    )
    assert torch.equal(first.gradient.data["dense"], torch.cat([a.data["dense"], b.data["dense"]]))


def test_accumulation_with_per_sample_and_interval(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    cb = OffloadCallback(2, store, recording_type="per_sample", gradient_accumulation_steps=2)
    for step in range(8):
        cb.on_step_end(record(step, batch=1))
    cb.on_context_end()
    groups = groups_of(store)
    assert [[r.step for r in g] for g in groups] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert [r.input_hash for r in groups[1]] == ["s4_0", "s5_0", "s6_0", "s7_0"]


def test_async_write_matches_sync(tmp_path):
    stores = {}
    for mode in (False, True):
        store = GradientStorageManager(tmp_path / str(mode))
        cb = OffloadCallback(1, store, async_write=mode, max_pending_writes=1)
        for step in range(4):
            cb.on_step_end(record(step))
        cb.on_context_end()
        assert cb._writer is None  # drained and closed
        stores[mode] = store
    # a second context re-opens a writer
    cb.on_step_end(record(9))
    cb.on_context_end()
    sync, asyn = groups_of(stores[False]), groups_of(stores[True])
    assert len(asyn) == len(sync) + 1
    for g_sync, g_async in zip(sync, asyn):
        for got, want in zip(g_async, g_sync):
            assert_records_equal(got, want)


def test_declares_accumulation_on_the_store(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    OffloadCallback(1, store, gradient_accumulation_steps=4)
    assert store.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="cannot declare 2"):
        OffloadCallback(1, store, gradient_accumulation_steps=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"recording_type": "per_token"}, "recording_type"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"offload_interval": 0}, "offload_interval"),
        ({"max_pending_writes": 0}, "max_pending_writes"),
    ],
)
def test_invalid_arguments(tmp_path, kwargs, match):
    args = {"offload_interval": 1, "file_manager": GradientStorageManager(tmp_path), **kwargs}
    with pytest.raises(ValueError, match=match):
        OffloadCallback(**args)


def test_hook_manager_capture_is_stored_exactly(tmp_path):
    from reference import per_sample_loop_grads

    from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    store = GradientStorageManager(tmp_path / "s")
    cb = OffloadCallback(1, store, recording_type="per_sample", gradient_accumulation_steps=2)
    manager = HookManager(model, config=HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
    with manager.collect():
        for rows in (x[:2], x[2:4], x[4:]):  # two windows: steps 0 (4 samples) and 1 (ragged)
            model(rows).pow(2).sum().backward()
    manager.remove()

    def loss(module, batch):
        return module(batch[0]).pow(2).sum()

    want = per_sample_loop_grads(model, loss, (x,))
    reopened = GradientStorageManager(tmp_path / "s")
    assert reopened.gradient_accumulation_steps == 2
    for i in range(5):
        [(step, sample_idx)] = reopened.lookup({"_arg0": x[i]})
        assert (step, sample_idx) == (0 if i < 4 else 1, 0)
        dense = reopened.load_sample({"_arg0": x[i]}, step, sample_idx).materialize()
        for layer in ("0", "2"):
            weight, bias = want[f"{layer}.weight"][i], want[f"{layer}.bias"][i]
            expected = torch.cat([weight, bias[:, None]], dim=1).reshape(1, -1)
            torch.testing.assert_close(dense.data[layer], expected, rtol=1e-5, atol=1e-6)

from __future__ import annotations

import types
import warnings

import pytest
import torch
from store_helpers import assert_gradients_equal, build_gradient, make_gradient, make_records

from dattri_llm.gradient.datasets import concatenate_gradients, iter_gradient_blocks, resolve_steps
from dattri_llm.gradient.gradient import Factorized, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.store import residency as store_residency
from dattri_llm.gradient.streaming import (
    DiskGradientSource,
    GradientSource,
    autocast_for,
    move_batch,
    rebatch_blocks,
)


def make_args(workers: int = 0, should_log: bool = True):
    return types.SimpleNamespace(dataloader_num_workers=workers, should_log=should_log)


def fill(store: GradientStorageManager, kind: str = "mixed", per_sample: bool = True):
    groups = make_records(kind, per_sample)
    for group in groups:
        store.save_bulk(group)
    return groups


def expected_blocks(groups, layer_name=None):
    """Per (group, step): the records' gradients concatenated in order."""
    out = []
    for group in groups:
        for step in sorted({r.step for r in group}):
            chosen = [r for r in group if r.step == step]
            grads = [r.gradient for r in chosen]
            if layer_name is not None:
                grads = [g.select_layers(layer_name, include_derived=True) for g in grads]
            ids = [
                h
                for r in chosen
                for h in ([r.input_hash] if isinstance(r.input_hash, str) else r.input_hash)
            ]
            out.append((step, concatenate_gradients(grads), ids))
    return out


def assert_blocks_equal(got, want):
    assert len(got) == len(want)
    for (s1, g1, i1), (s2, g2, i2) in zip(got, want):
        assert s1 == s2 and i1 == i2
        assert_gradients_equal(g1, g2)


@pytest.mark.parametrize("residency", ["disk", "memory"])
def test_iteration_order_blocks_and_reiteration(tmp_path, residency):
    store = GradientStorageManager(tmp_path / "s", residency=residency)
    groups = fill(store)
    source = DiskGradientSource(store, make_args())
    assert isinstance(source, GradientSource) and source.reusable
    assert len(source) == 6 and source.steps == [0, 1, 2, 3, 4, 5]
    first = list(source)
    assert [b[0] for b in first] == [0, 1, 2, 3, 4, 5]
    assert first[1][1].batch_size == 3  # per-sample records of a step concatenated
    assert_blocks_equal(first, expected_blocks(groups))
    assert_blocks_equal(list(source), first)


def test_block_equals_record_concatenation_with_padding(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    short = GradientRecord(0, ["a"], make_gradient("mixed", 0, 1, tokens=2))
    long = GradientRecord(0, ["b", "c"], make_gradient("mixed", 1, 2, tokens=4))
    store.save_bulk([short, long])
    [(step, block, ids)] = list(DiskGradientSource(store, make_args()))
    assert (step, ids) == (0, ["a", "b", "c"])
    assert block.data["lin"].activation.shape == (3, 4, 4)
    assert_gradients_equal(block, short.gradient.concatenate(long.gradient))


def test_each_group_is_loaded_once(tmp_path, monkeypatch):
    store = GradientStorageManager(tmp_path / "s")
    fill(store)
    source = DiskGradientSource(store, make_args())
    calls = []
    real = store_residency.load_group_file
    monkeypatch.setattr(store_residency, "load_group_file", lambda p: calls.append(p) or real(p))
    assert len(list(source)) == 6
    assert len(calls) == 3


def test_dataloader_workers_give_same_blocks(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    groups = fill(store, per_sample=False)
    got = list(DiskGradientSource(store, make_args(workers=1)))
    assert_blocks_equal(got, expected_blocks(groups))


def test_layer_filter_with_virtual_layers(tmp_path):
    layers = {
        "lin": ("materialized", "nn.Linear", "batch", torch.randn(2, 3)),
        "lin@2": ("materialized", "nn.Linear", "batch", torch.randn(2, 3)),
        "other": ("materialized", "nn.Linear", "batch", torch.randn(2, 5)),
    }
    store = GradientStorageManager(tmp_path / "s")
    store.save_bulk([GradientRecord(0, ["a", "b"], build_gradient(layers))])
    source = DiskGradientSource(store, make_args(), layer_name="lin")
    assert source.layer_name == ["lin"]
    [(_, block, _)] = list(source)
    assert block.layer_names == {"lin", "lin@2"}
    [(_, block, _)] = list(DiskGradientSource(store, make_args(), layer_name=["lin@2", "other"]))
    assert block.layer_names == {"lin@2", "other"}
    with pytest.raises(KeyError, match=r"\['missing'\] are not in gradient store"):
        DiskGradientSource(store, make_args(), layer_name=["lin", "missing"])


def test_param_grad_layers_are_dropped_with_warning(tmp_path):
    layers = {
        "lin": ("materialized", "nn.Linear", "batch", torch.randn(2, 3)),
        "bias": ("materialized", "param_grad_layers", "batch", torch.randn(4)),
    }
    store = GradientStorageManager(tmp_path / "s")
    store.save_bulk([GradientRecord(0, ["a", "b"], build_gradient(layers))])
    with pytest.warns(UserWarning, match=r"dropping batch-level param_grad layers \['bias'\]"):
        source = DiskGradientSource(store, make_args())
    [(_, block, _)] = list(source)
    assert block.layer_names == {"lin"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiskGradientSource(store, make_args(), layer_name="lin")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no per-sample layer"):
        DiskGradientSource(store, make_args(), layer_name="bias")


def test_steps_resolution_and_for_steps(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    groups = fill(store)
    assert resolve_steps(store) == [0, 1, 2, 3, 4, 5]
    assert resolve_steps(store, [5, 1, 42]) == [1, 5]
    with pytest.raises(ValueError, match=r"none of the requested steps \[42\]"):
        resolve_steps(store, [42])
    source = DiskGradientSource(store, make_args(), steps=[4, 1, 0], layer_name="lin", desc="x")
    assert source.steps == [0, 1, 4] and len(source) == 3
    view = source.for_steps([4, 9])
    assert view.steps == [4] and view.layer_name == ["lin"] and view.file_manager is store
    [(step, block, ids)] = list(view)
    [want] = [b for b in expected_blocks(groups, ["lin"]) if b[0] == 4]
    assert_blocks_equal([(step, block, ids)], [want])
    with pytest.raises(ValueError, match="for_steps"):
        source.for_steps([2])


def test_missing_and_empty_stores(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DiskGradientSource(GradientStorageManager(tmp_path / "nope"), make_args())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no records"):
        DiskGradientSource(GradientStorageManager(tmp_path / "empty"), make_args())


@pytest.mark.parametrize(
    ("desc", "verbose", "should_log", "shown"),
    [
        ("bar", True, True, True),
        (None, True, True, False),
        ("bar", False, True, False),
        ("bar", True, False, False),
    ],
)
def test_progress_bar_rules(tmp_path, capsys, desc, verbose, should_log, shown):
    store = GradientStorageManager(tmp_path / "s")
    fill(store)
    source = DiskGradientSource(store, make_args(should_log=should_log), desc=desc, verbose=verbose)
    list(source)
    assert ("bar" in capsys.readouterr().err) == shown


def test_iter_gradient_blocks_helper(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    groups = fill(store)
    assert_blocks_equal(
        list(iter_gradient_blocks(store, steps=[2, 3])), expected_blocks(groups)[2:4]
    )


# -------------------------------------------------------------------------- rebatch_blocks


def dense_block(step: int, batch: int):
    return step, make_gradient("dense", step, batch), [f"{step}_{i}" for i in range(batch)]


def test_rebatch_dense_blocks_to_at_least_batch_size_without_splitting():
    blocks = [dense_block(0, 3), dense_block(1, 2), dense_block(2, 4), dense_block(3, 1)]
    out = list(rebatch_blocks(blocks, 4))
    assert [len(s) for s, _, _ in out] == [5, 4, 1]  # 3+2 >= 4; 4 >= 4; the rest: no block cut
    assert out[0][0] == [0, 0, 0, 1, 1] and out[1][0] == [2, 2, 2, 2] and out[2][0] == [3]
    all_ids = [h for _, _, ids in out for h in ids]
    assert all_ids == [h for _, _, ids in blocks for h in ids]
    whole = concatenate_gradients([g for _, g, _ in blocks])
    assert_gradients_equal(concatenate_gradients([g for _, g, _ in out]), whole)
    for _, g, ids in out:
        assert g.batch_size == len(ids)


def test_rebatch_keeps_a_block_with_a_broadcast_layer_apart():
    """Merging would average the broadcast row with the other blocks' rows."""
    shared = dense_block(1, 3)
    broadcast = shared[1].slice("batch", 0)  # one row for the block's three samples
    blocks = [dense_block(0, 2), (1, broadcast, shared[2]), dense_block(2, 2)]
    out = list(rebatch_blocks(blocks, 8))
    assert [s for s, _, _ in out] == [[0, 0], [1, 1, 1], [2, 2]]
    assert out[1][1] is broadcast


def test_rebatch_factorized_blocks_pass_through_and_flush():
    fact = (7, make_gradient("factorized", 7, 2), ["f0", "f1"])
    out = list(rebatch_blocks([dense_block(0, 1), fact, dense_block(1, 1)], 8))
    assert [s for s, _, _ in out] == [[0], [7, 7], [1]]
    assert out[1][1] is fact[1]
    with pytest.raises(ValueError, match="batch_size"):
        list(rebatch_blocks([], 0))


def test_autocast_for_and_move_batch():
    args = types.SimpleNamespace(bf16=True, fp16=False, device=torch.device("cpu"))
    with autocast_for(args):
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert y.dtype == torch.bfloat16
    with autocast_for(types.SimpleNamespace(bf16=False, fp16=False, device="cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    batch = {"x": torch.ones(2, dtype=torch.float64), "y": [torch.zeros(1), "s"], "z": (1,)}
    moved = move_batch(batch, "cpu")
    assert moved["x"] is batch["x"] and moved["y"][1] == "s" and moved["z"] == (1,)
    assert isinstance(moved["y"], list)
    assert isinstance(move_batch(Factorized, "cpu"), type)


@pytest.mark.parametrize("workers", [0, 1])
def test_partly_resaved_record_is_streamed_once(tmp_path, workers):
    """Samples saved again later are read from their newest record only, in workers too."""
    store = GradientStorageManager(tmp_path / "store")
    old = make_gradient("dense", seed=0, batch=3)
    store.save_bulk([GradientRecord(step=0, input_hash=["a", "b", "c"], gradient=old)])
    new = make_gradient("dense", seed=1, batch=1)
    store.save_bulk([GradientRecord(step=0, input_hash=["b"], gradient=new)])

    reopened = GradientStorageManager(tmp_path / "store")
    blocks = list(DiskGradientSource(reopened, make_args(workers)))

    assert sorted(i for _, _, ids in blocks for i in ids) == ["a", "b", "c"]  # "b" once
    rows = {i: (block, k) for _, block, ids in blocks for k, i in enumerate(ids)}
    for sample, gradient, row in (("a", old, 0), ("b", new, 0), ("c", old, 2)):
        block, k = rows[sample]
        assert_gradients_equal(block.slice("batch", [k]), gradient.slice("batch", [row]))


def test_records_of_one_step_with_different_layers_are_kept_as_separate_blocks(tmp_path):
    """A micro-batch that skipped a layer is staged into the same group as its sibling."""
    from dattri_llm.gradient.datasets import GradientFileMultiStepDataset

    full = make_gradient("dense", seed=0, batch=2)
    names = sorted(full.data)
    partial = full.select_layers(names[:1])
    store = GradientStorageManager(tmp_path / "s")
    store.save_bulk(
        [
            GradientRecord(step=0, input_hash=["a", "b"], gradient=full),
            GradientRecord(step=0, input_hash=["c", "d"], gradient=partial),
        ]
    )
    blocks = list(DiskGradientSource(GradientStorageManager(tmp_path / "s"), make_args()))
    assert [ids for _, _, ids in blocks] == [["a", "b"], ["c", "d"]]
    assert_gradients_equal(blocks[0][1], full)
    assert_gradients_equal(blocks[1][1], partial)
    with pytest.raises(ValueError, match="different layer sets"):
        GradientFileMultiStepDataset(store, 0)[0]

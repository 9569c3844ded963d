"""DDP, FSDP1 and FSDP2 capture with 2 gloo ranks into one store, merged on read.

Each run trains `BlockNet` on two forked ranks with the user's own SGD loop (see
``distributed_example_helpers``); the merged store must equal the store of the
same run replayed in one process (every sample at the same step with the same
gradient, fp32 tight) and give the same TracIn and EK-FAC scores. The *uneven*
runs have rank 1 skip a layer (and, under DDP, run an extra batch). A store
whose rank directory is missing gets an error naming the rank.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from capture_helpers import dense
from ddp_capture_helpers import N_SAMPLES, STEPS, WORLD
from distributed_example_helpers import (
    EXTRA_ROWS,
    LAYERS,
    WRAPS,
    capture_queries,
    capture_reference,
    capture_worker,
    data,
    has_extra_batch,
    queries,
)
from free_port import free_port

from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient import storage_manager as sm
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.storage_manager import RANKS_FILE, GradientStorageManager
from dattri_llm.utils.hashing import hash_sample

RUNS = [(wrap, False) for wrap in WRAPS] + [("ddp", True), ("fsdp1", True)]


def _ids(rows: torch.Tensor) -> list[str]:
    return [hash_sample({"_arg0": row}) for row in rows]


@pytest.fixture(scope="module")
def query_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("queries") / "test"
    capture_queries(str(path))
    return path


_CAPTURED: dict[tuple[str, bool], tuple] = {}


def _captured(wrap: str, uneven: bool, tmp_path_factory) -> tuple:
    """``(wrap, uneven, merged store dir, single-process store dir)``, captured once per run."""
    key = (wrap, uneven)
    if key not in _CAPTURED:
        import torch.distributed.fsdp  # noqa: F401  (imported before the fork, not in each rank)

        root = tmp_path_factory.mktemp(f"{wrap}_{'uneven' if uneven else 'even'}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP on CPU / gloo warns about its device
            mp.start_processes(
                capture_worker,
                args=(wrap, uneven, f"tcp://127.0.0.1:{free_port()}", str(root / "merged")),
                nprocs=WORLD,
                join=True,
                start_method="fork",
            )
        capture_reference(str(root / "single"), wrap, uneven)
        _CAPTURED[key] = (wrap, uneven, root / "merged", root / "single")
    return _CAPTURED[key]


@pytest.fixture(
    scope="module", params=RUNS, ids=[f"{w}-{'uneven' if u else 'even'}" for w, u in RUNS]
)
def run(request, tmp_path_factory):
    """One 2-rank run and its single-process replay (see `_captured`)."""
    return _captured(*request.param, tmp_path_factory)


def test_merged_store_equals_the_single_process_store(run):
    wrap, uneven, merged_dir, single_dir = run
    merged, single = GradientStorageManager(merged_dir), GradientStorageManager(single_dir)
    assert sorted(p.name for p in merged_dir.iterdir()) == [f"rank_{r}" for r in range(WORLD)]
    rows = list(range(N_SAMPLES)) + (EXTRA_ROWS if has_extra_batch(wrap, uneven) else [])
    ids = _ids(data()[rows])
    assert sorted(merged.index) == sorted(single.index) == sorted(ids)
    extra = has_extra_batch(wrap, uneven)
    assert merged.available_steps() == list(range(STEPS + extra))
    for identifier in ids:
        ((step, sample_idx),) = merged.lookup_by_hash(identifier)
        ((single_step, single_idx),) = single.lookup_by_hash(identifier)
        assert step == single_step
        got = merged.load_sample_by_hash(identifier, step, sample_idx)
        want = single.load_sample_by_hash(identifier, step, single_idx)
        assert set(got.data) == set(want.data)
        for layer in want.data:
            expected = dense(want, layer)
            scale = expected.abs().max().item()
            torch.testing.assert_close(
                dense(got, layer), expected, rtol=1e-5, atol=1e-6 * scale, msg=layer
            )
    layer_sets = {
        frozenset(merged.load_sample_by_hash(i, *merged.lookup_by_hash(i)[0]).data) for i in ids
    }
    # rank 1 skipped `side` in the uneven run: its records hold one layer fewer
    expected_sets = (
        {frozenset(LAYERS), frozenset(LAYERS) - {"side"}} if uneven else {frozenset(LAYERS)}
    )
    assert layer_sets == expected_sets


def _score(attributor_class, train_dir, test_dir, out_dir, **kwargs):
    args = AttributionArguments(output_dir=str(out_dir), use_cpu=True)
    return attributor_class(args).attribute_from_cache(train_dir, test_dir, **kwargs)


# EK-FAC with damping relative to the curvature: the tiny fit (12 token rows per step) is
# near-singular, and an absolute 1e-3 would let summation-order noise dominate the inverse.
SCORERS = {
    "tracin": (TracInAttributor, {}),
    "ekfac": (EKFACAttributor, {"damping": 0.1, "relative_damping": True}),
}


@pytest.mark.parametrize("scorer", sorted(SCORERS))
def test_scores_from_the_merged_store_equal_single_process_scores(
    run, query_store, tmp_path, scorer
):
    _, _, merged_dir, single_dir = run
    attributor_class, kwargs = SCORERS[scorer]
    merged = _score(attributor_class, merged_dir, query_store, tmp_path / "merged", **kwargs)
    single = _score(attributor_class, single_dir, query_store, tmp_path / "single", **kwargs)
    train_ids = sorted(set(single.row_train_ids))
    test_ids = _ids(queries())
    assert sorted(merged.row_train_ids) == sorted(single.row_train_ids)
    got = merged.query(train_ids, test_ids, trajectory="aware")
    want = single.query(train_ids, test_ids, trajectory="aware")
    scale = want.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)


# --------------------------------------------------------------------------- missing shard


def test_each_rank_records_the_world_size(run):
    _, _, merged_dir, _ = run
    for rank in range(WORLD):
        ranks = json.loads((merged_dir / f"rank_{rank}" / RANKS_FILE).read_text())
        assert ranks == {"rank": rank, "world_size": WORLD}


@pytest.fixture
def ddp_store(tmp_path_factory, tmp_path):
    """A copy of the even DDP run's store (each test may break it)."""
    _, _, merged_dir, _ = _captured("ddp", False, tmp_path_factory)
    return shutil.copytree(merged_dir, tmp_path / "store")


def test_missing_rank_directory_is_named_on_every_read(ddp_store, query_store, tmp_path):
    shutil.rmtree(ddp_store / "rank_1")
    store = GradientStorageManager(ddp_store)  # opening (e.g. to re-run a capture) works
    first = _ids(data()[:1])[0]  # a rank-0 sample: its own reads refuse too
    reads = [
        lambda: store.index,
        store.available_steps,
        store.locations,
        lambda: store.lookup_by_hash(first),
        lambda: store.load_all_by_hash(first),
        lambda: _score(TracInAttributor, ddp_store, query_store, tmp_path / "out"),
    ]
    for read in reads:
        with pytest.raises(ValueError, match=r"missing the shard of rank\(s\) \[1\].*rank_1/"):
            read()


def test_rank_without_an_indexed_group_is_missing_until_it_is_re_run(ddp_store, monkeypatch):
    saved = GradientStorageManager(ddp_store).load_records("rank_1/batch_000000.mmap")
    (ddp_store / "rank_1" / "index.jsonl").write_text("")  # died before its first index line
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\]"):
        GradientStorageManager(ddp_store).available_steps()
    # Re-running rank 1 into the store (as its process would) makes it whole again.
    monkeypatch.setattr(sm, "dist_rank", lambda: 1)
    monkeypatch.setattr(sm, "dist_world_size", lambda: WORLD)
    GradientStorageManager(ddp_store).save_bulk(saved)
    monkeypatch.setattr(sm, "dist_rank", lambda: None)
    store = GradientStorageManager(ddp_store)
    for record in saved:
        for identifier in record.input_hash:
            assert store.lookup_by_hash(identifier) == [(0, record.input_hash.index(identifier))]


def test_store_without_rank_files_reads_the_ranks_present(tmp_path, monkeypatch):
    """A reference-written store (no ranks.json) with a rank directory gone reads as it is."""
    from store_helpers import make_gradient

    for rank in range(WORLD):
        monkeypatch.setattr(sm, "dist_rank", lambda rank=rank: rank)
        monkeypatch.setattr(sm, "dist_world_size", lambda: WORLD)
        GradientStorageManager(tmp_path).save_bulk(
            [GradientRecord(rank, [f"r{rank}"], make_gradient("dense", rank, 1))]
        )
    monkeypatch.setattr(sm, "dist_rank", lambda: None)
    shutil.rmtree(tmp_path / "rank_1")
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\]"):
        GradientStorageManager(tmp_path).available_steps()
    (tmp_path / "rank_0" / RANKS_FILE).unlink()
    assert GradientStorageManager(tmp_path).available_steps() == [0]

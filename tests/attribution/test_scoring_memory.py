"""Scoring from stores holds what the block being scored needs (peak memory of from-cache calls).

A store directory is opened once per call, so its identifier index is in memory
once (not once per step of the call that reads it); the running top-k
merges a batch's scores a slice of rows at a time (its float64 keys and sort
never cover the whole batch), ranking exactly as one merge would; merging the
held test blocks releases them, so the test side is held once; and EK-FAC drops
its covariances once it has their eigenbases.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch

from dattri_llm.attribution import scoring, topk
from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.scoring import ScoredBatch
from dattri_llm.attribution.topk import RunningTopK, TopK
from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager


def _dense(n: int, seed: int, width: int = 6) -> Gradient:
    gen = torch.Generator().manual_seed(seed)
    data = {f"l{i}": torch.randn(n, width, generator=gen) for i in range(2)}
    return Gradient(
        {name: "materialized" for name in data}, data, {name: "nn.Linear" for name in data}
    )


def _write(path, n: int, group: int, prefix: str, seed: int) -> str:
    store = GradientStorageManager(path)
    for start in range(0, n, group):
        size = min(group, n - start)
        ids = [f"{prefix}{start + i}" for i in range(size)]
        store.save_bulk([GradientRecord(0, ids, _dense(size, seed + start))])
    return str(path)


def _args(tmp_path, batch: int = 4) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
    )


class _Opened:
    """Counts the stores opened per directory (``GradientStorageManager.__init__``)."""

    def __init__(self, monkeypatch) -> None:
        self.dirs: list[str] = []
        real = GradientStorageManager.__init__

        def counting(store, save_dir, *args, **kwargs):
            self.dirs.append(str(save_dir))
            real(store, save_dir, *args, **kwargs)

        monkeypatch.setattr(GradientStorageManager, "__init__", counting)


@pytest.mark.parametrize(
    "call",
    [
        lambda a, train, test: TracInAttributor(a).attribute_from_cache(train, test),
        lambda a, train, test: TracInAttributor(a).top_k_from_cache(train, test, 3),
        lambda a, train, test: KFACAttributor(a).attribute_from_cache(
            train, test, non_kfac_strategy="direct"
        ),
        lambda a, train, test: KFACAttributor(a).top_k_from_cache(train, test, 3),
    ],
    ids=["grad-dot", "grad-dot-top-k", "kfac", "kfac-top-k"],
)
def test_a_store_directory_is_opened_once_per_call(tmp_path, monkeypatch, call):
    train = _write(tmp_path / "train", 12, 5, "t", 0)
    test = _write(tmp_path / "test", 3, 2, "q", 100)
    opened = _Opened(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # K-FAC: dense layers use the dense Fisher
        call(_args(tmp_path), train, test)
    assert sorted(opened.dirs) == [test, train]


def test_checkpoint_stores_are_opened_once_each(tmp_path, monkeypatch):
    trains = [_write(tmp_path / f"train{k}", 8, 3, "t", 10 * k) for k in range(2)]
    tests = [_write(tmp_path / f"test{k}", 2, 2, "q", 100 + k) for k in range(2)]
    opened = _Opened(monkeypatch)
    TracInAttributor(_args(tmp_path)).top_k_from_cache(trains, tests, 2)
    assert sorted(opened.dirs) == sorted(trains + tests)


# ---------------------------------------------------------------------------- running top-k
def _scores(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Scores with exact ties, NaN and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-3, 4, (rows, cols), generator=gen).float() / 2
    values[torch.rand(rows, cols, generator=gen) < 0.05] = float("nan")
    values[torch.rand(rows, cols, generator=gen) < 0.1] = -0.0
    return values


def _ranked(k: int, sign: int, batches: list[torch.Tensor], cols: int) -> TopK:
    sink = RunningTopK(k, sign)
    sink.start([f"q{j}" for j in range(cols)])
    first = 0
    for scores in batches:
        ids = [f"t{first + i}" for i in range(scores.shape[0])]
        sink.add(ScoredBatch(scores, ids, [0] * len(ids), None))
        first += len(ids)
    return sink.result(1, sign > 0, None)


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("k", [1, 4, 50])
def test_a_batch_merged_in_slices_ranks_as_merged_at_once(monkeypatch, sign, k):
    cols = 6
    batches = [_scores(rows, cols, seed) for seed, rows in enumerate([37, 1, 64, 20])]
    whole = _ranked(k, sign, batches, cols)
    monkeypatch.setattr(topk, "_MERGE_ELEMENTS", 1)  # slices of k rows
    sliced = _ranked(k, sign, batches, cols)
    assert sliced.train_ids == whole.train_ids
    assert torch.equal(sliced.scores.view(torch.int64), whole.scores.view(torch.int64))
    matrix = torch.cat(batches)
    ids = [f"t{i}" for i in range(matrix.shape[0])]
    full = AttributionScore(
        matrix, ids, [0] * len(ids), [f"q{j}" for j in range(cols)], "X", {}, None
    )
    expected = full.top_k(k, proponents=sign > 0)
    assert {q: [h for h, _ in v] for q, v in sliced.as_dict().items()} == {
        q: [h for h, _ in v] for q, v in expected.items()
    }


def test_the_merge_sorts_one_slice_of_a_batch_at_a_time(monkeypatch):
    """The float64 keys and the sort cover ``k`` + one slice of rows, not the whole batch."""
    sorted_rows = []
    real = torch.sort

    def recording(values, *args, **kwargs):
        if values.dim() == 2:  # the merge's keys (the repeated-id check sorts 1-D hashes)
            sorted_rows.append(values.shape[0])
        return real(values, *args, **kwargs)

    monkeypatch.setattr(topk, "_MERGE_ELEMENTS", 64)  # 64 // 4 columns = slices of 16 rows
    monkeypatch.setattr(torch, "sort", recording)
    _ranked(3, 1, [_scores(100, 4, 0)], 4)
    assert sorted_rows and max(sorted_rows) <= 3 + 16
    assert sum(rows - 3 for rows in sorted_rows[1:]) + sorted_rows[0] == 100


# ---------------------------------------------------------------------------- the test side
def test_merging_the_held_test_side_releases_its_pieces():
    """The test side is held once: merged blocks do not keep the blocks they were built from."""
    pieces = [scoring._TestBlock(_dense(2, seed), [2 * seed, 2 * seed + 1]) for seed in range(4)]
    refs = [weakref.ref(piece.rep.data["l0"]) for piece in pieces]
    held = list(pieces)
    del pieces
    merged = scoring._merge_dense_blocks(held, 8)
    assert held == [] and [ref() for ref in refs] == [None] * 4
    assert len(merged) == 1 and merged[0].cols == list(range(8))
    want = torch.cat([_dense(2, seed).data["l0"] for seed in range(4)])
    assert torch.equal(merged[0].rep.data["l0"], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cols", [[1, 2, 3, 4], [0, 1, 2, 3], [2, 0, 3, 1], [1, 1, 2, 3]])
def test_written_columns_equal_the_gathered_write(dtype, cols):
    """Consecutive columns are copied in place; the bits are those of the gathered write."""
    values = _scores(5, 4, 3).to(dtype)
    got = torch.zeros(5, 6)
    scoring._write_columns(got, values, cols)
    want = torch.zeros(5, 6)
    last = {col: row for row, col in enumerate(cols)}
    want[:, list(last)] = values[:, list(last.values())].to(dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


# ---------------------------------------------------------------------------- EK-FAC
def _factorized(n: int, seed: int) -> Gradient:
    gen = torch.Generator().manual_seed(seed)
    data = {
        f"l{i}": Factorized(
            torch.randn(n, 3, 4, generator=gen),
            torch.randn(n, 3, 5, generator=gen),
            module_kwargs={"has_bias": False},
        )
        for i in range(2)
    }
    return Gradient(
        {name: "factorized" for name in data},
        data,
        {name: "nn.Linear" for name in data},
        {name: "batch_token" for name in data},
    )


def test_ekfac_drops_the_covariances_before_its_eigenvalue_pass(tmp_path, monkeypatch):
    train, test = (
        GradientStorageManager(tmp_path / "train"),
        GradientStorageManager(tmp_path / "te"),
    )
    for start in range(0, 9, 3):
        ids = [f"t{start + i}" for i in range(3)]
        train.save_bulk([GradientRecord(0, ids, _factorized(3, start))])
    test.save_bulk([GradientRecord(0, ["q0", "q1"], _factorized(2, 99))])
    refs: list[weakref.ref] = []
    alive_at_rotation: list[int] = []
    real_pass = EKFACAttributor.covariance_pass
    real_rotation = EKFACAttributor._eigen_coordinates

    def covariance_pass(self, *args, **kwargs):
        covariances = real_pass(self, *args, **kwargs)
        refs.extend(weakref.ref(t) for pair in covariances.values() for t in pair)
        return covariances

    def eigen_coordinates(self, *args, **kwargs):
        alive_at_rotation.append(sum(ref() is not None for ref in refs))
        return real_rotation(self, *args, **kwargs)

    monkeypatch.setattr(EKFACAttributor, "covariance_pass", covariance_pass)
    monkeypatch.setattr(EKFACAttributor, "_eigen_coordinates", eigen_coordinates)
    score = EKFACAttributor(_args(tmp_path)).attribute_from_cache(train, test)
    assert len(refs) == 4 and alive_at_rotation
    assert set(alive_at_rotation) == {0}
    monkeypatch.undo()
    reference = EKFACAttributor(_args(tmp_path)).attribute_from_cache(train, test)
    assert torch.equal(score.scores, reference.scores)

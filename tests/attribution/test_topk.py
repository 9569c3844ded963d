"""Exact streaming top-k against a stable sort of the full matrix (``AttributionScore.top_k``)."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, mlp_data, mlp_loss, write_store

import dattri_llm.attribution.runs as runs
import dattri_llm.attribution.scoring as scoring
from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.algorithm.lorif import LoRIFAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.scoring import ScoredBatch
from dattri_llm.attribution.topk import RunningTopK, TopK
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.task import AttributionTask

N_TRAIN, N_TEST = 11, 4


def _args(path, batch: int = 3) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=2,
    )


class _NegativeTracIn(TracInAttributor):
    """Grad-Dot with the opposite polarity (a method that calls negative scores helpful)."""

    polarity = -1


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("topk")
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    tr = write_store(root / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4, 3, 4])
    te = write_store(root / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3, 1])
    low = GradientStorageManager(root / "low", low_rank=2)
    for location in tr.locations():
        low.save_bulk(tr.load_records(location))
    return {"tr": tr.save_dir, "te": te.save_dir, "low": low.save_dir}


METHODS = {
    "grad_dot": (TracInAttributor, {}, {}, "tr"),
    "grad_cos": (TracInAttributor, {}, {"normalized_grad": True}, "tr"),
    "negative_polarity": (_NegativeTracIn, {}, {}, "tr"),
    "kfac": (KFACAttributor, {}, {"damping": 1e-2}, "tr"),
    "ekfac": (EKFACAttributor, {}, {"damping": 1e-2}, "tr"),
    "lorif": (LoRIFAttributor, {"rank": None, "svd_rank": 4}, {}, "tr"),
    "lorif_low_rank_store": (LoRIFAttributor, {"rank": 2, "svd_rank": 4}, {}, "low"),
}


def _not_row_order(ranking: dict[str, list[tuple[str, float]]], train_ids: list[str]) -> bool:
    """Whether some query's ranking differs from the training order (a test that can fail)."""
    return any([h for h, _ in pairs] != train_ids[: len(pairs)] for pairs in ranking.values())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_streaming_top_k_equals_full_sort(stores, tmp_path, method):
    cls, init, kwargs, train_key = METHODS[method]
    full = cls(_args(tmp_path / "full"), **init).attribute_from_cache(
        stores[train_key], stores["te"], **kwargs
    )
    assert full.num_rows == N_TRAIN
    for k in (1, 4, N_TRAIN + 5):
        for proponents in (True, False):
            attributor = cls(_args(tmp_path / f"top_{k}_{proponents}"), **init)
            top = attributor.top_k_from_cache(
                stores[train_key], stores["te"], k, proponents=proponents, **kwargs
            )
            expected = full.top_k(k, proponents=proponents)
            assert isinstance(top, TopK)
            assert top.as_dict() == expected
            assert top.test_ids == full.test_ids
            assert top.scores.shape == (N_TEST, min(k, N_TRAIN))
            assert top.polarity == cls.polarity and top.proponents is proponents
            assert top.algorithm == full.algorithm
            if k > 1:
                assert _not_row_order(expected, full.train_ids)
            # nothing is saved: the stand-in score of the pass never reaches output_dir
            assert not (tmp_path / f"top_{k}_{proponents}" / "scores.pt").exists()
    # proponents of +1 polarity are the opponents of -1 polarity
    if method == "negative_polarity":
        dot = TracInAttributor(_args(tmp_path / "dot")).top_k_from_cache(
            stores["tr"], stores["te"], 3, proponents=False
        )
        neg = _NegativeTracIn(_args(tmp_path / "neg")).top_k_from_cache(
            stores["tr"], stores["te"], 3
        )
        assert dot.as_dict() == neg.as_dict()


def _random_batches(gen, sizes, num_test, *, low=-2, high=3):
    """Integer scores (many exact ties), some NaN, -0.0 and +0.0, cut into batches."""
    total = sum(sizes)
    matrix = torch.randint(low, high, (total, num_test), generator=gen).float()
    matrix[torch.rand(total, num_test, generator=gen) < 0.1] = float("nan")
    zeros = matrix == 0
    matrix[zeros & (torch.rand(total, num_test, generator=gen) < 0.5)] = -0.0
    ids = [f"s{i}" for i in range(total)]
    batches, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        batches.append(ScoredBatch(matrix[rows], ids[rows], [0] * size, None))
        start += size
    return matrix, ids, batches


@pytest.mark.parametrize("polarity", [1, -1])
@pytest.mark.parametrize("proponents", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_running_top_k_ties_nan_and_signed_zero(seed, proponents, polarity):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1, 6, (7,), generator=gen)]
    matrix, ids, batches = _random_batches(gen, sizes, 5)
    tests = [f"q{j}" for j in range(5)]
    full = AttributionScore(matrix, ids, [0] * len(ids), tests, "X", {}, None, polarity=polarity)
    for k in (1, 3, 8, len(ids), len(ids) + 4):
        sink = RunningTopK(k, polarity if proponents else -polarity)
        sink.start(tests)
        for batch in batches:
            sink.add(batch)
        got = sink.result(polarity, proponents, None).as_dict()
        expected = full.top_k(k, proponents=proponents)
        # NaN != NaN: compare ids, and the scores with NaN equal to NaN
        assert {q: [h for h, _ in v] for q, v in got.items()} == {
            q: [h for h, _ in v] for q, v in expected.items()
        }
        for q in tests:
            a = torch.tensor([s for _, s in got[q]], dtype=torch.float64)
            b = torch.tensor([s for _, s in expected[q]], dtype=torch.float64)
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(7.5), b.nan_to_num(7.5))
            assert not any(str(s) == "-0.0" for s in a.tolist())


def _dense_store(path, rows: torch.Tensor, ids: list[str], batch_sizes: list[int], step=0):
    store = GradientStorageManager(path)
    start = 0
    for size in batch_sizes:
        block = rows[start : start + size]
        grad = Gradient({"w": "materialized"}, {"w": block}, {"w": "nn.Linear"})
        store.save_bulk([GradientRecord(step, ids[start : start + size], grad)])
        start += size
    return store


def test_exact_ties_across_blocks_keep_training_order(tmp_path):
    # rows repeat across stored blocks and engine batches: many exact (integer) ties
    base = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    rows = base[torch.tensor([0, 1, 2, 0, 3, 1, 2, 0, 3, 1])]
    ids = [f"t{i}" for i in range(10)]
    tr = _dense_store(tmp_path / "tr", rows, ids, [3, 4, 3])
    queries = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    te = _dense_store(tmp_path / "te", queries, ["a", "b", "zero"], [3])
    full = TracInAttributor(_args(tmp_path / "f", batch=2)).attribute_from_cache(tr, te)
    for k in (1, 2, 5, 10, 20):
        for proponents in (True, False):
            top = TracInAttributor(_args(tmp_path / "t", batch=2)).top_k_from_cache(
                tr, te, k, proponents=proponents
            )
            assert top.as_dict() == full.top_k(k, proponents=proponents)
    # all-zero query: every score ties, so the order is the training order
    assert TracInAttributor(_args(tmp_path / "z")).top_k_from_cache(tr, te, 10).train_ids[2] == ids


def test_the_full_matrix_is_never_built(stores, tmp_path, monkeypatch):
    """No dense score_sources call; every batch handed over is one engine batch; state is k rows."""

    def refuse(*args, **kwargs):
        raise AssertionError("the dense score_sources was called")

    monkeypatch.setattr(scoring, "score_sources", refuse)
    seen = []
    add = RunningTopK.add

    def watched(self, batch):
        add(self, batch)
        seen.append((batch.scores.shape[0], self._values.shape[0]))

    monkeypatch.setattr(RunningTopK, "add", watched)
    batch, k = 2, 3
    top = KFACAttributor(_args(tmp_path, batch=batch)).top_k_from_cache(
        stores["tr"], stores["te"], k
    )
    assert sum(rows for rows, _ in seen) == N_TRAIN
    assert len(seen) >= 2
    # a batch is one stored group (7 and 4 rows here), never the whole set; the state k rows
    assert max(rows for rows, _ in seen) < N_TRAIN
    assert max(held for _, held in seen) <= k
    assert top.scores.shape == (N_TEST, k)


def test_empty_store_repeated_ids_and_refusals(stores, tmp_path):
    empty = GradientStorageManager(tmp_path / "empty")
    with pytest.raises(ValueError, match="training gradient store .* holds no records"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache(empty, stores["te"], 3)
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache(stores["tr"], stores["te"], 0)
    with pytest.raises(TypeError, match="proponents must be True or False"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache(
            stores["tr"], stores["te"], 2, proponents="yes"
        )
    with pytest.raises(ValueError, match="attribution_granularity must be 'instance'"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache(
            stores["tr"], stores["te"], 2, attribution_granularity="token"
        )
    with pytest.raises(TypeError, match="unknown keyword.*normalised_grad"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache(
            stores["tr"], stores["te"], 2, normalised_grad=True
        )
    with pytest.raises(NotImplementedError, match="LESSAttributor.top_k_from_cache"):
        LESSAttributor(_args(tmp_path)).top_k_from_cache(stores["tr"], stores["te"], 2)
    # the same samples at two steps: the full ranking sums them, a row stream cannot
    rows = torch.arange(12.0).reshape(4, 3)
    ids = ["a", "b", "c", "d"]
    two_steps = _dense_store(tmp_path / "two", rows, ids, [4], step=0)
    step_one = Gradient({"w": "materialized"}, {"w": -rows}, {"w": "nn.Linear"})
    two_steps.save_bulk([GradientRecord(1, ids, step_one)])
    te = _dense_store(tmp_path / "q", torch.ones(1, 3), ["q"], [1])
    with pytest.raises(NotImplementedError, match="appears in more than one row"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache(two_steps, te, 2)
    full = TracInAttributor(_args(tmp_path)).attribute_from_cache(
        two_steps, te, selected_training_steps=[1]
    )
    top = TracInAttributor(_args(tmp_path)).top_k_from_cache(
        two_steps, te, 2, selected_training_steps=[1]
    )
    assert top.as_dict() == full.top_k(2) == {"q": [("a", -3.0), ("b", -12.0)]}


@pytest.mark.parametrize("cls", [TracInAttributor, KFACAttributor])
def test_loop_over_test_layer_selection_and_progress(stores, tmp_path, cls):
    options = {"loop_over_test": True, "layer_name": "fc2", "verbose": True}
    full = cls(_args(tmp_path / "f")).attribute_from_cache(stores["tr"], stores["te"], **options)
    top = cls(_args(tmp_path / "t")).top_k_from_cache(stores["tr"], stores["te"], 5, **options)
    assert top.as_dict() == full.top_k(5)
    assert top.layer_name == ["fc2"]


def _dict_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def test_live_top_k_equals_live_full_sort(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    samples = [{"x": x, "y": y} for x, y in zip(*train)]
    queries = [{"x": x, "y": y} for x, y in zip(*test)]
    task = AttributionTask(_dict_loss, model)
    for normalized in (False, True):
        full = TracInAttributor(_args(tmp_path / "f"), task=task).attribute(
            samples, queries, normalized_grad=normalized
        )
        for proponents in (True, False):
            top = TracInAttributor(_args(tmp_path / "t"), task=task).top_k(
                queries, 4, train_source=samples, proponents=proponents, normalized_grad=normalized
            )
            assert top.as_dict() == full.top_k(4, proponents=proponents)
    for cls, kwargs in ((KFACAttributor, {"damping": 1e-2}), (EKFACAttributor, {"damping": 1e-2})):
        for residency in (None, "memory"):
            full = cls(_args(tmp_path / "kf"), task=task).attribute(
                samples, queries, gradient_cache_residency=residency, **kwargs
            )
            top = cls(_args(tmp_path / "kt"), task=task).top_k(
                queries, 3, train_source=samples, gradient_cache_residency=residency, **kwargs
            )
            assert top.as_dict() == full.top_k(3)
            assert not (tmp_path / "kt" / "scores.pt").exists()
    several = AttributionTask(_dict_loss, model, checkpoints=[model.state_dict()] * 2)
    with pytest.raises(NotImplementedError, match="the task has 2"):
        TracInAttributor(_args(tmp_path), task=several).top_k(queries, 2, train_source=samples)


def _ensemble(tmp_path):
    """Two checkpoints (different weights) cached by ``cache()``; their stores and queries."""
    torch.manual_seed(0)
    model = MLP()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    second = {k: v + 0.3 * torch.randn_like(v) for k, v in first.items()}
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    samples = [{"x": x, "y": y} for x, y in zip(*train)]
    queries = [{"x": x, "y": y} for x, y in zip(*test)]
    task = AttributionTask(_dict_loss, model, checkpoints=[first, second])
    pairs = TracInAttributor(_args(tmp_path / "cache"), task=task).cache(samples, queries)
    return [t for t, _ in pairs], [q for _, q in pairs]


@pytest.mark.parametrize("normalized", [False, True])
def test_checkpoint_ensemble_sums_rows_exactly(tmp_path, normalized):
    trains, tests = _ensemble(tmp_path)
    per_checkpoint = [
        TracInAttributor(_args(tmp_path / "f")).attribute_from_cache(
            t, q, normalized_grad=normalized
        )
        for t, q in zip(trains, tests)
    ]
    # the checkpoint ensemble as attribute() builds it: rows concatenated, summed per sample
    scores, rows, steps, test_ids, _ = runs.concat_results(
        [runs.score_result(s) for s in per_checkpoint]
    )
    full = AttributionScore(scores, rows, steps, test_ids, "TracIn", {}, None)
    single = per_checkpoint[0].top_k(N_TRAIN)
    assert full.top_k(N_TRAIN) != single  # the second checkpoint changes the ranking
    for k in (1, 3, N_TRAIN + 1):
        for proponents in (True, False):
            top = TracInAttributor(_args(tmp_path / "t")).top_k_from_cache(
                trains, tests, k, proponents=proponents, normalized_grad=normalized
            )
            assert top.as_dict() == full.top_k(k, proponents=proponents)
            assert top.algorithm_meta["n_checkpoints"] == 2
    with pytest.raises(ValueError, match="one store per checkpoint"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache(trains, tests[:1], 2)
    with pytest.raises(ValueError, match="KFACAttributor scores one checkpoint"):
        KFACAttributor(_args(tmp_path)).top_k_from_cache(trains, tests, 2)
    shuffled = GradientStorageManager(tmp_path / "shuffled")
    for location in reversed(GradientStorageManager(trains[1]).locations()):
        shuffled.save_bulk(GradientStorageManager(trains[1]).load_records(location))
    with pytest.raises(ValueError, match="does not hold the same samples in the same order"):
        TracInAttributor(_args(tmp_path)).top_k_from_cache([trains[0], shuffled.save_dir], tests, 2)


def test_live_top_k_refuses_a_sharded_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    attributor = TracInAttributor(AttributionArguments(output_dir=str(tmp_path), use_cpu=True))
    with pytest.raises(NotImplementedError, match="sharded over 2 ranks"):
        attributor.top_k([{"x": torch.zeros(2)}], 3, train_source=[{"x": torch.zeros(2)}])

"""Streaming top-k over a trajectory method's sweep against a sort of its full score.

A recorded run of 2 epochs (6 samples passed twice, batches of 2: 6 updates) holds every
sample at two steps, so a sample's full score (``AttributionScore.top_k``) is
the sum of two rows. ``top_k_from_cache`` / ``top_k`` must return the same
ranking, scores and tie order, for every trajectory method and propagation,
from a gradient store and from a replayed run, in both directions and with the
method's own polarity (AdamW-influence calls negative scores helpful).
"""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, mlp_data, mlp_loss

from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.scoring import ScoredBatch
from dattri_llm.attribution.topk import RunningTopK, SampleSums
from dattri_llm.task import AttributionTask

N_TRAIN, N_TEST, EPOCHS = 6, 3, 2
pytestmark = pytest.mark.filterwarnings("ignore:the configured learning_rate differs")
CLASSES = {
    "tracin": TrajectoryTracInAttributor,
    "dvemb": DVEmbAttributor,
    "adamw": AdamWInfluenceAttributor,
}


def _args(path, **kwargs) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=0.05,
        max_grad_norm=None,
        **kwargs,
    )


def _dict_loss(model, batch):
    return mlp_loss(model, (batch["x"], batch["y"]))


def _samples(seed: int, count: int) -> list[dict]:
    x, y = mlp_data(count, seed)
    return [{"x": x[i], "y": y[i]} for i in range(count)]


def _two_epochs() -> list[dict]:
    """The training samples twice, the second time in reverse order (a two-epoch run)."""
    samples = _samples(1, N_TRAIN)
    return samples + samples[::-1]


def _attributor(method: str, path, model=None, **kwargs):
    model = model if model is not None else MLP()
    return CLASSES[method](_args(path, **kwargs), task=AttributionTask(_dict_loss, model))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{(method, recompute): (train_dir, test_dir)}``: one recorded 2-epoch run each."""
    root = tmp_path_factory.mktemp("trajectory_topk")
    train, test = _two_epochs(), _samples(2, N_TEST)
    recorded = {}
    for method in CLASSES:
        for recompute in (False, True) if method == "dvemb" else (False,):
            torch.manual_seed(0)
            name = f"{method}_{recompute}"
            attributor = _attributor(method, root / name, recompute_gradients=recompute)
            ((train_dir, test_dir),) = attributor.cache(train, test, cache_dir=str(root / name))
            recorded[method, recompute] = (train_dir, test_dir)
    return recorded


def _check_equal(top, full: AttributionScore, k: int, proponents: bool) -> None:
    assert top.as_dict() == full.top_k(k, proponents=proponents)
    assert top.test_ids == full.test_ids and top.polarity == full.polarity
    assert top.algorithm == full.algorithm


CASES = [
    ("tracin", False, {}),
    ("dvemb", False, {"propagation": "test"}),
    ("dvemb", False, {"propagation": "train"}),
    ("dvemb", False, {"hessian_mode": "diagonal"}),
    ("dvemb", True, {}),  # replayed from snapshots
    ("adamw", False, {}),
    ("adamw", False, {"propagation": "test", "num_masks": 2}),
]


@pytest.mark.parametrize(("method", "recompute", "options"), CASES)
def test_top_k_over_the_sweep_equals_sorting_the_full_score(
    runs, tmp_path, method, recompute, options
):
    train_dir, test_dir = runs[method, recompute]
    full = _attributor(method, tmp_path / "full").attribute_from_cache(
        train_dir, test_dir, **options
    )
    assert full.num_rows == N_TRAIN * EPOCHS and full.num_train == N_TRAIN  # two rows each
    for k in (1, 4, N_TRAIN + 3):
        for proponents in (True, False):
            top = _attributor(method, tmp_path / "top").top_k_from_cache(
                train_dir, test_dir, k, proponents=proponents, **options
            )
            _check_equal(top, full, k, proponents)
    assert not (tmp_path / "top" / "scores.pt").exists()


def test_summed_rows_are_what_is_ranked(runs, tmp_path):
    """Each returned score is the sum of the sample's two rows, not either row alone."""
    train_dir, test_dir = runs["dvemb", False]
    full = _attributor("dvemb", tmp_path / "full").attribute_from_cache(train_dir, test_dir)
    top = _attributor("dvemb", tmp_path / "top").top_k_from_cache(train_dir, test_dir, N_TRAIN)
    summed = 0
    for j, query in enumerate(top.test_ids):
        for sample, value in zip(top.train_ids[j], top.scores[j].tolist()):
            rows = [r for r, h in enumerate(full.row_train_ids) if h == sample]
            assert len(rows) == EPOCHS
            column = full.scores[rows, full.test_ids.index(query)]
            assert value == pytest.approx(float(column.sum()), rel=1e-6)
            summed += all(abs(value - float(v)) > 1e-9 for v in column)
    assert summed > N_TRAIN  # most samples: the sum differs from each of its rows


def test_selected_steps_and_final_step(runs, tmp_path):
    train_dir, test_dir = runs["adamw", False]
    for options in ({"selected_training_steps": [0, 4, 5]}, {"final_step": 4}):
        full = _attributor("adamw", tmp_path / "f").attribute_from_cache(
            train_dir, test_dir, **options
        )
        top = _attributor("adamw", tmp_path / "t").top_k_from_cache(
            train_dir, test_dir, 3, **options
        )
        _check_equal(top, full, 3, True)


def test_live_top_k_records_the_run_and_ranks_it(tmp_path):
    train, test = _two_epochs(), _samples(2, N_TEST)
    torch.manual_seed(0)
    full = _attributor("adamw", tmp_path / "f").attribute(
        train, test, cache_dir=str(tmp_path / "a")
    )
    torch.manual_seed(0)
    top = _attributor("adamw", tmp_path / "t").top_k(
        test, 4, train_source=train, cache_dir=str(tmp_path / "b")
    )
    _check_equal(top, full, 4, True)


def test_loop_over_test_in_trajectory_tracins_weighted_pass(runs, tmp_path):
    """One learning rate for every coordinate: a weighted Grad-Dot, which loops over queries."""
    train_dir, test_dir = runs["tracin", False]
    full = _attributor("tracin", tmp_path / "f").attribute_from_cache(
        train_dir, test_dir, loop_over_test=True
    )
    top = _attributor("tracin", tmp_path / "t").top_k_from_cache(
        train_dir, test_dir, 4, loop_over_test=True
    )
    _check_equal(top, full, 4, True)


def test_loop_over_test_is_refused(runs, tmp_path):
    train_dir, test_dir = runs["dvemb", False]
    with pytest.raises(NotImplementedError, match="drop loop_over_test=True"):
        _attributor("dvemb", tmp_path).top_k_from_cache(
            train_dir, test_dir, 2, propagation="test", loop_over_test=True
        )


@pytest.mark.parametrize("known", [True, False])
def test_sample_sums_ties_signed_zero_and_nan(known):
    """Rows of repeated ids, out of order, with exact ties: equals the full score's sort."""
    gen = torch.Generator().manual_seed(3)
    ids = [f"s{i}" for i in torch.randint(0, 20, (40,), generator=gen).tolist()]
    rows = torch.randint(-2, 3, (40, 4), generator=gen).float()
    rows[torch.rand(40, 4, generator=gen) < 0.05] = float("nan")
    rows[(rows == 0) & (torch.rand(40, 4, generator=gen) < 0.5)] = -0.0
    tests = [f"q{j}" for j in range(4)]
    full = AttributionScore(rows, ids, list(range(40)), tests, "X", {}, None)
    counts = {h: ids.count(h) for h in set(ids) if ids.count(h) > 1} if known else None
    assert counts is None or len(counts) < len(set(ids))  # some ids have one row
    for k in (1, 3, 9, 25):
        for proponents in (True, False):
            sums = SampleSums(RunningTopK(k, 1 if proponents else -1), counts)
            sums.start(tests)
            for start in range(0, 40, 7):
                batch = slice(start, start + 7)
                sums.add(ScoredBatch(rows[batch], ids[batch], [0] * len(ids[batch]), None))
            sums.finish()
            assert sums.remaining in (None, {})  # every count consumed, none stored for singles
            got = sums.sink.result(1, proponents, None).as_dict()
            expected = full.top_k(k, proponents=proponents)
            assert {q: [h for h, _ in v] for q, v in got.items()} == {
                q: [h for h, _ in v] for q, v in expected.items()
            }
            for q in tests:
                a = torch.tensor([s for _, s in got[q]], dtype=torch.float64)
                b = torch.tensor([s for _, s in expected[q]], dtype=torch.float64)
                assert torch.equal(a.nan_to_num(9.5), b.nan_to_num(9.5))

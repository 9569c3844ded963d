from __future__ import annotations

import inspect
import json
import math
import os

import pytest
import torch

from dattri_llm.attribution.score import AttributionScore


def make_instance_score() -> AttributionScore:
    # rows: a@0, b@0, a@1, c@1 ; 3 test columns
    scores = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    return AttributionScore(
        scores=scores,
        row_train_ids=["a", "b", "a", "c"],
        row_steps=[0, 0, 1, 1],
        test_ids=["x", "y", "z"],
        algorithm="TracIn",
        algorithm_meta={"n_checkpoints": 2},
        layer_name=["lin"],
    )


def make_token_score() -> AttributionScore:
    # sample a at steps 0 and 1 (T=2), sample b at step 0 (T=2); 2 test columns
    scores = torch.tensor(
        [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [10.0, 20.0], [30.0, 40.0]]
    )
    return AttributionScore(
        scores=scores,
        row_train_ids=["a", "a", "b", "b", "a", "a"],
        row_steps=[0, 0, 0, 0, 1, 1],
        test_ids=["x", "y"],
        algorithm="TracIn",
        algorithm_meta={},
        layer_name=None,
        row_token_ids=[0, 1, 0, 1, 0, 1],
    )


def test_indexes_and_properties():
    s = make_instance_score()
    assert s.granularity == "instance"
    assert s.train_ids == ["a", "b", "c"]
    assert (s.num_rows, s.num_train, s.num_test) == (4, 3, 3)
    assert s.train_index == {"a": [(0, 0), (1, 2)], "b": [(0, 1)], "c": [(1, 3)]}
    assert s.test_index == {"x": 0, "y": 1, "z": 2}


def test_agnostic_and_trajectory_views():
    s = make_instance_score()
    ids, m = s.agnostic_matrix()
    assert ids == ["a", "b", "c"]
    expected = torch.stack([s.scores[0] + s.scores[2], s.scores[1], s.scores[3]])
    assert torch.equal(m, expected)
    steps, per_step = s.trajectory_aware("a")
    assert steps == [0, 1] and torch.equal(per_step, s.scores[[0, 2]])
    assert torch.equal(s.trajectory_agnostic("a"), s.scores[0] + s.scores[2])
    assert torch.equal(s.column("y"), s.scores[:, 1])
    ids0, m0 = s.step_matrix(0)
    assert ids0 == ["a", "b"] and torch.equal(m0, s.scores[[0, 1]])
    assert list(s.step_matrices()) == [0, 1]
    assert s.score_at("a", 1, "z").item() == s.scores[2, 2].item()


def test_query():
    s = make_instance_score()
    q = s.query(["c", "a"], ["z", "x"])
    assert torch.equal(q, torch.stack([s.scores[3, [2, 0]], (s.scores[0] + s.scores[2])[[2, 0]]]))
    assert torch.equal(s.query(), s.agnostic_matrix()[1])
    aware = s.query(["a"], trajectory="aware")
    assert torch.equal(aware, s.scores[[0, 2]])
    with pytest.raises(ValueError, match="trajectory"):
        s.query(trajectory="both")
    with pytest.raises(KeyError):
        s.query(["nope"])
    with pytest.raises(KeyError):
        s.query(test_hashes=["nope"])


def test_errors():
    s = make_instance_score()
    with pytest.raises(ValueError, match="token"):
        s.token_scores("a")
    with pytest.raises(KeyError):
        s.step_matrix(7)
    with pytest.raises(KeyError):
        s.score_at("b", 1, "x")
    with pytest.raises(KeyError):
        s.column("q")
    with pytest.raises(ValueError, match="rows"):
        AttributionScore(torch.zeros(2, 1), ["a"], [0, 0], ["x"], "T", {}, None)
    with pytest.raises(ValueError, match="columns"):
        AttributionScore(torch.zeros(1, 2), ["a"], [0], ["x"], "T", {}, None)
    with pytest.raises(ValueError, match="row_token_ids"):
        AttributionScore(torch.zeros(1, 1), ["a"], [0], ["x"], "T", {}, None, row_token_ids=[0, 1])
    with pytest.raises(ValueError, match="duplicates"):
        AttributionScore(torch.zeros(1, 2), ["a"], [0], ["x", "x"], "T", {}, None)


def test_token_scores():
    s = make_token_score()
    assert s.granularity == "token"
    pos, per = s.token_scores("a", step=0)
    assert pos == [0, 1] and torch.equal(per, s.scores[[0, 1]])
    pos, per = s.token_scores("a")
    assert torch.equal(per, s.scores[[0, 1]] + s.scores[[4, 5]])
    with pytest.raises(KeyError):
        s.token_scores("a", step=3)
    with pytest.raises(KeyError):
        s.token_scores("zz")
    # token rows are summed in every sample-level view
    steps, per_step = s.trajectory_aware("a")
    assert steps == [0, 1]
    assert torch.equal(per_step[1], s.scores[4] + s.scores[5])
    ids, m = s.agnostic_matrix()
    assert ids == ["a", "b"] and torch.equal(m[1], s.scores[2] + s.scores[3])
    assert s.score_at("b", 0, "y").item() == 14.0
    assert s.query(["a"], trajectory="aware").shape == (4, 2)


def test_save_load_roundtrip(tmp_path):
    s = make_token_score()
    out = s.save(tmp_path / "scores")
    assert (out / "scores.pt").is_file()
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["granularity"] == "token" and meta["num_train"] == 2
    t = AttributionScore.load(out)
    assert torch.equal(t.scores, s.scores)
    assert t.row_token_ids == s.row_token_ids and t.test_ids == s.test_ids
    assert t.train_index == s.train_index


def test_load_folds_top_level_normalized_grad(tmp_path):
    s = make_instance_score()
    out = s.save(tmp_path)
    meta = json.loads((out / "metadata.json").read_text())
    meta["normalized_grad"] = True
    (out / "metadata.json").write_text(json.dumps(meta))
    t = AttributionScore.load(out)
    assert t.algorithm_meta["normalized_grad"] is True
    with pytest.raises(FileNotFoundError):
        AttributionScore.load(tmp_path / "missing")


def test_failed_save_leaves_the_previous_scores_loadable(tmp_path, monkeypatch):
    first = make_instance_score()
    out = first.save(tmp_path / "scores")
    saved_files = sorted(p.name for p in out.iterdir())

    def save_then_fail(obj, f, *args, **kwargs):
        partial = b"PK\x03\x04 truncated"
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as handle:
                handle.write(partial)
        else:
            f.write(partial)
        raise OSError("disk full (simulated)")

    second = make_instance_score()
    second.scores = second.scores + 100.0
    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(OSError, match="simulated"):
        second.save(out)
    monkeypatch.undo()

    assert sorted(p.name for p in out.iterdir()) == saved_files  # no partial or stray file
    loaded = AttributionScore.load(out)
    assert torch.equal(loaded.scores, torch.arange(12, dtype=torch.float32).reshape(4, 3))
    assert loaded.row_train_ids == ["a", "b", "a", "c"] and loaded.test_ids == ["x", "y", "z"]


# ---------------------------------------------------------------------------- polarity
def test_polarity_defaults_to_plus_one_and_is_keyword_only():
    s = make_instance_score()
    assert s.polarity == 1
    parameter = inspect.signature(AttributionScore).parameters["polarity"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default == 1
    assert list(inspect.signature(AttributionScore).parameters)[-1] == "polarity"
    negative = AttributionScore(torch.zeros(1, 1), ["a"], [0], ["x"], "T", {}, None, polarity=-1)
    assert negative.polarity == -1 and type(negative.polarity) is int


@pytest.mark.parametrize("bad", [0, 2, -2, 1.0, -1.0, True, False, "1", None, "+1"])
def test_polarity_other_than_plus_or_minus_one_raises(bad):
    with pytest.raises(ValueError, match="polarity"):
        AttributionScore(torch.zeros(1, 1), ["a"], [0], ["x"], "T", {}, None, polarity=bad)


@pytest.mark.parametrize("polarity", [1, -1])
def test_polarity_is_saved_and_loaded(tmp_path, polarity):
    s = make_token_score()
    s.polarity = polarity
    out = s.save(tmp_path / "scores")
    assert json.loads((out / "metadata.json").read_text())["polarity"] == polarity
    loaded = AttributionScore.load(out)
    assert loaded.polarity == polarity
    assert loaded.top_k(2, proponents=False) == s.top_k(2, proponents=False)


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [("AdamWInfluence", -1), ("TracIn", 1), ("GradCos", 1), ("DVEmb", 1), ("EKFAC", 1)],
)
def test_load_without_polarity_key_infers_it_from_the_algorithm(tmp_path, algorithm, expected):
    s = make_instance_score()
    s.algorithm = algorithm
    out = s.save(tmp_path)
    meta = json.loads((out / "metadata.json").read_text())
    del meta["polarity"]  # a metadata.json written before polarity was recorded
    (out / "metadata.json").write_text(json.dumps(meta))
    assert AttributionScore.load(out).polarity == expected


def test_a_saved_polarity_wins_over_the_algorithm_default(tmp_path):
    s = make_instance_score()
    s.algorithm = "AdamWInfluence"  # polarity stays +1 (e.g. scores negated by the user)
    assert AttributionScore.load(s.save(tmp_path)).polarity == 1


# ---------------------------------------------------------------------------- top_k
NAN = float("nan")


def reference_top_k(score, k, proponents=True, test_ids=None):
    """A stable Python sort of each full ``agnostic_matrix()`` column, NaN last."""
    ids, matrix = score.agnostic_matrix()
    sign = score.polarity if proponents else -score.polarity
    result = {}
    for name in score.test_ids if test_ids is None else test_ids:
        column = matrix[:, score.test_ids.index(name)].tolist()

        def key(row, column=column):
            value = column[row]
            return (True, 0.0) if math.isnan(value) else (False, -sign * value)

        order = sorted(range(len(ids)), key=key)  # sorted() is stable
        result[name] = [(ids[row], column[row]) for row in order[:k]]
    return result


def assert_same_ranking(got, expected):
    """Equal ids in equal order, equal scores (NaN equals NaN)."""
    assert list(got) == list(expected)
    for name in expected:
        assert [h for h, _ in got[name]] == [h for h, _ in expected[name]], name
        for (_, a), (_, b) in zip(got[name], expected[name]):
            assert type(a) is float
            assert (math.isnan(a) and math.isnan(b)) or a == b, (name, got, expected)


def make_ranking_score(polarity: int, token: bool) -> AttributionScore:
    """Samples at several steps (and positions), with ties, -0.0 / 0.0 and NaN after summing.

    Summed per sample (exact in float32) the columns are
      x: a=3, b=3, c=-1, d=3, e=0, f=-0.0 -> ties among a, b, d and between e, f;
      y: a=NaN, b=1, c=2, d=-5, e=2, f=NaN;
      z: every sample 0 (all tied).
    """
    rows = [  # (train id, step, position, x, y, z)
        ("a", 0, 0, 1.0, 1.0, 0.0),
        ("b", 0, 0, 3.0, 1.0, 0.0),
        ("c", 0, 0, -1.0, 2.0, 0.0),
        ("a", 1, 0, 2.0, NAN, 0.0),
        ("d", 1, 0, 4.0, -5.0, 0.0),
        ("e", 1, 0, 0.0, 0.5, 0.0),
        ("f", 2, 0, -0.0, NAN, 0.0),
        ("e", 2, 0, 0.0, 1.5, 0.0),
        ("d", 2, 0, -1.0, 0.0, 0.0),
    ]
    if token:  # split every row over two token positions: halves sum back exactly
        rows = [
            (h, step, pos, x / 2, y / 2, z / 2) for h, step, _, x, y, z in rows for pos in (0, 1)
        ]
    return AttributionScore(
        scores=torch.tensor([r[3:] for r in rows], dtype=torch.float32),
        row_train_ids=[r[0] for r in rows],
        row_steps=[r[1] for r in rows],
        test_ids=["x", "y", "z"],
        algorithm="AdamWInfluence" if polarity == -1 else "TracIn",
        algorithm_meta={},
        layer_name=None,
        row_token_ids=[r[2] for r in rows] if token else None,
        polarity=polarity,
    )


def test_top_k_by_hand():
    s = make_ranking_score(1, token=False)
    assert s.top_k(4) == {
        "x": [("a", 3.0), ("b", 3.0), ("d", 3.0), ("e", 0.0)],
        "y": [("c", 2.0), ("e", 2.0), ("b", 1.0), ("d", -5.0)],
        "z": [("a", 0.0), ("b", 0.0), ("c", 0.0), ("d", 0.0)],
    }
    assert s.top_k(2, proponents=False, test_ids=["x"]) == {"x": [("c", -1.0), ("e", 0.0)]}
    opponents_y = s.top_k(6, proponents=False, test_ids=["y"])["y"]
    assert [h for h, _ in opponents_y] == ["d", "b", "c", "e", "a", "f"]  # NaN last
    assert all(math.isnan(v) for _, v in opponents_y[4:])


def test_top_k_with_negative_polarity_puts_the_most_negative_first():
    s = make_ranking_score(-1, token=False)
    # helpful = most negative; scores come back as stored, not sign-flipped
    assert s.top_k(2, test_ids=["x", "y"]) == {
        "x": [("c", -1.0), ("e", 0.0)],
        "y": [("d", -5.0), ("b", 1.0)],
    }
    assert s.top_k(3, proponents=False, test_ids=["x"]) == {
        "x": [("a", 3.0), ("b", 3.0), ("d", 3.0)]
    }
    opponents_y = s.top_k(6, proponents=False, test_ids=["y"])["y"]
    assert [h for h, _ in opponents_y] == ["c", "e", "b", "d", "a", "f"]  # NaN last


@pytest.mark.parametrize("token", [False, True], ids=["instance", "token"])
@pytest.mark.parametrize("polarity", [1, -1])
@pytest.mark.parametrize("proponents", [True, False], ids=["proponents", "opponents"])
def test_top_k_is_a_stable_sort_of_the_agnostic_columns(token, polarity, proponents):
    s = make_ranking_score(polarity, token)
    assert s.granularity == ("token" if token else "instance")
    for k in range(1, s.num_train + 3):
        got = s.top_k(k, proponents=proponents)
        assert_same_ranking(got, reference_top_k(s, k, proponents))
        assert all(len(pairs) == min(k, s.num_train) for pairs in got.values())
    subset = s.top_k(3, proponents=proponents, test_ids=["z", "x"])
    assert list(subset) == ["z", "x"]
    assert_same_ranking(subset, reference_top_k(s, 3, proponents, ["z", "x"]))


@pytest.mark.parametrize("seed", range(6))
def test_top_k_matches_a_stable_sort_on_random_scores_with_ties_and_nan(seed):
    gen = torch.Generator().manual_seed(seed)
    num_rows, num_test = 40, 4
    scores = torch.randint(-3, 4, (num_rows, num_test), generator=gen).float()
    scores[torch.rand(num_rows, num_test, generator=gen) < 0.05] = NAN
    row_ids = [f"s{int(i)}" for i in torch.randint(0, 12, (num_rows,), generator=gen)]
    tokens = torch.randint(0, 3, (num_rows,), generator=gen).tolist() if seed % 2 else None
    for polarity in (1, -1):
        s = AttributionScore(
            scores,
            row_ids,
            torch.randint(0, 4, (num_rows,), generator=gen).tolist(),
            [f"q{j}" for j in range(num_test)],
            "T",
            {},
            None,
            row_token_ids=tokens,
            polarity=polarity,
        )
        for proponents in (True, False):
            for k in (1, 3, s.num_train, s.num_train + 5):
                assert_same_ranking(
                    s.top_k(k, proponents=proponents), reference_top_k(s, k, proponents)
                )


def test_top_k_returns_every_sample_when_k_exceeds_num_train():
    s = make_instance_score()
    got = s.top_k(10)
    assert all(len(pairs) == s.num_train == 3 for pairs in got.values())
    assert got == {
        "x": [("c", 9.0), ("a", 6.0), ("b", 3.0)],
        "y": [("c", 10.0), ("a", 8.0), ("b", 4.0)],
        "z": [("c", 11.0), ("a", 10.0), ("b", 5.0)],
    }


def test_top_k_errors():
    s = make_instance_score()
    with pytest.raises(KeyError, match="nope"):
        s.top_k(1, test_ids=["x", "nope"])
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="k must be an int >= 1"):
            s.top_k(bad)
    with pytest.raises(TypeError, match="string"):
        s.top_k(1, test_ids="x")
    assert s.top_k(1, test_ids=[]) == {}


# ---------------------------------------------------------------------------- attributors
def test_attributors_declare_their_polarity():
    from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
    from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
    from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
    from dattri_llm.attribution.algorithm.less import LESSAttributor
    from dattri_llm.attribution.algorithm.lorif import LoRIFAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.base import BaseAttributor

    assert BaseAttributor.polarity == 1
    assert AdamWInfluenceAttributor.polarity == -1
    for cls in (TracInAttributor, KFACAttributor, EKFACAttributor, LESSAttributor,
                DVEmbAttributor, LoRIFAttributor):  # fmt: skip
        assert cls.polarity == 1, cls


def test_build_score_stamps_the_attributor_polarity(tmp_path):
    from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.arguments import AttributionArguments

    for cls, expected in ((AdamWInfluenceAttributor, -1), (TracInAttributor, 1)):
        out = tmp_path / cls.__name__
        attributor = cls(AttributionArguments(output_dir=str(out), use_cpu=True))
        score = attributor.build_score(torch.tensor([[-2.0], [1.0]]), ["a", "b"], [0, 0], ["q"])
        assert score.polarity == expected
        assert AttributionScore.load(out).polarity == expected  # build_score saved it
        assert score.top_k(1)["q"][0][0] == ("a" if expected == -1 else "b")


def test_cached_runs_carry_their_polarity(tmp_path):
    """A tiny AdamW run scored by AdamW-influence (-1) and by TracIn (+1) from its stores."""
    from torch import nn

    from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.task import AttributionTask

    def loss_fn(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Tanh(), nn.Linear(4, 2, bias=False))
    gen = torch.Generator().manual_seed(1)
    data = [
        {"x": torch.randn(3, generator=gen), "y": torch.randn(2, generator=gen)} for _ in "abcd"
    ]
    train, test = data, data[:2]  # two AdamW steps of two samples
    args = AttributionArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=2
    )
    adamw = AdamWInfluenceAttributor(args, task=AttributionTask(loss_fn, model))
    ((train_dir, test_dir),) = adamw.cache(train, test, cache_dir=str(tmp_path / "cache"))
    scores = {
        -1: adamw.attribute_from_cache(train_dir, test_dir, loss_reduction="sum"),
        1: TracInAttributor(args).attribute_from_cache(train_dir, test_dir),
    }
    for polarity, score in scores.items():
        assert score.polarity == polarity
        assert sorted(set(score.row_steps)) == [0, 1] and score.num_test == 2
        assert_same_ranking(score.top_k(2), reference_top_k(score, 2))

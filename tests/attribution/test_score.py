from __future__ import annotations

import json
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

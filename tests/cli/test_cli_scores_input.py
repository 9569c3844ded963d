"""``top-k --scores`` / ``report --scores``: rank an ``attribute`` run's saved score.

Live STRIDE and Grad-Dot runs of the tiny GPT-2 on the shared 8-sample corpus
(STRIDE fits 2 steps over 6 subsets), then the two commands on their output.
"""

from __future__ import annotations

import json

import pytest
import yaml
from cli_helpers import QUERIES, TRAIN, fails, nothing_written, write_jsonl, write_model

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main

STRIDE = ["--stride_rank", "2", "--stride_num_subsets", "6",
          "--stride_subsets_per_example", "2", "--stride_steps", "2"]  # fmt: skip
K = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"stride", "graddot"}``: the output directories of two live attribute runs."""
    root = tmp_path_factory.mktemp("scores_input")
    model = write_model(root / "model")
    train = write_jsonl(root / "train.jsonl", [{"text": t} for t in TRAIN])
    query = write_jsonl(root / "query.jsonl", [{"text": t} for t in QUERIES])
    out = {}
    for method, extra in (("stride", STRIDE), ("graddot", [])):
        out[method] = root / method
        argv = ["attribute", "--model", str(model), "--train_data", str(train),
                "--query_data", str(query), "--method", method, *extra, "--use_cpu", "--quiet",
                "--output_dir", str(out[method])]  # fmt: skip
        assert main(argv) == 0
    return out


def top_k_json(scores, out, *extra):
    argv = ["top-k", "--scores", str(scores), "--k", str(K), "--format", "json",
            "--quiet", "--output_dir", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "top_k.json").read_text())


@pytest.mark.parametrize("method", ["stride", "graddot"])
def test_top_k_of_saved_scores_equals_the_library(runs, tmp_path, capsys, method):
    score = AttributionScore.load(runs[method])
    for opponents in (False, True):
        out = tmp_path / f"top_{opponents}"
        result = top_k_json(runs[method], out, *(["--opponents"] if opponents else []))
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "top_k.json", "top_k.txt"]
        # The run records the ranked run's method, not the --method default (graddot).
        assert yaml.safe_load((out / "config.yaml").read_text())["method"] == method
        expected = score.top_k(K, proponents=not opponents)
        assert result["algorithm"] == score.algorithm and result["polarity"] == score.polarity
        assert result["proponents"] is (not opponents) and result["k"] == K
        got = {q["id"]: [(r["train_id"], r["score"]) for r in q["top"]] for q in result["queries"]}
        assert got == {q: [(t, pytest.approx(v)) for t, v in rows] for q, rows in expected.items()}
        # The texts are the corpus's, named by the score's ids.
        assert [q["text"] for q in result["queries"]] == QUERIES
        assert all(r["text"] in TRAIN for q in result["queries"] for r in q["top"])
    text = (out / "top_k.txt").read_text()
    assert f"{score.algorithm}: top {K} opponents per query" in text
    capsys.readouterr()


def test_report_of_saved_stride_scores(runs, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["report", "--scores", str(runs["stride"]), "--k", str(K), "--quiet",
            "--output_dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "tokens unshaded" in printed and "Tokens are unshaded" in printed
    page = (out / "report.html").read_text()
    assert "No token-level scores were given: the tokens are shown unshaded." in page
    assert "Tokens are unshaded: ranked from an attribute run&#x27;s saved STRIDE score" in page
    # The page names every query and the tokens of each query's top samples.
    table = top_k_json(runs["stride"], tmp_path / "t")["queries"]
    text_of = {row["train_id"]: row["text"] for query in table for row in query["top"]}
    query_of = {query["id"]: query["text"] for query in table}
    for query_id, rows in AttributionScore.load(runs["stride"]).top_k(K).items():
        assert query_of[query_id] in page
        for train_id, _ in rows:
            assert all(f">{word}<" in page for word in text_of[train_id].split())
    # --format json also writes the table, the same as top-k's.
    again = tmp_path / "report_json"
    assert main([*argv[:-1], str(again), "--format", "json"]) == 0
    table = json.loads((again / "top_k.json").read_text())
    assert table == top_k_json(runs["stride"], tmp_path / "t2")


def test_scores_source_errors(runs, tmp_path, capsys):
    out = tmp_path / "out"
    for command in ("top-k", "report"):
        both = [command, "--scores", str(runs["graddot"]), "--store", str(runs["graddot"]),
                "--output_dir", str(out), "--quiet"]  # fmt: skip
        assert "give one of them" in fails(both, capsys)
        neither = [command, "--output_dir", str(out), "--quiet"]
        assert "give --store" in fails(neither, capsys)
        missing = [command, "--scores", str(tmp_path / "absent"), "--output_dir", str(out)]
        err = fails(missing, capsys)
        assert "--scores" in err and "not found" in err
        not_attribute = [command, "--scores", str(runs["graddot"].parent / "model"),
                         "--output_dir", str(out)]  # fmt: skip
        assert "not the output directory of `dattri-llm attribute`" in fails(not_attribute, capsys)
        stride_store = [command, "--store", str(tmp_path), "--method", "stride",
                        "--output_dir", str(out)]  # fmt: skip
        assert f"dattri-llm {command} --scores" in fails(stride_store, capsys)
    index = ["top-k", "--scores", str(runs["graddot"]), "--index", "flat", "--output_dir", str(out)]
    assert "--index" in fails(index, capsys)
    nothing_written(out)


def test_scores_of_a_capture_run_match_top_k_of_its_store(workspace, tmp_path, capsys):
    """An attribute run from a capture: its texts come from the capture's samples."""
    scored = tmp_path / "attributed"
    store = ["--store", str(workspace["capture"]), "--quiet"]
    assert main(["attribute", *store, "--output_dir", str(scored)]) == 0
    from_scores = top_k_json(scored, tmp_path / "from_scores")
    out = tmp_path / "from_store"
    argv = ["top-k", *store, "--k", str(K), "--format", "json", "--output_dir", str(out)]
    assert main(argv) == 0
    from_store = json.loads((out / "top_k.json").read_text())
    ids = [[(r["train_id"], r["text"]) for r in q["top"]] for q in from_store["queries"]]
    assert [[(r["train_id"], r["text"]) for r in q["top"]] for q in from_scores["queries"]] == ids
    assert [q["text"] for q in from_scores["queries"]] == QUERIES
    capsys.readouterr()

"""capture --train --less and --method less in attribute / top-k / report; the refusals.

The shared tiny GPT-2 trains one AdamW epoch over the 8 training samples in
batches of 4 (2 steps) while LESS's preconditioned gradients are recorded.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from cli_helpers import QUERIES, TRAIN, capture_argv, fails, nothing_written

from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main

LESS_TRAINING = ["--train", "--less", "--learning_rate", "0.001"]


@pytest.fixture(scope="module")
def less_run(workspace):
    """A ``capture --train --less`` of the shared corpus (2 AdamW steps)."""
    out = workspace["root"] / "less"
    if not out.exists():
        assert main(capture_argv(workspace, out, *LESS_TRAINING)) == 0
    return out


def stores(capture):
    return str(capture / "ckpt_0" / "train_grads"), str(capture / "ckpt_0" / "test_grads")


def library_score(capture, tmp_path):
    """The library's own LESS scoring of the recorded run (weights from training_dynamics.json)."""
    args = AttributionArguments(output_dir=str(tmp_path / "lib"), use_cpu=True)
    return LESSAttributor(args).attribute_from_cache(*stores(capture))


def test_capture_records_less_run(less_run):
    config = yaml.safe_load((less_run / "config.yaml").read_text())
    assert config["train"] is True and config["less"] is True
    train_dir = less_run / "ckpt_0" / "train_grads"
    for name in ("index.jsonl", "lr_schedule.json", "training_dynamics.json"):
        assert (train_dir / name).is_file(), name
    assert json.loads((train_dir / "lr_schedule.json").read_text()).keys() == {"0", "1"}
    assert (less_run / "ckpt_0" / "test_grads" / "index.jsonl").is_file()


def test_attribute_equals_the_library_and_top_k_its_ranking(less_run, tmp_path, capsys):
    out = tmp_path / "score"
    argv = ["attribute", "--store", str(less_run), "--method", "less", "--output_dir", str(out)]
    assert main([*argv, "--use_cpu", "--quiet"]) == 0
    score = AttributionScore.load(out)
    expected = library_score(less_run, tmp_path)
    assert score.algorithm == "LESS" and expected.algorithm_meta["weights_from"] == (
        "training_dynamics"
    )
    assert score.scores.shape[:2] == (len(TRAIN), len(QUERIES))  # one epoch: one row each
    assert score.row_train_ids == expected.row_train_ids and score.test_ids == expected.test_ids
    assert score.row_steps == expected.row_steps
    assert torch.equal(score.scores, expected.scores)  # the same call on the same stores
    assert torch.isfinite(score.scores).all() and score.scores.abs().sum() > 0
    capsys.readouterr()
    common = ["--store", str(less_run), "--method", "less", "--k", "3", "--use_cpu", "--quiet"]
    for proponents in (True, False):
        flags = [] if proponents else ["--opponents"]
        out = tmp_path / f"j{proponents}"
        assert main(["top-k", *common, *flags, "--format", "json", "--output_dir", str(out)]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["algorithm"] == "LESS" and printed["polarity"] == 1
        full = expected.top_k(3, proponents=proponents)
        assert [q["id"] for q in printed["queries"]] == list(full)
        for query in printed["queries"]:
            assert [r["train_id"] for r in query["top"]] == [t for t, _ in full[query["id"]]]
            # the same float64 values through JSON
            assert [r["score"] for r in query["top"]] == [v for _, v in full[query["id"]]]


def test_report_of_less_is_unshaded(less_run, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["report", "--store", str(less_run), "--method", "less", "--k", "2"]
    assert main([*argv, "--use_cpu", "--quiet", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "LESS: top 2" in printed
    assert "tokens unshaded" in printed and "no token-level scores" in printed
    assert TRAIN[0].split()[1] in (out / "report.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("command", ["attribute", "top-k", "report"])
def test_less_refuses_a_capture_without_its_run(workspace, tmp_path, capsys, command):
    out = tmp_path / "out"
    argv = [command, "--store", str(workspace["capture"]), "--method", "less",
            "--output_dir", str(out), "--quiet"]  # fmt: skip
    err = fails(argv, capsys)
    assert "frozen capture" in err and "capture --train --less" in err
    nothing_written(out)


def test_other_methods_refuse_a_less_capture(less_run, tmp_path, capsys):
    out = tmp_path / "out"
    for method in ("graddot", "dvemb"):
        argv = ["attribute", "--store", str(less_run), "--method", method,
                "--output_dir", str(out), "--quiet"]  # fmt: skip
        assert "serves only --method less" in fails(argv, capsys)
    nothing_written(out)


def test_less_capture_and_live_refusals(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    assert "needs --train" in fails(capture_argv(workspace, out, "--less"), capsys, code=2)
    argv = capture_argv(workspace, out, "--train", "--less", "--optim", "sgd")
    assert "use --optim adamw_torch" in fails(argv, capsys)
    live = ["attribute", *capture_argv(workspace, out, "--method", "less")[1:]]
    assert "capture --train --less" in fails(live, capsys)
    nothing_written(out)

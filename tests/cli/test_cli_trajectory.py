"""capture --train and the trajectory methods; live attribute; their refusals.

The shared tiny GPT-2 trains one epoch over the 8 training samples in batches
of 4 (2 AdamW steps) while the run is recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import QUERIES, TRAIN, capture_argv, fails, nothing_written
from transformers import AutoModelForCausalLM

from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main
from dattri_llm.cli.methods import TRAJECTORY_KEYWORDS

CLASSES = {
    "trajectory_tracin": TrajectoryTracInAttributor,
    "dvemb": DVEmbAttributor,
    "adamw_influence": AdamWInfluenceAttributor,
}
ALGORITHMS = {
    "trajectory_tracin": "TrajectoryTracIn",
    "dvemb": "DVEmb",
    "adamw_influence": "AdamWInfluence",
}
TRAINING = ["--train", "--learning_rate", "0.001", "--save_model"]


@pytest.fixture(scope="module")
def trained(workspace):
    """A ``capture --train`` of the shared corpus (2 steps), its trained model saved."""
    out = workspace["root"] / "trained"
    if not out.exists():
        assert main(capture_argv(workspace, out, *TRAINING)) == 0
    return out


def stores(capture):
    return str(capture / "ckpt_0" / "train_grads"), str(capture / "ckpt_0" / "test_grads")


def attribute(store, out, method, *extra):
    argv = ["attribute", "--store", str(store), "--method", method, "--output_dir", str(out)]
    assert main([*argv, "--use_cpu", "--quiet", *extra]) == 0
    return AttributionScore.load(out)


def library_score(capture, method, tmp_path):
    args = AttributionArguments(output_dir=str(tmp_path / "lib"), use_cpu=True)
    attributor = CLASSES[method](args)
    return attributor.attribute_from_cache(*stores(capture), **TRAJECTORY_KEYWORDS[method])


def test_capture_train_records_the_run(workspace, trained):
    config = yaml.safe_load((trained / "config.yaml").read_text())
    assert config["command"] == "capture" and config["train"] is True
    train_dir = trained / "ckpt_0" / "train_grads"
    for name in ("index.jsonl", "lr_schedule.json", "training_dynamics.json", "adamw_dynamics.pt"):
        assert (train_dir / name).is_file(), name
    assert json.loads((train_dir / "lr_schedule.json").read_text()).keys() == {"0", "1"}
    # the samples files and store layout are a frozen capture's
    for name in ("train_samples.jsonl", "query_samples.jsonl"):
        assert (trained / name).read_text() == (workspace["capture"] / name).read_text()
    # the trained weights moved away from the model's
    before = AutoModelForCausalLM.from_pretrained(workspace["model"]).state_dict()
    after = AutoModelForCausalLM.from_pretrained(trained / "trained_model").state_dict()
    assert not torch.equal(before["transformer.h.0.mlp.c_fc.weight"],
                           after["transformer.h.0.mlp.c_fc.weight"])  # fmt: skip


@pytest.mark.parametrize("method", list(CLASSES))
def test_attribute_equals_the_library_and_top_k_its_ranking(trained, tmp_path, capsys, method):
    score = attribute(trained, tmp_path / "score", method)
    expected = library_score(trained, method, tmp_path)
    assert score.algorithm == ALGORITHMS[method]
    assert score.scores.shape[:2] == (len(TRAIN), len(QUERIES))  # one epoch: one row each
    assert score.row_train_ids == expected.row_train_ids and score.test_ids == expected.test_ids
    assert torch.equal(score.scores, expected.scores)
    assert score.polarity == (-1 if method == "adamw_influence" else 1)
    capsys.readouterr()
    common = ["--store", str(trained), "--method", method, "--k", "3", "--use_cpu", "--quiet"]
    assert main(["top-k", *common, "--format", "json", "--output_dir", str(tmp_path / "j")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["polarity"] == score.polarity
    full = expected.top_k(3)
    for query in printed["queries"]:
        assert [r["train_id"] for r in query["top"]] == [t for t, _ in full[query["id"]]]
        values = [r["score"] for r in query["top"]]
        assert values == pytest.approx([v for _, v in full[query["id"]]], rel=1e-6)
        # helpful first: AdamW-influence's most negative score leads
        column = score.scores[:, score.test_ids.index(query["id"])]
        best = column.min() if method == "adamw_influence" else column.max()
        assert values[0] == pytest.approx(float(best), rel=1e-6)
    assert main(["top-k", *common, "--output_dir", str(tmp_path / "t")]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert ("more negative score is more helpful" in header) == (method == "adamw_influence")


def test_report_of_a_trajectory_method_is_unshaded(trained, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["report", "--store", str(trained), "--method", "adamw_influence", "--k", "2"]
    assert main([*argv, "--use_cpu", "--quiet", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokens unshaded" in printed and "no token-level scores" in printed
    assert TRAIN[0].split()[1] in (out / "report.html").read_text(encoding="utf-8")


def test_inner_product_methods_score_a_trained_capture(trained, tmp_path):
    score = attribute(trained, tmp_path / "gd", "graddot")
    assert score.scores.shape[:2] == (len(TRAIN), len(QUERIES))
    assert torch.isfinite(score.scores).all()


@pytest.mark.parametrize("command", ["attribute", "top-k", "report"])
def test_trajectory_methods_refuse_a_frozen_capture(workspace, tmp_path, capsys, command):
    out = tmp_path / "out"
    argv = [command, "--store", str(workspace["capture"]), "--method", "dvemb",
            "--output_dir", str(out), "--quiet"]  # fmt: skip
    err = fails(argv, capsys)
    assert "frozen capture" in err and "capture --train" in err
    nothing_written(out)


def live_argv(workspace, out, *extra):
    argv = capture_argv(workspace, out, *extra)
    return ["attribute", *argv[1:]]


@pytest.mark.parametrize("method", ["graddot", "kfac"])
def test_live_attribute_equals_capture_and_attribute(workspace, tmp_path, method):
    out = tmp_path / "live"
    assert main(live_argv(workspace, out, "--method", method)) == 0
    live = AttributionScore.load(out)
    stored = attribute(workspace["capture"], tmp_path / "stored", method)
    assert live.row_train_ids == stored.row_train_ids and live.test_ids == stored.test_ids
    assert torch.allclose(live.scores, stored.scores, rtol=1e-5, atol=0)
    assert not (out / "ckpt_0").exists()  # no store written
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["store"] is None and config["model"] == str(workspace["model"])


def test_live_attribute_bad_combinations(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    both = [*live_argv(workspace, out), "--store", str(workspace["capture"])]
    assert "give one of them" in fails(both, capsys)
    neither = ["attribute", "--output_dir", str(out), "--quiet"]
    assert "give --store" in fails(neither, capsys)
    partial = live_argv(workspace, out)
    del partial[partial.index("--query_data") : partial.index("--query_data") + 2]
    assert "also needs --query_data" in fails(partial, capsys)
    for method in ("dvemb", "lorif"):
        err = fails(live_argv(workspace, out, "--method", method), capsys)
        assert "live attribute serves" in err
    assert "capture --train" in fails(live_argv(workspace, out, "--method", "dvemb"), capsys)
    assert "needs --train" in fails(capture_argv(workspace, out, "--save_model"), capsys, code=2)
    nothing_written(out)


def test_trained_capture_replays_bit_for_bit(trained, tmp_path):
    again = tmp_path / "again"
    assert main(["capture", "--config", str(trained / "config.yaml"), "--quiet",
                 "--output_dir", str(again)]) == 0  # fmt: skip
    for first, second in zip(stores(trained), stores(again)):
        names = sorted(p.relative_to(first).as_posix() for p in Path(first).rglob("*"))
        assert names == sorted(p.relative_to(second).as_posix() for p in Path(second).rglob("*"))
        for name in names:
            a, b = Path(first) / name, Path(second) / name
            if a.is_file():
                assert a.read_bytes() == b.read_bytes(), name
    weights = [AutoModelForCausalLM.from_pretrained(c / "trained_model").state_dict()
               for c in (trained, again)]  # fmt: skip
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_sgd_run_serves_tracin_and_dvemb_not_adamw_influence(workspace, tmp_path, capsys):
    out = tmp_path / "sgd"
    assert main(capture_argv(workspace, out, "--train", "--optim", "sgd")) == 0
    assert not (out / "ckpt_0" / "train_grads" / "adamw_dynamics.pt").exists()
    for method in ("trajectory_tracin", "dvemb"):
        expected = library_score(out, method, tmp_path)
        assert torch.equal(attribute(out, tmp_path / method, method).scores, expected.scores)
    capsys.readouterr()  # the sweeps' warnings
    argv = ["attribute", "--store", str(out), "--method", "adamw_influence",
            "--output_dir", str(tmp_path / "a"), "--quiet"]  # fmt: skip
    assert "needs an AdamW run" in fails(argv, capsys)
    argv = capture_argv(workspace, tmp_path / "r", "--train", "--recompute_gradients")
    assert "drop --recompute_gradients" in fails(argv, capsys)

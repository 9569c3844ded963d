"""``attribute --method stride``: live only, its options, and the commands that refuse it.

A tiny GPT-2 and the shared 8-sample corpus; the fit runs 2 steps over 6
subsets (each sample in 2), so a run takes a few seconds on a CPU.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from cli_helpers import QUERIES, TRAIN, fails, nothing_written, write_jsonl, write_model

from dattri_llm.attribution.algorithm.stride import StrideAttributor, StrideConfig
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main
from dattri_llm.cli.arguments import DataArguments, ModelArguments
from dattri_llm.cli.data import load_records, tokenize
from dattri_llm.cli.model import causal_lm_loss, load_model
from dattri_llm.task import AttributionTask

# Small enough to run in seconds; the same settings as the library run below.
OPTIONS = {"rank": 2, "num_subsets": 6, "subsets_per_example": 2, "steps": 2}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{"model", "train", "query"}``: the tiny model and the corpus on disk."""
    root = tmp_path_factory.mktemp("stride_cli")
    return {
        "model": write_model(root / "model"),
        "train": write_jsonl(root / "train.jsonl", [{"text": t} for t in TRAIN]),
        "query": write_jsonl(root / "query.jsonl", [{"text": t} for t in QUERIES]),
    }


def stride_argv(files, out, *extra, command="attribute", options=OPTIONS):
    """A live STRIDE run of the corpus into ``out`` (``options``: the --stride_* flags)."""
    flags = [item for name, value in options.items() for item in (f"--stride_{name}", str(value))]
    return [
        command,
        "--model", str(files["model"]),
        "--train_data", str(files["train"]),
        "--query_data", str(files["query"]),
        "--method", "stride",
        *flags,
        "--use_cpu",
        "--quiet",
        "--output_dir", str(out),
        *extra,
    ]  # fmt: skip


def test_live_stride_writes_the_library_score(files, tmp_path):
    out = tmp_path / "scores"
    assert main(stride_argv(files, out)) == 0
    score = AttributionScore.load(out)
    assert score.algorithm == "STRIDE" and score.polarity == 1
    assert score.scores.shape == (len(TRAIN), len(QUERIES))
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metadata.json", "scores.pt"]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["method"] == "stride" and config["stride_rank"] == 2 and config["store"] is None

    # The same numbers and ids as the library on the same tokenized samples; rows
    # and queries named as the command line names samples (their model inputs).
    model, tokenizer = load_model(ModelArguments(model=str(files["model"])), quiet=True)
    data = DataArguments(train_data=str(files["train"]), query_data=str(files["query"]))
    sets = {
        side: tokenize(load_records(str(files[side])), tokenizer, data, side)
        for side in ("train", "query")
    }
    attributor = StrideAttributor(
        AttributionArguments(output_dir=str(tmp_path / "lib"), use_cpu=True),
        task=AttributionTask(loss_func=causal_lm_loss, model=model),
        config=StrideConfig(**OPTIONS),
    )
    expected = attributor.attribute(sets["train"].samples, sets["query"].samples)
    assert torch.equal(score.scores, expected.scores)
    assert score.row_train_ids == sets["train"].ids and score.test_ids == sets["query"].ids
    # The library itself names them so (the command line swaps nothing).
    assert expected.row_train_ids == sets["train"].ids and expected.test_ids == sets["query"].ids
    assert score.algorithm_meta == expected.algorithm_meta

    # A replay of the run's config gives the same score.
    again = tmp_path / "again"
    replay = ["attribute", "--config", str(out / "config.yaml"), "--quiet"]
    assert main([*replay, "--output_dir", str(again)]) == 0
    assert torch.equal(AttributionScore.load(again).scores, score.scores)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 0}, "--stride_rank must be >= 1"),
        ({"injection": "middle"}, "--stride_injection must be one of"),
        ({"num_subsets": 2, "subsets_per_example": 3}, "--stride_subsets_per_example (d=3)"),
        ({"lasso_lambda": 1.0}, "--stride_lasso_lambda"),
        ({"steps": -1}, "--stride_steps must be >= 1"),
    ],
)
def test_bad_stride_options_are_usage_errors(files, tmp_path, capsys, options, message):
    out = tmp_path / "out"
    assert message in fails(stride_argv(files, out, options=options), capsys, code=2)
    nothing_written(out)


def test_stride_options_need_method_stride(files, tmp_path, capsys):
    out = tmp_path / "out"
    argv = stride_argv(files, out, "--method", "graddot", options={"rank": 4})
    assert "pass --method stride" in fails(argv, capsys, code=2)
    nothing_written(out)


def test_stride_refuses_a_store_and_gradient_options(files, tmp_path, capsys):
    out = tmp_path / "out"
    store = ["attribute", "--store", str(tmp_path), "--method", "stride",
             "--output_dir", str(out), "--quiet"]  # fmt: skip
    err = fails(store, capsys)
    assert "stride reads no gradient store" in err and "drop --store" in err
    err = fails(stride_argv(files, out, "--linear_io", "all", "--proj_dim", "4"), capsys)
    assert "drop --linear_io, --proj_dim" in err and "--stride_layer" in err
    assert "drop --fit" in fails(stride_argv(files, out, "--fit", str(tmp_path)), capsys)
    nothing_written(out)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("top-k", "`dattri-llm top-k --scores <its output_dir>`"),
        ("report", "`dattri-llm report --scores <its output_dir>`"),
        ("fit", "`dattri-llm fit` persists the fits of kfac, ekfac, lorif only"),
    ],
)
def test_store_commands_refuse_stride(tmp_path, capsys, command, message):
    out = tmp_path / "out"
    argv = [command, "--store", str(tmp_path), "--method", "stride",
            "--output_dir", str(out), "--quiet"]  # fmt: skip
    err = fails(argv, capsys)
    assert "stride" in err and message in err
    nothing_written(out)


def test_plan_refuses_stride(files, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["plan", "--model", str(files["model"]), "--config_only", "--num_train", "8",
            "--num_test", "2", "--seq_len", "16", "--method", "stride",
            "--output_dir", str(out), "--quiet"]  # fmt: skip
    assert "stride captures no gradients" in fails(argv, capsys)
    nothing_written(out)

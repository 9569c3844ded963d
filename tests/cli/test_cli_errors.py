"""Bad invocations: non-zero exit, one clear line on stderr, no finished-looking output."""

from __future__ import annotations

import importlib
import shutil

import pytest
from cli_helpers import capture_argv, fails, nothing_written

from dattri_llm.cli import main
from dattri_llm.cli.errors import CLIError


def test_bad_flag(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    err = fails(capture_argv(workspace, out, "--no_such_flag", "1"), capsys, code=2)
    assert err.startswith("dattri-llm capture: error:") and "--no_such_flag" in err
    nothing_written(out)


def test_bad_value_and_unknown_method(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    store = ["--store", str(workspace["capture"]), "--output_dir", str(out)]
    assert "--k must be >= 1" in fails(["top-k", *store, "--k", "0"], capsys, code=2)
    assert "unknown --method 'pagerank'" in fails(
        ["attribute", *store, "--method", "pagerank"], capsys, code=2
    )
    assert "invalid int value" in fails(["top-k", *store, "--k", "many"], capsys, code=2)
    nothing_written(out)


def test_traceback_on_request(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("DATTRI_LLM_TRACEBACK", "1")
    store = ["--store", str(workspace["capture"]), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(CLIError, match="unknown --method .pagerank."):
        main(["attribute", *store, "--method", "pagerank"])


def test_unknown_command(capsys):
    assert "unknown command 'train'" in fails(["train"], capsys, code=2)


def test_missing_data_file(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    argv = capture_argv(workspace, out)
    argv[argv.index("--train_data") + 1] = str(tmp_path / "absent.jsonl")
    assert "absent.jsonl not found" in fails(argv, capsys)
    nothing_written(out)


def test_missing_config_file(tmp_path, capsys):
    err = fails(["attribute", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert "nope.yaml not found" in err


def test_config_of_another_command(workspace, tmp_path, capsys):
    config = str(workspace["capture"] / "config.yaml")
    err = fails(["attribute", "--config", config, "--output_dir", str(tmp_path / "o")], capsys)
    assert "written by `capture`, not `attribute`" in err


def test_attribute_on_a_directory_that_is_not_a_capture(workspace, tmp_path, capsys):
    out, not_a_store = tmp_path / "out", tmp_path / "plain"
    not_a_store.mkdir()
    (not_a_store / "notes.txt").write_text("hello")
    err = fails(["attribute", "--store", str(not_a_store), "--output_dir", str(out)], capsys)
    assert "is not the output directory of `dattri-llm capture`" in err
    nothing_written(out)
    err = fails(["top-k", "--store", str(tmp_path / "absent"), "--output_dir", str(out)], capsys)
    assert "--store" in err and "not found" in err
    nothing_written(out)


def test_store_that_does_not_fit_the_method(workspace, tmp_path, capsys):
    """A method option the library refuses, and a capture whose store is gone: one line each."""
    out = tmp_path / "out"
    argv = ["attribute", "--store", str(workspace["capture"]), "--output_dir", str(out)]
    err = fails([*argv, "--method", "lorif", "--lorif_rank", "0"], capsys)
    assert err.startswith("dattri-llm attribute: error: ValueError: LoRIFAttributor: rank")
    nothing_written(out)
    broken = tmp_path / "broken"
    shutil.copytree(workspace["capture"], broken)
    shutil.rmtree(broken / "ckpt_0" / "train_grads")
    err = fails(["top-k", "--store", str(broken), "--output_dir", str(out)], capsys)
    assert "train_grads is missing or empty" in err
    nothing_written(out)


def test_layer_pattern_that_matches_nothing(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    argv = capture_argv(workspace, out)
    argv[argv.index("--linear_io") + 1] = r"^no\.such\.layer$"
    err = fails(argv, capsys)
    assert "matches no linear_io-capable layer" in err
    nothing_written(out)


def test_finished_output_dir_is_refused_unless_overwrite(workspace, tmp_path, capsys):
    out = tmp_path / "scores"
    argv = ["attribute", "--store", str(workspace["capture"]), "--output_dir", str(out), "--quiet"]
    assert main(argv) == 0
    stamp = (out / "scores.pt").stat().st_mtime_ns
    assert "already holds a finished run" in fails(argv, capsys)
    assert (out / "scores.pt").stat().st_mtime_ns == stamp
    assert main([*argv, "--overwrite", "--method", "gradcos"]) == 0
    assert "GradCos" in (out / "metadata.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores"]  # no staging left


def test_failure_during_a_run_leaves_no_output(workspace, tmp_path, capsys, monkeypatch):
    cli_main = importlib.import_module("dattri_llm.cli.main")  # the module, not the function

    def broken(staging, *args, **kwargs):
        (staging / "scores.pt").write_text("half")
        raise ValueError("disk full")

    monkeypatch.setattr(cli_main, "run_attribute", broken)
    out = tmp_path / "out"
    err = fails(["attribute", "--store", str(workspace["capture"]), "--output_dir", str(out)],
                capsys)  # fmt: skip
    assert "disk full" in err
    nothing_written(out)

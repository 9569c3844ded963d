"""plan, the preflight of capture / attribute / fit, fit reuse and the token report."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import transformers
from cli_helpers import QUERIES, TRAIN, capture_argv, fails, nothing_written

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main
from dattri_llm.gradient.storage_manager import GradientStorageManager

plan_module = importlib.import_module("dattri_llm.cli.plan")


def plan_argv(workspace, out, *extra):
    return [
        "plan",
        "--model", str(workspace["model"]),
        "--train_data", str(workspace["train"]),
        "--query_data", str(workspace["query"]),
        "--linear_io", r"^transformer\.h\.",
        "--per_device_train_batch_size", "4",
        "--use_cpu",
        "--quiet",
        "--output_dir", str(out),
        *extra,
    ]  # fmt: skip


def store_bytes_per_record(store_dir):
    """``{layer: payload bytes per record}`` of the first group of a store."""
    with GradientStorageManager(str(store_dir)) as store:
        records = store.load_records(store.locations()[0])
    per_layer = {}
    for record in records:
        gradient = record.gradient
        batch = len(record.ids) if hasattr(record, "ids") else gradient.batch_size
        for name, value in gradient.data.items():
            per_layer[name] = value.nbytes // batch
    return per_layer


def test_plan_from_config_only_allocates_no_weights(workspace, tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the plan loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)
    out = tmp_path / "plan"
    assert main(plan_argv(workspace, out, "--config_only", "--format", "json")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "plan.json").read_text())
    assert (out / "plan.txt").read_text().startswith("graddot plan: 8 train x 2 test records")
    assert (out / "config.yaml").is_file()
    assert printed["num_train"] == len(TRAIN) and printed["num_test"] == len(QUERIES)
    # its per-layer bytes per record are what the capture stored
    stored = store_bytes_per_record(workspace["capture"] / "ckpt_0" / "train_grads")
    planned = {layer["name"]: layer["bytes_per_record"] for layer in printed["layers"]}
    assert planned == stored
    # and the capture's own plan (written beside its stores) says the same
    captured = json.loads((workspace["capture"] / "plan.json").read_text())
    assert {la["name"]: la["bytes_per_record"] for la in captured["layers"]} == stored


def test_plan_from_sizes_and_a_config_only_directory(workspace, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((workspace["model"] / "config.json").read_text())
    out = tmp_path / "plan"
    argv = ["plan", "--model", str(bare), "--num_train", "1000", "--num_test", "10",
            "--seq_len", "16", "--method", "kfac", "--output_dir", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("kfac plan: 1000 train x 10 test records, seq_len 16")
    assert "fit: covariances" in text and (out / "plan.json").is_file()
    # no data and no sizes: one line, nothing written
    out2 = tmp_path / "plan2"
    err = fails(["plan", "--model", str(bare), "--output_dir", str(out2)], capsys)
    assert "give --train_data or --num_train" in err
    nothing_written(out2)
    err = fails([*argv[:-3], "--probe", "--output_dir", str(out2)], capsys)
    assert "--probe needs the model's weights" in err
    nothing_written(out2)


@pytest.mark.parametrize(
    "method", ["lorif", "trak", "trackstar", "datainf", "influence", "metagradient"]
)
def test_a_graddot_planned_method_says_what_is_not_predicted(workspace, tmp_path, capsys, method):
    out = tmp_path / method
    argv = plan_argv(workspace, out, "--config_only", "--format", "json", "--method", method)
    assert main(argv) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(note.startswith(f"{method} is planned as graddot: ") for note in notes), notes


def test_plan_probe_estimates_time(workspace, tmp_path, capsys):
    out = tmp_path / "probed"
    assert main(plan_argv(workspace, out, "--probe", "--format", "json")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["seconds_per_record"] > 0 and printed["estimated_seconds"] > 0


@pytest.fixture
def no_room(monkeypatch):
    """Free disk and memory patched to 1 KiB."""
    monkeypatch.setattr(plan_module, "free_disk_bytes", lambda path: 1024)
    monkeypatch.setattr(plan_module, "free_memory_bytes", lambda device=None: 1024)


def test_capture_refuses_when_the_stores_do_not_fit(workspace, tmp_path, capsys, no_room):
    out = tmp_path / "cap"
    err = fails(capture_argv(workspace, out), capsys)
    assert "the train and query stores need" in err and "1.0 KiB is free on" in err
    assert str(out) in err and err.endswith("free space or pass --force")
    nothing_written(out)
    assert main(capture_argv(workspace, out, "--force")) == 0
    assert (out / "ckpt_0" / "train_grads" / "index.jsonl").is_file()


def test_attribute_and_fit_refuse_when_memory_is_short(workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan_module, "free_memory_bytes", lambda device=None: 1024)
    out = tmp_path / "scores"
    argv = ["attribute", "--store", str(workspace["capture"]), "--method", "kfac",
            "--use_cpu", "--quiet", "--output_dir", str(out)]  # fmt: skip
    err = fails(argv, capsys)
    assert "the kfac fit and scoring need" in err and "of memory but 1.0 KiB is free" in err
    nothing_written(out)
    fit_out = tmp_path / "fit"
    err = fails(["fit", *argv[1:-1], str(fit_out)], capsys)
    assert "the kfac fit need" in err and "pass --force" in err
    nothing_written(fit_out)
    assert main([*argv, "--force"]) == 0
    assert (out / "scores.pt").is_file() and (out / "plan.json").is_file()


def test_attribute_prints_its_plan_unless_quiet(workspace, tmp_path, capsys):
    out = tmp_path / "scores"
    argv = [
        "attribute",
        "--store",
        str(workspace["capture"]),
        "--use_cpu",
        "--output_dir",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("graddot plan: 8 train x 2 test records")
    assert (out / "plan.txt").read_text().strip() in printed


@pytest.mark.parametrize(("method", "extra"), [("kfac", ["--damping", "0.01"]), ("ekfac", []),
                                               ("lorif", ["--lorif_svd_rank", "2"])])  # fmt: skip
def test_fit_reuse_gives_the_same_scores_bit_for_bit(workspace, tmp_path, method, extra):
    store = ["--store", str(workspace["capture"]), "--method", method, "--use_cpu", "--quiet"]
    assert main(["fit", *store, *extra, "--output_dir", str(tmp_path / "fit")]) == 0
    fitted = tmp_path / "fit"
    assert (fitted / ("lorif_fit.pt" if method == "lorif" else "fisher_factors.pt")).is_file()
    assert main(["attribute", *store, *extra, "--output_dir", str(tmp_path / "a")]) == 0
    assert main(["attribute", *store, *extra, "--fit", str(fitted),
                 "--output_dir", str(tmp_path / "b")]) == 0  # fmt: skip
    plain = AttributionScore.load(tmp_path / "a")
    reused = AttributionScore.load(tmp_path / "b")
    assert torch.equal(plain.scores, reused.scores)
    assert plain.train_ids == reused.train_ids and plain.test_ids == reused.test_ids


def test_bad_fit_invocations(workspace, tmp_path, capsys):
    store = ["--store", str(workspace["capture"]), "--use_cpu", "--quiet"]
    out = tmp_path / "out"
    err = fails(["fit", *store, "--method", "graddot", "--output_dir", str(out)], capsys)
    assert "fit is for kfac, ekfac, lorif; graddot has no fit" in err
    nothing_written(out)
    err = fails(["attribute", *store, "--method", "kfac", "--fit", str(workspace["capture"]),
                 "--output_dir", str(out)], capsys)  # fmt: skip
    assert "is not the output directory of `dattri-llm fit`" in err
    nothing_written(out)
    fitted = tmp_path / "fit"
    assert main(["fit", *store, "--method", "kfac", "--output_dir", str(fitted)]) == 0
    err = fails(["attribute", *store, "--method", "ekfac", "--fit", str(fitted),
                 "--output_dir", str(out)], capsys)  # fmt: skip
    assert "holds a kfac fit, not ekfac" in err
    nothing_written(out)


def test_report_lists_the_top_proponents_in_order(workspace, tmp_path, capsys):
    store = ["--store", str(workspace["capture"]), "--use_cpu", "--quiet", "--k", "3"]
    assert main(["top-k", *store, "--format", "json", "--output_dir", str(tmp_path / "t")]) == 0
    top = json.loads(capsys.readouterr().out)
    out = tmp_path / "report"
    assert main(["report", *store, "--format", "json", "--output_dir", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == top and printed == json.loads((out / "top_k.json").read_text())
    page = (out / "report.html").read_text()
    assert "shaded by its contribution" in page  # graddot on factorized stores: token rows
    for query in top["queries"]:
        section = page[page.index(f"query: {query['text']}") :]
        positions = []
        for row in query["top"]:
            first_word = row["text"].split()[0]
            score = f"<b>{row['score']:+.4g}</b>"
            positions.append(section.index(score))
            assert f'title="{first_word}:' in section
        assert positions == sorted(positions)


def test_report_unshaded_when_the_store_has_no_token_rows(workspace, tmp_path, capsys):
    captured = tmp_path / "materialized"
    assert main(capture_argv(workspace, captured, "--capture_style", "materialized")) == 0
    out = tmp_path / "report"
    argv = ["report", "--store", str(captured), "--use_cpu", "--quiet", "--output_dir", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "tokens unshaded" in printed and "Tokens are unshaded" in printed
    page = (out / "report.html").read_text()
    assert "the tokens are shown unshaded" in page and "cannot give token-level scores" in page
    assert not (out / "top_k.json").exists()


def test_projected_capture_matches_its_plan(workspace, tmp_path, capsys):
    out = tmp_path / "projected"
    assert main(capture_argv(workspace, out, "--proj_dim", "4", "--proj_style", "dense")) == 0
    stored = store_bytes_per_record(out / "ckpt_0" / "train_grads")
    planned = json.loads((out / "plan.json").read_text())
    assert all(layer["projection"]["proj_dim"] == 4 for layer in planned["layers"])
    assert {la["name"]: la["bytes_per_record"] for la in planned["layers"]} == stored
    plan_out = tmp_path / "plan"
    assert (
        main(
            plan_argv(
                workspace, plan_out, "--config_only", "--proj_dim", "4", "--proj_style", "dense"
            )
        )
        == 0
    )
    again = json.loads((plan_out / "plan.json").read_text())
    assert {la["name"]: la["bytes_per_record"] for la in again["layers"]} == stored

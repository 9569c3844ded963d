"""``dattri-llm validate``: saved scores measured against resumable retrains of the tiny GPT-2.

Two saved scores of the shared 8-sample corpus: a live Grad-Dot run and its
negation (a copy of the run with the score negated). Retrains fine-tune one
epoch, batch 2, learning rate 1e-2; LDS over 4 subsets, LOO over 3 samples.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import QUERIES, TRAIN, fails, nothing_written, write_jsonl, write_model
from torch.utils.data import DataLoader
from transformers import GPT2LMHeadModel

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main
from dattri_llm.cli.arguments import DataArguments, ModelArguments
from dattri_llm.cli.data import load_records, tokenize
from dattri_llm.cli.model import load_tokenizer
from dattri_llm.cli.retrain import FineTuner
from dattri_llm.evaluation import (
    LDSConfig,
    lds,
    lds_ground_truth,
    leave_one_out,
    loo_correlation,
    recall_at_k,
    sample_subsets,
)

LR = 1e-2
SEED = 3
SETTINGS = ["--num_subsets", "4", "--num_removed", "3", "--learning_rate", str(LR),
            "--per_device_train_batch_size", "2", "--seed", str(SEED), "--use_cpu",
            "--quiet"]  # fmt: skip
RETRAINS = 4 + 3 + 1  # LDS subsets, LOO removals, the full LOO run
PLANTED = [[0, 1], [5, 6]]  # baking queries <- recipes, football query <- football samples


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Files, and two attribute runs: ``graddot`` and ``negated`` (same rows, score × -1)."""
    root = tmp_path_factory.mktemp("validate")
    paths = {
        "root": root,
        "model": write_model(root / "model"),
        "train": write_jsonl(root / "train.jsonl", [{"text": t} for t in TRAIN]),
        "query": write_jsonl(root / "query.jsonl", [{"text": t} for t in QUERIES]),
        "planted": root / "planted.json",
    }
    paths["planted"].write_text(json.dumps(PLANTED))
    paths["graddot"] = root / "graddot"
    argv = ["attribute", "--model", str(paths["model"]), "--train_data", str(paths["train"]),
            "--query_data", str(paths["query"]), "--method", "graddot", "--use_cpu", "--quiet",
            "--output_dir", str(paths["graddot"])]  # fmt: skip
    assert main(argv) == 0
    paths["negated"] = root / "negated"
    shutil.copytree(paths["graddot"], paths["negated"])
    score = AttributionScore.load(paths["graddot"])
    AttributionScore(
        scores=-score.scores,
        row_train_ids=score.row_train_ids,
        row_steps=score.row_steps,
        test_ids=score.test_ids,
        algorithm="Negated",
        algorithm_meta={},
        layer_name=score.layer_name,
    ).save(paths["negated"])
    return paths


def validate_argv(ws, out, *extra, scores=("graddot", "negated")):
    return ["validate", "--model", str(ws["model"]), "--train_data", str(ws["train"]),
            "--query_data", str(ws["query"]), "--scores", *[str(ws[s]) for s in scores],
            *SETTINGS, "--output_dir", str(out), *extra]  # fmt: skip


def no_training(kept, seed):
    raise AssertionError("every retrain should be read back from the retrain directory")


def no_eval(model):
    raise AssertionError("unused")


def as_dict(interval):
    values = [None if math.isnan(v) else v for v in interval.per_query.tolist()]
    return {"mean": interval.mean, "low": interval.low, "high": interval.high,
            "level": interval.level, "method": interval.method, "per_query": values}  # fmt: skip


@pytest.fixture(scope="module")
def full_run(ws):
    """One uninterrupted ``validate --metric both --planted`` run: its output directory."""
    out = ws["root"] / "val"
    assert main(validate_argv(ws, out, "--metric", "both", "--planted", str(ws["planted"]),
                              "--k", "2")) == 0  # fmt: skip
    return out


def test_validate_equals_the_library_on_the_same_retrains(ws, full_run, capsys):
    result = json.loads((full_run / "validation.json").read_text())
    retrains = full_run.parent / "val.retrains"
    assert result["retrain_dir"] == str(retrains)
    train_ids = AttributionScore.load(ws["graddot"]).train_ids  # the data's ids, in file order
    query_ids = result["query_ids"]
    config = LDSConfig(alpha=0.5, num_subsets=4, seed=SEED)
    truth = lds_ground_truth(no_training, no_eval, train_ids, config, out_dir=retrains / "lds")
    loo = leave_one_out(
        no_training,
        no_eval,
        train_ids,
        removed=result["loo"]["removed"],
        seed=SEED,
        out_dir=retrains / "loo",
    )
    assert len(result["loo"]["removed"]) == 3 and truth.losses.shape == (4, 2)
    assert [row["name"] for row in result["methods"]] == ["graddot", "negated"]
    for row in result["methods"]:
        score = AttributionScore.load(ws[row["name"]])
        assert row["lds"] == as_dict(lds(score, truth, test_ids=query_ids))
        assert row["loo"] == as_dict(loo_correlation(score, loo, test_ids=query_ids))
        recall = recall_at_k(score, PLANTED, 2, train_ids=train_ids, test_ids=query_ids)
        assert row["recall_at_k"] == as_dict(recall)
    # Negating a score negates every per-query correlation (no ties in these scores).
    gd, neg = result["methods"]
    for key in ("lds", "loo"):
        assert neg[key]["per_query"] == pytest.approx([-v for v in gd[key]["per_query"]])
    table = (full_run / "validation.md").read_text()
    assert "| TracIn | graddot |" in table and "| Negated | negated |" in table
    assert "recall@2" in table
    capsys.readouterr()


def manual_losses(ws, kept, seed):
    """An explicit one-epoch AdamW fine-tune (linear decay, clip 1.0) and the query losses."""
    model = GPT2LMHeadModel.from_pretrained(ws["model"])
    train, query = _sets(ws)
    samples = train.samples
    loader = DataLoader(
        [samples[i] for i in kept],
        batch_size=2,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    steps = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (steps - s) / steps)
    model.train()
    for batch in loader:
        optimizer.zero_grad()
        losses = _mean_token_losses(model, batch)
        losses.sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    model.eval()
    with torch.no_grad():
        batch = {k: torch.stack([s[k] for s in query.samples]) for k in query.samples[0]}
        return _mean_token_losses(model, batch).double()


def _mean_token_losses(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    token = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
    return token.sum(1) / (targets != -100).sum(1)


def _args():
    return AttributionArguments(
        output_dir="unused", learning_rate=LR, per_device_train_batch_size=2, use_cpu=True
    )


def _sets(ws):
    tokenizer = load_tokenizer(ModelArguments(model=str(ws["model"])))
    data = DataArguments(train_data=str(ws["train"]), query_data=str(ws["query"]))
    return tuple(
        tokenize(load_records(str(ws[side])), tokenizer, data, side) for side in ("train", "query")
    )


def test_retrain_losses_equal_an_explicit_training_loop(ws, full_run):
    base = GPT2LMHeadModel.from_pretrained(ws["model"])
    subsets = sample_subsets(len(TRAIN), 0.5, 4, SEED)
    kept, seed = subsets[0].tolist(), SEED + 1  # LDS subset 0 trains with seed + 1
    expected = manual_losses(ws, kept, seed)
    saved = json.loads((full_run.parent / "val.retrains/lds/results/subset-0.json").read_text())
    assert torch.tensor(saved["losses"], dtype=torch.float64) == pytest.approx(expected, rel=1e-5)
    # The retrain moved the model: its losses differ from the starting model's.
    tuner = FineTuner(base, _args(), *_sets(ws))
    assert not torch.allclose(tuner.losses(base), expected, rtol=1e-3)


def test_a_killed_run_resumes_without_redoing_finished_retrains(ws, full_run, monkeypatch, capsys):
    calls, limit = [], [3]
    train = FineTuner.train

    def counted(self, kept, seed):
        calls.append((tuple(kept), seed))
        if len(calls) > limit[0]:
            raise KeyboardInterrupt  # killed during the 4th retrain
        return train(self, kept, seed)

    monkeypatch.setattr(FineTuner, "train", counted)
    out = ws["root"] / "resumed"
    extra = ("--metric", "both", "--planted", str(ws["planted"]), "--k", "2")
    argv = validate_argv(ws, out, *extra)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    nothing_written(out)  # the staged output is gone; the finished retrains are kept
    saved = list((ws["root"] / "resumed.retrains").rglob("results/*.json"))
    assert len(saved) == 3 and len(calls) == 4
    calls.clear()
    limit[0] = RETRAINS
    assert main(argv) == 0
    assert len(calls) == RETRAINS - 3  # only the missing retrains ran
    printed = capsys.readouterr().out
    assert f"{RETRAINS - 3} trained now, 3 reused" in printed
    resumed = json.loads((out / "validation.json").read_text())
    full = json.loads((full_run / "validation.json").read_text())
    assert resumed.pop("retrain_dir") != full.pop("retrain_dir")
    assert resumed == full  # bit-identical metrics to the uninterrupted run
    # A repeat (new output directory, same --retrain_dir) trains nothing.
    calls.clear()
    again = ws["root"] / "again"
    retrain_dir = str(ws["root"] / "resumed.retrains")
    assert main(validate_argv(ws, again, *extra, "--retrain_dir", retrain_dir)) == 0
    assert calls == []
    assert json.loads((again / "validation.json").read_text())["methods"] == full["methods"]
    capsys.readouterr()


def test_other_training_settings_are_refused_in_a_used_retrain_dir(ws, full_run, capsys):
    out = ws["root"] / "other_lr"
    argv = validate_argv(ws, out, "--retrain_dir", str(full_run.parent / "val.retrains"))
    argv[argv.index("--learning_rate") + 1] = "0.5"
    err = fails(argv, capsys)
    assert "holds retrains trained with other settings" in err
    assert "learning_rate: saved 0.01, now 0.5" in err
    nothing_written(out)


def test_a_replayed_config_reuses_the_retrains(ws, full_run, monkeypatch, capsys):
    monkeypatch.setattr(FineTuner, "train", no_training)
    out = ws["root"] / "replayed"
    config = str(full_run / "config.yaml")
    assert main(["validate", "--config", config, "--output_dir", str(out), "--quiet"]) == 0
    assert "0 trained now, 8 reused" in capsys.readouterr().out
    replayed = (out / "validation.json").read_text()
    assert replayed == (full_run / "validation.json").read_text()


def test_other_lds_settings_are_refused_naming_the_flag(ws, full_run, capsys):
    out = ws["root"] / "more_subsets"
    retrain_dir = full_run.parent / "val.retrains"
    err = fails(
        validate_argv(ws, out, "--retrain_dir", str(retrain_dir), "--alpha", "0.25"), capsys
    )
    assert f"--retrain_dir {retrain_dir} holds lds retrains made with --alpha 0.5 (now 0.25)" in err
    nothing_written(out)


def test_lds_only_by_default_and_one_scores_dir(ws, full_run, capsys):
    out = ws["root"] / "lds_only"
    argv = validate_argv(ws, out, "--retrain_dir", str(full_run.parent / "val.retrains"),
                         scores=("graddot",))  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "validation.json").read_text())
    assert result["metric"] == "lds" and "loo" not in result
    (row,) = result["methods"]
    assert set(row) == {"scores", "name", "algorithm", "polarity", "lds"}
    full = json.loads((full_run / "validation.json").read_text())
    assert row["lds"] == full["methods"][0]["lds"]
    assert "0 reused" not in capsys.readouterr().out


def test_errors_are_one_line(ws, tmp_path, capsys):
    out = tmp_path / "out"
    # a query set the scores do not cover
    other = write_jsonl(tmp_path / "q.jsonl", [{"text": "the comet passed the sun"}])
    argv = validate_argv(ws, out)
    argv[argv.index("--query_data") + 1] = str(other)
    err = fails(argv, capsys)
    assert (
        f"--scores {ws['graddot']}: 1 of the 1 query samples of --query_data have no score" in err
    )
    nothing_written(out)
    # a training set with a sample the scores lack
    bigger = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in [*TRAIN, "a new sample"]])
    argv = validate_argv(ws, out)
    argv[argv.index("--train_data") + 1] = str(bigger)
    assert "1 of the 9 training samples of --train_data have no score" in fails(argv, capsys)
    # a missing scores directory, and one that is not an attribute run
    argv = validate_argv(ws, out)
    argv[argv.index("--scores") + 1] = str(tmp_path / "nope")
    assert f"--scores {tmp_path / 'nope'} not found" in fails(argv, capsys)
    argv[argv.index("--scores") + 1] = str(ws["model"])
    assert "is not the output directory of `dattri-llm attribute`" in fails(argv, capsys)
    # usage errors
    assert "--metric must be one of" in fails(validate_argv(ws, out, "--metric", "r2"), capsys, 2)
    err = fails(validate_argv(ws, out, "--num_subsets", "1"), capsys, 2)
    assert "--num_subsets must be >= 2" in err
    # a planted file that does not fit the queries
    bad = tmp_path / "planted.json"
    bad.write_text(json.dumps([[0]]))
    err = fails(validate_argv(ws, out, "--planted", str(bad)), capsys)
    assert "lists 1 queries but --query_data has 2" in err
    bad.write_text(json.dumps([[0], [99]]))
    assert "row 99 is not in [0, 8)" in fails(validate_argv(ws, out, "--planted", str(bad)), capsys)
    nothing_written(out)


def test_a_stride_score_is_measured_as_any_other(ws, full_run, monkeypatch, capsys):
    stride = ws["root"] / "stride"
    argv = ["attribute", "--model", str(ws["model"]), "--train_data", str(ws["train"]),
            "--query_data", str(ws["query"]), "--method", "stride", "--stride_rank", "2",
            "--stride_num_subsets", "6", "--stride_subsets_per_example", "2", "--stride_steps",
            "2", "--use_cpu", "--quiet", "--output_dir", str(stride)]  # fmt: skip
    assert main(argv) == 0
    ws["stride"] = stride
    monkeypatch.setattr(FineTuner, "train", no_training)  # the LDS retrains of full_run serve
    out = ws["root"] / "with_stride"
    retrain_dir = str(full_run.parent / "val.retrains")
    argv = validate_argv(ws, out, "--retrain_dir", retrain_dir, scores=("stride", "graddot"))
    assert main(argv) == 0
    result = json.loads((out / "validation.json").read_text())
    assert [row["algorithm"] for row in result["methods"]] == ["STRIDE", "TracIn"]
    truth = lds_ground_truth(
        no_training,
        no_eval,
        AttributionScore.load(ws["graddot"]).train_ids,
        LDSConfig(alpha=0.5, num_subsets=4, seed=SEED),
        out_dir=full_run.parent / "val.retrains/lds",
    )
    score = AttributionScore.load(stride)
    assert result["methods"][0]["lds"] == as_dict(lds(score, truth, test_ids=result["query_ids"]))
    capsys.readouterr()

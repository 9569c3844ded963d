"""``attribute --method trackstar | metagradient``: live runs equal the library's own call.

The tiny GPT-2 of the shared corpus. TrackStar scores a copy trained here for
3 AdamW steps (Hugging Face ``Trainer``'s two parameter groups), with its saved
``optimizer.state_dict()``; the reference rebuilds that optimizer over the
loaded model with torch's own ``load_state_dict`` (not the library's index
mapping). The metagradient trains the model itself (one epoch, 2 AdamW
updates of 4 samples, the clip active) and is compared with the library's
``MetagradientAttributor.attribute`` on the same settings, per-sample losses
by the library's default slicing.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import QUERIES, TRAIN, fails, nothing_written, write_jsonl, write_model
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm.attribution.algorithm.metagradient import MetagradientAttributor
from dattri_llm.attribution.algorithm.trackstar import TrackStarAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main, plan
from dattri_llm.cli.arguments import DataArguments, ModelArguments
from dattri_llm.cli.data import load_records, tokenize
from dattri_llm.cli.model import causal_lm_loss, load_model, sample_losses
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.task import AttributionTask

LAYERS = r"h\.1\.(attn|mlp)\.c_proj"  # two Conv1D layers (32 -> 32, 128 -> 32)
PROJECTION = {"__default__": {"proj_dim": 16, "style": "dense"}}
TRAINING = {"learning_rate": 0.01, "per_device_train_batch_size": 4, "max_grad_norm": 0.5}


def trainer_groups(model):
    """HF ``Trainer``'s groups, written out: decayed weights, then biases and LayerNorms."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if "bias" in n or "ln_" in n]
    decay = [p for n, p in named if not ("bias" in n or "ln_" in n)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def tokenized(ws, tokenizer):
    data = DataArguments(train_data=str(ws["train"]), query_data=str(ws["query"]))
    return [tokenize(load_records(str(ws[s])), tokenizer, data, s) for s in ("train", "query")]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackstar_metagradient")
    paths = {
        "root": root,
        "gpt2": write_model(root / "gpt2"),
        "train": write_jsonl(root / "train.jsonl", [{"text": t} for t in TRAIN]),
        "query": write_jsonl(root / "query.jsonl", [{"text": t} for t in QUERIES]),
    }
    model, tokenizer = load_model(ModelArguments(model=str(paths["gpt2"])), quiet=True)
    train, _ = tokenized(paths, tokenizer)
    optimizer = torch.optim.AdamW(trainer_groups(model), lr=1e-2)
    model.train()
    for step in range(3):
        batch = {k: torch.stack([s[k] for s in train.samples[step::3]]) for k in ("input_ids",
                 "attention_mask", "labels")}  # fmt: skip
        optimizer.zero_grad()
        causal_lm_loss(model, batch).backward()
        optimizer.step()
    paths["trained"] = root / "trained"
    model.save_pretrained(paths["trained"])
    tokenizer.save_pretrained(paths["trained"])
    paths["optimizer"] = root / "optimizer.pt"
    torch.save(optimizer.state_dict(), paths["optimizer"])
    # The same moments laid out as an optimizer over model.parameters() (one group).
    flat = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for param in model.parameters():
        flat.state[param] = optimizer.state[param]
    paths["flat_optimizer"] = root / "flat_optimizer.pt"
    torch.save(flat.state_dict(), paths["flat_optimizer"])
    # A copy of the untrained model with dropout on.
    config = GPT2Config.from_pretrained(paths["gpt2"])
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.1
    dropout = GPT2LMHeadModel.from_pretrained(paths["gpt2"], config=config)
    paths["dropout"] = root / "dropout"
    dropout.save_pretrained(paths["dropout"])
    tokenizer.save_pretrained(paths["dropout"])
    return paths


def live_argv(ws, model, method, out, *extra):
    return ["attribute", "--model", str(ws[model]), "--train_data", str(ws["train"]),
            "--query_data", str(ws["query"]), "--method", method, "--linear_io", LAYERS,
            "--use_cpu", "--quiet", "--output_dir", str(out), *extra]  # fmt: skip


def trackstar_argv(ws, out, *extra):
    return live_argv(ws, "trained", "trackstar", out, "--optimizer_state", str(ws["optimizer"]),
                     "--proj_dim", "16", "--proj_style", "dense", *extra)  # fmt: skip


def library_trackstar(ws, **kwargs):
    model, tokenizer = load_model(ModelArguments(model=str(ws["trained"])), quiet=True)
    train, query = tokenized(ws, tokenizer)
    optimizer = torch.optim.AdamW(trainer_groups(model), lr=1e-2)
    optimizer.load_state_dict(torch.load(ws["optimizer"], weights_only=True))
    args = AttributionArguments(output_dir=str(ws["root"] / "lib"), use_cpu=True)
    task = AttributionTask(loss_func=causal_lm_loss, model=model)
    attributor = TrackStarAttributor(
        args, task=task, optimizer=optimizer, loss_reduction="sum", **kwargs
    )
    config = HookManagerConfig(linear_io=[LAYERS], projection_kwargs=PROJECTION)
    return attributor.attribute(train.samples, query.samples, hook_config=config)


@pytest.mark.parametrize("mixing", [None, "0.5"])
def test_trackstar_equals_the_library(ws, tmp_path, capsys, mixing):
    out = tmp_path / "trackstar"
    extra = [] if mixing is None else ["--trackstar_mixing", mixing]
    assert main(trackstar_argv(ws, out, *extra)) == 0
    assert "TrackStar: 8 training rows x 2 queries" in capsys.readouterr().out
    expected = library_trackstar(ws, **({} if mixing is None else {"mixing": float(mixing)}))
    score = AttributionScore.load(out)
    assert score.algorithm == "TrackStar" and score.train_ids == expected.train_ids
    assert score.algorithm_meta["mixing"] == (0.9 if mixing is None else 0.5)
    torch.testing.assert_close(score.scores, expected.scores, rtol=1e-6, atol=0)


def test_trackstar_param_orders(ws, tmp_path, capsys):
    """The one-group state read in model order scores as the Trainer-order state."""
    reference = tmp_path / "trainer"
    assert main(trackstar_argv(ws, reference)) == 0
    out = tmp_path / "model_order"
    argv = trackstar_argv(ws, out, "--optimizer_param_order", "model")
    argv[argv.index("--optimizer_state") + 1] = str(ws["flat_optimizer"])
    assert main(argv) == 0
    capsys.readouterr()
    torch.testing.assert_close(
        AttributionScore.load(out).scores,
        AttributionScore.load(reference).scores,
        rtol=1e-6,
        atol=0,
    )
    # read in Trainer order, the one-group state maps its moments to other parameters
    wrong = argv[: argv.index("--optimizer_param_order")]
    wrong[wrong.index("--output_dir") + 1] = str(tmp_path / "wrong")
    err = fails(wrong, capsys)
    assert "--optimizer_param_order model" in err
    nothing_written(tmp_path / "wrong")


def test_trackstar_refusals(ws, tmp_path, capsys):
    out = tmp_path / "out"
    argv = trackstar_argv(ws, out)
    without = argv[: argv.index("--optimizer_state")] + argv[argv.index("--optimizer_state") + 2 :]
    err = fails(without, capsys)
    assert "trained model's optimizer state: pass --optimizer_state PATH" in err
    missing = list(argv)
    missing[missing.index("--optimizer_state") + 1] = str(tmp_path / "no_optimizer.pt")
    assert "no_optimizer.pt: no such file" in fails(missing, capsys)
    logra = [*argv[:-1], "logra"]
    assert "pass --proj_style dense or mask" in fails(logra, capsys)
    err = fails([*argv, "--trackstar_mixing", "1.5"], capsys, 2)
    assert "--trackstar_mixing must lie in [0, 1]" in err
    graddot = live_argv(ws, "trained", "graddot", out, "--optimizer_state", str(ws["optimizer"]))
    assert "set TrackStar's options; pass --method trackstar" in fails(graddot, capsys, 2)
    store = ["top-k", "--store", str(tmp_path), "--method", "trackstar", "--quiet",
             "--output_dir", str(out)]  # fmt: skip
    assert "trackstar runs only as a live attribute" in fails(store, capsys)
    nothing_written(out)


def metagradient_argv(ws, model, out):
    return live_argv(ws, model, "metagradient", out, *(
        f"--{k}={v}" for k, v in TRAINING.items()), "--seed", "3")  # fmt: skip


@pytest.fixture(scope="module")
def metagradient(ws):
    """The CLI's metagradient output directory and the library's scores of the same run.

    ``{"batched": ..., "sliced": ...}``: per-sample losses by ``sample_losses`` (one
    forward per batch, as the CLI) and by the library's default one-sample slices.
    """
    out = ws["root"] / "metagradient"
    assert main(metagradient_argv(ws, "gpt2", out)) == 0
    expected = {}
    for name, losses in (("batched", sample_losses), ("sliced", None)):
        model, tokenizer = load_model(ModelArguments(model=str(ws["gpt2"])), quiet=True)
        train, query = tokenized(ws, tokenizer)
        output_dir = str(ws["root"] / f"lib_{name}")
        args = AttributionArguments(output_dir=output_dir, use_cpu=True, seed=3, **TRAINING)
        task = AttributionTask(loss_func=causal_lm_loss, model=model)
        attributor = MetagradientAttributor(
            args, task=task, sample_loss_func=losses, sample_target_func=losses
        )
        expected[name] = attributor.attribute(
            train.samples,
            query.samples,
            hook_config=HookManagerConfig(linear_io=[LAYERS]),
            loss_reduction="sum",
        )
    return out, expected


def test_metagradient_equals_the_library(metagradient):
    out, expected = metagradient
    score = AttributionScore.load(out)
    batched = expected["batched"]
    assert score.algorithm == "Metagradient" and score.polarity == -1
    assert score.scores.shape[:2] == (len(TRAIN), len(QUERIES))  # one epoch: one row each
    assert score.row_train_ids == batched.row_train_ids and score.test_ids == batched.test_ids
    torch.testing.assert_close(score.scores, batched.scores, rtol=1e-6, atol=0)
    # The library's per-sample slicing computes the same losses in other float32 kernels;
    # Adam amplifies that rounding (measured 1e-4 of the largest score; against a float64
    # run both are 5e-4 away).
    largest = float(score.scores.abs().max())
    assert largest > 1e-3  # the scores are not all zero
    sliced = expected["sliced"]
    assert sliced.row_train_ids == score.row_train_ids
    torch.testing.assert_close(score.scores, sliced.scores, rtol=0, atol=2e-3 * largest)
    meta = score.algorithm_meta
    assert meta["loss_reduction"] == "sum" and meta["max_grad_norm"] == 0.5
    assert max(meta["replay_errors"].values()) < 1e-5  # the recorded run is reproduced
    assert min(meta["clip_coefficients"].values()) < 1.0  # the clip acts
    assert [p.name for p in out.iterdir() if p.name.startswith(".metagradient")] == []


def test_metagradient_top_k_ranks_the_most_negative_first(metagradient, tmp_path, capsys):
    out, _ = metagradient
    score = AttributionScore.load(out)
    argv = ["top-k", "--scores", str(out), "--k", "3", "--format", "json", "--quiet",
            "--output_dir", str(tmp_path / "top")]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["polarity"] == -1
    for query in printed["queries"]:
        column = score.scores[:, score.test_ids.index(query["id"])]
        order = torch.argsort(column)[:3].tolist()
        assert [r["train_id"] for r in query["top"]] == [score.train_ids[i] for i in order]
        assert query["top"][0]["score"] == pytest.approx(float(column.min()), rel=1e-6)


def test_metagradient_sets_dropout_to_zero(ws, metagradient, tmp_path, capsys):
    """The same weights with dropout 0.1: a warning, and the scores of the dropout-free model."""
    out = tmp_path / "dropout"
    with pytest.warns(UserWarning, match="dropout is set to 0"):
        assert main(metagradient_argv(ws, "dropout", out)) == 0
    capsys.readouterr()
    torch.testing.assert_close(
        AttributionScore.load(out).scores, AttributionScore.load(metagradient[0]).scores,
        rtol=0, atol=0,
    )  # fmt: skip


def test_metagradient_refusals(ws, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(plan, "free_disk_bytes", lambda path: 1000)
        err = fails(metagradient_argv(ws, "gpt2", out), capsys)
    assert "the metagradient's recorded run (2 updates x" in err and "is free on" in err
    err = fails([*metagradient_argv(ws, "gpt2", out), "--optim", "sgd"], capsys)
    assert "replays torch.optim.AdamW" in err
    store = ["attribute", "--store", str(tmp_path), "--method", "metagradient", "--quiet",
             "--output_dir", str(out)]  # fmt: skip
    assert "metagradient runs only as a live attribute" in fails(store, capsys)
    nothing_written(out)

"""capture → attribute → top-k through ``main``, config replay, prompt masking."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from cli_helpers import QUERIES, TRAIN, capture_argv, write_jsonl
from transformers import AutoTokenizer

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main
from dattri_llm.cli.arguments import DataArguments
from dattri_llm.cli.data import load_records, tokenize
from dattri_llm.cli.errors import CLIError


def attribute(workspace, out, *extra):
    argv = ["attribute", "--store", str(workspace["capture"]), "--output_dir", str(out)]
    assert main([*argv, "--use_cpu", "--quiet", *extra]) == 0
    return AttributionScore.load(out)


def samples(directory, name):
    lines = (directory / name).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_capture_writes_stores_samples_and_resolved_config(workspace):
    out = workspace["capture"]
    assert (out / "ckpt_0" / "train_grads" / "index.jsonl").is_file()
    assert (out / "ckpt_0" / "test_grads" / "index.jsonl").is_file()
    assert [s["text"] for s in samples(out, "train_samples.jsonl")] == TRAIN
    assert [s["text"] for s in samples(out, "query_samples.jsonl")] == QUERIES
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["command"] == "capture"
    assert config["linear_io"] == [r"^transformer\.h\."]
    assert config["per_device_train_batch_size"] == 4 and config["data_seed"] == 42
    assert config["train_data"] == str(workspace["train"])  # absolute: replays anywhere
    assert "overwrite" not in config and "quiet" not in config
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]


def test_attribute_graddot_ids_are_the_captured_samples(workspace, tmp_path):
    score = attribute(workspace, tmp_path / "scores", "--method", "graddot")
    train_ids, matrix = score.agnostic_matrix()
    assert matrix.shape == (len(TRAIN), len(QUERIES))
    captured = workspace["capture"]
    assert set(train_ids) == {s["id"] for s in samples(captured, "train_samples.jsonl")}
    assert set(score.test_ids) == {s["id"] for s in samples(captured, "query_samples.jsonl")}
    assert yaml.safe_load((tmp_path / "scores" / "config.yaml").read_text())["method"] == "graddot"


@pytest.mark.parametrize(
    ("method", "extra", "algorithm"),
    [
        ("gradcos", [], "GradCos"),
        ("kfac", ["--damping", "0.01"], "KFAC"),
        ("ekfac", [], "EKFAC"),
        ("lorif", ["--lorif_svd_rank", "2"], "LoRIF"),
    ],
)
def test_attribute_each_method(workspace, tmp_path, method, extra, algorithm):
    score = attribute(workspace, tmp_path / method, "--method", method, *extra)
    assert score.algorithm == algorithm
    assert score.scores.shape[:2] == (len(TRAIN), len(QUERIES))
    assert torch.isfinite(score.scores).all()


def test_top_k_text_and_json(workspace, tmp_path, capsys):
    store = str(workspace["capture"])
    common = ["--store", store, "--k", "3", "--use_cpu", "--quiet"]
    assert main(["top-k", *common, "--output_dir", str(tmp_path / "text")]) == 0
    text = capsys.readouterr().out
    assert f"query 1: {QUERIES[0]}" in text and sum(t in text for t in TRAIN) >= 3
    assert main(["top-k", *common, "--format", "json", "--output_dir", str(tmp_path / "j")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "j" / "top_k.json").read_text())
    assert (tmp_path / "j" / "top_k.txt").read_text().strip() == text.strip()
    # the same ranking as the full score's top_k
    full = attribute(workspace, tmp_path / "full").top_k(3)
    for query in printed["queries"]:
        assert [r["train_id"] for r in query["top"]] == [t for t, _ in full[query["id"]]]
        assert [r["text"] for r in query["top"]] == [
            next(s["text"] for s in samples(workspace["capture"], "train_samples.jsonl")
                 if s["id"] == r["train_id"])
            for r in query["top"]
        ]  # fmt: skip


def test_config_replay_gives_identical_scores(workspace, tmp_path):
    first = attribute(workspace, tmp_path / "a", "--method", "kfac", "--damping", "0.05")
    config = str(tmp_path / "a" / "config.yaml")
    assert main(["attribute", "--config", config, "--output_dir", str(tmp_path / "b")]) == 0
    replayed = AttributionScore.load(tmp_path / "b")
    assert torch.equal(first.scores, replayed.scores)
    assert replayed.algorithm_meta["damping"] == 0.05
    # a capture replayed from its config gives the same stores, hence the same scores
    recaptured = tmp_path / "recaptured"
    capture_config = str(workspace["capture"] / "config.yaml")
    assert main(["capture", "--config", capture_config, "--output_dir", str(recaptured)]) == 0
    again = tmp_path / "c"
    assert main(["attribute", "--config", config, "--store", str(recaptured),
                 "--output_dir", str(again)]) == 0  # fmt: skip
    assert torch.equal(first.scores, AttributionScore.load(again).scores)


def test_prompt_tokens_are_masked(workspace, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(workspace["model"])
    data = DataArguments(
        train_data=str(workspace["prompts"]),
        query_data=str(workspace["prompts"]),
        prompt_field="prompt",
        completion_field="completion",
    )
    tokenized = tokenize(load_records(data.train_data), tokenizer, data, "train")
    first = tokenized.samples[0]  # "the striker" + "scored a goal"
    prompt = tokenizer("the striker", add_special_tokens=False)["input_ids"]
    completion = tokenizer("scored a goal", add_special_tokens=False)["input_ids"]
    n = len(prompt) + len(completion)
    assert first["input_ids"][:n].tolist() == prompt + completion
    assert first["labels"][: len(prompt)].tolist() == [-100] * len(prompt)
    assert first["labels"][len(prompt) : n].tolist() == completion
    assert (first["labels"][n:] == -100).all() and (first["attention_mask"][n:] == 0).all()
    # and end to end: a prompt/completion capture that scores
    out = tmp_path / "prompted"
    argv = capture_argv(workspace, out, "--prompt_field", "prompt", "--completion_field",
                        "completion")  # fmt: skip
    argv[argv.index("--train_data") + 1] = str(workspace["prompts"])
    argv[argv.index("--query_data") + 1] = str(workspace["prompts"])
    assert main(argv) == 0
    rows = samples(out, "query_samples.jsonl")
    assert rows[0]["prompt"] == "the striker" and rows[0]["completion"] == "scored a goal"


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} says {{ m['content'] }} [EOS] {% endfor %}"
CHATS = [
    {"messages": [{"role": "user", "content": "the striker"},
                  {"role": "assistant", "content": "scored a goal"}]},
    {"messages": [{"role": "system", "content": "chop the"},
                  {"role": "user", "content": "onions"},
                  {"role": "assistant", "content": "fry them in olive oil"}]},
]  # fmt: skip


def test_chat_messages_score_only_the_assistant(workspace, tmp_path):
    model_dir = tmp_path / "chat_model"
    shutil.copytree(workspace["model"], model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    data = DataArguments(train_data=str(chats), query_data=str(chats), messages_field="messages")
    tokenized = tokenize(load_records(data.train_data), tokenizer, data, "train")
    second = tokenized.samples[1]
    rendered = tokenizer.apply_chat_template(CHATS[1]["messages"], tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    n = len(ids)
    assert second["input_ids"][:n].tolist() == ids
    # the scored tokens are exactly the assistant message's: "assistant says fry ... [EOS]"
    answer = tokenizer("assistant says fry them in olive oil [EOS]", add_special_tokens=False)
    scored = [t for t in second["labels"][:n].tolist() if t != -100]
    assert scored == answer["input_ids"]
    assert second["labels"][: n - len(scored)].tolist() == [-100] * (n - len(scored))
    # end to end: capture, then top-k reads the chats back
    out = tmp_path / "chat_capture"
    argv = capture_argv({**workspace, "model": model_dir}, out, "--messages_field", "messages")
    argv[argv.index("--train_data") + 1] = str(chats)
    argv[argv.index("--query_data") + 1] = str(chats)
    assert main(argv) == 0
    assert samples(out, "train_samples.jsonl")[0]["messages"] == CHATS[0]["messages"]
    top = tmp_path / "chat_top"
    assert main(["top-k", "--store", str(out), "--k", "1", "--output_dir", str(top)]) == 0
    assert "assistant: scored a goal" in (top / "top_k.txt").read_text()


def test_chat_messages_need_a_chat_template(workspace, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(workspace["model"])
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    data = DataArguments(train_data=str(chats), query_data=str(chats), messages_field="messages")
    with pytest.raises(CLIError, match="needs a tokenizer with a chat template"):
        tokenize(load_records(data.train_data), tokenizer, data, "train")
    with pytest.raises(CLIError, match="must be a list of"):
        tokenize([{"messages": "hi"}], tokenizer, data, "train")
    with pytest.raises(ValueError, match="give one"):
        DataArguments(train_data="a", query_data="b", messages_field="m", prompt_field="p",
                      completion_field="c")  # fmt: skip


def test_import_dattri_llm_does_not_load_the_cli():
    code = "import sys, dattri_llm; assert 'dattri_llm.cli' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

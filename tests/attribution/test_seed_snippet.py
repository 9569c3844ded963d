"""The design README's quick-start snippet runs verbatim.

GPT-2 is swapped for a tiny model and the tokenizer for a character-level encoding.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import dattri_llm

transformers = pytest.importorskip("transformers")

# README lines that load GPT-2 and its tokenizer are replaced by a tiny model from config and a
# character-level encoding; everything from `train_set = ...` on is the README code verbatim.
SETUP = """
from transformers import GPT2Config, GPT2LMHeadModel
from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                   n_positions=64))

def encode(*texts):
    ids = torch.tensor([[ord(c) % 97 for c in t[:32]] + [0] * (32 - len(t[:32]))
                        for t in texts])
    return [{"input_ids": i} for i in ids]
"""

README = """
train_set = encode("Influence functions trace a model's predictions back to its training data.",
                   "Preheat the oven and mix flour, sugar, and butter until crumbly.")
val_set = encode("Which training examples shaped this language model's behavior?")

def loss_fn(model, batch):  # (model, batch) -> loss, evaluated on the live model
    ids = batch["input_ids"]
    return model(input_ids=ids, labels=ids).loss * len(ids)

task = AttributionTask(loss_func=loss_fn, model=model)  # scores at the current weights
attributor = TracInAttributor(AttributionArguments(output_dir="scores", use_cpu=True), task=task)
score = attributor.attribute(train_set, val_set)
print(score.agnostic_matrix()[1])  # (num_train, num_val) influence scores
"""


def test_package_exports_the_snippet_names():
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.task import AttributionTask

    assert dattri_llm.TracInAttributor is TracInAttributor
    assert dattri_llm.AttributionArguments is AttributionArguments
    assert dattri_llm.AttributionTask is AttributionTask


def test_readme_snippet_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"torch": torch}
    exec(textwrap.dedent(SETUP) + textwrap.dedent(README), namespace)  # noqa: S102
    score = namespace["score"]
    ids, matrix = score.agnostic_matrix()
    assert matrix.shape == (2, 1) and torch.isfinite(matrix).all()
    assert len(set(ids)) == 2
    assert (tmp_path / "scores" / "scores.pt").is_file()
    assert "tensor(" in capsys.readouterr().out

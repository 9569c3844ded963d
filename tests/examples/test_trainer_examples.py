"""examples/trainers: each runs, and its stored gradients for one step equal torch.func
per-sample gradients of the loss that trainer backpropagated at that step's parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call
from trainer_example_helpers import (
    TrainingRecorder,
    assert_rows_equal,
    lm_row_loss,
    load_example,
    reference_rows,
    stored_rows,
    token_log_probs,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

STEP = 1  # the second optimizer step: parameters already updated once


def check_lm_step(trainer, recorder, store_dir, accumulation: int) -> None:
    """Optimizer step ``STEP`` of an LM trainer against the token-mean loss it backpropagated."""
    hashes, captured, layer_types = stored_rows(store_dir, STEP)
    window = recorder.micro[STEP * accumulation : (STEP + 1) * accumulation]
    params = window[0]["params"]
    losses = []
    for micro in window:
        torch.testing.assert_close(micro["params"], params)  # constant inside a window
        inputs, batch = micro["inputs"], micro["inputs"]["input_ids"].shape[0]
        divisor = micro["num_items_in_batch"]
        assert divisor is not None  # the trainer normalised by the window's label tokens
        losses.append((inputs, batch, divisor))
        with torch.no_grad():
            total = sum(
                lm_row_loss(trainer.model, params, inputs, i, batch, divisor) for i in range(batch)
            )
        torch.testing.assert_close(total, micro["loss"], rtol=1e-5, atol=1e-7)
    rows = [(inputs, i, batch, divisor) for inputs, batch, divisor in losses for i in range(batch)]
    assert len(hashes) == len(rows)

    def row_loss(p, k):
        inputs, i, batch, divisor = rows[k]
        return lm_row_loss(trainer.model, p, inputs, i, batch, divisor)

    expected = reference_rows(trainer.model, params, row_loss, len(rows), captured, layer_types)
    assert_rows_equal(captured, expected)


@pytest.mark.parametrize("pattern", ["context", "callback"])
def test_hf_trainer_example(tmp_path, monkeypatch, pattern):
    from transformers import Trainer

    example = load_example("hf_trainer")
    recorder = TrainingRecorder(monkeypatch, Trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, matrix = example.main(tmp_path, pattern=pattern, max_steps=2)
    assert matrix.shape == (16, 2) and torch.isfinite(matrix).all()
    check_lm_step(trainer, recorder, tmp_path / "train_grads", accumulation=2)


@pytest.mark.parametrize("packing", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_trl_sft_example(tmp_path, monkeypatch, packing):
    pytest.importorskip("trl")
    from trl import SFTTrainer

    example = load_example("trl_sft")
    recorder = TrainingRecorder(monkeypatch, SFTTrainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, matrix = example.main(tmp_path, packing=packing, max_steps=2)
    assert torch.isfinite(matrix).all()
    batch = recorder.micro[STEP]["inputs"]["input_ids"].shape[0]
    assert batch == (1 if packing else 4)  # padding-free packing: one row per micro-batch
    check_lm_step(trainer, recorder, tmp_path / "train_grads", accumulation=1)


def grpo_row_loss(trainer, params, inputs, i):
    """Completion ``i``'s share of TRL's ``"dapo"`` GRPO loss (beta 0, on-policy)."""
    args = trainer.args
    completion = inputs["completion_ids"][i : i + 1]
    mask = inputs["completion_mask"][i : i + 1]
    ids = torch.cat([inputs["prompt_ids"][i : i + 1], completion], dim=1)
    attention = torch.cat([inputs["prompt_mask"][i : i + 1], mask], dim=1)
    logits = functional_call(
        trainer.model, params, (), {"input_ids": ids, "attention_mask": attention}
    )
    logits = logits.logits[:, -completion.shape[1] - 1 : -1] / args.temperature
    logp = token_log_probs(logits, completion)
    ratio = torch.exp(logp - logp.detach())  # old log-probs = current ones, detached
    advantage = inputs["advantages"][i]
    clipped = torch.clamp(ratio, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    normalizer = inputs["num_items_in_batch"] * args.gradient_accumulation_steps
    return (per_token * mask).sum() / (normalizer / args.steps_per_generation)


@pytest.mark.slow
def test_trl_grpo_example(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    example = load_example("trl_grpo")
    recorder = TrainingRecorder(monkeypatch, GRPOTrainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, matrix = example.main(tmp_path, max_steps=2)
    args = trainer.args
    assert args.loss_type == "dapo" and args.beta == 0.0 and args.num_iterations == 1
    micro = recorder.micro[STEP]
    inputs, params = micro["inputs"], micro["params"]
    assert inputs.get("old_per_token_logps") is None  # on-policy: ratio 1, gradient -A grad logp
    completions = inputs["completion_ids"].shape[0]
    assert matrix.shape == (2 * completions, 2)  # one row per completion and step
    assert inputs["advantages"].abs().sum() > 0
    with torch.no_grad():
        total = sum(grpo_row_loss(trainer, params, inputs, i) for i in range(completions))
    torch.testing.assert_close(total, micro["loss"], rtol=1e-5, atol=1e-7)
    hashes, captured, layer_types = stored_rows(tmp_path / "train_grads", STEP)
    assert len(hashes) == completions
    expected = reference_rows(
        trainer.model,
        params,
        lambda p, i: grpo_row_loss(trainer, p, inputs, i),
        completions,
        captured,
        layer_types,
    )
    assert_rows_equal(captured, expected)

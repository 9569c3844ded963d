"""examples/trainers/olmo_core_trainer.py: OLMo-core's `Trainer` runs unchanged on CPU, and the
stored gradients of one optimizer step equal torch.func per-sample gradients of the loss it
backpropagated (each sequence's token-loss sum over the batch's label-token count) at that
step's parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
from capture_helpers import flat_reference
from torch.func import functional_call, grad
from trainer_example_helpers import assert_rows_equal, load_example, stored_rows, token_log_probs

pytest.importorskip("olmo_core")
pytest.importorskip("transformers")  # the example's character tokenizer

STEP = 1  # the second optimizer step: parameters already updated once


class StepRecorder:
    """Records each batch OLMo-core's train module trains on, without changing it.

    ``steps[k]`` holds the batch's ``input_ids`` and ``labels``, the parameters when the batch
    started (dry run excluded), and ``loss``: the sum of the micro-batch losses backpropagated.
    """

    def __init__(self, monkeypatch, module_cls):
        self.steps: list[dict] = []
        train_batch, model_forward = module_cls.train_batch, module_cls.model_forward

        def recording_train_batch(module, batch, dry_run=False):
            if not dry_run:
                params = module.model.named_parameters()
                self.steps.append(
                    {
                        "input_ids": batch["input_ids"].clone(),
                        "labels": batch["labels"].clone(),
                        "params": {k: p.detach().clone() for k, p in params},
                        "loss": torch.tensor(0.0),
                    }
                )
            return train_batch(module, batch, dry_run=dry_run)

        def recording_model_forward(module, *args, **kwargs):
            output = model_forward(module, *args, **kwargs)
            if module.model.training and self.steps:
                self.steps[-1]["loss"] += output.loss.detach()
            return output

        monkeypatch.setattr(module_cls, "train_batch", recording_train_batch)
        monkeypatch.setattr(module_cls, "model_forward", recording_model_forward)


def row_loss(model, params, step: dict, row: int) -> torch.Tensor:
    """Row ``row``'s share of the step's loss: its label-token NLL sum / the batch's count."""
    ids, labels = step["input_ids"][row : row + 1], step["labels"][row : row + 1]
    logits = functional_call(model, params, (ids,))
    logp = token_log_probs(logits, labels)
    return -(logp * (labels != -100)).sum() / (step["labels"] != -100).sum()


def test_olmo_core_example(tmp_path, monkeypatch):
    from olmo_core.train.train_module import TransformerTrainModule

    example = load_example("olmo_core_trainer")
    recorder = StepRecorder(monkeypatch, TransformerTrainModule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_module, matrix = example.main(tmp_path, max_steps=2)
    assert matrix.shape == (2 * example.BATCH, 2) and torch.isfinite(matrix).all()
    assert len(recorder.steps) == 2

    model, step = train_module.model, recorder.steps[STEP]
    batch = step["input_ids"].shape[0]
    assert batch == example.BATCH > example.MICRO  # two micro-batches merged into one record
    with torch.no_grad():
        total = sum(row_loss(model, step["params"], step, i) for i in range(batch))
    torch.testing.assert_close(total, step["loss"], rtol=1e-5, atol=1e-7)

    hashes, captured, layer_types = stored_rows(tmp_path / "train_grads", STEP)
    assert len(hashes) == batch
    assert {"embeddings", "lm_head.w_out", "blocks.1.feed_forward.w2"} <= set(captured)
    params = step["params"]
    wanted = {k: v for k, v in params.items() if any(k.startswith(f"{n}.") for n in captured)}
    model.eval()
    per_row = [
        grad(lambda sel, i=i: row_loss(model, {**params, **sel}, step, i))(wanted)
        for i in range(batch)
    ]
    stacked = {k: torch.stack([g[k] for g in per_row]) for k in wanted}
    expected = {n: flat_reference(stacked, n, layer_types[n], batch) for n in captured}
    assert_rows_equal(captured, expected)

"""Helpers for the examples/trainers tests: load an example, record what the trainer
backpropagated, read a step's rows from a store, and build torch.func references."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from capture_helpers import dense, flat_reference
from torch.func import functional_call, grad

from dattri_llm import GradientStorageManager

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "trainers"


def load_example(name: str):
    """Import ``examples/trainers/<name>.py`` (its sibling ``tiny`` module on the path)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class TrainingRecorder:
    """Records every micro-batch a trainer class backpropagates, without changing it.

    ``micro[k]`` holds the ``inputs`` and ``num_items_in_batch`` its ``compute_loss``
    received, the model's parameters at that moment, and the scalar ``loss`` that
    ``training_step`` backpropagated.
    """

    def __init__(self, monkeypatch, trainer_cls):
        self.micro: list[dict] = []
        compute_loss, training_step = trainer_cls.compute_loss, trainer_cls.training_step

        def recording_compute_loss(trainer, model, inputs, *args, **kwargs):
            self.micro.append(
                {
                    "inputs": {k: _copy(v) for k, v in inputs.items()},
                    "num_items_in_batch": _copy(kwargs.get("num_items_in_batch")),
                    "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                }
            )
            return compute_loss(trainer, model, inputs, *args, **kwargs)

        def recording_training_step(trainer, *args, **kwargs):
            loss = training_step(trainer, *args, **kwargs)
            self.micro[-1]["loss"] = loss.detach().clone()
            return loss

        monkeypatch.setattr(trainer_cls, "compute_loss", recording_compute_loss)
        monkeypatch.setattr(trainer_cls, "training_step", recording_training_step)


def stored_rows(store_dir: Path, step: int) -> tuple[list[str], dict, dict]:
    """Identifiers, ``{layer: (B, d)}`` gradients and layer types of one step, in row order."""
    store = GradientStorageManager(str(store_dir))
    records = []
    for location, steps in store.iter_steps(step):
        group = store.load_records(location)
        records += [group[i] for i in steps[step]]
    layers = records[0].gradient.layer_names
    rows = {name: torch.cat([dense(r.gradient, name) for r in records]) for name in layers}
    return [r.input_hash for r in records], rows, records[0].gradient.layer_types


def row_inputs(inputs: dict, row: int, batch: int) -> dict:
    """The model kwargs of one row: batch-leading tensors sliced, trainer-only keys dropped."""
    out = {}
    for key, value in inputs.items():
        if key in ("num_items_in_batch", "use_cache"):
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
            value = value[row : row + 1]
        out[key] = value
    return out


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log p(targets)`` under ``logits`` ``(1, T, V)``; targets ``(1, T)`` (ignored < 0 → 0)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]


def lm_row_loss(model, params, inputs: dict, row: int, batch: int, divisor) -> torch.Tensor:
    """Row ``row``'s share of a token-mean LM loss: its label-token NLL sum / ``divisor``."""
    kwargs = row_inputs(inputs, row, batch)
    labels = kwargs.pop("labels")
    logits = functional_call(model, params, (), kwargs).logits
    targets = labels[:, 1:]
    logp = token_log_probs(logits[:, :-1], targets)
    return -(logp * (targets != -100)).sum() / divisor


def reference_rows(model, params: dict, row_loss, rows: int, layers, layer_types) -> dict:
    """``{layer: (rows, d)}`` torch.func gradients of ``row_loss(params, i)``, one per row."""
    model.eval()  # no checkpointing recompute in the reference; the tiny Llama has no dropout
    wanted = {k: v for k, v in params.items() if any(k.startswith(f"{n}.") for n in layers)}
    # The trainers' checkpointing hook on the embedding calls requires_grad_(), which torch.func
    # refuses; it does not change the function, so it is lifted while the reference runs.
    embedding_hooks = model.get_input_embeddings()._forward_hooks
    saved = dict(embedding_hooks)
    embedding_hooks.clear()
    try:
        per_row = [
            grad(lambda sel, i=i: row_loss({**params, **sel}, i))(wanted) for i in range(rows)
        ]
    finally:
        embedding_hooks.update(saved)
    stacked = {k: torch.stack([g[k] for g in per_row]) for k in wanted}
    return {n: flat_reference(stacked, n, layer_types[n], rows) for n in layers}


def assert_rows_equal(captured: dict, expected: dict) -> None:
    """Every captured layer equals the reference (fp32)."""
    assert set(captured) == set(expected)
    for name in captured:
        torch.testing.assert_close(captured[name], expected[name], rtol=1e-4, atol=1e-7)

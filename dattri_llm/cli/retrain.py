"""The ``train_fn`` and ``eval_fn`` of ``dattri-llm validate``: fine-tune, then score the queries.

A retrain fine-tunes a fresh copy of the starting model on the kept training
rows for one epoch, as ``capture --train`` trains: the library's
`GradientStreamer` with ``enable_update=True`` (AdamW or SGD from
``--optim``, ``--learning_rate``, ``--weight_decay``, the scheduler, warm-up,
``--max_grad_norm``, batch and accumulation sizes, bf16 / fp16; a batch's loss
is the sum of its samples' mean next-token losses), batches shuffled by the
retrain's seed. The streamer captures per-sample gradients of one layer only
(it needs one hooked layer to step; the input embedding where it can) and
they are dropped. The query loss is the same per-sample mean next-token loss,
in eval mode without gradients (under ``--bf16`` / ``--fp16`` autocast when
set).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.cli.data import TokenizedSet
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.model import causal_lm_loss, sample_losses
from dattri_llm.gradient.hooks.config import HookManagerConfig, resolve_hook_assignments
from dattri_llm.gradient.streaming import GradientStreamer, autocast_for, move_batch
from dattri_llm.utils.atomic import atomic_write

__all__ = ["SETUP_FILE", "TRAINING_FIELDS", "FineTuner", "check_setup"]

SETUP_FILE = "training.json"  # in the retrain directory: what every retrain there was trained with
# The AttributionArguments fields that change a retrain's result (the seeds come per retrain).
TRAINING_FIELDS = (
    "per_device_train_batch_size", "learning_rate", "weight_decay", "optim", "adam_beta1",
    "adam_beta2", "adam_epsilon", "lr_scheduler_type", "warmup_steps",
    "gradient_accumulation_steps", "max_grad_norm", "bf16", "fp16", "full_determinism",
)  # fmt: skip


class FineTuner:
    """``train(kept, seed) -> model`` and ``losses(model) -> (n_queries,)`` over loaded sets.

    Args:
        model: the starting model (kept unchanged; each retrain trains a deep copy).
        args: the training settings (``--learning_rate``, ``--optim``, batch sizes, device...).
        train: the tokenized training set; ``kept`` indexes its samples.
        query: the tokenized query set, scored in file order.
    """

    def __init__(
        self,
        model: nn.Module,
        args: AttributionArguments,
        train: TokenizedSet,
        query: TokenizedSet,
    ) -> None:
        """Keep the starting model on the CPU and pick the one layer the streamer hooks."""
        self.base = model.to("cpu")
        self.args = args
        self.train_samples = train.samples
        self.query_samples = query.samples
        self.hook_config = HookManagerConfig(hook_types=dict([_hooked_layer(model)]))

    def train(self, kept: list[int], seed: int) -> nn.Module:
        """A fresh copy of the starting model fine-tuned one epoch on ``kept`` with ``seed``."""
        if not kept:
            raise ValueError("a retrain needs at least one kept training sample")
        model = copy.deepcopy(self.base)
        run_args = dataclasses.replace(self.args, seed=int(seed), data_seed=int(seed))
        streamer = GradientStreamer(
            model,
            [self.train_samples[i] for i in kept],
            run_args,
            batch_size=run_args.per_device_train_batch_size,
            enable_update=True,
            loss_fn=causal_lm_loss,
            config=self.hook_config,
        )
        with streamer:
            for _step, _block, _ids in streamer:  # each batch steps the optimizer
                pass
        return model

    @torch.no_grad()
    def losses(self, model: nn.Module) -> torch.Tensor:
        """Each query's mean next-token loss under ``model``, ``(n_queries,)`` float64."""
        device = torch.device(self.args.device)
        model.to(device).eval()
        size = self.args.per_device_eval_batch_size
        out = []
        for start in range(0, len(self.query_samples), size):
            chunk = self.query_samples[start : start + size]
            batch = move_batch({k: torch.stack([s[k] for s in chunk]) for k in chunk[0]}, device)
            with autocast_for(self.args):  # bf16 / fp16 as in training and the attribution
                losses = sample_losses(model, batch)
            out.append(losses.detach().to("cpu", torch.float64))
        model.to("cpu")
        return torch.cat(out)


def _hooked_layer(model: nn.Module) -> tuple[str, str]:
    """``(name, family)`` of the one layer the training streamer hooks.

    The input embedding when it is hookable (every forward uses it, and its
    capture is small), else the hookable layer with the fewest parameters.
    """
    layers = resolve_hook_assignments(model, HookManagerConfig())
    if not layers:
        raise CLIError("validate trains through the gradient streamer, which hooks no layer here")
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if module is embedding and name in layers:
            return name, layers[name]

    def size(item: tuple[str, str]) -> tuple[bool, int]:
        name, family = item
        return family != "linear_io", sum(p.numel() for p in modules[name].parameters())

    return min(layers.items(), key=size)


def check_setup(directory: Path, setup: dict[str, Any]) -> None:
    """Write ``setup`` to ``directory/training.json``, or check it equals the saved one.

    ``CLIError`` naming the differing settings: the retrains saved there were
    trained otherwise and cannot be reused.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SETUP_FILE
    setup = json.loads(json.dumps(setup, sort_keys=True))
    if not path.is_file():
        data = json.dumps(setup, indent=2, sort_keys=True).encode("utf-8")
        atomic_write(path, lambda handle: handle.write(data))
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CLIError(f"{path} is not valid JSON ({err}); use another --retrain_dir") from err
    if not isinstance(saved, dict):
        raise CLIError(f"{path} is not a validate training record; use another --retrain_dir")
    diff = sorted(k for k in set(saved) | set(setup) if saved.get(k) != setup.get(k))
    if diff:
        shown = ", ".join(f"{k}: saved {saved.get(k)!r}, now {setup.get(k)!r}" for k in diff)
        raise CLIError(
            f"--retrain_dir {directory} holds retrains trained with other settings ({shown}); "
            "pass the same settings to reuse them, or another --retrain_dir"
        )

"""``dattri-llm capture``: one frozen pass (or one recorded epoch) over both sets into two stores.

The output directory holds what ``TracInAttributor.cache`` writes
(``ckpt_0/train_grads`` and ``ckpt_0/test_grads``, usable by any
``attribute_from_cache``), the samples' identifiers and texts
(``train_samples.jsonl``, ``query_samples.jsonl``), the run plan
(``plan.txt``, ``plan.json``) and the resolved ``config.yaml``. With
``--train`` the model is trained one epoch over the training set and the run
recorded (``AdamWInfluenceAttributor.cache``): ``ckpt_0/train_grads`` holds
every step's per-sample gradients with the run's ``lr_schedule.json``,
``training_dynamics.json`` and ``adamw_dynamics.pt``, and ``ckpt_0/test_grads``
the queries at the trained weights; the trained model is discarded unless
``--save_model`` (``trained_model/``). ``--train --less`` records the run for LESS
instead (``LESSAttributor.cache(enable_update=True)``): ``ckpt_0/train_grads``
holds every step's per-sample gradients preconditioned by Adam's state before
the step, with the run's learning rates and training dynamics, and
``ckpt_0/test_grads`` the queries at the loaded weights (taken before training).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.planning import RunPlan
from dattri_llm.cli.arguments import (
    CaptureArguments,
    DataArguments,
    ModelArguments,
    TrainArguments,
)
from dattri_llm.cli.data import TokenizedSet, load_records, tokenize
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.model import causal_lm_loss, load_model
from dattri_llm.cli.output import SAMPLE_FILES, STORE_DIRS
from dattri_llm.cli.plan import build_plan, preflight
from dattri_llm.gradient.hooks.config import HookManagerConfig, resolve_hook_assignments
from dattri_llm.task import AttributionTask

__all__ = [
    "ADAMW_OPTIMS",
    "TRAINED_MODEL_DIR",
    "load_inputs",
    "record_less",
    "record_training",
    "run_capture",
]

ADAMW_OPTIMS = ("adamw_torch", "adamw")  # the optimizers AdamW-influence models
TRAINED_MODEL_DIR = "trained_model"  # capture --train --save_model


def load_inputs(
    model_args: ModelArguments,
    data_args: DataArguments,
    capture_args: CaptureArguments,
    *,
    quiet: bool,
) -> tuple[torch.nn.Module, Any, int, dict[str, TokenizedSet]]:
    """``(model, tokenizer, hooked layers, {"train", "query": tokenized set})`` of a run.

    ``CLIError`` when a file or the model cannot be loaded, or the layer
    selection captures no layer of the model.
    """
    records = {"train": load_records(data_args.train_data)}
    records["query"] = load_records(data_args.query_data)
    model, tokenizer = load_model(model_args, quiet=quiet)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the capture below warns once, where it matters
        layers = resolve_hook_assignments(model, capture_args.hook_config())
    if not layers:
        raise CLIError("the layer selection captures no layer of this model")
    sets = {name: tokenize(rows, tokenizer, data_args, name) for name, rows in records.items()}
    return model, tokenizer, len(layers), sets


def input_plan(
    model: torch.nn.Module,
    sets: dict[str, TokenizedSet],
    capture_args: CaptureArguments,
    method: str,
    args: AttributionArguments,
) -> RunPlan:
    """The run plan of ``method`` over the loaded model and the tokenized sets."""
    return build_plan(
        model,
        capture_args,
        method,
        num_train=len(sets["train"].ids),
        num_test=len(sets["query"].ids),
        train_len=int(sets["train"].samples[0]["input_ids"].shape[0]),
        query_len=int(sets["query"].samples[0]["input_ids"].shape[0]),
        batch_size=args.per_device_train_batch_size,
        device=args.device,
    )


def run_capture(
    staging: Path,
    args: AttributionArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    capture_args: CaptureArguments,
    train_args: TrainArguments | None = None,
    *,
    quiet: bool,
    force: bool = False,
    final: Path | None = None,
) -> dict[str, Any]:
    """Capture both sets into ``staging``; return a short summary.

    Before capturing, the run plan is printed (unless ``quiet``) and written
    beside the stores; ``CLIError`` when the stores would not fit the free disk
    of ``final``'s file system (the output directory), unless ``force``. With
    ``train_args.train`` the model is trained over the training set once
    while the run is recorded (:func:`record_training`).
    """
    train = train_args is not None and train_args.train
    less = train and train_args.less
    if train and args.recompute_gradients:
        raise CLIError("capture --train records every step's gradients; drop --recompute_gradients")
    if less and args.optim not in ADAMW_OPTIMS:
        raise CLIError(
            f"capture --train --less preconditions with Adam's state; --optim {args.optim!r} "
            "has none: use --optim adamw_torch"
        )
    model, tokenizer, layers, sets = load_inputs(model_args, data_args, capture_args, quiet=quiet)
    plan = input_plan(model, sets, capture_args, "graddot", args)
    preflight("capture", plan, "graddot", final or staging, staging, force=force, quiet=quiet)
    for name, tokenized in sets.items():
        _write_samples(staging / SAMPLE_FILES[name], tokenized)
    hook_config = capture_args.hook_config()
    run_args = dataclasses.replace(args, output_dir=str(staging))
    task = AttributionTask(loss_func=causal_lm_loss, model=model)
    batches = math.ceil(len(sets["train"].samples) / args.per_device_train_batch_size)
    desc = "train and record" if train else "capture (training set)"
    with tqdm(total=batches, desc=desc, unit="batch", disable=quiet) as bar:
        if less:
            record_less(run_args, task, sets, staging, hook_config, lambda: bar.update(1))
        elif train:
            record_training(run_args, task, sets, staging, hook_config, lambda: bar.update(1))
        else:
            TracInAttributor(run_args, task=task).cache(
                sets["train"].samples,
                sets["query"].samples,
                cache_dir=str(staging),
                hook_config=hook_config,
                on_train_block=lambda *_: bar.update(1),
            )
    if train and train_args.save_model:
        model.save_pretrained(staging / TRAINED_MODEL_DIR)
        tokenizer.save_pretrained(staging / TRAINED_MODEL_DIR)
    return {
        "layers": layers,
        "train": len(sets["train"].ids),
        "query": len(sets["query"].ids),
        "trained": train,
        "less": less,
    }


def record_training(
    args: AttributionArguments,
    task: AttributionTask,
    sets: dict[str, TokenizedSet],
    staging: Path,
    hook_config: HookManagerConfig,
    on_batch: Callable[[], None],
) -> None:
    """Train the task model one epoch over the training set, recording the run under ``ckpt_0``.

    An AdamW run is recorded by ``AdamWInfluenceAttributor.cache`` (per-step
    gradients, learning rates, training dynamics and the AdamW moments: what
    all three trajectory methods read); another optimizer by the shared
    trajectory recording of ``TrajectoryTracInAttributor.cache`` (no moments:
    trajectory_tracin and dvemb only). ``on_batch`` is called after every
    training batch.
    """
    cls = AdamWInfluenceAttributor if args.optim in ADAMW_OPTIMS else TrajectoryTracInAttributor

    class _Recorder(cls):  # the shared hook after each training batch drives the progress bar
        def on_trajectory_block(self) -> None:
            super().on_trajectory_block()
            on_batch()

    root = staging / Path(STORE_DIRS["train"]).parent
    _Recorder(args, task=task).cache(
        sets["train"].samples,
        sets["query"].samples,
        cache_dir=str(root),
        hook_config=hook_config,
    )


def record_less(
    args: AttributionArguments,
    task: AttributionTask,
    sets: dict[str, TokenizedSet],
    staging: Path,
    hook_config: HookManagerConfig,
    on_batch: Callable[[], None],
) -> None:
    """Train the task model one AdamW epoch, recording LESS's run under ``ckpt_0``.

    ``LESSAttributor.cache(enable_update=True)``: each step's per-sample
    gradients preconditioned by Adam's state before the step (the training
    loss is the sum of the samples' losses: ``loss_reduction="sum"``), the
    learning rates and training dynamics; the queries raw, taken before
    training (at the loaded weights). ``on_batch`` is called after every
    training batch.
    """
    LESSAttributor(args, task=task).cache(
        sets["train"].samples,
        sets["query"].samples,
        cache_dir=str(staging),
        hook_config=hook_config,
        enable_update=True,
        loss_reduction="sum",
        on_train_block=lambda *_: on_batch(),
    )


def _write_samples(path: Path, tokenized: TokenizedSet) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for index, (sample_id, text) in enumerate(zip(tokenized.ids, tokenized.texts)):
            handle.write(json.dumps({"id": sample_id, "index": index, **text}) + "\n")

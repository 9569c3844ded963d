"""``dattri-llm capture``: one frozen pass over both sets into two gradient stores.

The output directory holds what ``TracInAttributor.cache`` writes
(``ckpt_0/train_grads`` and ``ckpt_0/test_grads``, usable by any
``attribute_from_cache``), the samples' identifiers and texts
(``train_samples.jsonl``, ``query_samples.jsonl``), the run plan
(``plan.txt``, ``plan.json``) and the resolved ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.cli.arguments import CaptureArguments, DataArguments, ModelArguments
from dattri_llm.cli.data import TokenizedSet, load_records, tokenize
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.model import causal_lm_loss, load_model
from dattri_llm.cli.output import SAMPLE_FILES
from dattri_llm.cli.plan import build_plan, preflight
from dattri_llm.gradient.hooks.config import resolve_hook_assignments
from dattri_llm.task import AttributionTask

__all__ = ["run_capture"]


def run_capture(
    staging: Path,
    args: AttributionArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    capture_args: CaptureArguments,
    *,
    quiet: bool,
    force: bool = False,
    final: Path | None = None,
) -> dict[str, Any]:
    """Capture both sets into ``staging``; return a short summary.

    Before capturing, the run plan is printed (unless ``quiet``) and written
    beside the stores; ``CLIError`` when the stores would not fit the free disk
    of ``final``'s file system (the output directory), unless ``force``.
    """
    records = {"train": load_records(data_args.train_data)}
    records["query"] = load_records(data_args.query_data)
    model, tokenizer = load_model(model_args, quiet=quiet)
    hook_config = capture_args.hook_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the capture below warns once, where it matters
        layers = resolve_hook_assignments(model, hook_config)
    if not layers:
        raise CLIError("the layer selection captures no layer of this model")
    sets = {}
    for name, rows in records.items():
        sets[name] = tokenize(rows, tokenizer, data_args, name)
    plan = build_plan(
        model,
        capture_args,
        "graddot",
        num_train=len(sets["train"].ids),
        num_test=len(sets["query"].ids),
        train_len=int(sets["train"].samples[0]["input_ids"].shape[0]),
        query_len=int(sets["query"].samples[0]["input_ids"].shape[0]),
        batch_size=args.per_device_train_batch_size,
        device=args.device,
    )
    preflight("capture", plan, "graddot", final or staging, staging, force=force, quiet=quiet)
    for name, tokenized in sets.items():
        _write_samples(staging / SAMPLE_FILES[name], tokenized)
    attributor = TracInAttributor(
        dataclasses.replace(args, output_dir=str(staging)),
        task=AttributionTask(loss_func=causal_lm_loss, model=model),
    )
    batches = math.ceil(len(sets["train"].samples) / args.per_device_train_batch_size)
    with tqdm(total=batches, desc="capture (training set)", unit="batch", disable=quiet) as bar:
        attributor.cache(
            sets["train"].samples,
            sets["query"].samples,
            cache_dir=str(staging),
            hook_config=hook_config,
            on_train_block=lambda *_: bar.update(1),
        )
    return {"layers": len(layers), "train": len(sets["train"].ids), "query": len(sets["query"].ids)}


def _write_samples(path: Path, tokenized: TokenizedSet) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for index, (sample_id, text) in enumerate(zip(tokenized.ids, tokenized.texts)):
            handle.write(json.dumps({"id": sample_id, "index": index, **text}) + "\n")

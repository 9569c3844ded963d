"""``dattri-llm plan`` and the preflight of ``capture`` / ``attribute`` / ``fit``.

The plan is the library's ``plan_run`` (:mod:`dattri_llm.attribution.planning`)
for the command's model, data, layer selection and method. ``plan`` builds it
from a model directory or Hub id (its ``config.json`` alone with
``--config_only`` or when the directory holds no weight file: nothing is
allocated) and the data files (samples counted and tokenized) or bare sizes,
and writes ``plan.txt`` and ``plan.json``. The other commands build the same
plan at their start, print it, write it beside their output and refuse to start
when the stores do not fit the free disk of the output directory's file system
or the fit and scoring do not fit the free memory, unless ``--force``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.planning import RunPlan, format_bytes, measure_capture_seconds, plan_run
from dattri_llm.cli.arguments import (
    CaptureArguments,
    ModelArguments,
    PlanArguments,
    PlanDataArguments,
)
from dattri_llm.cli.data import TokenizedSet, load_records, tokenize
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.method_arguments import STRIDE_METHOD, MethodArguments
from dattri_llm.cli.methods import check_not_stride
from dattri_llm.cli.model import causal_lm_loss, load_config, load_model, load_tokenizer
from dattri_llm.cli.stores import capture_arguments, captured_sets
from dattri_llm.utils.memory import free_memory_bytes

__all__ = [
    "PLAN_FILES",
    "WEIGHT_SUFFIXES",
    "build_plan",
    "check_metagradient_disk",
    "free_disk_bytes",
    "has_weights",
    "plan_method",
    "preflight",
    "run_plan",
    "store_plan",
    "store_preflight",
]

PLAN_FILES = ("plan.txt", "plan.json")
# What the Grad-Dot plan leaves out for the methods planned as Grad-Dot (the plan's notes).
UNPLANNED_MEMORY = {
    "lorif": "its SVD fit's memory is",
    "trak": "its per-layer (D x D) kernel over the projected gradients is",
    "trackstar": "its per-layer (D x D) train and query autocorrelations are",
    "datainf": "the training and query gradients it holds in memory are",
    "influence": "the gradients it holds in memory and the Hessian's gradient graph are",
    "metagradient": "the reverse sweep's double-backward graph and adjoints are (its disk is "
    "checked before training)",
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")


def plan_method(method: str) -> str:
    """The ``plan_run`` method of a command-line method (LoRIF and TracIn plan as Grad-Dot)."""
    return method if method in ("kfac", "ekfac") else "graddot"


def has_weights(model: str) -> bool:
    """Whether ``--model`` may hold weights (a Hub id: assumed; a directory: a weight file)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return True
    return any(p.suffix in WEIGHT_SUFFIXES for p in path.rglob("*") if p.is_file())


def free_disk_bytes(path: Path) -> int:
    """Free bytes of the file system holding ``path`` (its nearest existing ancestor)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _config_dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return torch.float32 if param is None else param.dtype


def build_plan(
    model: Any,
    capture_args: CaptureArguments,
    method: str,
    *,
    num_train: int,
    num_test: int,
    train_len: int,
    query_len: int,
    batch_size: int,
    device: torch.device | str,
    probe: float | None = None,
) -> RunPlan:
    """``plan_run`` of a loaded model or a config, the query side planned at its own length.

    ``train_len`` / ``query_len`` are the padded token widths of the two sets
    (the capture pads each set to its longest sample); the plan's ``seq_len``
    is the training side's.
    """
    dtype = _model_dtype(model) if isinstance(model, torch.nn.Module) else _config_dtype(model)
    common = dict(
        method=plan_method(method),
        hook_config=capture_args.hook_config(),
        batch_size=batch_size,
        dtype=dtype,
        device=device,
    )
    try:
        plan = plan_run(
            model, num_train=num_train, num_test=num_test, seq_len=train_len, probe=probe, **common
        )
        if query_len != train_len and num_test:
            query = plan_run(model, num_train=1, num_test=num_test, seq_len=query_len, **common)
            held = query.held_test_bytes
            plan = dataclasses.replace(
                plan,
                test_store_bytes=query.test_store_bytes,
                held_test_bytes=held,
                scoring_bytes=plan.train_block_bytes + held + plan.score_bytes,
                notes=(*plan.notes, f"query records are {query_len} tokens long"),
            )
    except ValueError as err:
        raise CLIError(str(err)) from err
    unplanned = UNPLANNED_MEMORY.get(method)
    if unplanned is not None:
        note = f"{method} is planned as graddot: {unplanned} not predicted"
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    return plan


def _width(tokenized: TokenizedSet) -> int:
    return int(tokenized.samples[0]["input_ids"].shape[0])


def store_plan(store: str, method: str, args: AttributionArguments) -> RunPlan:
    """The plan of scoring a capture's stores with ``method`` (the model's config only)."""
    model_args, capture_args, config = capture_arguments(store)
    sets = captured_sets(store)
    return build_plan(
        load_config(model_args),
        capture_args,
        method,
        num_train=len(sets["train"].ids),
        num_test=len(sets["query"].ids),
        train_len=_width(sets["train"]),
        query_len=_width(sets["query"]),
        batch_size=int(config.get("per_device_train_batch_size", 8)),
        device=args.device,
    )


def _needs(command: str, method: str, plan: RunPlan, reuses_fit: bool) -> tuple[tuple, tuple]:
    """``((disk bytes, what), (memory bytes, what))`` a command needs (0: not checked)."""
    fit = plan.covariance_bytes + plan.eigenbasis_bytes + plan.correction_bytes
    if command == "capture":
        stores = plan.train_store_bytes + plan.test_store_bytes
        return (stores, "the train and query stores"), (0, "")
    if command == "fit":
        return (fit, f"the {method} fit"), (fit + plan.train_block_bytes, f"the {method} fit")
    scoring = plan.scoring_bytes + (0 if reuses_fit else fit)
    what = "scoring" if reuses_fit or not fit else f"the {method} fit and scoring"
    return (plan.score_bytes, "the score matrix"), (scoring, what)


def check_metagradient_disk(
    model: torch.nn.Module,
    num_train: int,
    args: AttributionArguments,
    output_dir: Path,
    *,
    force: bool,
) -> int:
    """The disk bytes of the metagradient's recorded run; ``CLIError`` when they are not free.

    Per update the run keeps the trainable parameters (in their dtype) and the
    replay's Adam moments (two float32 values per parameter), all in the output
    directory's file system until scoring ends. Not checked with ``force``.
    """
    per_update = sum(
        p.numel() * (p.element_size() + 8) for p in model.parameters() if p.requires_grad
    )
    batches = math.ceil(num_train / args.per_device_train_batch_size)
    updates = math.ceil(batches / args.gradient_accumulation_steps)
    need = updates * per_update
    free = free_disk_bytes(output_dir)
    if need > free and not force:
        raise CLIError(
            f"the metagradient's recorded run ({updates} updates x {format_bytes(per_update)}: "
            f"each update's parameters and Adam moments) needs {format_bytes(need)} but "
            f"{format_bytes(free)} is free on {output_dir}; free space, train on fewer samples "
            "or pass --force"
        )
    return need


def preflight(
    command: str,
    plan: RunPlan,
    method: str,
    output_dir: Path,
    staging: Path,
    *,
    force: bool,
    quiet: bool,
    reuses_fit: bool = False,
) -> None:
    """Print the plan, write it to ``staging``; ``CLIError`` when it does not fit, unless forced."""
    if not quiet:
        print(plan.format())
    _write_plan(staging, plan)
    (disk, disk_what), (memory, memory_what) = _needs(command, method, plan, reuses_fit)
    if force:
        return
    free = free_disk_bytes(output_dir)
    if disk > free:
        raise CLIError(
            f"{disk_what} need {format_bytes(disk)} but {format_bytes(free)} is free on "
            f"{output_dir}; free space or pass --force"
        )
    available = free_memory_bytes()
    if memory and available is not None and memory > available:
        raise CLIError(
            f"{memory_what} need {format_bytes(memory)} of memory but {format_bytes(available)} "
            "is free; free memory or pass --force"
        )


def store_preflight(
    command: str,
    store: str,
    method_args: MethodArguments,
    args: AttributionArguments,
    final: Path,
    staging: Path,
    *,
    force: bool,
    quiet: bool,
) -> None:
    """:func:`preflight` of a command that reads a capture's stores (``attribute``, ``fit``).

    A plan that cannot be made (the model's config or tokenizer is gone) is a
    ``CLIError`` unless ``force``, which then runs without a preflight.
    """
    try:
        plan = store_plan(store, method_args.method, args)
    except CLIError as err:
        if not force:
            raise CLIError(
                f"cannot plan the run ({err}); pass --force to run without the preflight"
            ) from err
        if not quiet:
            print(f"no run plan ({err}); running without the preflight (--force)")
        return
    preflight(
        command,
        plan,
        method_args.method,
        final,
        staging,
        force=force,
        quiet=quiet,
        reuses_fit=method_args.fit is not None,
    )


def _write_plan(directory: Path, plan: RunPlan) -> None:
    (directory / PLAN_FILES[0]).write_text(plan.format() + "\n", encoding="utf-8")
    text = json.dumps(plan.as_dict(), indent=2)
    (directory / PLAN_FILES[1]).write_text(text + "\n", encoding="utf-8")


def _side(
    name: str, path: str | None, count: int | None, tokenizer: Any, data: PlanDataArguments
) -> tuple[TokenizedSet | None, int]:
    """One side's tokenized samples (``None`` without a file) and its record count."""
    if path is None:
        if count is None:
            flag = "--num_train" if name == "train" else "--num_test"
            raise CLIError(f"give --{name}_data or {flag}")
        return None, count
    tokenized = tokenize(load_records(path), tokenizer, data, name)
    return tokenized, len(tokenized.ids)


def _probe_batch(
    tokenized: TokenizedSet | None, model: torch.nn.Module, seq_len: int, batch: int
) -> dict[str, torch.Tensor]:
    """One batch of real samples, or random token ids of ``seq_len`` without data."""
    if tokenized is not None:
        rows = tokenized.samples[:batch]
        return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_plan(
    staging: Path,
    args: AttributionArguments,
    model_args: ModelArguments,
    data_args: PlanDataArguments,
    capture_args: CaptureArguments,
    plan_args: PlanArguments,
    method_args: MethodArguments,
    *,
    quiet: bool,
) -> str:
    """Plan into ``staging`` (``plan.txt``, ``plan.json``); return the text to print.

    ``CLIError`` for stride, which captures no gradients (nothing to plan). The
    other live-only methods plan as the live ``attribute`` run does: as Grad-Dot,
    with a note of what that leaves out (``UNPLANNED_MEMORY``).
    """
    if method_args.method == STRIDE_METHOD:
        check_not_stride(method_args.method, "plan")
    from_config = plan_args.config_only or not has_weights(model_args.model)
    if plan_args.probe and from_config:
        raise CLIError(f"--probe needs the model's weights; {model_args.model} holds none")
    files = data_args.train_data is not None or data_args.query_data is not None
    tokenizer = load_tokenizer(model_args) if files else None
    train, num_train = _side(
        "train", data_args.train_data, plan_args.num_train, tokenizer, data_args
    )
    query, num_test = _side("query", data_args.query_data, plan_args.num_test, tokenizer, data_args)
    widths = [_width(t) for t in (train, query) if t is not None]
    default = plan_args.seq_len if plan_args.seq_len is not None else max(widths, default=None)
    if default is None:
        raise CLIError("give --seq_len, or the data files whose token lengths set it")
    lengths = {
        side: _width(tokenized) if tokenized is not None else default
        for side, tokenized in (("train", train), ("query", query))
    }
    if from_config:
        model = load_config(model_args)
    else:
        model, _tokenizer = load_model(model_args, quiet=quiet)
    seconds = None
    if plan_args.probe:
        model.to(args.device)
        batch = _probe_batch(train, model, lengths["train"], args.per_device_train_batch_size)
        batch = {key: value.to(args.device) for key, value in batch.items()}
        seconds = measure_capture_seconds(model, batch, causal_lm_loss, capture_args.hook_config())
    plan = build_plan(
        model,
        capture_args,
        method_args.method,
        num_train=num_train,
        num_test=num_test,
        train_len=lengths["train"],
        query_len=lengths["query"],
        batch_size=args.per_device_train_batch_size,
        device=args.device,
        probe=seconds,
    )
    _write_plan(staging, plan)
    return json.dumps(plan.as_dict(), indent=2) if plan_args.format == "json" else plan.format()

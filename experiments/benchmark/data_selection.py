"""Data-selection overhead: time per training step with and without ``DataSelectionCallback``.

Model: ``LlamaForCausalLM`` from a small config (4 layers, hidden 128, 4 heads,
intermediate 256, vocabulary 1000; float32), batch 8 x 64 tokens of random ids,
loss ``model(input_ids, labels=input_ids).loss``, ``AdamW``. Hooks on every
attention and MLP projection (the seed paper's full-fine-tuning setting).

Rows (all on the same model and batch; configurations interleaved over
``--rounds`` rounds in rotated order, warm-up steps at the start of each):

* ``standard training`` -- plain loop, no hooks;
* ``capture only`` -- ``HookManager`` with no callback (cost of the hooks);
* ``selection, batch target`` -- ``DataSelectionCallback(target="batch")``,
  bottom half dropped (``"bottom_fraction"``, 0.5), ``renormalize=True``;
* ``selection, val_loader target`` -- as above against one validation sequence
  per step (one extra forward+backward per step, as in the seed paper);
* ``selection, layer-wise`` -- batch target, per-layer choice.

Time: median wall and process-CPU time per step (zero_grad, forward,
backward, selection, ``AdamW.step``) over all timed steps; ratios are against
standard training. On a shared machine the CPU time is the steadier measure.
The seed paper reports 1.63x (146 ms vs 89 ms) at 1B parameters on a GPU.

Usage: ``python experiments/benchmark/data_selection.py [--out PATH] [--steps N]
[--rounds R] [--warmup W] [--threads T]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dattri_llm.gradient.callbacks.data_selection_callback import DataSelectionCallback
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager

RESULTS = Path(__file__).parent / "results"
MODEL_CONFIG = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
)
BATCH, SEQ = 8, 64
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SELECT = {"threshold": 0.5, "threshold_mode": "bottom_fraction"}


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def build_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG))


def callbacks_for(name: str, model: nn.Module, val: list[torch.Tensor]) -> list | None:
    """The callbacks of one row (``None``: no HookManager at all)."""
    if name == "standard training":
        return None
    if name == "capture only":
        return []
    if name == "selection, val_loader target":
        return [
            DataSelectionCallback(
                model,
                target="val_loader",
                val_loader=val,
                val_loss_fn=lm_loss,
                renormalize=True,
                selection_kwargs=SELECT,
            )
        ]
    layer_wise = name == "selection, layer-wise"
    return [
        DataSelectionCallback(
            model, renormalize=True, selection_kwargs={**SELECT, "layer_wise": layer_wise}
        )
    ]


ROWS = [
    "standard training",
    "capture only",
    "selection, batch target",
    "selection, val_loader target",
    "selection, layer-wise",
]


def time_row(name: str, steps: int, warmup: int) -> list[tuple[float, float]]:
    """Per-step ``(wall, process CPU)`` seconds of one row (fresh model, same batch each step)."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
    val = [torch.randint(0, MODEL_CONFIG["vocab_size"], (1, SEQ), generator=gen)]
    callbacks = callbacks_for(name, model, val)
    config = HookManagerConfig(linear_io=[rf"\.{p}$" for p in PROJECTIONS])
    manager = None if callbacks is None else HookManager(model, config, callbacks=callbacks)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model, ids).backward()
        opt.step()

    times = []
    with manager.collect() if manager is not None else contextlib.nullcontext():
        for i in range(warmup + steps):
            start, cpu = time.perf_counter(), time.process_time()
            step()
            if i >= warmup:
                times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times


def machine_description(threads: int) -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        head = "\n".join(lscpu.splitlines()[:10])
    except (OSError, subprocess.CalledProcessError):
        head = platform.processor() or platform.machine()
    import transformers

    return (
        f"```\n{head}\n```\n\ntorch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, torch threads {threads}."
    )


def _median(times: list[tuple[float, float]], which: int) -> float:
    return statistics.median(t[which] for t in times)


def report(times: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> str:
    base = [_median(times["standard training"], k) for k in (0, 1)]
    lines = [
        "# Data-selection overhead (time per training step)",
        "",
        f"Date: {datetime.date.today().isoformat()}. Generated by `data_selection.py` "
        f"(`--steps {args.steps} --rounds {args.rounds} --warmup {args.warmup} "
        f"--threads {args.threads}`).",
        "",
        "Machine:",
        "",
        machine_description(args.threads),
        "",
        f"Load average at the end (1/5/15 min): {os.getloadavg()}; the machine was shared, "
        "so rows are interleaved over rounds in rotated order.",
        "",
        f"Workload: tiny `LlamaForCausalLM` (4 layers, hidden 128, vocabulary 1000), batch "
        f"{BATCH} x {SEQ} tokens, AdamW, hooks on the attention and MLP projections; selection "
        "drops the bottom half of each batch (`bottom_fraction` 0.5, `renormalize=True`). "
        "Medians over all timed steps. The seed paper reports 1.63x at 1B parameters on a GPU.",
        "",
        "| configuration | wall ms / step | x standard | process CPU ms / step | x standard |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ROWS:
        wall, cpu = (_median(times[name], k) for k in (0, 1))
        lines.append(
            f"| {name} | {1000 * wall:.1f} | {wall / base[0]:.2f} | {1000 * cpu:.1f} "
            f"| {cpu / base[1]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, printer: Callable[[str], None] = print) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "data_selection.md")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ROWS}
    for r in range(args.rounds):  # rotated order: load drift hits every row alike
        for name in ROWS[r % len(ROWS) :] + ROWS[: r % len(ROWS)]:
            times[name] += time_row(name, args.steps, args.warmup)
    text = report(times, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    printer(text)
    return text


if __name__ == "__main__":
    main()

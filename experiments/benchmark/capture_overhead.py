"""Capture overhead benchmark: a tiny causal-LM training loop with and without capture.

Model: ``GPTNeoXForCausalLM`` from a small config (4 layers, hidden 128, 4 heads,
intermediate 512, vocabulary 1000; float32), batch 8 x 64 tokens of random ids, loss
``model(input_ids, labels=input_ids).loss``. GPT-NeoX is used rather than GPT-2 because
its projections are ``nn.Linear`` (GPT-2's are HF ``Conv1D``), the only type the
weight-gradient-free (``invasive_linear_io``) capture accepts, so every row runs on the
same model and the ratios are comparable.

Configurations (``HookManager`` built before the loop, steps run inside ``collect()``):

* ``no hooks`` -- plain loop;
* ``capture (all layers)`` -- ``linear_io=REGISTER_ALL`` (every embedding, LayerNorm and
  linear layer) with ``CaptureCallback`` (keeps the latest record);
* ``capture (nn.Linear only)`` -- ``linear_io`` on the ``nn.Linear`` layers only: the
  same layer set as the invasive row, to isolate its effect;
* ``capture + offload`` / ``capture + async offload`` -- all layers, ``OffloadCallback``
  (``offload_interval=1``, ``"per_batch"``) into a temporary on-disk (memmap)
  ``GradientStorageManager``; with ``async_write`` False / True;
* ``invasive capture (nn.Linear)`` -- ``invasive_linear_io=REGISTER_ALL`` +
  ``CaptureCallback``: the ``nn.Linear`` backward returns only the input gradient.
  It cannot train, so it appears only in the frozen-probe table.

Two tables: *training step* (zero_grad, forward, backward, ``AdamW.step``) and *frozen
probe* (zero_grad, forward, backward; no optimizer step, as in attribution of a frozen
model). Configurations are interleaved over ``--rounds`` rounds (warm-up steps at the
start of each round) so that load drift on a shared machine hits every row alike.

Time: median wall and process-CPU time per step over all timed steps. Memory, in a
separate pass before the timing (``--memory-steps`` steps per configuration, after the
warm-up): growth of the process's peak resident set during one step (``VmHWM``, reset
through ``/proc/self/clear_refs`` before the step, minus ``VmRSS`` before the step),
median over the measured steps. For that pass only, glibc's mmap threshold is pinned at
128 KiB so large tensors are mapped fresh and unmapped on free (this slows every large
allocation); the memory pass runs first, on a fresh heap, and the timing after it with
the threshold at glibc's 32 MiB ceiling (the steady state of its dynamic threshold).
The last column is the time spent leaving ``collect()`` (flushing
the staged records and draining the async writer), once per round, not in the step time.

Usage: ``python experiments/benchmark/capture_overhead.py [--out PATH] [--steps N]
[--rounds R] [--warmup W] [--memory-steps M] [--threads T]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dattri_llm.gradient.callbacks import CaptureCallback, OffloadCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.storage_manager import GradientStorageManager

RESULTS = Path(__file__).parent / "results"
MODEL_CONFIG = {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 64,
}
BATCH, SEQ = 8, 64
LR = 1e-4


@dataclass
class Setup:
    """One benchmarked configuration: how to build (and tear down) its capture."""

    name: str
    make_manager: Callable[[nn.Module, str], HookManager | None]
    trains: bool = True


@dataclass
class Measurements:
    """Per-step wall/CPU seconds and peak-extra MiB, and context-exit seconds per round."""

    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)
    exit_seconds: list[float] = field(default_factory=list)


def pin_glibc_mmap_threshold(nbytes: int) -> None:
    """Serve every allocation above ``nbytes`` by ``mmap`` and unmap it on free."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, nbytes)


def _status_kb(name: str) -> int:
    match = re.search(rf"{name}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(match.group(1)) if match else 0


def linear_layer_patterns(model: nn.Module) -> list[str]:
    """Anchored regexes selecting exactly the ``nn.Linear`` modules of ``model``."""
    return [f"^{re.escape(n)}$" for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def capture_all(model: nn.Module, _: str) -> HookManager:
    """Factorized capture of every eligible layer, latest record kept."""
    config = HookManagerConfig(linear_io=REGISTER_ALL)
    return HookManager(model, config=config, callbacks=[CaptureCallback()])


def capture_linear(model: nn.Module, _: str) -> HookManager:
    """Factorized capture of the ``nn.Linear`` layers only, latest record kept."""
    config = HookManagerConfig(linear_io=linear_layer_patterns(model))
    return HookManager(model, config=config, callbacks=[CaptureCallback()])


def capture_offload(async_write: bool) -> Callable[[nn.Module, str], HookManager]:
    """Factory: all-layer capture offloaded each step to an on-disk store in ``tmp``."""

    def make(model: nn.Module, tmp: str) -> HookManager:
        store = GradientStorageManager(tempfile.mkdtemp(dir=tmp))
        offload = OffloadCallback(
            offload_interval=1,
            file_manager=store,
            recording_type="per_batch",
            async_write=async_write,
        )
        return HookManager(
            model, config=HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[offload]
        )

    return make


def capture_invasive(model: nn.Module, _: str) -> HookManager:
    """Weight-gradient-free capture of every ``nn.Linear`` layer, latest record kept."""
    config = HookManagerConfig(invasive_linear_io=REGISTER_ALL)
    return HookManager(model, config=config, callbacks=[CaptureCallback()])


SETUPS = (
    Setup("no hooks", lambda model, tmp: None),
    Setup("capture (all layers)", capture_all),
    Setup("capture (nn.Linear only)", capture_linear),
    Setup("capture + offload", capture_offload(async_write=False)),
    Setup("capture + async offload", capture_offload(async_write=True)),
    Setup("invasive capture (nn.Linear)", capture_invasive, trains=False),
)


def build_model() -> nn.Module:
    """The tiny GPT-NeoX causal LM (seeded)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**MODEL_CONFIG)).train()


def make_batches(n: int) -> list[torch.Tensor]:
    """``n`` distinct random token batches ``(BATCH, SEQ)``."""
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, MODEL_CONFIG["vocab_size"], (BATCH, SEQ), generator=gen) for _ in range(n)
    ]


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, ids: torch.Tensor):
    """zero_grad, forward, backward and (when training) the optimizer step."""
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    if optimizer is not None:
        optimizer.step()


def timed_step(model, optimizer, ids) -> tuple[float, float]:
    """Run one step; return (wall seconds, process CPU seconds)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    one_step(model, optimizer, ids)
    return time.perf_counter() - start, time.process_time() - cpu_start


def memory_step(model, optimizer, ids) -> float:
    """Run one step; return its peak extra resident memory in MiB (``VmHWM - VmRSS``)."""
    Path("/proc/self/clear_refs").write_text("5")
    base_kb = _status_kb("VmRSS")
    one_step(model, optimizer, ids)
    return max(_status_kb("VmHWM") - base_kb, 0) / 1024


def run_round(
    setup: Setup, model, optimizer, batches, tmp: str, step_fn: Callable
) -> tuple[list, float | None]:
    """``step_fn`` over ``batches`` under one configuration: (per-step results, exit s)."""
    manager = setup.make_manager(model, tmp)
    if manager is None:
        return [step_fn(model, optimizer, ids) for ids in batches], None
    try:
        with manager.collect():
            steps = [step_fn(model, optimizer, ids) for ids in batches]
            exit_start = time.perf_counter()
        return steps, time.perf_counter() - exit_start
    finally:
        manager.remove()


def run(
    mode: str,
    steps: int,
    warmup: int,
    rounds: int,
    results: dict[str, Measurements],
    measure: str,
) -> None:
    """Interleave the configurations in ``results`` over ``rounds`` rounds for one mode.

    ``mode``: ``"train"`` or ``"frozen"``; ``measure``: ``"time"`` or ``"memory"``
    (appended to ``results``).
    """
    model = build_model() if mode == "train" else build_model().eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR) if mode == "train" else None
    batches = make_batches(warmup + steps)
    setups = [s for s in SETUPS if s.name in results]
    timing = measure == "time"
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for setup in setups if r % 2 == 0 else reversed(setups):
                out = results[setup.name]
                step_fn = timed_step if timing else memory_step
                measured, exit_seconds = run_round(setup, model, optimizer, batches, tmp, step_fn)
                if not timing:
                    out.peak_mib += measured[warmup:]
                    continue
                out.seconds += [wall for wall, _ in measured[warmup:]]
                out.cpu_seconds += [cpu for _, cpu in measured[warmup:]]
                if exit_seconds is not None:
                    out.exit_seconds.append(exit_seconds)
                ms = statistics.median(out.seconds) * 1e3
                print(f"[{mode}] round {r} {setup.name}: median so far {ms:.1f} ms", flush=True)


def machine_description() -> str:
    """CPU model, cores, torch threads and version, and the load at start."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.+)", cpuinfo)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{model.group(1) if model else platform.processor()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"load average at start {load} (shared machine)"
    )


def table(results: dict[str, Measurements]) -> list[str]:
    """Markdown rows: absolute medians and ratios vs ``no hooks``."""
    base = results["no hooks"]
    base_s, base_cpu, base_mib = (
        statistics.median(v) for v in (base.seconds, base.cpu_seconds, base.peak_mib)
    )
    lines = [
        "| configuration | wall ms / step | x no hooks | CPU ms / step | x no hooks "
        "| peak extra MiB / step | x no hooks | collect() exit ms |",
        "|:--|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in results.items():
        s, cpu, mib = (statistics.median(v) for v in (m.seconds, m.cpu_seconds, m.peak_mib))
        exit_ms = f"{statistics.median(m.exit_seconds) * 1e3:.1f}" if m.exit_seconds else "–"
        lines.append(
            f"| {name} | {s * 1e3:.1f} | {s / base_s:.2f} | {cpu * 1e3:.1f} | "
            f"{cpu / base_cpu:.2f} | {mib:.1f} | {mib / base_mib:.2f} | {exit_ms} |"
        )
    return lines


def layer_counts() -> str:
    """'N parameterized modules (a Embedding, b LayerNorm, c Linear)' of the model."""
    counts: dict[str, int] = {}
    for module in build_model().modules():
        if any(True for _ in module.parameters(recurse=False)):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    parts = ", ".join(f"{n} `{t}`" for t, n in sorted(counts.items()))
    return f"{sum(counts.values())} parameterized modules ({parts})"


def write_markdown(train: dict, frozen: dict, args, out: Path, elapsed: float) -> None:
    """Write both tables with the setup description."""
    import transformers

    cfg = ", ".join(f"{k}={v}" for k, v in MODEL_CONFIG.items())
    n_timed = args.steps * args.rounds
    lines = [
        "# Capture overhead benchmark",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {machine_description()}; transformers {transformers.__version__}",
        f"- Total benchmark time {elapsed:.0f} s.",
        f"- Model: `GPTNeoXForCausalLM({cfg})`, float32, CPU; batch {BATCH} x {SEQ} random "
        "tokens, loss `model(input_ids, labels=input_ids).loss`. GPT-NeoX (not GPT-2) "
        "because its projections are `nn.Linear`, which invasive capture needs (GPT-2 uses "
        "HF `Conv1D`); all rows use this model.",
        f"- Time: median per step over {n_timed} timed steps ({args.rounds} interleaved "
        f"rounds of {args.steps}, each after {args.warmup} warm-up steps). `wall`: "
        "`time.perf_counter`; `CPU`: `time.process_time` (all threads of the process, "
        "including the async writer's), less sensitive to other jobs on a shared machine. "
        f"torch runs with {args.threads} intra-op thread(s) (`--threads`) to avoid "
        "oversubscribing the shared cores.",
        "- Memory (separate pass before the timing, "
        f"{args.memory_steps} steps per configuration after {args.warmup} warm-up steps): "
        "peak extra host memory per step = `VmHWM` (reset through "
        "`/proc/self/clear_refs` before the step) minus `VmRSS` before the step, median "
        "over the measured steps. It covers activations, gradients, optimizer temporaries and "
        "the step's captures; memory already resident before the step (weights, AdamW "
        "state, the previous step's kept record) is not counted. In this pass glibc's mmap "
        "threshold is pinned at 128 KiB (every large tensor mapped fresh, unmapped on "
        "free); small heap-recycled allocations are not counted. The timing runs after it "
        "with the threshold at 32 MiB (glibc's ceiling for its dynamic threshold).",
        "- `collect() exit`: time to leave the capture context (OffloadCallback flushes "
        "the staged record and drains/closes the async writer), once per round; not part "
        "of the step time.",
        f"- Capture rows: `linear_io=REGISTER_ALL` hooks all {layer_counts()}; "
        "`nn.Linear only` and invasive hook the `Linear` modules. Offload: "
        "`OffloadCallback(offload_interval=1, "
        'recording_type="per_batch")` into a fresh on-disk (memmap) '
        "`GradientStorageManager` in a temporary directory.",
        "",
        "## Training step (zero_grad + forward + backward + AdamW.step)",
        "",
        *table(train),
        "",
        "## Frozen probe (zero_grad + forward + backward; no optimizer step)",
        "",
        "Invasive capture skips the `nn.Linear` weight/bias gradients, so it cannot train "
        "and appears only here.",
        "",
        *table(frozen),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Run both modes and write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "capture_overhead.md")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--memory-steps", type=int, default=5, help="steps of the memory pass")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    train = {s.name: Measurements() for s in SETUPS if s.trains}
    frozen = {s.name: Measurements() for s in SETUPS}
    # Memory first, on a fresh heap (after the timing its freed pages would be reused).
    pin_glibc_mmap_threshold(128 * 1024)
    run("train", args.memory_steps, args.warmup, 1, train, "memory")
    run("frozen", args.memory_steps, args.warmup, 1, frozen, "memory")
    pin_glibc_mmap_threshold(32 * 2**20)  # glibc's dynamic-threshold ceiling on 64-bit
    run("train", args.steps, args.warmup, args.rounds, train, "time")
    run("frozen", args.steps, args.warmup, args.rounds, frozen, "time")
    write_markdown(train, frozen, args, args.out, time.perf_counter() - start)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

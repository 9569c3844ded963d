"""Trajectory methods against Grad-Dot on the same recorded run (CPU).

Workload (the TSLOO-like run of ``experiments/fidelity/``, larger): a GPT-2 from a
config (2 layers, hidden 64, 4 heads, 744-word vocabulary, 16 positions, untied head),
every block ``Conv1D`` and the LM head trained and captured (p ≈ 147k coordinates),
256 random training sequences in 16 AdamW steps of 16 (lr 1e-3, weight decay 0.01,
clip 1.0, sum loss), 64 query sequences at the final parameters. The run is captured
once (per-sample gradients of every step, the Adam moments around every update,
``lr_schedule.json``); a second capture keeps a ``"mask"`` projection of 1024
coordinates per layer, a third each sample's Adam update direction on those
coordinates (LESS's preconditioned capture). Every method then scores the same
stores, query-side propagation, one torch thread:

* Grad-Dot (``P``): ``TracInAttributor.attribute_from_cache`` over the trajectory store
  (every step's rows against the queries, unit weights);
* trajectory TracIn (lr-weighted; rows ``η_t c_t <g, q>``);
* DVEmb, full and block-diagonal curvature;
* AdamW-influence over every coordinate, with 8 disjoint coordinate groups, and on the
  masked store;
* LESS on the preconditioned store, against Grad-Dot on that store (``P''``).

Each method is timed after a warm-up call, median of ``--repeats`` calls; peak memory is
the growth of the process's peak resident set (``VmHWM`` reset through
``/proc/self/clear_refs``) over the resident size before the call. Methods the installed
version does not have are reported as not run.

    python experiments/benchmark/trajectory.py            # writes results/trajectory.md
    python experiments/benchmark/trajectory.py --repeats 1 --out /tmp/t.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch
from throughput import machine_line, read_status_kib

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = [r"\.(c_attn|c_proj|c_fc)$", r"^lm_head$"]
VOCAB, SEQ, N_TRAIN, BATCH, N_QUERIES = 744, 16, 256, 16, 64
MASK = {"__default__": {"style": "mask", "proj_dim": 1024}}


def build_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    import re

    for name, module in model.named_modules():
        trained = any(re.search(pattern, name) for pattern in LAYERS)
        for param in module.parameters(recurse=False):
            param.requires_grad_(trained)
    return model


def sequences(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def summed_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum"
    ) / (SEQ - 1)


def capture(root: Path, projection: dict | None, precondition: bool = False) -> dict:
    """Train once under the hooks; return the AdamW dynamics (stores written under ``root``).

    ``precondition``: capture each sample's Adam update direction (LESS's train side).
    """
    from dattri_llm import (
        GradientStorageManager,
        HookManager,
        HookManagerConfig,
        OffloadCallback,
        OptimizerStateCallback,
    )
    from dattri_llm.attribution.utils import write_lr_schedule

    model = build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    config = HookManagerConfig(linear_io=LAYERS, projection_kwargs=projection)
    store = GradientStorageManager(root / "train")
    state = OptimizerStateCallback(model, optimizer, projection_kwargs=projection)
    hm = HookManager(
        model,
        config=config,
        callbacks=[OffloadCallback(1, store), state],
        optimizer=optimizer if precondition else None,
    )
    train = sequences(N_TRAIN, 1)
    lrs = {}
    with hm.collect():
        for t in range(N_TRAIN // BATCH):
            lrs[t] = 1e-3 * (N_TRAIN // BATCH - t) / (N_TRAIN // BATCH)
            for group in optimizer.param_groups:
                group["lr"] = lrs[t]
            optimizer.zero_grad(set_to_none=True)
            summed_loss(model, train[t * BATCH : (t + 1) * BATCH]).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            state.record_post(t)
    hm.remove()
    write_lr_schedule(root / "train", lrs)
    if hasattr(state, "save"):
        state.save(root / "train")
    queries = GradientStorageManager(root / "test")
    qhm = HookManager(model, config=config, callbacks=[OffloadCallback(1, queries)])
    with qhm.collect():
        summed_loss(model, sequences(N_QUERIES, 2)).backward()
    qhm.remove()
    return {"dynamics": state.dynamics(), "lrs": lrs}


def methods(
    root: Path, masked: Path, preconditioned: Path, captured: dict, masked_captured: dict
) -> dict:
    """``{name: call}`` of every method the installed version offers."""
    import dattri_llm
    from dattri_llm import AttributionArguments

    args = AttributionArguments(output_dir=tempfile.mkdtemp(), use_cpu=True)
    train, test = root / "train", root / "test"
    calls = {
        "Grad-Dot (P)": lambda: dattri_llm.TracInAttributor(args).attribute_from_cache(train, test),
        "DVEmb, full H": lambda: dattri_llm.DVEmbAttributor(args).attribute_from_cache(
            train, test, propagation="test", loss_reduction="sum", learning_rate=captured["lrs"]
        ),
        "DVEmb, diagonal H": lambda: dattri_llm.DVEmbAttributor(args).attribute_from_cache(
            train,
            test,
            propagation="test",
            loss_reduction="sum",
            hessian_mode="diagonal",
            learning_rate=captured["lrs"],
        ),
        "AdamW-influence, every coordinate": lambda: adamw(args, train, test, captured, 1),
        "AdamW-influence, 8 coordinate groups": lambda: adamw(args, train, test, captured, 8),
        "Grad-Dot, masked store (P')": lambda: dattri_llm.TracInAttributor(
            args
        ).attribute_from_cache(masked / "train", masked / "test"),
        "AdamW-influence, masked store": lambda: adamw(
            args, masked / "train", masked / "test", masked_captured, 1
        ),
        "Grad-Dot, preconditioned store (P'')": lambda: dattri_llm.TracInAttributor(
            args
        ).attribute_from_cache(preconditioned / "train", preconditioned / "test"),
        "LESS, preconditioned store": lambda: dattri_llm.LESSAttributor(args).attribute_from_cache(
            preconditioned / "train", preconditioned / "test"
        ),
    }
    if hasattr(dattri_llm, "TrajectoryTracInAttributor"):
        calls["trajectory TracIn (lr-weighted)"] = lambda: dattri_llm.TrajectoryTracInAttributor(
            args
        ).attribute_from_cache(train, test)
    return calls


def adamw(args, train, test, captured, num_masks):
    import dattri_llm

    return dattri_llm.AdamWInfluenceAttributor(args).attribute_from_cache(
        train, test, dynamics=captured["dynamics"], loss_reduction="sum", propagation="test",
        num_masks=num_masks,
    )  # fmt: skip


def measure(call, repeats: int) -> dict:
    call()  # warm-up
    seconds, peaks = [], []
    for _ in range(repeats):
        Path("/proc/self/clear_refs").write_text("5")
        before = read_status_kib("VmRSS")
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
        peaks.append((read_status_kib("VmHWM") - before) / 1024)
    return {"seconds": statistics.median(seconds), "peak_mib": max(peaks)}


def render(rows: dict[str, dict], total: float, repeats: int) -> str:
    bases = {
        "masked": rows["Grad-Dot, masked store (P')"]["seconds"],
        "preconditioned": rows["Grad-Dot, preconditioned store (P'')"]["seconds"],
    }
    p = rows["Grad-Dot (P)"]["seconds"]
    lines = [
        "# Trajectory methods against Grad-Dot (CPU)",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine_line()}. Produced by "
        f"`experiments/benchmark/trajectory.py` in {total / 60:.1f} min (median of {repeats} "
        "calls after a warm-up).",
        "",
        f"Workload: GPT-2 from config (2 layers, hidden 64, vocab {VOCAB}, {SEQ} positions), "
        f"{N_TRAIN} training sequences in {N_TRAIN // BATCH} AdamW steps of {BATCH} (clip 1.0), "
        f"{N_QUERIES} queries at the final parameters; block Conv1Ds and the LM head captured "
        "(every coordinate, or a 1024-coordinate mask per layer; LESS: each sample's Adam "
        "update direction on that mask). Query-side propagation, one torch thread. Peak = "
        "growth of peak RSS (VmHWM) over the RSS before the call.",
        "",
        "| method | seconds | × Grad-Dot on the same store | peak RSS growth (MiB) |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        base = next((v for k, v in bases.items() if k in name), p)
        lines.append(
            f"| {name} | {row['seconds']:.2f} | {row['seconds'] / base:.2f} | "
            f"{row['peak_mib']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "trajectory.md")
    parser.add_argument("--only", default=None, help="time only the methods containing this")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="trajectory_bench_"))
    full = capture(root / "full", None)
    masked = capture(root / "masked", MASK)
    capture(root / "preconditioned", MASK, precondition=True)
    rows = {}
    calls = methods(root / "full", root / "masked", root / "preconditioned", full, masked)
    for name, call in calls.items():
        if opts.only is None or opts.only in name or "Grad-Dot" in name:
            rows[name] = measure(call, opts.repeats)
            print(f"{name}: {rows[name]['seconds']:.2f} s, {rows[name]['peak_mib']:.0f} MiB")
    report = render(rows, time.perf_counter() - start, opts.repeats)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()

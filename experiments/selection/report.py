"""The look-ahead selection experiment's results: one ``Cell`` per run, the tables, plots and
``lookahead.md`` rendered from them, and ``lookahead.json`` written and read back (used by
``lookahead.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixtures import BATCH, KEEP_FRACTION, LLAMA, MIXTURES, SEQ, VOCAB  # noqa: E402


# ---------------------------------------------------------------------------- results
@dataclass
class Cell:
    """One (mixture, learning rate, seed, method) result."""

    mixture: str
    lr: float
    seed: int
    method: str
    curve: dict[int, float]
    seconds_per_step: float
    dropped: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def final(self) -> float:
        """Target loss after the last step."""
        return self.curve[max(self.curve)]

    @property
    def tail(self) -> float:
        """Mean target loss over the last 4 evaluations (less sensitive to the last step)."""
        last = sorted(self.curve)[-4:]
        return sum(self.curve[s] for s in last) / len(last)


def method_names(horizons: Sequence[int], offline: bool = True) -> list[str]:
    """Row names in table order."""
    looks = [f"look-ahead K={k}" for k in horizons]
    return ["none", "grad-dot", *looks, *(["offline"] if offline else [])]


def methods_of(args: argparse.Namespace) -> list[str]:
    """The rows a run with ``args`` produces."""
    return method_names(args.horizons, getattr(args, "offline", True))


# ---------------------------------------------------------------------------- reporting
def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def finals(
    cells: list[Cell], mixture: str, method: str, lr: float, metric: str = "final"
) -> list[float]:
    """One value per seed: ``"final"`` target loss or its ``"tail"`` mean."""
    chosen = [c for c in cells if (c.mixture, c.method, c.lr) == (mixture, method, lr)]
    return [getattr(c, metric) for c in chosen]


def loss_table(
    cells: list[Cell], mixture: str, methods: list[str], lrs: list[float], metric: str = "final"
) -> str:
    """Rows = methods, columns = learning rates, cells = ``metric`` mean ± s.e. over seeds;
    the best mean of each column in bold."""
    stats = {(m, lr): mean_se(finals(cells, mixture, m, lr, metric)) for m in methods for lr in lrs}
    best = {lr: min(stats[m, lr][0] for m in methods) for lr in lrs}
    lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |"]
    lines.append("|---|" + "---|" * len(lrs))
    for m in methods:
        row = []
        for lr in lrs:
            mean, se = stats[m, lr]
            text = f"{mean:.4f} ± {se:.4f}"
            row.append(f"**{text}**" if mean == best[lr] else text)
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def time_table(cells: list[Cell], methods: list[str]) -> str:
    """Mean milliseconds per optimizer step of each method over every run (offline: its
    reference run + query capture + attribution + retraining, per retraining step)."""
    lines = ["| method | ms / step | × none |", "|---|---|---|"]
    base = None
    for m in methods:
        ms = 1000 * mean_se([c.seconds_per_step for c in cells if c.method == m])[0]
        base = base or ms
        lines.append(f"| {m} | {ms:.1f} | {ms / base:.2f} |")
    offline = [c.stage_seconds for c in cells if c.method == "offline"]
    if offline:
        parts = ", ".join(
            f"{k} {sum(s[k] for s in offline) / len(offline):.2f} s" for k in offline[0]
        )
        lines.append("")
        lines.append(f"Offline stages, mean seconds per run: {parts}.")
    return "\n".join(lines)


def composition(cells: list[Cell], n_sources: int) -> list[float]:
    """Share of each source among the samples ``cells`` trained on (online: the kept rows
    of every batch; offline: the kept pool)."""
    counts = [0] * n_sources
    for c in cells:
        if c.method == "offline":
            kept = c.kept
        else:
            visits = BATCH // n_sources * max(c.curve)
            kept = [visits - (c.dropped[s] if c.dropped else 0) for s in range(n_sources)]
        counts = [a + b for a, b in zip(counts, kept)]
    total = sum(counts) or 1
    return [n / total for n in counts]


def composition_table(
    cells: list[Cell], mixture: str, methods: list[str], names: list[str], lrs: list[float]
) -> str:
    """Rows = methods, columns = learning rates, cells = the percent share of each source
    (in ``names`` order, ``/``-separated) among the samples trained on, over the seeds."""
    lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |"]
    lines.append("|---|" + "---|" * len(lrs))
    for m in methods:
        row = []
        for lr in lrs:
            chosen = [c for c in cells if (c.mixture, c.method, c.lr) == (mixture, m, lr)]
            row.append("/".join(f"{100 * x:.0f}" for x in composition(chosen, len(names))))
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def heatmaps(cells: list[Cell], mixtures, methods, lrs, path: Path) -> None:
    """Per mixture: rows = methods (K by K, then the references), columns = learning rates,
    annotated mean final target loss ± s.e.; colour = log2 of the mean over ``none``'s at
    the same learning rate (blue: better than no selection); the best look-ahead ``K`` of
    each column is boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    horizons = [m for m in methods if m.startswith("look-ahead")]
    order = horizons + [m for m in methods if m not in horizons]
    fig, axes = plt.subplots(
        1, len(mixtures), figsize=(4.6 * len(mixtures), 0.45 * len(order) + 1.8), squeeze=False
    )
    for ax, mixture in zip(axes[0], mixtures):
        stats = [[mean_se(finals(cells, mixture, m, lr)) for lr in lrs] for m in order]
        means = torch.tensor([[s[0] for s in row] for row in stats])
        ratio = (means / means[order.index("none")]).log2()
        bound = max(float(ratio.abs().max()), 1e-3)
        image = ax.imshow(ratio, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        for i, row in enumerate(stats):
            for j, (mean, se) in enumerate(row):
                dark = abs(float(ratio[i, j])) > 0.6 * bound
                text = f"{mean:.3f}\n±{se:.3f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")  # fmt: skip
        if horizons:
            for j in range(len(lrs)):
                i = int(means[: len(horizons), j].argmin())
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec="k"))
            ax.axhline(len(horizons) - 0.5, color="k", lw=1)
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_yticks(range(len(order)), order)
        ax.set_xlabel("learning rate")
        ax.set_title(f"mixture {mixture}: final target loss", fontsize=10)
        fig.colorbar(image, ax=ax, label="log2(loss / no selection)", shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paired(cells: list[Cell], mixture: str, lr: float, a: str, b: str) -> tuple[float, float]:
    """Mean ± s.e. over seeds of ``final(a) − final(b)`` (same seed = same pool and init)."""
    by = {(c.method, c.seed): c.final for c in cells if (c.mixture, c.lr) == (mixture, lr)}
    seeds = sorted({seed for method, seed in by if method == a and (b, seed) in by})
    return mean_se([by[a, s] - by[b, s] for s in seeds])


def horizon_table(cells: list[Cell], mixture: str, methods: list[str], lrs: list[float]) -> str:
    """Per learning rate: the look-ahead horizon of lowest mean loss and paired differences
    (negative = the first is lower) against ``offline`` (when run) and ``none``."""
    horizons = [m for m in methods if m.startswith("look-ahead")]
    pairs = [("best", "none"), ("grad-dot", "none"), (horizons[0], "grad-dot")]
    if "offline" in methods:
        pairs = [("best", "offline"), (horizons[0], "offline"), *pairs, ("offline", "none")]
    short = {"best": "best K"} | {m: m.replace("look-ahead ", "") for m in horizons}
    heads = " | ".join(f"{short.get(a, a)} − {b}" for a, b in pairs)
    lines = [f"| lr | best K (mean) | {heads} |", "|---|---|" + "---|" * len(pairs)]
    for lr in lrs:
        best = min(horizons, key=lambda m: mean_se(finals(cells, mixture, m, lr))[0])
        row = []
        for a, b in pairs:
            mean, se = paired(cells, mixture, lr, best if a == "best" else a, b)
            row.append(f"{mean:+.4f} ± {se:.4f}")
        lines.append(f"| {lr:g} | {best.split('=')[1]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def curves(cells: list[Cell], mixtures, methods, lrs, path: Path) -> None:
    """Mean target-loss curve of each method, one panel per (mixture, learning rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(mixtures),
        len(lrs),
        figsize=(3.6 * len(lrs), 3 * len(mixtures)),
        squeeze=False,
        sharey=True,
    )
    for row, mixture in zip(axes, mixtures):
        for ax, lr in zip(row, lrs):
            for m in methods:
                runs = [c.curve for c in cells if (c.mixture, c.method, c.lr) == (mixture, m, lr)]
                steps = sorted(runs[0])
                mean = [sum(r[s] for r in runs) / len(runs) for s in steps]
                style = "--" if m in ("none", "offline", "grad-dot") else "-"
                ax.plot(steps, mean, style, label=m, lw=1.2)
            ax.set_yscale("log")
            ax.set_title(f"mixture {mixture}, lr {lr:g}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("target loss")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine() -> str:
    """CPU model (``lscpu``: model name, family, hypervisor) and ``nproc``."""
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    except OSError:
        pass
    model = fields.get("Model name", platform.processor() or "unknown CPU").strip()
    for key, label in (("CPU family", "family"), ("Hypervisor vendor", "hypervisor")):
        if key in fields:
            model += f", {label} {fields[key].strip()}"
    return f"{model}, nproc {os.cpu_count()}"


def report(cells: list[Cell], args: argparse.Namespace, meta: dict) -> str:
    """The results document's tables (the hand-written reading is kept by :func:`write`)."""
    lrs, methods = args.lrs, methods_of(args)
    lines = [
        "# Online look-ahead vs offline data selection"
        + ("" if getattr(args, "curvature", True) else ": look-ahead without the coupling"),
        "",
        f"Generated by `lookahead.py{' --smoke' if args.smoke else ''}` on {meta['date']}; "
        f"machine: {meta['machine']}; torch {meta['torch']}, {args.threads} thread(s); "
        f"wall time {meta['wall_seconds'] / 60:.1f} min (shared machine).",
        "",
        f"Setting: tiny Llama (hidden {LLAMA['hidden_size']}, {LLAMA['num_hidden_layers']} "
        f"layers, vocab {VOCAB}, sequence {SEQ}); pool = half the sample visits (each sample "
        "seen twice without selection); "
        f"{args.steps} AdamW steps of batch {BATCH}; seeds {args.seeds}; online rows keep the "
        f"top {KEEP_FRACTION:.0%} of each batch, offline keeps the top {KEEP_FRACTION:.0%} of "
        f"the pool. Look-ahead score: `{args.lookahead_score}`, Gauss–Newton coupling "
        f"{'on' if getattr(args, 'curvature', True) else 'off'}. Cells: final held-out target "
        "(count-up) loss, mean ± standard error over seeds; bold = best mean of the column.",
    ]
    for mixture in args.mixtures:
        names = list(MIXTURES[mixture])
        lines += [
            "",
            f"## Mixture {mixture} ({', '.join(names)})",
            "",
            loss_table(cells, mixture, methods, lrs),
            "",
            "Paired differences of final target loss over seeds (negative = the first is "
            "lower; the best K is picked on these same seeds, so its row is optimistic):",
            "",
            horizon_table(cells, mixture, methods, lrs),
            "",
            f"Percent share of each source ({' / '.join(names)}) among the samples trained "
            "on (online: rows kept in the batches; offline: the kept pool), over the seeds:",
            "",
            composition_table(cells, mixture, methods, names, lrs),
            "",
            "Robustness: mean target loss over the last 4 evaluations (the last "
            f"{3 * args.eval_every} steps), mean ± s.e. over seeds:",
            "",
            loss_table(cells, mixture, methods, lrs, metric="tail"),
        ]
    lines += ["", "## Step time", "", time_table(cells, methods), ""]
    return "\n".join(lines)


READING = "## Reading"


def write(cells: list[Cell], args: argparse.Namespace, meta: dict) -> None:
    """Plots, ``lookahead.md`` (keeping a hand-written section from ``READING`` on) and the
    raw ``lookahead.json`` under ``args.out``."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    methods = methods_of(args)
    heatmaps(cells, args.mixtures, methods, args.lrs, out / "lookahead_heatmap.png")
    curves(cells, args.mixtures, methods, args.lrs, out / "lookahead_curves.png")
    document = out / "lookahead.md"
    kept = ""
    if document.exists() and READING in document.read_text():
        kept = READING + document.read_text().split(READING, 1)[1]
    document.write_text(report(cells, args, meta) + ("\n" + kept if kept else ""))
    raw = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},  # no machine paths
        "meta": meta,
        "cells": [asdict(c) for c in cells],
    }
    (out / "lookahead.json").write_text(json.dumps(raw, indent=1))


def load(path: Path) -> tuple[list[Cell], argparse.Namespace, dict]:
    """Cells, arguments and run metadata of a written ``lookahead.json``."""
    raw = json.loads(path.read_text())
    cells = []
    for c in raw["cells"]:
        c["curve"] = {int(k): v for k, v in c["curve"].items()}
        cells.append(Cell(**c))
    args = argparse.Namespace(**raw["args"])
    args.out = path.parent
    meta = raw.get("meta") or run_meta(raw["wall_seconds"], args.threads)
    return cells, args, meta


def run_meta(wall: float, threads: int) -> dict:
    """Date, machine, torch version, threads and wall time of a run."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": threads,
        "wall_seconds": wall,
    }

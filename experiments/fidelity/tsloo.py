"""TSLOO fidelity experiment (seed paper §4.2, appendix B.2) scaled to CPU.

1. Pretrain a small GPT-2 on part of the quickstart corpus (no download).
2. Fine-tune it along one fixed AdamW trajectory (seeded order, warm-up +
   linear decay, dropout 0, one torch thread, deterministic kernels).
3. Ground truth: for each removed sample ``i``, replay EXACTLY that trajectory
   without ``i`` and record ``Δ[i, j] = L_j(θ_T^{-i}) − L_j(θ_T)`` on every
   query ``j`` (positive: ``i`` helped ``j``).
4. Capture the trajectory once with the library (``capture.py``) and score
   every method of the registry (``methods.py``) from the stores.
5. Fidelity: per query, the Spearman correlation between a method's scores of
   the removed samples and ``Δ[:, j]``; mean ± standard error over queries.
6. Noise ceiling: the same statistic between the float32 ground truth and a
   float64 replay of the whole protocol (see README.md).

Writes ``results/tsloo.md`` and ``results/tsloo.png`` (``--out DIR``); with
``--setting trainer`` (the Hugging Face ``Trainer`` defaults: mean loss, clip
1.0, no-decay biases and norms) ``results/tsloo_trainer.{md,png}``.

Run:  python experiments/fidelity/tsloo.py [--setting trainer] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from methods import NEEDS, exported, unavailable  # noqa: E402
from scoring import (  # noqa: E402
    MEMORY_NOTE,
    Scored,
    capture_with_model,
    fresh_model,
    prepare,
    score_matrices,
)
from setting import (  # noqa: E402
    SMOKE,
    TRAINER,
    TRAINER_SMOKE,
    Data,
    Setting,
    finetuned_parameters,
    lr_schedule,
    query_losses,
    run_trajectory,
)

__all__ = ["fresh_model", "loo_ground_truth", "mean_se", "ranks", "spearman_per_query"]

RESULTS = Path(__file__).resolve().parent / "results"
FIRST_ORDER_EPSILON = 1e-4


# ---------------------------------------------------------------------------- ground truth
def loo_ground_truth(
    start: dict[str, torch.Tensor],
    setting: Setting,
    data: Data,
    dtype: torch.dtype,
    epsilon: float | None = None,
) -> torch.Tensor:
    """``Δ (num_removed, num_query)`` in ``dtype``: query-loss change on removing each sample.

    Every replay starts from the same pretrained weights ``start``. With
    ``epsilon`` the sample is only down-weighted to ``1 − ε`` and ``Δ/ε`` is
    returned: the infinitesimal (first-order) removal effect.
    """
    model = fresh_model(start, setting, data, dtype)
    run_trajectory(model, setting, data)
    reference = query_losses(model, data)
    weight = 0.0 if epsilon is None else 1.0 - epsilon
    deltas = []
    for removed in data.removed:
        model = fresh_model(start, setting, data, dtype)
        run_trajectory(model, setting, data, removed=removed, removed_weight=weight)
        deltas.append(query_losses(model, data) - reference)
    return torch.stack(deltas) / (1.0 if epsilon is None else epsilon)


# ---------------------------------------------------------------------------- metrics
def ranks(values: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank) along dim 0 of ``(n, m)``."""
    n = values.shape[0]
    order = values.argsort(dim=0)
    sorted_values = values.gather(0, order)
    positions = torch.arange(n, dtype=torch.float64).unsqueeze(1).expand_as(values).clone()
    for col in range(values.shape[1]):  # average over runs of equal values
        start = 0
        for i in range(1, n + 1):
            if i == n or sorted_values[i, col] != sorted_values[start, col]:
                positions[start:i, col] = (start + i - 1) / 2
                start = i
    result = torch.empty_like(positions)
    result.scatter_(0, order, positions)
    return result


def spearman_per_query(scores: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """``(num_query,)`` Spearman correlations between the columns of two ``(n, m)`` matrices."""
    a, b = ranks(scores.double()), ranks(truth.double())
    a, b = a - a.mean(0), b - b.mean(0)
    denom = (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-300)
    return (a * b).sum(0) / denom


def mean_se(values: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error over queries."""
    n = values.numel()
    return float(values.mean()), float(values.std() / math.sqrt(n)) if n > 1 else 0.0


# ---------------------------------------------------------------------------- report
def machine() -> str:
    """CPU model and core count from ``lscpu``, torch threads and versions."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        cpu = f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPU(s)"
        cpu += f" (nproc {len(os.sched_getaffinity(0))})"
    except (OSError, subprocess.CalledProcessError):
        cpu = "lscpu unavailable"
    import transformers

    return (
        f"{cpu}; torch {torch.__version__} with {torch.get_num_threads()} thread, "
        f"transformers {transformers.__version__}"
    )


def write_table(rows: list[dict], info: dict, out: Path) -> Path:
    """``tsloo.md``: settings, the fidelity table, what was skipped."""
    s: Setting = info["setting"]
    lines = [
        "# TSLOO fidelity (CPU scale)"
        + (" — Hugging Face Trainer defaults" if s.name == "trainer" else ""),
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {info['machine']}",
        f"- Total run time {info['total']:.0f} s (ground truth {info['truth']:.0f} s, "
        f"float64 reference replays {info['ceiling_time']:.0f} s, captures "
        f"{info['capture']:.0f} s).",
        f"- Model: GPT-2 (`GPT2Config`, n_embd={s.n_embd}, n_layer={s.n_layer}, "
        f"n_head={s.n_head}, vocab {info['vocab']}, 16 positions, dropout 0, untied LM head), "
        f"pretrained {s.pretrain_epochs} epochs (lr {s.pretrain_lr}) on "
        f"{info['num_pretrain']} quickstart-corpus sentences.",
        f"- Trajectory: {s.num_steps} AdamW steps (batch {s.finetune_batch}, "
        f"{s.num_finetune} fine-tuning sentences, {s.finetune_epochs} epoch(s), seeded order), "
        f"peak lr {s.peak_lr} with {max(1, round(s.warmup_fraction * s.num_steps))}-step warm-up "
        f"then linear decay, betas {s.betas}, eps {s.eps}, weight decay {s.weight_decay}"
        + (
            " on weights only (biases and LayerNorm weights in a no-decay group)"
            if s.no_decay
            else " on every trained parameter"
        )
        + (
            f", global gradient norm clipped at {s.max_grad_norm} (active on "
            f"{info['clipped_steps']} of {s.num_steps} steps)"
            if s.max_grad_norm
            else ", no clipping"
        )
        + f"; trained (and hooked): `{'`, `'.join(s.hooked_layers)}` "
        f"({info['num_params']} parameters); embeddings"
        + ("" if s.train_norms else " and LayerNorms")
        + " frozen. "
        + (
            "Batch loss = mean over the batch of per-sentence mean token losses; removing a "
            "sample zeroes its term and keeps the divisor."
            if s.loss_reduction == "mean"
            else "Batch loss = sum of per-sentence mean token losses."
        ),
        f"- TSLOO: {len(info['removed'])} leave-one-out replays (fine-tuning samples "
        f"{info['removed_desc']}), {info['num_queries']} held-out queries; "
        f"ground truth Δ = L(θ_T without i) − L(θ_T), mean |Δ| = {info['mean_abs_delta']:.2e}.",
        "- Sign convention: every score is positive when the sample HELPS the query "
        "(removing it raises the query loss), the sign of Δ.",
        "- Fidelity: per query, Spearman between scores and Δ over the removed samples; "
        "mean ± standard error over queries.",
        "- Attribution seconds: scoring from the stores plus the captures only that method needs "
        "(the frozen pass at θ_T for single-checkpoint methods, the query passes at every "
        "checkpoint for TracIn / LESS); training and the capture during training excluded (B.2). "
        "STRIDE needs no capture: its seconds are the operator fit on the fine-tuning samples at "
        "θ_T, the query measurement and the Lasso.",
        f"- {MEMORY_NOTE[0].upper()}{MEMORY_NOTE[1:]}.",
        "",
        "| method | mean Spearman ± s.e. | attribution s | peak MiB | notes |",
        "|:--|--:|--:|--:|:--|",
    ]
    for row in rows:
        seconds = "–" if row["seconds"] is None else f"{row['seconds']:.2f}"
        peak = "–" if row.get("peak_mib") is None else f"{row['peak_mib']:.1f}"
        lines.append(
            f"| {row['name']} | {row['mean']:+.3f} ± {row['se']:.3f} | {seconds} | {peak} "
            f"| {row['note']} |"
        )
    for name, reason in info["skipped"].items():
        lines.append(f"| {name} | not run | – | – | {reason} |")
    if info["unexported"]:
        lines += [
            "",
            f"Not exported from `dattri_llm` at the time of the run (imported from their "
            f"modules): {', '.join(info['unexported'])}.",
        ]
    lines += [
        "",
        "Noise ceiling: the float32 ground truth against a float64 replay of the same "
        "protocol (same pretrained weights cast to float64, same order, same schedule). "
        "Repeated float32 replays are bit-identical "
        f"({'checked' if info['bitwise'] else 'NOT bit-identical'}), so rounding is the only "
        "noise left.",
        "",
        "First-order limit: the exact infinitesimal removal effect, (L(θ_T with the sample's "
        f"loss weighted 1 − ε) − L(θ_T)) / ε with ε = {FIRST_ORDER_EPSILON:g}, by float64 "
        "replays of the same trajectory, against the same ground truth. A first-order method "
        "that were exact (every coordinate, the true Hessians, the exact AdamW maps) would "
        "score this; the gap to 1 is the Taylor error of removing a whole sample.",
    ]
    path = out / f"{stem(s)}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def stem(setting: Setting) -> str:
    """File stem of a setting's results: ``tsloo`` or ``tsloo_<name>``."""
    return "tsloo" if setting.name == "default" else f"tsloo_{setting.name}"


def write_plot(rows: list[dict], out: Path, setting: Setting) -> Path:
    """``tsloo.png``: fidelity against attribution time (log x); references as dashed lines.

    The references are the rows without a time (ceiling, first-order limit) and the
    random baseline, whose time is meaningless.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    markers = "osD^v<>pPX*h"
    methods = [r for r in rows if r["seconds"] is not None and r["name"] != "Random"]
    for k, row in enumerate(methods):
        ax.errorbar(row["seconds"], row["mean"], yerr=row["se"], fmt=markers[k % len(markers)],
                    capsize=3, label=f"{row['name']} ({row['mean']:.2f})")  # fmt: skip
    styles = iter(["--", ":", "-."])
    for row in rows:
        if row["seconds"] is None or row["name"] == "Random":
            ax.axhline(row["mean"], ls=next(styles, "--"), lw=1, color="gray",
                       label=f"{row['name']} ({row['mean']:.2f})")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("attribution time (s, log scale)")
    ax.set_ylabel("mean query-wise Spearman with TSLOO")
    ax.set_title("TSLOO fidelity vs attribution time (CPU)")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    path = out / f"{stem(setting)}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main
def score_methods(captured, truth: torch.Tensor, removed: list[int]) -> list[dict]:
    """Run every available registry entry; its fidelity, attribution time and peak memory."""
    return [fidelity_row(scored, truth, removed) for scored in score_matrices(captured)]


def fidelity_row(scored: Scored, truth: torch.Tensor, removed: list[int]) -> dict:
    """A table row: the method's TSLOO Spearman (mean ± s.e. over queries) and its costs."""
    mean, se = mean_se(spearman_per_query(scored.scores[removed], truth))
    print(f"  {scored.name:<24} {mean:+.3f} ± {se:.3f}  {scored.seconds:7.2f} s", flush=True)
    return {
        "name": scored.name,
        "mean": mean,
        "se": se,
        "seconds": scored.seconds,
        "peak_mib": scored.peak_mib,
        "note": scored.note,
    }


def run(setting: Setting, out: Path) -> Path:
    """The whole protocol; returns the table's path."""
    t0 = time.perf_counter()
    prepared = prepare(setting)
    data, start = prepared.data, prepared.start
    print(f"{setting.num_steps} steps, lrs {[f'{x:.2g}' for x in lr_schedule(setting)]}")

    t = time.perf_counter()
    truth = loo_ground_truth(start, setting, data, torch.float32)
    truth_time = time.perf_counter() - t
    t = time.perf_counter()
    ceiling = mean_se(
        spearman_per_query(loo_ground_truth(start, setting, data, torch.float64), truth)
    )
    first_order = mean_se(
        spearman_per_query(
            loo_ground_truth(start, setting, data, torch.float64, epsilon=FIRST_ORDER_EPSILON),
            truth,
        )
    )
    ceiling_time = time.perf_counter() - t
    print(
        f"ground truth {truth_time:.0f} s; ceiling {ceiling[0]:.3f}, first-order limit "
        f"{first_order[0]:.3f} ({ceiling_time:.0f} s)"
    )

    reference_model, bitwise = prepared.reference_model, prepared.bitwise

    with tempfile.TemporaryDirectory(prefix="tsloo_") as work:
        t = time.perf_counter()
        captured = capture_with_model(prepared, Path(work))
        capture_time = time.perf_counter() - t
        rows = score_methods(captured, truth, data.removed)
        clip_coefficients = [captured.clip(step) for step in sorted(captured.dynamics)]
    rows.append(
        {
            "name": "Noise ceiling (float32 vs float64 TSLOO)",
            "mean": ceiling[0],
            "se": ceiling[1],
            "seconds": None,
            "note": "reference, not a method",
        }
    )
    rows.append(
        {
            "name": "First-order limit (exact ∂L/∂w by replay)",
            "mean": first_order[0],
            "se": first_order[1],
            "seconds": None,
            "note": f"reference: replays with weight 1 − {FIRST_ORDER_EPSILON:g}",
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    removed = data.removed
    info = {
        "setting": setting,
        "machine": machine(),
        "total": time.perf_counter() - t0,
        "truth": truth_time,
        "ceiling_time": ceiling_time,
        "capture": capture_time,
        "vocab": data.vocab_size,
        "num_pretrain": len(data.pretrain),
        "num_params": sum(p.numel() for p in finetuned_parameters(reference_model, setting)),
        "removed": removed,
        "removed_desc": "all" if len(removed) == setting.num_finetune else f"{removed}",
        "num_queries": len(data.queries),
        "mean_abs_delta": float(truth.abs().mean()),
        "bitwise": bitwise,
        "clipped_steps": sum(captured_clip < 1.0 for captured_clip in clip_coefficients),
        "skipped": unavailable(),
        "unexported": sorted({n for n in NEEDS.values() if not exported(n)}),
    }
    table = write_table(rows, info, out)
    plot = write_plot(rows, out, setting)
    print(f"wrote {table} and {plot} in {info['total']:.0f} s")
    return table


def main(argv: list[str] | None = None) -> Path:
    """Parse ``--setting`` / ``--smoke`` / ``--out`` and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setting", choices=["default", "trainer"], default="default",
        help="trainer: the Hugging Face Trainer defaults (mean loss, clip 1.0, no-decay groups)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="smallest setting (for the test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    args = parser.parse_args(argv)
    settings = {("default", False): Setting(), ("default", True): SMOKE,
                ("trainer", False): TRAINER, ("trainer", True): TRAINER_SMOKE}  # fmt: skip
    return run(settings[args.setting, args.smoke], args.out)


if __name__ == "__main__":
    main()

"""TSLOO fidelity experiment (seed paper §4.2, appendix B.2) scaled to CPU.

1. Pretrain a small GPT-2 on part of the quickstart corpus (no download).
2. Fine-tune it along one fixed AdamW trajectory (seeded order, warm-up +
   linear decay, dropout 0, one torch thread, deterministic kernels).
3. Ground truth (``dattri_llm.evaluation.leave_one_out``, ``protocol.py``): for each
   removed sample ``i``, replay EXACTLY that trajectory without ``i`` and record
   ``Δ[i, j] = L_j(θ_T^{-i}) − L_j(θ_T)`` on every query ``j`` (positive: ``i`` helped
   ``j``); resumable through ``--cache``.
4. Capture the trajectory once with the library (``capture.py``) and score
   every method of the registry (``methods.py``) from the stores.
5. Fidelity: per query, the Spearman correlation between a method's scores of
   the removed samples and ``Δ[:, j]`` (``evaluation.loo_correlation``); mean ±
   standard error and the library's bootstrap 95 % interval over queries.
6. Noise ceiling: the same statistic between the float32 ground truth and a
   float64 replay of the whole protocol (see README.md).

Writes ``results/tsloo.md`` and ``results/tsloo.png`` (``--out DIR``); with
``--setting trainer`` (the Hugging Face ``Trainer`` defaults: mean loss, clip
1.0, no-decay biases and norms) ``results/tsloo_trainer.{md,png}``.

Run:  python experiments/fidelity/tsloo.py [--setting trainer] [--smoke] [--out DIR]
          [--cache DIR | --no-cache]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from methods import exported, needed_classes, unavailable  # noqa: E402
from protocol import CACHE, Stat, loo_truth, machine, tsloo_stat  # noqa: E402
from scoring import (  # noqa: E402
    MEMORY_NOTE,
    Prepared,
    Scored,
    capture_with_model,
    prepare,
    score_matrices,
)
from setting import (  # noqa: E402
    SMOKE,
    TRAINER,
    TRAINER_SMOKE,
    Setting,
    finetuned_parameters,
    lr_schedule,
)

from dattri_llm.evaluation import LeaveOneOutResult, spearman  # noqa: E402

__all__ = ["main", "run"]

RESULTS = Path(__file__).resolve().parent / "results"


def write_table(rows: list[dict], info: dict, out: Path) -> Path:
    """``tsloo.md``: settings, the fidelity table, what was skipped."""
    s: Setting = info["setting"]
    lines = [
        "# TSLOO fidelity (CPU scale)"
        + (" — Hugging Face Trainer defaults" if s.name == "trainer" else ""),
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {info['machine']}",
        f"- Total run time {info['total']:.0f} s (ground truth {info['truth']:.0f} s"
        f"{info['cached']}, float64 reference replays {info['ceiling_time']:.0f} s, captures "
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
        "- Ground truth and metric from `dattri_llm.evaluation`: `leave_one_out` (retrains "
        "`train_fn(kept, seed)` = the pretrained start fine-tuned by `run_subset_trajectory` on "
        "the kept samples; the trajectory is deterministic, so the seed is unused) and "
        "`loo_correlation`.",
        "- Fidelity: per query, Spearman between scores and Δ over the removed samples; "
        "mean ± standard error over queries, and the library's bootstrap 95 % interval over "
        "queries (`mean_ci`, 2000 resamples, seed 0).",
        "- Attribution seconds: scoring from the stores plus the captures only that method needs "
        "(the frozen pass at θ_T for single-checkpoint methods, the query passes at every "
        "checkpoint for TracIn / LESS); training and the capture during training excluded (B.2). "
        "STRIDE needs no capture: its seconds are the operator fit on the fine-tuning samples at "
        "θ_T, the query measurement and the Lasso. The metagradient (MAGIC) reads the snapshots "
        "recorded during training (not charged) and is charged its forward replay and reverse "
        "sweep; TrackStar and TRAK their own gradient passes at θ_T; SOURCE its passes at the "
        "earlier segment ends plus the frozen pass at θ_T.",
        f"- {MEMORY_NOTE[0].upper()}{MEMORY_NOTE[1:]}.",
        "",
        "| method | mean Spearman ± s.e. | 95 % CI | attribution s | peak MiB | notes |",
        "|:--|--:|--:|--:|--:|:--|",
    ]
    for row in rows:
        seconds = "–" if row["seconds"] is None else f"{row['seconds']:.2f}"
        peak = "–" if row.get("peak_mib") is None else f"{row['peak_mib']:.1f}"
        lines.append(
            f"| {row['name']} | {row['stat'].cell()} | {row['stat'].ci()} | {seconds} | {peak} "
            f"| {row['note']} |"
        )
    for name, reason in info["skipped"].items():
        lines.append(f"| {name} | not run | – | – | – | {reason} |")
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
    ]
    lines += ["", *(row["footnote"] for row in rows if "footnote" in row)]
    path = out / f"{stem(s)}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def stem(setting: Setting) -> str:
    """File stem of a setting's results: ``tsloo`` or ``tsloo_<name>``."""
    return "tsloo" if setting.name == "default" else f"tsloo_{setting.name}"


def write_plot(rows: list[dict], out: Path, setting: Setting) -> Path:
    """``tsloo.png``: fidelity against attribution time (log x); references as dashed lines.

    The references are the rows without a time (the noise ceiling) and the random
    baseline, whose time is meaningless.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    palette = plt.cm.tab20.colors + plt.cm.tab20b.colors  # 40 colors: one per method
    markers = "osD^v<>pPX*h"
    methods = [r for r in rows if r["seconds"] is not None and r["name"] != "Random"]
    for k, row in enumerate(methods):
        stat = row["stat"]
        ax.errorbar(row["seconds"], stat.mean, yerr=stat.se, fmt=markers[k % len(markers)],
                    capsize=3, color=palette[k % len(palette)],
                    label=f"{row['name']} ({stat.mean:.2f})")  # fmt: skip
    styles = iter(["--", ":", "-."])
    for row in rows:
        if row["seconds"] is None or row["name"] == "Random":
            ax.axhline(row["stat"].mean, ls=next(styles, "--"), lw=1, color="gray",
                       label=f"{row['name']} ({row['stat'].mean:.2f})")  # fmt: skip
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
def fidelity_row(scored: Scored, truth: LeaveOneOutResult) -> dict:
    """A table row: the method's TSLOO Spearman (mean ± s.e., 95 % CI) and its costs."""
    stat = tsloo_stat(scored.scores, truth)
    print(f"  {scored.name:<24} {stat.cell()} {stat.ci()} {scored.seconds:7.2f} s", flush=True)
    return {
        "name": scored.name,
        "stat": stat,
        "seconds": scored.seconds,
        "peak_mib": scored.peak_mib,
        "note": scored.note,
    }


def noise_ceiling(prepared: Prepared, truth: LeaveOneOutResult, cache: Path | None) -> dict:
    """The float32 ground truth against the whole protocol replayed in float64.

    ``leave_one_out`` runs in float64 through a float64 ``train_fn`` (its own cache entry).
    """
    p = prepared
    double = loo_truth(p.start, p.setting, p.data, dtype=torch.float64, cache=cache)
    return {
        "name": "Noise ceiling (float32 vs float64 TSLOO)",
        "stat": Stat.over(spearman(double.delta, truth.delta)),
        "seconds": None,
        "peak_mib": None,
        "note": "reference, not a method",
    }


def run(setting: Setting, out: Path, cache: Path | None = CACHE) -> Path:
    """The whole protocol; returns the table's path."""
    t0 = time.perf_counter()
    prepared = prepare(setting)
    data = prepared.data
    print(f"{setting.num_steps} steps, lrs {[f'{x:.2g}' for x in lr_schedule(setting)]}")

    t = time.perf_counter()
    truth = loo_truth(prepared.start, setting, data, cache=cache)
    truth_time = time.perf_counter() - t
    t = time.perf_counter()
    references = [noise_ceiling(prepared, truth, cache)]
    ceiling_time = time.perf_counter() - t
    print(f"ground truth {truth_time:.0f} s; references {ceiling_time:.0f} s")

    with tempfile.TemporaryDirectory(prefix="tsloo_") as work:
        t = time.perf_counter()
        captured = capture_with_model(prepared, Path(work))
        capture_time = time.perf_counter() - t
        rows = [fidelity_row(scored, truth) for scored in score_matrices(captured)]
        clip_coefficients = [captured.clip(step) for step in sorted(captured.dynamics)]
    rows += references
    out.mkdir(parents=True, exist_ok=True)
    removed = data.removed
    info = {
        "setting": setting,
        "machine": machine(),
        "total": time.perf_counter() - t0,
        "truth": truth_time,
        "cached": "" if cache is None else " (retrains cached, read back on a rerun)",
        "ceiling_time": ceiling_time,
        "capture": capture_time,
        "vocab": data.vocab_size,
        "num_pretrain": len(data.pretrain),
        "num_params": sum(
            p.numel() for p in finetuned_parameters(prepared.reference_model, setting)
        ),
        "removed": removed,
        "removed_desc": "all" if len(removed) == setting.num_finetune else f"{removed}",
        "num_queries": len(data.queries),
        "mean_abs_delta": float(truth.delta.abs().mean()),
        "bitwise": prepared.bitwise,
        "clipped_steps": sum(clip < 1.0 for clip in clip_coefficients),
        "skipped": unavailable(),
        "unexported": sorted({n for n in needed_classes() if not exported(n)}),
    }
    table = write_table(rows, info, out)
    plot = write_plot(rows, out, setting)
    print(f"wrote {table} and {plot} in {info['total']:.0f} s")
    return table


def main(argv: list[str] | None = None) -> Path:
    """Parse ``--setting`` / ``--smoke`` / ``--out`` / ``--cache`` and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setting", choices=["default", "trainer"], default="default",
        help="trainer: the Hugging Face Trainer defaults (mean loss, clip 1.0, no-decay groups)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="smallest setting (for the test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    parser.add_argument("--cache", type=Path, default=CACHE,
                        help="resumable retrain results (experiments/fidelity/.cache)")  # fmt: skip
    parser.add_argument("--no-cache", action="store_true", help="retrain everything, keep nothing")
    args = parser.parse_args(argv)
    settings = {("default", False): Setting(), ("default", True): SMOKE,
                ("trainer", False): TRAINER, ("trainer", True): TRAINER_SMOKE}  # fmt: skip
    return run(settings[args.setting, args.smoke], args.out, None if args.no_cache else args.cache)


if __name__ == "__main__":
    main()

"""Linear datamodeling score (LDS) of every method, on the TSLOO setting's trajectory.

1. Prepare the TSLOO setting (``scoring.prepare``): pretrained start, reference run.
2. Draw ``--subsets`` random subsets of the fine-tuning samples, each holding
   ``--fraction`` of them (50 % by default), subset ``k`` from ``random.Random(seed_k)``
   with its own seed ``seed_k = LDS_SEED + k``.
3. Retrain each subset: the same trajectory restricted to the subset
   (``setting.run_subset_trajectory``: the kept samples in the same order and batches,
   the same schedule, the same pretrained start; an emptied batch makes no update), and
   record every query's loss.
4. Capture once and score every method of the registry (``scoring.score_matrices``);
   the same matrices give the LDS and, as a reference column, the TSLOO Spearman.
5. LDS of a method for query ``j``: the Spearman correlation, over the subsets, between
   the summed scores of each subset's members ``Σ_{i∈S_k} score[i, j]`` and ``−L_j(θ_{S_k})``
   (scores are positive when the sample helps: a subset of helpful samples should give a low
   loss). Mean ± standard error over queries.

Writes ``results/lds.md`` and ``results/lds.png`` (``--out DIR``).

Run:  python experiments/fidelity/lds.py [--subsets 128] [--fraction 0.5] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from methods import unavailable  # noqa: E402
from scoring import (  # noqa: E402
    MEMORY_NOTE,
    Prepared,
    Scored,
    capture_with_model,
    fresh_model,
    prepare,
    score_matrices,
)
from setting import (  # noqa: E402
    SMOKE,
    Setting,
    batch_order,
    query_losses,
    run_subset_trajectory,
)
from tsloo import loo_ground_truth, machine, mean_se, spearman_per_query  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LDS_SEED = 10_000  # subset k is drawn from random.Random(LDS_SEED + k)


# ---------------------------------------------------------------------------- ground truth
def draw_subsets(num_examples: int, count: int, fraction: float) -> torch.Tensor:
    """``(count, num_examples)`` 0/1 membership, ``round(fraction · N)`` members per row."""
    size = round(fraction * num_examples)
    members = torch.zeros(count, num_examples, dtype=torch.float64)
    for k in range(count):
        members[k, random.Random(LDS_SEED + k).sample(range(num_examples), size)] = 1.0
    return members


def subset_losses(prepared: Prepared, members: torch.Tensor) -> torch.Tensor:
    """``(count, num_query)`` query losses after retraining on each subset (float64)."""
    p = prepared
    losses = []
    for row in members:
        model = fresh_model(p.start, p.setting, p.data)
        run_subset_trajectory(model, p.setting, p.data, row.nonzero().flatten().tolist())
        losses.append(query_losses(model, p.data))
    return torch.stack(losses)


# ---------------------------------------------------------------------------- metric
def lds_per_query(scores: torch.Tensor, members: torch.Tensor, losses: torch.Tensor):
    """``(num_query,)`` LDS: Spearman over subsets of ``members @ scores`` and ``−losses``."""
    return spearman_per_query(members @ scores.double(), -losses)


def lds_rows(
    scored: list[Scored], members: torch.Tensor, losses: torch.Tensor, truth: torch.Tensor
) -> list[dict]:
    """One row per method: LDS and TSLOO Spearman (mean ± s.e.), seconds, peak memory."""
    rows = []
    for s in scored:
        lds = mean_se(lds_per_query(s.scores, members, losses))
        tsloo = mean_se(spearman_per_query(s.scores, truth))
        rows.append(
            {"name": s.name, "lds": lds, "tsloo": tsloo, "seconds": s.seconds,
             "peak_mib": s.peak_mib, "note": s.note}
        )  # fmt: skip
        print(f"  {s.name:<26} LDS {lds[0]:+.3f} ± {lds[1]:.3f}  TSLOO {tsloo[0]:+.3f}", flush=True)
    return rows


# ---------------------------------------------------------------------------- report
def write_table(rows: list[dict], info: dict, out: Path) -> Path:
    """``lds.md``: the protocol, the table, the references."""
    s: Setting = info["setting"]
    lines = [
        "# Linear datamodeling score (CPU scale)",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {info['machine']}",
        f"- Total run time {info['total']:.0f} s (subset retrainings {info['retrain']:.0f} s, "
        f"leave-one-out replays {info['truth']:.0f} s, captures {info['capture']:.0f} s, "
        f"scoring {info['scoring']:.0f} s).",
        "- Setting: the TSLOO default (`experiments/fidelity/README.md`): GPT-2 "
        f"n_embd={s.n_embd}, "
        f"n_layer={s.n_layer}, {s.num_finetune} fine-tuning sentences, {s.num_steps} AdamW steps "
        f"(batch {s.finetune_batch}, peak lr {s.peak_lr}, weight decay {s.weight_decay}), "
        f"{info['num_queries']} held-out queries.",
        f"- Subsets: {info['count']} random subsets of {info['size']} of the {s.num_finetune} "
        f"fine-tuning samples ({info['fraction']:.0%}), subset k drawn with its own seed "
        f"({LDS_SEED} + k). Each is retrained from the same pretrained start along the same "
        "trajectory restricted to its members: the kept samples in the same order and batches, "
        "the same learning-rate schedule and optimizer; a batch left empty makes no update "
        f"({info['empty_steps']:.1f} of {s.num_steps} steps per subset on average).",
        "- LDS: for each query, the Spearman correlation over the subsets between the sum of a "
        "method's scores over the subset's members and the negated query loss after retraining "
        "on the subset (scores are positive when a sample helps, so a high sum should mean a "
        "low loss); mean ± standard error over queries.",
        "- TSLOO: the per-query Spearman of the same score matrix against the leave-one-out "
        "ground truth of `results/tsloo.md` (same setting), for comparison.",
        "- Attribution seconds as in `results/tsloo.md` (scoring plus the captures only that "
        "method needs; STRIDE: fit, measurement and Lasso).",
        f"- {MEMORY_NOTE[0].upper()}{MEMORY_NOTE[1:]}.",
        f"- Spread of the ground truth: the query losses vary over the subsets with a mean "
        f"per-query standard deviation of {info['loss_std']:.2e} "
        f"(mean loss {info['loss_mean']:.3f}).",
        "",
        "| method | LDS ± s.e. | TSLOO Spearman ± s.e. | attribution s | peak MiB | notes |",
        "|:--|--:|--:|--:|--:|:--|",
    ]
    for row in rows:
        seconds = "–" if row["seconds"] is None else f"{row['seconds']:.2f}"
        peak = "–" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
        tsloo = "–" if row["tsloo"] is None else f"{row['tsloo'][0]:+.3f} ± {row['tsloo'][1]:.3f}"
        lines.append(
            f"| {row['name']} | {row['lds'][0]:+.3f} ± {row['lds'][1]:.3f} | {tsloo} | "
            f"{seconds} | {peak} | {row['note']} |"
        )
    for name, reason in info["skipped"].items():
        lines.append(f"| {name} | not run | – | – | – | {reason} |")
    lines += [
        "",
        "Reference row: the exact leave-one-out effects Δ[i, j] (the TSLOO ground truth) used as "
        "scores. Its LDS is how far an additive model of exact single removals predicts the "
        "retraining on half the data; it is not an upper bound for the methods.",
    ]
    path = out / "lds.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_plot(rows: list[dict], out: Path) -> Path:
    """``lds.png``: LDS against TSLOO Spearman, one point per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    markers = "osD^v<>pPX*hd"
    for k, row in enumerate(r for r in rows if r["tsloo"] is not None):
        ax.errorbar(row["tsloo"][0], row["lds"][0], xerr=row["tsloo"][1], yerr=row["lds"][1],
                    fmt=markers[k % len(markers)], capsize=3, color=plt.cm.tab20(k % 20),
                    label=f"{row['name']} ({row['lds'][0]:.2f})")  # fmt: skip
    ax.axhline(0, lw=0.8, color="gray")
    ax.axvline(0, lw=0.8, color="gray")
    ax.set_xlabel("TSLOO Spearman (mean over queries)")
    ax.set_ylabel("LDS (mean over queries)")
    ax.set_title("Linear datamodeling score vs leave-one-out fidelity (CPU)")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    path = out / "lds.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main
def run(setting: Setting, count: int, fraction: float, out: Path) -> Path:
    """Retrain the subsets, capture and score once, write the table and the plot."""
    t0 = time.perf_counter()
    prepared = prepare(setting)
    n = setting.num_finetune
    members = draw_subsets(n, count, fraction)
    t = time.perf_counter()
    losses = subset_losses(prepared, members)
    retrain = time.perf_counter() - t
    print(f"{count} subset retrainings in {retrain:.0f} s")
    t = time.perf_counter()
    truth = loo_ground_truth(prepared.start, setting, prepared.data, torch.float32)
    truth_time = time.perf_counter() - t
    if prepared.data.removed != list(range(n)):
        raise ValueError("lds.py needs the leave-one-out replays of every fine-tuning sample")
    with tempfile.TemporaryDirectory(prefix="lds_") as work:
        t = time.perf_counter()
        captured = capture_with_model(prepared, Path(work))
        capture_time = time.perf_counter() - t
        t = time.perf_counter()
        scored = score_matrices(captured)
        scoring_time = time.perf_counter() - t
    rows = lds_rows(scored, members, losses, truth)
    reference = mean_se(lds_per_query(truth, members, losses))
    rows.append(
        {"name": "Exact leave-one-out Δ as scores", "lds": reference, "tsloo": None,
         "seconds": None, "peak_mib": None, "note": "reference: the TSLOO ground truth, summed"}
    )  # fmt: skip
    batches = batch_order(setting)
    empty = sum(sum(1 for b in batches if not any(row[i] for i in b)) for row in members)
    out.mkdir(parents=True, exist_ok=True)
    info = {
        "setting": setting,
        "machine": machine(),
        "total": time.perf_counter() - t0,
        "retrain": retrain,
        "truth": truth_time,
        "capture": capture_time,
        "scoring": scoring_time,
        "count": count,
        "size": int(members[0].sum()),
        "fraction": float(members[0].sum()) / n,
        "num_queries": len(prepared.data.queries),
        "empty_steps": empty / count,
        "loss_std": float(losses.std(0).mean()),
        "loss_mean": float(losses.mean()),
        "skipped": unavailable(),
    }
    table = write_table(rows, info, out)
    plot = write_plot(rows, out)
    print(f"wrote {table} and {plot} in {info['total']:.0f} s")
    return table


def main(argv: list[str] | None = None) -> Path:
    """Parse ``--subsets`` / ``--fraction`` / ``--smoke`` / ``--out`` and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subsets", type=int, default=None, help="retrained subsets (128)")
    parser.add_argument("--fraction", type=float, default=0.5, help="share of samples kept")
    parser.add_argument("--smoke", action="store_true", help="smallest setting (for the test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    args = parser.parse_args(argv)
    if not 0 < args.fraction < 1:
        parser.error("--fraction must be in (0, 1)")
    setting = SMOKE if args.smoke else Setting()
    if args.smoke:  # every fine-tuning sample needs its leave-one-out replay here
        setting = Setting(**{**SMOKE.__dict__, "num_removed": SMOKE.num_finetune})
    count = args.subsets or (12 if args.smoke else 128)
    return run(setting, count, args.fraction, args.out)


if __name__ == "__main__":
    main()

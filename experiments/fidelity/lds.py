"""Linear datamodeling score (LDS) of every method, on the TSLOO setting's trajectory.

1. Prepare the TSLOO setting (``scoring.prepare``): pretrained start, reference run.
2. Draw ``--subsets`` random subsets of the fine-tuning samples, each holding
   ``--fraction`` of them (50 % by default): ``dattri_llm.evaluation.sample_subsets``
   seeded with ``LDSConfig.seed = protocol.LDS_SEED``.
3. Retrain each subset (``evaluation.lds_ground_truth``, resumable through ``--cache``):
   the same trajectory restricted to the subset (``setting.run_subset_trajectory``: the
   kept samples in the same order and batches, the same schedule, the same pretrained
   start; an emptied batch makes no update), and record every query's loss. The
   trajectory is deterministic, so the retrain seed the library passes is unused.
4. Capture once and score every method of the registry (``scoring.score_matrices``);
   the same matrices give the LDS and, as a reference column, the TSLOO Spearman.
5. LDS of a method for query ``j``: the Spearman correlation, over the subsets, between
   the summed scores of each subset's members ``Σ_{i∈S_k} score[i, j]`` and ``−L_j(θ_{S_k})``
   (scores are positive when the sample helps: a subset of helpful samples should give a low
   loss), ``evaluation.lds``. Mean ± standard error and the library's bootstrap 95 %
   interval over queries.

Writes ``results/lds.md`` and ``results/lds.png`` (``--out DIR``); with ``--setting
trainer`` ``results/lds_trainer.{md,png}``.

Run:  python experiments/fidelity/lds.py [--setting trainer] [--subsets 128] [--fraction 0.5]
          [--smoke] [--out DIR] [--cache DIR | --no-cache]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from methods import unavailable  # noqa: E402
from protocol import (  # noqa: E402
    CACHE,
    LDS_SEED,
    lds_stat,
    lds_truth,
    loo_truth,
    machine,
    membership,
    tsloo_stat,
)
from scoring import MEMORY_NOTE, Scored, capture_with_model, prepare, score_matrices  # noqa: E402
from setting import SMOKE, TRAINER, TRAINER_SMOKE, Setting, batch_order  # noqa: E402

from dattri_llm.evaluation import LDSGroundTruth, LeaveOneOutResult  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------- metric
def lds_rows(scored: list[Scored], subsets: LDSGroundTruth, truth: LeaveOneOutResult) -> list[dict]:
    """One row per method: LDS and TSLOO Spearman (mean ± s.e., 95 % CI), seconds, peak memory."""
    rows = []
    for s in scored:
        lds, tsloo = lds_stat(s.scores, subsets), tsloo_stat(s.scores, truth)
        rows.append(
            {"name": s.name, "lds": lds, "tsloo": tsloo, "seconds": s.seconds,
             "peak_mib": s.peak_mib, "note": s.note}
        )  # fmt: skip
        print(f"  {s.name:<26} LDS {lds.cell()} {lds.ci()}  TSLOO {tsloo.cell()}", flush=True)
    return rows


def stem(setting: Setting) -> str:
    """File stem of a setting's results: ``lds`` or ``lds_<name>``."""
    return "lds" if setting.name == "default" else f"lds_{setting.name}"


# ---------------------------------------------------------------------------- report
def write_table(rows: list[dict], info: dict, out: Path) -> Path:
    """``lds.md``: the protocol, the table, the references."""
    s: Setting = info["setting"]
    lines = [
        "# Linear datamodeling score (CPU scale)"
        + (" — Hugging Face Trainer defaults" if s.name == "trainer" else ""),
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {info['machine']}",
        f"- Total run time {info['total']:.0f} s (subset retrainings {info['retrain']:.0f} s, "
        f"leave-one-out replays {info['truth']:.0f} s, captures {info['capture']:.0f} s, "
        f"scoring {info['scoring']:.0f} s); retrains cached by `RetrainRunner` and read back "
        "on a rerun when the cache holds them.",
        f"- Setting: the TSLOO {'default' if s.name == 'default' else repr(s.name)} setting "
        "(`experiments/fidelity/README.md`): GPT-2 "
        f"n_embd={s.n_embd}, "
        f"n_layer={s.n_layer}, {s.num_finetune} fine-tuning sentences, {s.num_steps} AdamW steps "
        f"(batch {s.finetune_batch}, peak lr {s.peak_lr}, weight decay {s.weight_decay}, "
        f"{s.loss_reduction} batch loss, clip {s.max_grad_norm}), "
        f"{info['num_queries']} held-out queries.",
        f"- Subsets: {info['count']} random subsets of {info['size']} of the {s.num_finetune} "
        f"fine-tuning samples ({info['fraction']:.0%}), drawn by "
        f"`dattri_llm.evaluation.sample_subsets` (`LDSConfig(seed={LDS_SEED})`). "
        "Each is retrained from the same pretrained start along the same "
        "trajectory restricted to its members: the kept samples in the same order and batches, "
        "the same learning-rate schedule and optimizer; a batch left empty makes no update "
        f"({info['empty_steps']:.1f} of {s.num_steps} steps per subset on average).",
        "- LDS: for each query, the Spearman correlation over the subsets between the sum of a "
        "method's scores over the subset's members and the negated query loss after retraining "
        "on the subset (scores are positive when a sample helps, so a high sum should mean a "
        "low loss), `dattri_llm.evaluation.lds` on `lds_ground_truth` (`train_fn(kept, seed)` = "
        "the pretrained start fine-tuned by `run_subset_trajectory`; the trajectory is "
        "deterministic, so the seed is unused); mean ± standard error over queries and the "
        "library's bootstrap 95 % interval over queries (`mean_ci`).",
        "- TSLOO: the per-query Spearman of the same score matrix against the leave-one-out "
        f"ground truth of `results/{info['tsloo_stem']}.md` (same setting, "
        "`evaluation.leave_one_out`), for comparison.",
        "- Attribution seconds as in `results/tsloo.md` (scoring plus the captures only that "
        "method needs; STRIDE: fit, measurement and Lasso; MAGIC: replay and reverse sweep from "
        "the snapshots recorded during training; TrackStar, TRAK: their own passes; SOURCE: its "
        "segment passes).",
        f"- {MEMORY_NOTE[0].upper()}{MEMORY_NOTE[1:]}.",
        f"- Spread of the ground truth: the query losses vary over the subsets with a mean "
        f"per-query standard deviation of {info['loss_std']:.2e} "
        f"(mean loss {info['loss_mean']:.3f}).",
        "",
        "| method | LDS ± s.e. | LDS 95 % CI | TSLOO Spearman ± s.e. | TSLOO 95 % CI "
        "| attribution s | peak MiB | notes |",
        "|:--|--:|--:|--:|--:|--:|--:|:--|",
    ]
    for row in rows:
        seconds = "–" if row["seconds"] is None else f"{row['seconds']:.2f}"
        peak = "–" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
        tsloo = "– | –" if row["tsloo"] is None else f"{row['tsloo'].cell()} | {row['tsloo'].ci()}"
        lines.append(
            f"| {row['name']} | {row['lds'].cell()} | {row['lds'].ci()} | {tsloo} | "
            f"{seconds} | {peak} | {row['note']} |"
        )
    for name, reason in info["skipped"].items():
        lines.append(f"| {name} | not run | – | – | – | – | – | {reason} |")
    lines += [
        "",
        "Reference row: the exact leave-one-out effects Δ[i, j] (the TSLOO ground truth) used as "
        "scores. Its LDS is how far an additive model of exact single removals predicts the "
        "retraining on half the data; it is not an upper bound for the methods.",
    ]
    path = out / f"{stem(s)}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_plot(rows: list[dict], out: Path, setting: Setting) -> Path:
    """``lds.png``: LDS against TSLOO Spearman, one point per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    palette = plt.cm.tab20.colors + plt.cm.tab20b.colors  # 40 colors: one per method
    markers = "osD^v<>pPX*hd"
    for k, row in enumerate(r for r in rows if r["tsloo"] is not None):
        ax.errorbar(row["tsloo"].mean, row["lds"].mean, xerr=row["tsloo"].se, yerr=row["lds"].se,
                    fmt=markers[k % len(markers)], capsize=3, color=palette[k % len(palette)],
                    label=f"{row['name']} ({row['lds'].mean:.2f})")  # fmt: skip
    ax.axhline(0, lw=0.8, color="gray")
    ax.axvline(0, lw=0.8, color="gray")
    ax.set_xlabel("TSLOO Spearman (mean over queries)")
    ax.set_ylabel("LDS (mean over queries)")
    ax.set_title("Linear datamodeling score vs leave-one-out fidelity (CPU)")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    path = out / f"{stem(setting)}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main
def run(setting: Setting, count: int, fraction: float, out: Path, cache: Path | None = CACHE):
    """Retrain the subsets, capture and score once, write the table and the plot."""
    t0 = time.perf_counter()
    prepared = prepare(setting)
    p = prepared
    n = setting.num_finetune
    if p.data.removed != list(range(n)):
        raise ValueError("lds.py needs the leave-one-out replays of every fine-tuning sample")
    t = time.perf_counter()
    subsets = lds_truth(p.start, setting, p.data, count, fraction, cache=cache)
    retrain = time.perf_counter() - t
    print(f"{count} subset retrainings in {retrain:.0f} s")
    t = time.perf_counter()
    truth = loo_truth(p.start, setting, p.data, cache=cache)
    truth_time = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="lds_") as work:
        t = time.perf_counter()
        captured = capture_with_model(prepared, Path(work))
        capture_time = time.perf_counter() - t
        t = time.perf_counter()
        scored = score_matrices(captured)
        scoring_time = time.perf_counter() - t
    rows = lds_rows(scored, subsets, truth)
    rows.append(
        {"name": "Exact leave-one-out Δ as scores", "lds": lds_stat(truth.delta, subsets),
         "tsloo": None, "seconds": None, "peak_mib": None,
         "note": "reference: the TSLOO ground truth, summed"}
    )  # fmt: skip
    members = membership(subsets)
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
        "num_queries": len(p.data.queries),
        "empty_steps": empty / count,
        "loss_std": float(subsets.losses.std(0).mean()),
        "loss_mean": float(subsets.losses.mean()),
        "skipped": unavailable(),
        "tsloo_stem": "tsloo" if setting.name == "default" else f"tsloo_{setting.name}",
    }
    table = write_table(rows, info, out)
    plot = write_plot(rows, out, setting)
    print(f"wrote {table} and {plot} in {info['total']:.0f} s")
    return table


def main(argv: list[str] | None = None) -> Path:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=["default", "trainer"], default="default",
                        help="trainer: the Hugging Face Trainer defaults")  # fmt: skip
    parser.add_argument("--subsets", type=int, default=None, help="retrained subsets (128)")
    parser.add_argument("--fraction", type=float, default=0.5, help="share of samples kept")
    parser.add_argument("--smoke", action="store_true", help="smallest setting (for the test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    parser.add_argument("--cache", type=Path, default=CACHE,
                        help="resumable retrain results (experiments/fidelity/.cache)")  # fmt: skip
    parser.add_argument("--no-cache", action="store_true", help="retrain everything, keep nothing")
    args = parser.parse_args(argv)
    if not 0 < args.fraction < 1:
        parser.error("--fraction must be in (0, 1)")
    settings = {("default", False): Setting(), ("default", True): SMOKE,
                ("trainer", False): TRAINER, ("trainer", True): TRAINER_SMOKE}  # fmt: skip
    setting = settings[args.setting, args.smoke]
    if args.smoke:  # every fine-tuning sample needs its leave-one-out replay here
        setting = Setting(**{**setting.__dict__, "num_removed": setting.num_finetune})
    count = args.subsets or (12 if args.smoke else 128)
    return run(setting, count, args.fraction, args.out, None if args.no_cache else args.cache)


if __name__ == "__main__":
    main()

"""LoRIF vs LoGRA-style projected influence: store bytes, query time and TSLOO Spearman.

Same setting and ground truth as ``tsloo.py`` (the CPU-scale TSLOO protocol).
Training and query gradients are captured once at ``θ_T`` (unprojected), then
projected post hoc with LoGRA factor projections (``d_out' = d_in' = k`` per
layer) and written as

* LoGRA-style: the dense ``k²`` projected gradient per layer and sample, scored
  with the exact inverse ``(GᵀG/N + λI)⁻¹`` (``svd_rank = N``: ``G`` has rank
  at most ``N``, so the Woodbury form is exact);
* LoRIF: rank-``c`` factors (``c·2k`` numbers per layer and sample) and a
  rank-``r`` truncated SVD.

Both use ``damping=None`` (0.1 × mean ``σ²/N`` per layer). Query time is
``attribute_from_cache`` with the fit loaded from disk (reading the train store
and scoring 32 queries); the fit is timed separately.

Writes ``results/lorif_tradeoff.md`` and ``results/lorif_tradeoff.png``.

Run:  python experiments/fidelity/lorif_tradeoff.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture import FROZEN_BATCH, Captured, backward_over, offloading  # noqa: E402
from methods import aligned, arguments, projected_stores  # noqa: E402
from protocol import CACHE, loo_truth, machine, tsloo_stat  # noqa: E402
from scoring import fresh_model  # noqa: E402
from setting import Setting, make_data, make_model, pretrain, run_trajectory  # noqa: E402

from dattri_llm import LoRIFAttributor, hash_sample  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROJECTIONS = (16, 32, 64)
RANKS = (1, 2, 4)
SVD_RANKS = (16, 64)


def store_bytes(directory: Path) -> int:
    """Bytes of every file of a store directory."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def capture_final(setting: Setting, data, start, root: Path) -> Captured:
    """Training and query gradients at ``θ_T`` (unprojected), as ``capture.py`` takes them."""
    model = fresh_model(start, setting, data)
    run_trajectory(model, setting, data)
    captured = Captured(
        root=root,
        train_ids=[hash_sample(x) for x in data.finetune],
        query_ids=[hash_sample(q) for q in data.queries],
        lrs={},
        dynamics={},
        setting=setting,
    )
    with offloading(model, captured.queries_final, setting).collect(deregister_on_exit=True):
        backward_over(model, data.queries, len(data.queries))
    with offloading(model, captured.final_train, setting).collect(deregister_on_exit=True):
        backward_over(model, data.finetune, FROZEN_BATCH)
    return captured


def evaluate(captured: Captured, truth, k: int, c: int | None, r: int) -> dict:
    """One (k, c, r) point: store bytes, fit and query seconds, Spearman."""
    train, queries = projected_stores(captured, k, c)
    fit_dir = captured.root / "fits" / f"k{k}_c{c}_r{r}"
    attributor = LoRIFAttributor(arguments(captured), rank=c, svd_rank=r)
    t = time.perf_counter()
    attributor.fit(train, str(fit_dir))
    fit_seconds = time.perf_counter() - t
    t = time.perf_counter()
    score = attributor.attribute_from_cache(train, queries, fit_dir=str(fit_dir))
    query_seconds = time.perf_counter() - t
    stat = tsloo_stat(aligned(score, captured), truth)
    return {
        "method": "LoGRA-style" if c is None else "LoRIF",
        "k": k,
        "c": c,
        "r": r,
        "bytes": store_bytes(train),
        "fit": fit_seconds,
        "query": query_seconds,
        "mean": stat.mean,
        "se": stat.se,
    }


def closing_note(rows: list[dict]) -> list[str]:
    """Best storage reduction keeping >= 95 % of LoGRA's Spearman (same k; and best LoGRA)."""
    logra = {row["k"]: row for row in rows if row["c"] is None}
    best_logra = max(logra.values(), key=lambda row: row["mean"])
    lines = []
    for label, reference_of in (
        ("LoGRA-style at the same k", lambda row: logra[row["k"]]),
        (f"the best LoGRA-style point (k={best_logra['k']})", lambda row: best_logra),
    ):
        kept = [
            (reference_of(row)["bytes"] / row["bytes"], row)
            for row in rows
            if row["c"] is not None and row["mean"] >= 0.95 * reference_of(row)["mean"]
        ]
        if not kept:
            lines.append(f"- No LoRIF point keeps 95 % of the Spearman of {label}.")
            continue
        factor, row = max(kept, key=lambda item: item[0])
        ref = reference_of(row)
        lines.append(
            f"- Against {label}: best storage reduction keeping ≥ 95 % of its Spearman is "
            f"**{factor:.1f}×** (LoRIF k={row['k']}, c={row['c']}, r={row['r']}: "
            f"{row['mean']:+.3f} vs {ref['mean']:+.3f}, {row['bytes'] / 1024:.0f} KiB vs "
            f"{ref['bytes'] / 1024:.0f} KiB)."
        )
    return lines


def write_table(rows: list[dict], info: dict, out: Path) -> Path:
    """Markdown table of every point plus the closing note."""
    lines = [
        "# LoRIF vs LoGRA-style projected influence (TSLOO, CPU scale)",
        "",
        f"- Machine: {info['machine']}; total {info['total']:.0f} s.",
        f"- Setting: the `tsloo.py` protocol ({info['removed']} leave-one-out replays, "
        f"{info['queries']} queries, ground truth Δ = L(θ_T without i) − L(θ_T)); gradients "
        "at θ_T of the 9 hooked layers, projected post hoc with LoGRA factor projections "
        "(`style='logra'`, `proj_dim=k`: each layer's gradient becomes a k × k matrix).",
        "- Store: bytes on disk of the training store (64 samples). LoGRA-style stores the "
        "dense k² projected gradient; LoRIF stores rank-c factors (c·2k per layer).",
        "- LoGRA-style = LoRIF's formula with no low rank and the exact inverse (svd_rank = N = "
        "64 ≥ rank G). Damping: 0.1 × mean σ²/N per layer for both.",
        "- Query s: `attribute_from_cache` with the fit loaded (reads the train store, "
        "preconditions and scores 32 queries); fit s: the streaming SVD over the store.",
        "",
        "| method | k | c | r | store KiB | vs LoGRA (same k) | fit s | query s | "
        "Spearman ± s.e. |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    logra = {row["k"]: row for row in rows if row["c"] is None}
    for row in rows:
        ratio = logra[row["k"]]["bytes"] / row["bytes"]
        lines.append(
            f"| {row['method']} | {row['k']} | {row['c'] or '–'} | {row['r']} | "
            f"{row['bytes'] / 1024:.0f} | {ratio:.1f}× less | {row['fit']:.2f} | "
            f"{row['query']:.2f} | {row['mean']:+.3f} ± {row['se']:.3f} |"
        )
    lines += ["", "## Closing note", "", *closing_note(rows), ""]
    path = out / "lorif_tradeoff.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def write_plot(rows: list[dict], out: Path) -> Path:
    """Spearman against store bytes (log scale), one series per method and k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in PROJECTIONS:
        for method, marker in (("LoGRA-style", "s"), ("LoRIF", "o")):
            points = [row for row in rows if row["k"] == k and row["method"] == method]
            ax.errorbar(
                [row["bytes"] / 1024 for row in points],
                [row["mean"] for row in points],
                yerr=[row["se"] for row in points],
                fmt=marker,
                label=f"{method} k={k}",
                capsize=2,
            )
    ax.set_xscale("log")
    ax.set_xlabel("training store (KiB, log scale)")
    ax.set_ylabel("mean TSLOO Spearman")
    ax.set_title("LoRIF (rank-c records, rank-r SVD) vs LoGRA-style")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / "lorif_tradeoff.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(setting: Setting, out: Path) -> Path:
    """Ground truth, captures at θ_T, every (k, c, r) point; returns the table's path."""
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = make_data(setting)
    model = make_model(setting, data.vocab_size)
    pretrain(model, setting, data)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    truth = loo_truth(start, setting, data, cache=CACHE)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lorif_tradeoff_") as work:
        captured = capture_final(setting, data, start, Path(work))
        for k in PROJECTIONS:
            rows.append(evaluate(captured, truth, k, None, 64))
            for c in RANKS:
                for r in SVD_RANKS:
                    rows.append(evaluate(captured, truth, k, c, r))
                    print({key: rows[-1][key] for key in ("k", "c", "r", "bytes", "mean")})
    out.mkdir(parents=True, exist_ok=True)
    info = {
        "machine": machine(),
        "total": time.perf_counter() - t0,
        "removed": len(data.removed),
        "queries": len(data.queries),
    }
    table = write_table(rows, info, out)
    write_plot(rows, out)
    print(table.read_text(encoding="utf-8"))
    return table


def main(argv: list[str] | None = None) -> Path:
    """Parse ``--out`` and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    return run(Setting(), parser.parse_args(argv).out)


if __name__ == "__main__":
    main()

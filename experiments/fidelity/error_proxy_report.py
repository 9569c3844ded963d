"""The report of ``error_proxy.py``: ``results/error_proxy.md`` and ``error_proxy.png``.

``write_table`` writes the markdown (per-configuration tables, the first update, the
samples outside it, the ε-by-ε sweep, the Spearman across configurations, the reliability
flag); ``write_plot`` the three panels.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from error_proxy_metrics import Row, spearman_flat  # noqa: E402
from setting import Setting  # noqa: E402


def fmt(value, spec: str = ".2e") -> str:
    """A number, or ``–`` when missing."""
    return "–" if value is None else format(value, spec)


def describe_lengths(base: Setting) -> dict[str, str]:
    """How each trajectory length is built."""
    n, b = base.num_finetune, base.finetune_batch
    return {
        "half": f"{n // 2} samples × 1 epoch, batch {b}",
        "one": f"{n} samples × 1 epoch, batch {b}",
        "two": f"{n} samples × 2 epochs, batch {b} (each sample at 2 steps)",
    }


def across(rows: list[Row], x: str, y: str, sign: float = 1.0) -> float | None:
    """Spearman over configurations between two config-level metrics."""
    if any(x not in r.metrics or y not in r.metrics for r in rows):
        return None
    a = torch.tensor([r.metrics[x] for r in rows])
    b = torch.tensor([sign * r.metrics[y] for r in rows])
    return spearman_flat(a, b)


def sweep_lines(sweep: list[dict], rows: list) -> list[str]:
    """The ε-by-ε table of :func:`epsilon_sweep`."""
    if not sweep:
        return []
    lines = [
        "",
        "## One sample of the first batch, ε by ε",
        "",
        "Float64 central differences on the first query at the configuration of the scatter "
        "plot, for one removed sample of the first batch and one outside it: −a'(0) ≈ "
        "−(a(ε) − a(−ε)) / (2ε) (the removal estimate) and ½a''(0) ≈ (a(ε) + a(−ε) − 2a(0)) / "
        "(2ε²). Where they settle as ε shrinks, a(w) is smooth and the pointwise derivatives "
        "are what the removal sees; where they keep moving, the pointwise derivatives describe "
        "a feature narrower than ε that the removal (w: 1 → 0) steps over.",
        "",
        "| sample | ε | −a'(0) | ½a''(0) |",
        "|:--|--:|--:|--:|",
    ]
    for e in sweep:
        where = "first batch" if e["first"] else "later batch"
        for eps, d1, d2 in e["eps"]:
            lines.append(f"| {e['sample']} ({where}) | {eps:g} | {d1:+.4g} | {d2:+.4g} |")
        lines.append(
            f"| {e['sample']}: Δ_true {e['truth']:+.4g}; AdamW-influence Δ_linear "
            f"{e['linear']:+.4g}; proxy E {fmt(e['proxy'], '+.4g')} | | | |"
        )
    return lines


def write_table(rows: list[Row], info: dict, out: Path) -> Path:
    """``error_proxy.md``."""
    base: Setting = info["base"]
    have = info["proxy"]
    lines = [
        "# AdamW-influence's first-order error and the error proxy (CPU scale)",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {info['machine']}",
        f"- Wall time {info['total']:.0f} s (float64 replays {info['replay']:.0f} s"
        + (
            f" — read from the cache, where they took {info['replay_original']:.0f} s"
            if info["cached"]
            else ""
        )
        + f", captures and scoring {info['library']:.0f} s, "
        f"ε check {info['stability_time']:.0f} s).",
        f"- Model and corpus: the TSLOO setting (GPT-2 n_embd={base.n_embd}, n_layer="
        f"{base.n_layer}, n_head={base.n_head}, pretrained once on {info['num_pretrain']} "
        "sentences, the same weights for every configuration); trained (and hooked): every "
        "block Conv1D and the LM head. AdamW betas "
        f"{base.betas}, eps {base.eps}, weight decay {base.weight_decay}, warm-up over 10 % of "
        "the steps then linear decay, no clipping; batch loss = sum of per-sentence mean token "
        'losses (`loss_reduction="sum"`).',
        "- Grid: peak learning rate η ∈ {"
        + ", ".join(f"{lr:g}" for lr in info["lrs"])
        + "} × trajectory length T: "
        + "; ".join(
            f"T={info['steps'][k]}: {v}"
            for k, v in describe_lengths(base).items()
            if k in info["lengths"]
        )  # fmt: skip
        + ". The batch stays the same so each step perturbs alike; the shorter trajectory "
        "keeps the pretraining split (its unused sentences are simply not fine-tuned on).",
        f"- Ground truth: leave-one-out replays in float64 of {base.num_removed} removed "
        f"samples (seeded; all of them at T={info['steps']['half']}) × {base.num_queries} "
        "held-out queries: Δ_true = L(θ_T without i) − L(θ_T).",
        '- Δ_linear: AdamW-influence (`attribute_from_cache(..., loss_reduction="sum", '
        'propagation="test")`, float32 capture), the removal estimate −∂L/∂w. Measured error '
        "= Δ_true − Δ_linear.",
        f"- FD reference: ½a''(0) ≈ (a(ε) + a(−ε) − 2a(0)) / (2ε²), ε = {info['epsilon']:g}, "
        "float64 replays with the sample's loss weighted 1 ± ε; the same replays give the exact "
        "derivative (a(ε) − a(−ε)) / (2ε), whose removal estimate is the first-order limit. "
        f"Stability: {info['stability']}.",
        (
            '- Proxy E: `AdamWInfluenceAttributor.error_proxy(..., loss_reduction="sum", '
            "per_sample=True)` (the query-loss curvature is the library's default stand-in, "
            "the mean per-sample Gauss–Newton of the last update); relative_error = "
            "|mean_i E| / rms_i(Δ_linear) per query (over all fine-tuned samples); the table "
            "gives its median over queries, and `reliable` is the library's flag (median ≤ "
            f"{info['threshold']:g}), with the share of queries at or under the threshold."
            if have
            else "- Proxy E: **not run** — the installed `AdamWInfluenceAttributor` has no "
            "`error_proxy`. Every proxy column is empty; the FD reference ½a''(0) (what an "
            "exact proxy would return) stands in for it in the analyses below."
        ),
        "- Correlations: “pairs” = Spearman over all sample × query pairs; “per query” = "
        "Spearman over the removed samples for each query, mean over queries.",
        "",
        "## Per configuration",
        "",
        "| η | T | mean \\|Δ_true\\| | mean \\|error\\| | error / \\|Δ_true\\| | mean \\|E\\| "
        "| E / error | Spearman(E, error) pairs | per query | AdamW-infl. Spearman | Pearson "
        "| relative_error | reliable |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        m = r.metrics
        rel = m.get("relative_error")
        reliable = (
            "–"
            if rel is None
            else f"{'yes' if m['reliable'] else 'no'} ({m['reliable_fraction']:.0%} of q.)"
        )
        lines.append(
            f"| {r.lr:g} | {r.steps} | {m['mean_abs_truth']:.2e} | {m['mean_abs_error']:.2e} "
            f"| {m['rel_error']:.2f} | {fmt(m.get('mean_abs_proxy'))} "
            f"| {fmt(m.get('ratio'), '.2f')} "
            f"| {fmt(m.get('proxy_vs_error_pairs'), '+.2f')} "
            f"| {fmt(m.get('proxy_vs_error_query'), '+.2f')} "
            f"| {m['spearman']:+.3f} ± {m['spearman_se']:.3f} | {m['pearson']:+.3f} "
            f"| {fmt(rel, '.3f')} | {reliable} |"
        )
    lines += [
        "",
        "## Where the error comes from, and the proxy's own maths",
        "",
        "Taylor part = Δ_true − exact first-order (the float64 central difference at ε): what "
        "a second-order term can explain; method part = exact first-order − Δ_linear: "
        "AdamW-influence's own approximation (the Gauss–Newton training Hessian, the stand-ins "
        "of the sweep; not a Taylor error, and no second-order term models it). FD = the float64 "
        "½a''(0) at ε. Caveat: for the samples of the first batch, a(w) is not smooth on the "
        "scale of ε (Adam's first update, g / (|g| + eps) per coordinate, is nearly a step in "
        "the coordinates whose batch gradient is near 0): there the central difference is a "
        "derivative smoothed over ±ε, the pointwise derivatives that AdamW-influence and E "
        "compute are far larger, and the split is not Taylor vs approximation (see the "
        "first-update table).",
        "",
        "| η | T | mean \\|Taylor part\\| | mean \\|method part\\| | mean \\|FD\\| "
        "| Spearman(FD, Taylor part) pairs | Spearman(FD, error) pairs | mean \\|E − FD\\| / "
        "mean \\|FD\\| | Spearman(E, FD) pairs | sign(E) = sign(error) | first-order limit "
        "Spearman | limit + FD Spearman | Δ_linear + E Spearman |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        m = r.metrics
        lines.append(
            f"| {r.lr:g} | {r.steps} | {m['mean_abs_taylor']:.2e} | {m['mean_abs_method']:.2e} "
            f"| {m['mean_abs_fd']:.2e} | {m['fd_vs_taylor_pairs']:+.2f} "
            f"| {m['fd_vs_error_pairs']:+.2f} | {fmt(m.get('proxy_vs_fd_rel'), '.2e')} "
            f"| {fmt(m.get('proxy_vs_fd_pairs'), '+.3f')} | {fmt(m.get('sign_agreement'), '.0%')} "
            f"| {m['limit_spearman']:+.3f} | {m['fd_corrected_spearman']:+.3f} "
            f"| {fmt(m.get('corrected_spearman'), '+.3f')} |"
        )
    lines += [
        "",
        "## Medians over the sample × query pairs",
        "",
        "The means above are dominated by a few pairs where the second-order term is huge; "
        "the medians are not.",
        "",
        "| η | T | median \\|error\\| | median \\|Taylor part\\| | median \\|FD\\| "
        "| median \\|E\\| | mean \\|E\\| / median \\|E\\| "
        "| largest sample's share of Σ_i max_j \\|E\\| |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        m = r.metrics
        med = m.get("median_abs_proxy")
        lines.append(
            f"| {r.lr:g} | {r.steps} | {m['median_abs_error']:.2e} "
            f"| {m['median_abs_taylor']:.2e} | {m['median_abs_fd']:.2e} | {fmt(med)} "
            f"| {fmt(None if med is None else m['mean_abs_proxy'] / med, '.3g')} "
            f"| {fmt(m.get('max_share'), '.0%')} |"
        )
    lines += [
        "",
        "## The first update",
        "",
        "Mean |second-order term| / mean |Taylor part|, for the removed samples in the first "
        "batch (its update is Adam's first: m̂ = g, v̂ = g², so the step is g / (|g| + eps) per "
        "coordinate, all learning rate at T = 8 where the warm-up is one step) and for the "
        "others. A ratio far above 1 means ½a''(0) is large but the Taylor series does not "
        "reach the removal (w: 1 → 0).",
        "",
        "| η | T | removed in batch 1 | FD / Taylor, batch 1 | FD / Taylor, others "
        "| E / Taylor, batch 1 | E / Taylor, others | method part / \\|Δ_true\\|, batch 1 "
        "| method part / \\|Δ_true\\|, others |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        m = r.metrics
        lines.append(
            f"| {r.lr:g} | {r.steps} | {m['num_first']} | {fmt(m.get('fd_ratio_first'), '.2f')} "
            f"| {fmt(m.get('fd_ratio_rest'), '.2f')} | {fmt(m.get('proxy_ratio_first'), '.2f')} "
            f"| {fmt(m.get('proxy_ratio_rest'), '.2f')} "
            f"| {fmt(m.get('method_ratio_first'), '.2f')} "
            f"| {fmt(m.get('method_ratio_rest'), '.2f')} |"
        )
    if have:
        checks = [r.metrics["linear_check"] for r in rows]
        lines += [
            "",
            f"`proxy.linear` against AdamW-influence's removal estimate: max relative "
            f"difference {max(checks):.1e} over the configurations. Proxy seconds per "
            "configuration: " + ", ".join(f"{r.metrics['proxy_seconds']:.1f}" for r in rows) + ".",
            "",
            "The proxy above is swept in float64 (`block_dtype=torch.float64`, the default). "
            "With a float32 sweep, the share of non-finite E per configuration: "
            + ", ".join(f"{r.metrics['nonfinite32']:.0%}" for r in rows)
            + "; its `reliable` flag: "
            + ", ".join("yes" if r.metrics["reliable32"] else "no" for r in rows)
            + "; its median relative_error: "
            + ", ".join(f"{r.metrics['relative32']:.3g}" for r in rows)
            + " (configurations in table order).",
        ]
    lines += rest_lines(rows, have)
    lines += sweep_lines(info["sweep"], rows)
    lines += ["", "## Across configurations", "", *across_lines(rows, have), ""]
    lines += reliability_lines(rows, have)
    path = out / "error_proxy.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def rest_lines(rows: list[Row], have: bool) -> list[str]:
    """The per-configuration table over the removed samples outside the first batch."""
    if not have:
        return []
    lines = [
        "",
        "## Without the first update's samples",
        "",
        "The same statistics over the removed samples that are not in the first batch "
        "(relative_error here: |mean_i E| / rms_i(Δ_linear) over those samples, median over "
        "queries; ≤ threshold = reliable).",
        "",
        "| η | T | samples | mean \\|Δ_true\\| | mean \\|error\\| | error / \\|Δ_true\\| "
        "| mean \\|E\\| | E / error | Spearman(E, error) pairs | per query "
        "| AdamW-infl. Spearman | relative_error | reliable |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        m = r.metrics
        lines.append(
            f"| {r.lr:g} | {r.steps} | {m['rest_n']} | {m['rest_mean_abs_truth']:.2e} "
            f"| {m['rest_mean_abs_error']:.2e} | {m['rest_rel_error']:.2f} "
            f"| {m['rest_mean_abs_proxy']:.2e} | {m['rest_ratio']:.2f} "
            f"| {m['rest_proxy_vs_error_pairs']:+.2f} | {m['rest_proxy_vs_error_query']:+.2f} "
            f"| {m['rest_spearman']:+.3f} | {m['rest_relative']:.3f} "
            f"| {'yes' if m['rest_reliable'] else 'no'} |"
        )
    return lines


def across_lines(rows: list[Row], have: bool) -> list[str]:
    """Spearman over the configurations between config-level proxies and measurements."""
    pairs = [
        ("mean |E|", "mean_abs_proxy", "mean |measured error|", "mean_abs_error", 1.0),
        ("relative_error", "relative_error", "mean |error| / mean |Δ_true|", "rel_error", 1.0),
        ("relative_error", "relative_error", "−AdamW-influence Spearman", "spearman", -1.0),
        ("median |E|", "median_abs_proxy", "median |measured error|", "median_abs_error", 1.0),
        (
            "mean |E| (no batch 1)",
            "rest_mean_abs_proxy",
            "mean |error| (no batch 1)",
            "rest_mean_abs_error",
            1.0,
        ),
        (
            "relative_error (no batch 1)",
            "rest_relative",
            "mean |error| / mean |Δ_true| (no batch 1)",
            "rest_rel_error",
            1.0,
        ),
        (
            "relative_error (no batch 1)",
            "rest_relative",
            "−AdamW-influence Spearman (no batch 1)",
            "rest_spearman",
            -1.0,
        ),
        ("mean |FD|", "mean_abs_fd", "mean |measured error|", "mean_abs_error", 1.0),
        ("median |FD|", "median_abs_fd", "median |measured error|", "median_abs_error", 1.0),
        ("FD relative statistic", "fd_relative", "mean |error| / mean |Δ_true|", "rel_error", 1.0),
        ("FD relative statistic", "fd_relative", "−AdamW-influence Spearman", "spearman", -1.0),
        (
            "mean |error| / mean |Δ_true|",
            "rel_error",
            "−AdamW-influence Spearman",
            "spearman",
            -1.0,
        ),
    ]
    lines = [
        f"Spearman over the {len(rows)} configurations (target ≥ 0.8 for the proxy rows). "
        "The FD rows use the exact ½a''(0) in place of E (FD relative statistic = "
        "|mean_i FD| / rms_i(exact first-order) over the removed samples, median over queries; "
        "relative_error is also the median over queries).",
        "",
        "| config-level proxy | config-level measurement | Spearman |",
        "|:--|:--|--:|",
    ]
    for xl, x, yl, y, sign in pairs:
        value = across(rows, x, y, sign)
        xl, yl = xl.replace("|", "\\|"), yl.replace("|", "\\|")
        if value is None and not have:
            lines.append(f"| {xl} | {yl} | – (no proxy) |")
        elif value is not None:
            lines.append(f"| {xl} | {yl} | {value:+.3f} |")
    return lines


def split_line(rows: list[Row], flag: str, spearman: str, label: str) -> str:
    """AdamW-influence's Spearman in the configurations a flag calls reliable, and in the rest."""
    parts = []
    for name, group in (
        ("reliable", [r for r in rows if r.metrics[flag]]),
        ("unreliable", [r for r in rows if not r.metrics[flag]]),
    ):
        if not group:
            parts.append(f"{name}: none")
            continue
        values = [r.metrics[spearman] for r in group]
        names = ", ".join(f"η={r.lr:g}/T={r.steps}" for r in group)
        parts.append(
            f"{name}: {len(group)} ({names}), AdamW-influence Spearman mean "
            f"{sum(values) / len(values):+.3f}, range {min(values):+.3f} … {max(values):+.3f}"
        )
    return f"{label} — " + "; ".join(parts) + "."


def reliability_lines(rows: list[Row], have: bool) -> list[str]:
    """Does ``reliable`` separate where AdamW-influence's Spearman degrades?"""
    if not have:
        return []
    lines = ["## The reliability flag", ""]
    threshold = rows[0].metrics["threshold"]
    lines.append(
        split_line(rows, "reliable", "spearman",
                   f"The library's flag (median relative_error ≤ {threshold:g}, all samples)")
    )  # fmt: skip
    lines += [
        "",
        split_line(rows, "rest_reliable", "rest_spearman",
                   "The same threshold without the first batch's samples (their Spearman "
                   "over those samples too)"),
    ]  # fmt: skip
    spear = torch.cat([r.per_query["spearman"] for r in rows])
    reliable = torch.cat([r.per_query["reliable"] for r in rows])
    relative = torch.cat([r.per_query["relative_error"] for r in rows])
    parts = []
    for name, mask in (("reliable", reliable), ("unreliable", ~reliable)):
        if mask.any():
            parts.append(
                f"{name}: {int(mask.sum())} query × configuration cells, per-query Spearman "
                f"mean {float(spear[mask].mean()):+.3f}"
            )
    lines += [
        "",
        "Per query, pooled over the configurations — "
        + "; ".join(parts)
        + f". Spearman between a query's relative_error and its AdamW-influence Spearman "
        f"over all {spear.numel()} cells: {spearman_flat(relative, spear):+.3f}.",
    ]
    return lines


def write_plot(rows: list[Row], out: Path, have: bool, example: int) -> Path:
    """Config means (log-log), one configuration's pairs, fidelity against relative_error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({r.lr for r in rows})
    colors = dict(zip(lrs, plt.cm.viridis([k / max(1, len(lrs) - 1) for k in range(len(lrs))])))
    steps = sorted({r.steps for r in rows})
    markers = dict(zip(steps, "o^sD"))
    key = "mean_abs_proxy" if have else "mean_abs_fd"
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for r in rows:
        ax.scatter(r.metrics[key], r.metrics["mean_abs_error"], color=colors[r.lr],
                   marker=markers[r.steps], s=60, edgecolor="k")  # fmt: skip
        if have:
            ax.scatter(r.metrics["mean_abs_fd"], r.metrics["mean_abs_error"], facecolor="none",
                       edgecolor=colors[r.lr], marker=markers[r.steps], s=60)  # fmt: skip
    values = [r.metrics[k] for r in rows for k in (key, "mean_abs_error", "mean_abs_fd")]
    lo, hi = min(values) / 2, max(values) * 2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mean |E| (filled; hollow: float64 FD)" if have else "mean |FD ½a''(0)|")
    ax.set_ylabel("mean |Δ_true − Δ_linear|")
    ax.set_title("config means: proxy vs measured first-order error")
    for lr in lrs:
        ax.scatter([], [], color=colors[lr], label=f"η = {lr:g}")
    for s in steps:
        ax.scatter([], [], color="gray", marker=markers[s], label=f"T = {s}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")

    ax = axes[1]
    r = rows[example]
    first = r.scatter["first"]
    err = r.scatter["error"]
    for name, color in (("proxy", "C0"), ("fd", "C1")):
        if name not in r.scatter:
            continue
        label = "E" if name == "proxy" else "FD"
        ax.scatter(r.scatter[name][~first].reshape(-1), err[~first].reshape(-1), s=5,
                   alpha=0.4, color=color, label=f"{label}, other samples")  # fmt: skip
        ax.scatter(r.scatter[name][first].reshape(-1), err[first].reshape(-1), s=12,
                   marker="x", color=color, label=f"{label}, first batch")  # fmt: skip
    values = torch.cat(
        [r.scatter[k].reshape(-1) for k in ("proxy", "fd", "error") if k in r.scatter]
    )
    lim = float(values.abs().max()) * 1.5
    ax.plot([-lim, lim], [-lim, lim], "k--", lw=0.8)
    linthresh = float(err.abs().median())
    ax.set_xscale("symlog", linthresh=linthresh)
    ax.set_yscale("symlog", linthresh=linthresh)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(
            matplotlib.ticker.SymmetricalLogLocator(base=100, linthresh=linthresh)
        )
    ax.set_xlabel("predicted second-order term (symlog)")
    ax.set_ylabel("measured error Δ_true − Δ_linear (symlog)")
    ax.set_title(f"pairs, η = {r.lr:g}, T = {r.steps}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    ax = axes[2]
    stat = "relative_error" if have else "fd_relative"
    for r in rows:
        ax.errorbar(r.metrics[stat], r.metrics["spearman"], yerr=r.metrics["spearman_se"],
                    color=colors[r.lr], marker=markers[r.steps], ms=7, mec="k",
                    capsize=2)  # fmt: skip
    if have:
        for r in rows:
            ax.scatter(r.metrics["rest_relative"], r.metrics["rest_spearman"],
                       facecolor="none", edgecolor=colors[r.lr], marker=markers[r.steps],
                       s=50)  # fmt: skip
        ax.scatter([], [], facecolor="none", edgecolor="gray", label="without batch-1 samples")
        ax.axvline(rows[0].metrics["threshold"], color="r", ls=":", label="threshold 0.3")
        ax.legend(fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("relative_error (median over queries)" if have else "FD relative statistic")
    ax.set_ylabel("AdamW-influence Spearman with Δ_true")
    ax.set_title("fidelity vs the reliability statistic")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = out / "error_proxy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

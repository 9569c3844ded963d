"""Scaling of Grad-Dot, K-FAC and EK-FAC with the training-set size and the model width (CPU).

Full run (writes ``results/scaling.md``, ``results/scaling_size.png`` and
``results/scaling_width.png``; the committed run took 52 minutes on 2 CPU cores, the
hidden-1024 EK-FAC points of both libraries and kronfluence's K-FAC hitting the 240 s
point timeout)::

    python experiments/benchmark/scaling.py \\
        --kronfluence-python /tmp/venv_kron/bin/python --budget-min 70 --timeout 240 \\
        --width-n-train 32

With the default ``--budget-min 20`` the size sweep (never cut by the budget) uses it up,
and every width point is recorded as skipped. Shorter runs: drop ``--kronfluence-python``
(about -12 min), or narrow ``--methods`` / ``--hiddens``.

Smoke run (Grad-Dot and EK-FAC at tiny sizes, about 45 s; writes to a temporary directory
unless ``--out`` names another one)::

    python experiments/benchmark/scaling.py --smoke

Workload: ``throughput_kfac.py``'s (imported from it): GPT-NeoX from config (4 layers,
``hidden`` wide, ``max(4, hidden // 64)`` heads, MLP ``4 * hidden``, vocab 1024), random
training sequences of 128 tokens, 16 query sequences, fp32, batch 8, the 16 linear layers of
the transformer blocks, loss = sum over samples of each sequence's mean next-token loss
(empirical Fisher), damping 1e-3 relative to the mean eigenvalue.

Methods (``throughput_kfac`` configurations): ``graddot`` (``TracInAttributor``, one
checkpoint), ``kfac``, ``ekfac`` (default pass plan), and each with capture-time LoGRA
projection ``k_a = k_g = 64`` (``*-logra``). Peer, when ``--kronfluence-python`` names an
interpreter where kronfluence and transformers import: ``kronfluence-kfac`` /
``kronfluence-ekfac`` (``Analyzer.fit_all_factors`` + ``compute_pairwise_scores``, empirical
Fisher, ``damping_factor=None`` with kronfluence's heuristic scale set to 1e-3, i.e. 1e-3 times
the mean eigenvalue of its Kronecker (K-FAC) or corrected (EK-FAC) eigenvalues; no projection).

Sweeps: (a) size — ``--sizes`` training sequences at hidden ``--size-hidden``;
(b) width — ``--hiddens`` at ``--width-n-train`` training sequences. Every point runs in a
fresh subprocess with ``torch.set_num_threads(1)``: one warm-up call on one batch, then one
timed live ``attribute`` call (for kronfluence: fit + scores). Reported: seconds, samples/s
(``n_train / seconds``), growth of peak RSS (VmHWM) over the RSS before the call. A point
that runs past ``--timeout`` seconds (the whole subprocess: imports, warm-up, timed call) is
recorded as timed out, and the method's larger points of that sweep are skipped. Once
``--budget-min`` minutes have passed since the start, the remaining width points are
skipped and listed. The report is rewritten after every point, so an interrupted run keeps
what it measured; the plots are drawn after each sweep.

Child mode (internal): ``--worker METHOD --n-train N --hidden H``. The kronfluence worker
imports only torch, transformers and kronfluence (and this folder's benchmark modules,
which import torch at module level only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from throughput import (
    RESULTS,
    kronfluence_task,
    linear_names,
    machine_line,
    time_kronfluence,
)
from throughput_kfac import (
    BATCH,
    DAMPING,
    N_QUERIES,
    SEQ,
    VOCAB,
    build_data,
    build_model,
    run_worker,
)

OURS = ("graddot", "kfac", "ekfac", "graddot-logra", "kfac-logra", "ekfac-logra")
KRONFLUENCE = ("kronfluence-kfac", "kronfluence-ekfac")
LABELS = {
    "graddot": "Grad-Dot",
    "kfac": "K-FAC",
    "ekfac": "EK-FAC",
    "graddot-logra": "Grad-Dot k=64",
    "kfac-logra": "K-FAC k=64",
    "ekfac-logra": "EK-FAC k=64",
    "kronfluence-kfac": "kronfluence K-FAC",
    "kronfluence-ekfac": "kronfluence EK-FAC",
}
FULL = {
    "sizes": "128,256,512,1024,2048",
    "size_hidden": 128,
    "hiddens": "128,256,512,1024",
    "width_n_train": 64,
    "methods": ",".join(OURS),
}
# each point is a fresh process (~5 s of imports), so the smoke run measures two methods only
SMOKE = {
    "sizes": "16,32",
    "size_hidden": 32,
    "hiddens": "32,64",
    "width_n_train": 16,
    "methods": "graddot,ekfac",
}
LINEAR_SLOPE_TOLERANCE = 0.15  # |slope - 1| within this reads as linear in n_train


def heads_for(hidden: int) -> int:
    """Attention heads of the GPT-NeoX at width ``hidden`` (head size 64, at least 4 heads)."""
    return max(4, hidden // 64)


# ----------------------------------------------------------------------------------- workers


def run_ours(method: str, n_train: int, hidden: int) -> dict:
    """One dattri_llm point: ``throughput_kfac.run_worker`` on a resized workload."""
    workload = {"hidden": hidden, "heads": heads_for(hidden), "n_train": n_train}
    return run_worker(method, workload)


def run_kronfluence(method: str, n_train: int, hidden: int) -> dict:
    """One kronfluence point (fit_all_factors + compute_pairwise_scores); imports no dattri_llm."""
    import kronfluence.factor.config as kronfluence_config
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments

    torch.set_num_threads(1)
    # damping_factor=None damps with HEURISTIC_DAMPING_SCALE x the mean eigenvalue: make the
    # scale ours, the closest kronfluence comes to relative damping 1e-3.
    kronfluence_config.HEURISTIC_DAMPING_SCALE = DAMPING
    model = build_model(hidden, heads_for(hidden))
    train, test = build_data(n_train)
    task = kronfluence_task(linear_names(model))
    model = prepare_model(model, task)
    analyzer = Analyzer(
        "scaling", model, task, cpu=True, disable_tqdm=True, output_dir=tempfile.mkdtemp()
    )
    strategy = method.removeprefix("kronfluence-")
    factor_args = FactorArguments(strategy=strategy, use_empirical_fisher=True)
    score_args = ScoreArguments(damping_factor=None)

    return time_kronfluence(analyzer, train, test, factor_args, score_args)


# ------------------------------------------------------------------------------------ driver


@dataclass
class Run:
    """Settings and results of one benchmark run (``points``: one dict per measured point)."""

    opts: argparse.Namespace
    start: float = field(default_factory=time.monotonic)
    started_at: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        )
    )
    load: float = field(default_factory=lambda: os.getloadavg()[0])
    kronfluence_reason: str | None = None  # why kronfluence rows were not run
    points: list[dict] = field(default_factory=list)

    def methods(self) -> list[str]:
        """The methods of every point: the chosen ones of ours, then kronfluence's."""
        return [m for m in self.opts.methods.split(",") if m] + list(KRONFLUENCE)

    def over_budget(self) -> bool:
        """Whether ``--budget-min`` minutes have passed since the start."""
        return time.monotonic() - self.start > 60 * self.opts.budget_min


def run_point(python: str, method: str, n_train: int, hidden: int, timeout: float) -> dict:
    """Run one point in a fresh ``python``: its metrics, or ``{"status": reason}``."""
    cmd = [python, __file__, "--worker", method, "--n-train", str(n_train)]
    cmd += ["--hidden", str(hidden)]
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        env = {**os.environ, "TMPDIR": tmp}  # stores and factors are removed with the point
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            return {"status": f"timed out (> {timeout:g} s)"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"status": f"failed (exit {proc.returncode}): {tail[0][:300]}"}


def check_kronfluence(python: str | None) -> str | None:
    """``None`` when kronfluence and transformers import under ``python``, else the reason."""
    if not python:
        return "not run (no `--kronfluence-python`)"
    probe = "import kronfluence, transformers"
    try:
        proc = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not run: `{python}` could not be started ({err})"
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return f"not run: `{python} -c '{probe}'` failed: {tail[0][:200]}"
    return None


def run_sweep(run: Run, sweep: str, grid: list[tuple[int, int]], budgeted: bool) -> None:
    """Measure every method at every ``(n_train, hidden)`` of ``grid`` (ascending cost).

    A method that times out skips its larger points; with ``budgeted``, points after the
    budget is spent are skipped. The report is rewritten after every point.
    """
    given_up: dict[str, str] = {}
    for n_train, hidden in grid:
        for method in run.methods():
            point = {"sweep": sweep, "method": method, "n_train": n_train, "hidden": hidden}
            if method in KRONFLUENCE and run.kronfluence_reason:
                point["status"] = run.kronfluence_reason
            elif method in given_up:
                point["status"] = f"skipped ({given_up[method]} at a smaller point)"
            elif budgeted and run.over_budget():
                point["status"] = f"skipped (budget of {run.opts.budget_min:g} min spent)"
            else:
                is_peer = method in KRONFLUENCE
                python = run.opts.kronfluence_python if is_peer else sys.executable
                point.update(run_point(python, method, n_train, hidden, run.opts.timeout))
                if point.get("status", "").startswith("timed out"):
                    given_up[method] = "timed out"
            run.points.append(point)
            print(json.dumps(point), flush=True)
            write_report(run)


# ------------------------------------------------------------------------------------ report


def log_log_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (needs two distinct ``x``)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def affine_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b x`` (needs two distinct ``x``)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def growth_verdict(slope: float) -> str:
    """Words for a log-log slope of seconds against ``n_train``."""
    if abs(slope - 1) <= LINEAR_SLOPE_TOLERANCE:
        return "~linear"
    return "sub-linear" if slope < 1 else "super-linear"


def measured(points: list[dict], sweep: str, method: str) -> list[dict]:
    """The points of ``sweep`` and ``method`` that produced a time."""
    return [p for p in points if p["sweep"] == sweep and p["method"] == method and "seconds" in p]


def plan_text(point: dict) -> str:
    """The K-FAC / EK-FAC pass plan of a point, ``-`` for methods without one."""
    plan = point.get("plan")
    if not plan:
        return "-"
    return f"{plan['source_passes']} of {plan['passes']}"


def point_table(points: list[dict], sweep: str, axis: str) -> list[str]:
    """Markdown rows of one sweep: a row per method and point, with kronfluence ratios."""
    lines = [
        f"| method | {axis} | seconds | samples/s | peak RSS growth (MiB) | model runs of passes "
        "| ours / kronfluence time | sum of abs scores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    peer = {
        (p["method"].removeprefix("kronfluence-"), p["n_train"], p["hidden"]): p["seconds"]
        for p in points
        if p["sweep"] == sweep and p["method"] in KRONFLUENCE and "seconds" in p
    }
    order = list(LABELS)
    rows = sorted(
        (p for p in points if p["sweep"] == sweep),
        key=lambda p: (order.index(p["method"]), p[axis]),
    )
    for p in rows:
        if "seconds" not in p:
            lines.append(f"| {LABELS[p['method']]} | {p[axis]} | {p['status']} | | | | | |")
            continue
        kron = peer.get((p["method"], p["n_train"], p["hidden"]))
        ratio = f"{p['seconds'] / kron:.2f}" if kron else "-"
        lines.append(
            f"| {LABELS[p['method']]} | {p[axis]} | {p['seconds']:.2f} "
            f"| {p['n_train'] / p['seconds']:.1f} | {p['peak_mib']:.0f} | {plan_text(p)} "
            f"| {ratio} | {p['checksum']:.6g} |"
        )
    return lines


def slope_table(run: Run, sweep: str, axis: str) -> list[str]:
    """Per method: fitted log-log slope of seconds against ``axis`` (and, for size, a + b n)."""
    size = sweep == "size"
    head = f"| method | points | log-log slope of seconds vs {axis} |"
    lines = [head + (" verdict | fit seconds = a + b n: a (s) | b (ms/sample) |" if size else "")]
    lines.append("|---|---|---|" + ("---|---|---|" if size else ""))
    for method in run.methods():
        pts = measured(run.points, sweep, method)
        xs = sorted({p[axis] for p in pts})
        if len(xs) < 2:
            continue
        secs = [p["seconds"] for p in pts]
        values = [float(p[axis]) for p in pts]
        slope = log_log_slope(values, secs)
        row = f"| {LABELS[method]} | {len(pts)} | {slope:.2f} |"
        if size:
            a, b = affine_fit(values, secs)
            row += f" {growth_verdict(slope)} | {a:.2f} | {1000 * b:.1f} |"
        lines.append(row)
    return lines


def growth_reasons(pts: list[dict], slope: float) -> list[str]:
    """Hints, from one method's size points, for why its seconds grow as they do."""
    pts = sorted(pts, key=lambda p: p["n_train"])
    first, last = pts[0], pts[-1]
    reasons = [
        f"time per sample {1000 * first['seconds'] / first['n_train']:.1f} ms at "
        f"n_train {first['n_train']}, {1000 * last['seconds'] / last['n_train']:.1f} ms at "
        f"{last['n_train']}"
    ]
    fixed, _ = affine_fit([float(p["n_train"]) for p in pts], [p["seconds"] for p in pts])
    if slope < 1 - LINEAR_SLOPE_TOLERANCE and fixed > 0:
        reasons.append(
            f"a cost independent of n_train (queries, curvature fit, per-call setup) of "
            f"{fixed:.2f} s, {fixed / first['seconds']:.0%} of the smallest point"
        )
    changed = [(a, b) for a, b in zip(pts, pts[1:]) if plan_text(a) != plan_text(b)]
    for before, after in changed:
        reasons.append(
            f"the pass plan went from {plan_text(before)} to {plan_text(after)} model runs at "
            f"n_train {after['n_train']} (the kept training gradients outgrew "
            "`kept_gradient_budget`, so later passes re-run the model)"
        )
    return reasons


def size_summary(run: Run) -> list[str]:
    """One line per method: is the size slope ~1, its number, and hints at why."""
    lines = []
    for method in run.methods():
        pts = measured(run.points, "size", method)
        if len({p["n_train"] for p in pts}) < 2:
            continue
        slope = log_log_slope([float(p["n_train"]) for p in pts], [p["seconds"] for p in pts])
        words = growth_verdict(slope)
        lines.append(
            f"* {LABELS[method]}: slope {slope:.2f} — {words} in n_train "
            f"(|slope - 1| {'<=' if words == '~linear' else '>'} {LINEAR_SLOPE_TOLERANCE}); "
            + "; ".join(growth_reasons(pts, slope))
            + "."
        )
    return lines


def render(run: Run) -> str:
    """The whole Markdown report of ``run`` so far."""
    opts = run.opts
    elapsed = (time.monotonic() - run.start) / 60
    lines = [
        "# Scaling with the training-set size and the model width (CPU)",
        "",
        f"Date: {run.started_at}. Machine: {machine_line()}; load average {run.load:.2f} at "
        "the start; every point ran in a fresh process with `torch.set_num_threads(1)`.",
        f"Produced by `python experiments/benchmark/{' '.join([Path(__file__).name] + opts.argv)}`"
        f" in {elapsed:.1f} min.",
        "",
        f"Workload: GPT-NeoX from config (4 layers, hidden h, max(4, h/64) heads, MLP 4h, vocab "
        f"{VOCAB}), training sequences of {SEQ} tokens, {N_QUERIES} queries, fp32, batch "
        f"{BATCH}, 16 hooked linear layers, empirical Fisher, damping {DAMPING:g} relative to the "
        "mean eigenvalue. `k=64` = capture-time LoGRA projection k_a = k_g = 64 (library default "
        "projector). One warm-up call on one batch, then one timed live `attribute(train, test)` "
        "call; samples/s = n_train / seconds; peak = growth of peak RSS (VmHWM) over the RSS "
        "before the call. 'model runs of passes' = the K-FAC/EK-FAC pass plan (passes over the "
        "training set that ran the model, of all passes; the others reused kept gradients).",
        "",
        "kronfluence: `fit_all_factors` + `compute_pairwise_scores`, same model, data, batch and "
        "layers, `use_empirical_fisher=True`, `damping_factor=None` with its heuristic scale set "
        f"to {DAMPING:g} (EK-FAC: {DAMPING:g} x mean corrected eigenvalue, as ours; K-FAC: one "
        "damping on the Kronecker eigenvalues, ours damps each factor); factors and scores "
        "written to a temporary directory; full gradients only. 'ours / kronfluence' divides the "
        "unprojected row by kronfluence's row of the same method and point. With the same "
        "damping, EK-FAC score sums of the two libraries agree closely; K-FAC's differ by the "
        "damping form.",
        "",
        f"## (a) Training-set size (hidden {opts.size_hidden})",
        "",
        *point_table(run.points, "size", "n_train"),
        "",
        *slope_table(run, "size", "n_train"),
        "",
        "Growth in n_train (seconds = a + b n separates the fixed cost a — queries, curvature "
        "fit and eigendecompositions, per-call setup — from the per-sample cost b):",
        "",
        *(size_summary(run) or ["* (fewer than two sizes measured)"]),
        "",
        f"## (b) Model width (n_train {opts.width_n_train})",
        "",
        *point_table(run.points, "width", "hidden"),
        "",
        *slope_table(run, "width", "hidden"),
        "",
        "Parameters of the hooked layers grow as h^2 (slope 2); Kronecker factors as h^2 "
        "entries and their eigendecompositions as h^3.",
    ]
    versions = sorted({p["version"] for p in run.points if "version" in p})
    if versions:
        lines += ["", "Versions: " + "; ".join(versions) + "."]
    return "\n".join(lines) + "\n"


def plot_sweep(run: Run, sweep: str, axis: str, slopes: tuple[int, ...], path: Path) -> None:
    """Log-log plot of seconds against ``axis``, one line per method, dashed reference slopes."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {
        m: sorted(measured(run.points, sweep, m), key=lambda p: p[axis]) for m in run.methods()
    }
    curves = {m: pts for m, pts in curves.items() if pts}
    if not curves:
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    anchor = None  # reference lines start at the first measured point
    for method, pts in curves.items():
        style, marker = ("-.", "s") if method in KRONFLUENCE else ("-", "o")
        xs, ys = [p[axis] for p in pts], [p["seconds"] for p in pts]
        ax.plot(xs, ys, style, marker=marker, label=LABELS[method])
        anchor = anchor or (xs[0], ys[0])
    x_all = sorted({p[axis] for p in run.points if p["sweep"] == sweep})
    for slope, ref_style in zip(slopes, ("--", ":")):  # slope 1 dashed, slope 2 dotted
        ys = [anchor[1] * (x / anchor[0]) ** slope for x in x_all]
        ax.plot(x_all, ys, linestyle=ref_style, color="gray", label=f"slope {slope} (reference)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(x_all, [str(x) for x in x_all])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel(axis)
    ax.set_ylabel("seconds (one attribute call)")
    ax.set_title(f"{sweep} sweep: seconds vs {axis} (log-log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(run: Run) -> None:
    """Rewrite ``scaling.md`` under ``--out`` (atomically: an interrupted write keeps the old)."""
    # imported here: the kronfluence worker imports this module where dattri_llm is absent
    from dattri_llm.utils.atomic import atomic_write

    text = render(run).encode()
    atomic_write(Path(run.opts.out) / "scaling.md", lambda fh: fh.write(text))


def write_plots(run: Run) -> None:
    """Draw ``scaling_size.png`` and ``scaling_width.png`` under ``--out``."""
    out = Path(run.opts.out)
    plot_sweep(run, "size", "n_train", (1,), out / "scaling_size.png")
    plot_sweep(run, "width", "hidden", (1, 2), out / "scaling_width.png")


def parse_sizes(text: str) -> list[int]:
    """``"128,256"`` -> ``[128, 256]``, ascending."""
    return sorted(int(v) for v in text.split(",") if v)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options; ``--smoke`` fills the unset sweep options with tiny values and a temp ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=OURS + KRONFLUENCE, help=argparse.SUPPRESS)
    parser.add_argument("--n-train", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny settings, temporary --out")
    parser.add_argument("--sizes", help=f"training-set sizes (default {FULL['sizes']})")
    parser.add_argument(
        "--size-hidden", type=int, help=f"hidden of the size sweep (default {FULL['size_hidden']})"
    )
    parser.add_argument("--hiddens", help=f"widths (default {FULL['hiddens']})")
    parser.add_argument(
        "--width-n-train",
        type=int,
        help=f"training sequences of the width sweep (default {FULL['width_n_train']})",
    )
    parser.add_argument(
        "--methods", help=f"comma-separated, of ours (default all; --smoke: {SMOKE['methods']})"
    )
    parser.add_argument("--kronfluence-python", help="interpreter with kronfluence installed")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per point")
    parser.add_argument("--budget-min", type=float, default=20, help="width points stop after")
    parser.add_argument("--out", help="report folder (default results/, or a temp one)")
    opts = parser.parse_args(argv)
    opts.argv = argv
    defaults = SMOKE if opts.smoke else FULL
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    unknown = sorted(set(opts.methods.split(",")) - set(OURS) - {""})
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {', '.join(OURS)}")
    if opts.smoke and opts.out and Path(opts.out).resolve() == RESULTS.resolve():
        parser.error("--smoke must not write over the committed results/; drop --out")
    if opts.out is None and not opts.worker:
        opts.out = tempfile.mkdtemp(prefix="scaling-smoke-") if opts.smoke else str(RESULTS)
    return opts


def main(argv: list[str] | None = None) -> None:
    """Run one worker point (``--worker``) or both sweeps, writing the report and plots."""
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    if opts.worker:
        worker = run_kronfluence if opts.worker in KRONFLUENCE else run_ours
        print(json.dumps(worker(opts.worker, opts.n_train, opts.hidden)), flush=True)
        return
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    run = Run(opts)
    run.kronfluence_reason = check_kronfluence(opts.kronfluence_python)
    size_grid = [(n, opts.size_hidden) for n in parse_sizes(opts.sizes)]
    width_grid = [(opts.width_n_train, h) for h in parse_sizes(opts.hiddens)]
    run_sweep(run, "size", size_grid, budgeted=False)
    write_plots(run)
    run_sweep(run, "width", width_grid, budgeted=True)
    write_report(run)
    write_plots(run)
    print(f"wrote {Path(opts.out) / 'scaling.md'} and the scaling_*.png plots")


if __name__ == "__main__":
    main()

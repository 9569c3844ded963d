"""AdamW-influence's first-order error and its closed-form proxy, over learning rates and lengths.

For every configuration of a grid (peak learning rate η × trajectory length T) on the
TSLOO setting (``setting.py``):

1. ground truth by leave-one-out replays in float64:
   ``Δ_true[i, j] = L_j(θ_T without i) − L_j(θ_T)``;
2. ``Δ_linear``: AdamW-influence's removal estimate (``−`` its up-weighting score), from
   the float32 capture of the trajectory (``capture.py``);
3. the measured first-order error ``Δ_true − Δ_linear``, per sample and query;
4. a float64 finite-difference reference of the second-order term,
   ``½a''(0) ≈ (a(ε) + a(−ε) − 2a(0)) / (2ε²)`` with ``a(δ)`` the query loss after
   training with the sample's loss weighted ``1 + δ`` (the same replays give the exact
   first derivative ``(a(ε) − a(−ε)) / (2ε)``, the first-order limit);
5. the error proxy ``E = ½a''(0)`` of ``AdamWInfluenceAttributor.error_proxy`` (a forward
   sweep along the recorded trajectory), its ``relative_error`` statistic and
   ``reliable`` flag — when the installed library has it;
6. AdamW-influence's fidelity (per-query Spearman / Pearson with ``Δ_true``).

Writes ``results/error_proxy.md`` and ``results/error_proxy.png`` (``--out DIR``).
``--cache DIR`` keeps the float64 replays of each configuration (the slow part), so a
rerun only redoes the captures and the scoring.

Run:  python experiments/fidelity/error_proxy.py [--smoke] [--out DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import math
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import setting as setting_module  # noqa: E402
from capture import Captured, capture_trajectory  # noqa: E402
from methods import adamw_influence, arguments, attributor_class  # noqa: E402
from setting import (  # noqa: E402
    SMOKE,
    Data,
    Setting,
    batch_order,
    lr_schedule,
    make_data,
    make_model,
    pretrain,
    query_losses,
    run_trajectory,
)
from tsloo import fresh_model, machine, spearman_per_query  # noqa: E402

from dattri_llm import hash_sample  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
EPSILON = 1e-2  # finite-difference step of the float64 second-order reference
STABILITY_EPSILONS = (3e-3, 3e-2)  # checked against EPSILON on a few samples
STABILITY_SAMPLES = 8

# 32 of the 64 fine-tuning samples are removed (seeded), the 32 queries of tsloo.py.
BASE = Setting(num_removed=32)
LEARNING_RATES = (3e-4, 1e-3, 3e-3, 1e-2)
SMOKE_BASE = replace(SMOKE, num_removed=4)
SMOKE_LEARNING_RATES = (1e-3, 1e-2)
LENGTHS = ("half", "one", "two")
SMOKE_LENGTHS = ("half", "one")


def configuration(base: Setting, lr: float, length: str) -> Setting:
    """The setting at peak rate ``lr`` and trajectory length ``length``.

    The batch (4 in the full grid) stays, so every step perturbs the same way and only
    the length changes: ``half`` fine-tunes one epoch on the first half of the
    fine-tuning sentences (the other half stays out of pretraining, which is unchanged),
    ``one`` is one epoch on all of them, ``two`` is two epochs (each sample seen twice).
    """
    if length == "half":
        return replace(
            base,
            peak_lr=lr,
            num_finetune=base.num_finetune // 2,
            finetune_pool=base.num_finetune,
        )
    return replace(base, peak_lr=lr, finetune_epochs={"one": 1, "two": 2}[length])


# ---------------------------------------------------------------------------- replays (float64)
def replay(start, setting: Setting, data: Data, removed=None, weight: float = 0.0):
    """Float64 query losses after the trajectory with ``removed`` weighted ``weight``."""
    model = fresh_model(start, setting, data, torch.float64)
    run_trajectory(model, setting, data, removed=removed, removed_weight=weight)
    return query_losses(model, data)


def replays(start, setting: Setting, data: Data, cache: Path | None) -> dict[str, torch.Tensor]:
    """Leave-one-out, ``1 ± ε`` replays of every removed sample (cached by setting).

    Returns ``truth`` (Δ_true), ``exact_linear`` (``−a'(0)``, the exact first-order
    removal estimate), ``fd_second`` (``½a''(0)``), each ``(num_removed, num_query)``,
    and ``seconds``.
    """
    key = hashlib.sha1(repr((setting, EPSILON, "float64 loss")).encode()).hexdigest()[:16]
    path = None if cache is None else cache / f"replays_{key}.pt"
    if path is not None and path.is_file():
        return torch.load(path)
    t = time.perf_counter()
    base = replay(start, setting, data)
    rows = {"truth": [], "exact_linear": [], "fd_second": []}
    for i in data.removed:
        loo = replay(start, setting, data, i, 0.0)
        plus = replay(start, setting, data, i, 1.0 + EPSILON)
        minus = replay(start, setting, data, i, 1.0 - EPSILON)
        rows["truth"].append(loo - base)
        rows["exact_linear"].append(-(plus - minus) / (2 * EPSILON))
        rows["fd_second"].append((plus + minus - 2 * base) / (2 * EPSILON**2))
    result = {k: torch.stack(v) for k, v in rows.items()}
    result["seconds"] = torch.tensor(time.perf_counter() - t)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, path)
    return result


SWEEP_EPSILONS = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)


def epsilon_sweep(start, setting: Setting, data: Data, row, linear, proxy) -> list[dict]:
    """Central differences at shrinking ε for one removed sample of the first batch and one
    outside it, on the first query, beside Δ_true, Δ_linear and E."""
    first = row.scatter["first"]
    picks = [k for k in (first.nonzero(), (~first).nonzero()) if len(k)]
    base = replay(start, setting, data)
    out = []
    for k in [int(p[0]) for p in picks]:
        i = data.removed[k]
        entry = {
            "sample": i,
            "first": bool(first[k]),
            "truth": float(row.scatter["error"][k, 0] + linear[k, 0]),
            "linear": float(linear[k, 0]),
            "proxy": None if proxy is None else float(proxy["second"][k, 0]),
            "eps": [],
        }
        for eps in SWEEP_EPSILONS:
            plus = replay(start, setting, data, i, 1.0 + eps)[0]
            minus = replay(start, setting, data, i, 1.0 - eps)[0]
            entry["eps"].append(
                (eps, float(-(plus - minus) / (2 * eps)),
                 float((plus + minus - 2 * base[0]) / (2 * eps**2)))
            )  # fmt: skip
        out.append(entry)
    return out


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


def fd_stability(start, setting: Setting, data: Data, fd_second: torch.Tensor) -> dict:
    """``½a''(0)`` at the other ε on the first removed samples: relative deviation from ε."""
    n = min(STABILITY_SAMPLES, len(data.removed))
    base = replay(start, setting, data)
    scale = fd_second[:n].abs().mean()
    out = {}
    for eps in STABILITY_EPSILONS:
        second = torch.stack(
            [
                (
                    replay(start, setting, data, i, 1.0 + eps)
                    + replay(start, setting, data, i, 1.0 - eps)
                    - 2 * base
                )
                / (2 * eps**2)
                for i in data.removed[:n]
            ]
        )
        out[eps] = float((second - fd_second[:n]).abs().mean() / scale)
    return out


# ---------------------------------------------------------------------------- library (float32)
def capture(start, setting: Setting, data: Data, root: Path) -> Captured:
    """The trajectory's per-step gradients, Adam dynamics and the queries at ``θ_T``."""
    reference_model = fresh_model(start, setting, data)
    run_trajectory(reference_model, setting, data)
    reference = {k: v.detach().clone() for k, v in reference_model.named_parameters()}
    captured = Captured(
        root=root,
        train_ids=[hash_sample(x) for x in data.finetune],
        query_ids=[hash_sample(q) for q in data.queries],
        lrs=dict(enumerate(lr_schedule(setting))),
        dynamics={},
        setting=setting,
    )
    model = fresh_model(start, setting, data)
    captured.dynamics = capture_trajectory(model, setting, data, captured, reference)
    return captured


def proxy_available() -> bool:
    """Whether the installed ``AdamWInfluenceAttributor`` has ``error_proxy``."""
    return hasattr(attributor_class("AdamWInfluenceAttributor"), "error_proxy")


def run_proxy(captured: Captured, dtype: torch.dtype):
    """``AdamWInfluenceAttributor.error_proxy`` of the capture, the sweep in ``dtype``."""
    attributor = attributor_class("AdamWInfluenceAttributor")(arguments(captured))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attributor.error_proxy(
            captured.trajectory,
            captured.queries_final,
            dynamics=captured.dynamics,
            loss_reduction=captured.setting.loss_reduction,
            per_sample=True,
            block_dtype=dtype,
        )


def error_proxy(captured: Captured) -> dict:
    """The library's error proxy in fine-tuning-row / query-column order (float64).

    The sweep runs in float64 (the library's default); a float32 sweep is run too, for
    its share of non-finite ``E`` and its ``reliable`` flag.
    """
    t = time.perf_counter()
    proxy = run_proxy(captured, torch.float64)
    seconds = time.perf_counter() - t
    single = run_proxy(captured, torch.float32)
    nonfinite32 = float((~torch.isfinite(torch.as_tensor(single.second_order))).double().mean())
    relative = torch.as_tensor(proxy.relative_error).double()
    row_of = {sample: r for r, sample in enumerate(captured.train_ids)}
    test_ids = list(proxy.test_ids)
    columns = [test_ids.index(q) for q in captured.query_ids]
    rows = [row_of[i] for i in proxy.train_ids]
    shape = (len(captured.train_ids), len(captured.query_ids))
    linear, second = (
        torch.zeros(shape, dtype=torch.float64),
        torch.zeros(shape, dtype=torch.float64),
    )
    linear[rows] = torch.as_tensor(proxy.linear).double()[:, columns]
    second[rows] = torch.as_tensor(proxy.second_order).double()[:, columns]
    return {
        "linear": linear,
        "second": second,
        "relative_error": relative[columns],
        "reliable_queries": relative[columns] <= float(proxy.threshold),
        "reliable": bool(proxy.reliable),  # the library's flag: median relative_error
        "threshold": float(proxy.threshold),
        "seconds": seconds,
        "nonfinite32": nonfinite32,
        "reliable32": bool(single.reliable),
        "relative32": float(torch.as_tensor(single.relative_error).double().median()),
    }


# ---------------------------------------------------------------------------- metrics
def pearson_per_query(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(num_query,)`` Pearson correlations between the columns of two ``(n, m)`` matrices."""
    a, b = a.double() - a.double().mean(0), b.double() - b.double().mean(0)
    return (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-300)


def spearman_flat(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman over all entries (sample × query pairs, or configurations)."""
    a, b = a.reshape(-1, 1).double(), b.reshape(-1, 1).double()
    return float(spearman_per_query(a, b)[0])


def relative_statistic(second: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """``(num_query,)`` ``|mean_i second| / rms_i(linear)`` (the proxy's ``relative_error``)."""
    return second.mean(0).abs() / linear.pow(2).mean(0).sqrt().clamp_min(1e-300)


def split_ratios(name: str, second: torch.Tensor, taylor: torch.Tensor, first) -> dict:
    """``mean |second| / mean |taylor|`` over the first update's samples and the others."""
    out = {}
    for part, rows in (("first", first), ("rest", ~first)):
        if rows.any():
            out[f"{name}_ratio_{part}"] = float(
                second[rows].abs().mean() / taylor[rows].abs().mean()
            )
    return out


@dataclass
class Row:
    """One configuration's numbers."""

    lr: float
    steps: int
    length: str
    metrics: dict
    per_query: dict  # (num_query,) tensors: AdamW Spearman, relative_error, reliable
    scatter: dict  # per-pair tensors for the plot


def evaluate(setting, length, rep, linear, proxy, removed: list[int]) -> Row:
    """Every statistic of one configuration (``proxy`` may be ``None``)."""
    truth, exact, fd = rep["truth"], rep["exact_linear"], rep["fd_second"]
    error = truth - linear
    first = torch.tensor([i in batch_order(setting)[0] for i in removed])
    m = {
        "num_first": int(first.sum()),
        **split_ratios("fd", fd, truth - exact, first),
        **split_ratios("method", exact - linear, truth, first),
        "mean_abs_truth": float(truth.abs().mean()),
        "mean_abs_error": float(error.abs().mean()),
        "rel_error": float(error.abs().mean() / truth.abs().mean()),
        "mean_abs_taylor": float((truth - exact).abs().mean()),
        "mean_abs_method": float((exact - linear).abs().mean()),
        "mean_abs_fd": float(fd.abs().mean()),
        "median_abs_fd": float(fd.abs().median()),
        "median_abs_error": float(error.abs().median()),
        "median_abs_taylor": float((truth - exact).abs().median()),
        "fd_vs_taylor_pairs": spearman_flat(fd, truth - exact),
        "fd_vs_error_pairs": spearman_flat(fd, error),
        "fd_relative": float(relative_statistic(fd, exact).median()),
        "spearman": float(spearman_per_query(linear, truth).mean()),
        "spearman_se": float(spearman_per_query(linear, truth).std() / math.sqrt(truth.shape[1])),
        "pearson": float(pearson_per_query(linear, truth).mean()),
        "limit_spearman": float(spearman_per_query(exact, truth).mean()),
        "fd_corrected_spearman": float(spearman_per_query(exact + fd, truth).mean()),
        "replay_seconds": float(rep["seconds"]),
    }
    per_query = {"spearman": spearman_per_query(linear, truth)}
    scatter = {"error": error, "fd": fd, "first": first}
    if proxy is not None:
        second = proxy["second"]
        m |= split_ratios("proxy", second, truth - exact, first)
        m |= {
            "mean_abs_proxy": float(second.abs().mean()),
            "median_abs_proxy": float(second.abs().median()),
            "max_share": float(second.abs().amax(1).max() / second.abs().amax(1).sum()),
            "ratio": float(second.abs().mean() / error.abs().mean()),
            "proxy_vs_error_pairs": spearman_flat(second, error),
            "proxy_vs_error_query": float(spearman_per_query(second, error).mean()),
            "proxy_vs_fd_pairs": spearman_flat(second, fd),
            "proxy_vs_fd_rel": float((second - fd).abs().mean() / fd.abs().mean()),
            "sign_agreement": float((second.sign() == error.sign()).double().mean()),
            "linear_check": float((proxy["linear"] - linear).abs().max() / linear.abs().max()),
            "relative_error": float(proxy["relative_error"].median()),
            "reliable": proxy["reliable"],
            "reliable_fraction": float(proxy["reliable_queries"].double().mean()),
            "corrected_spearman": float(spearman_per_query(linear + second, truth).mean()),
            "proxy_seconds": proxy["seconds"],
            "nonfinite32": proxy["nonfinite32"],
            "reliable32": proxy["reliable32"],
            "relative32": proxy["relative32"],
            "threshold": proxy["threshold"],
        }
        m |= rest_metrics(truth, linear, second, ~first, threshold=proxy["threshold"])
        per_query |= {
            "relative_error": proxy["relative_error"],
            "reliable": proxy["reliable_queries"],
        }
        scatter["proxy"] = second
    return Row(setting.peak_lr, setting.num_steps, length, m, per_query, scatter)


def rest_metrics(truth, linear, second, rest: torch.Tensor, threshold: float) -> dict:
    """The statistics over the removed samples outside the first batch (``rest``)."""
    truth, linear, second = truth[rest], linear[rest], second[rest]
    error = truth - linear
    relative = relative_statistic(second, linear)
    return {
        "rest_n": int(rest.sum()),
        "rest_mean_abs_truth": float(truth.abs().mean()),
        "rest_mean_abs_error": float(error.abs().mean()),
        "rest_rel_error": float(error.abs().mean() / truth.abs().mean()),
        "rest_mean_abs_proxy": float(second.abs().mean()),
        "rest_ratio": float(second.abs().mean() / error.abs().mean()),
        "rest_proxy_vs_error_pairs": spearman_flat(second, error),
        "rest_proxy_vs_error_query": float(spearman_per_query(second, error).mean()),
        "rest_spearman": float(spearman_per_query(linear, truth).mean()),
        "rest_relative": float(relative.median()),
        "rest_reliable": bool(relative.median() <= threshold),
    }


# ---------------------------------------------------------------------------- report
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
        f"- FD reference: ½a''(0) ≈ (a(ε) + a(−ε) − 2a(0)) / (2ε²), ε = {EPSILON:g}, float64 "
        "replays with the sample's loss weighted 1 ± ε; the same replays give the exact "
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


# ---------------------------------------------------------------------------- main
def run(smoke: bool, out: Path, cache: Path | None) -> Path:
    """The whole grid; returns the table's path."""
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    setting_module.FLOAT64_LOSS = True  # float64 replays are float64 through the loss
    base = SMOKE_BASE if smoke else BASE
    lrs = SMOKE_LEARNING_RATES if smoke else LEARNING_RATES
    lengths = SMOKE_LENGTHS if smoke else LENGTHS
    pool_data = make_data(base)
    model = make_model(base, pool_data.vocab_size)
    pretrain(model, base, pool_data)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    have = proxy_available()
    print(f"error proxy available: {have}", flush=True)
    rows, replay_time, library_time, cached, sweep = [], 0.0, 0.0, True, []
    stability, stability_time = [], 0.0
    for lr in lrs:
        for length in lengths:
            setting = configuration(base, lr, length)
            data = make_data(setting)
            if [hash_sample(x) for x in data.pretrain] != [
                hash_sample(x) for x in pool_data.pretrain
            ]:
                raise RuntimeError("the pretraining split moved")
            t = time.perf_counter()
            rep = replays(start, setting, data, cache)
            replay_time += time.perf_counter() - t
            cached &= time.perf_counter() - t < 0.5 * float(rep["seconds"])
            if (length, lr) in (("one", lrs[1]), ("two", lrs[-1])):
                t = time.perf_counter()
                stability.append(
                    (lr, setting.num_steps, fd_stability(start, setting, data, rep["fd_second"]))
                )
                stability_time += time.perf_counter() - t
            t = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="error_proxy_") as work:
                captured = capture(start, setting, data, Path(work))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    linear = adamw_influence(1)(captured)[data.removed]
                proxy = error_proxy(captured) if have else None
            if proxy is not None:
                proxy = {k: v[data.removed] if k in ("linear", "second") else v
                         for k, v in proxy.items()}  # fmt: skip
            library_time += time.perf_counter() - t
            row = evaluate(setting, length, rep, linear, proxy, data.removed)
            rows.append(row)
            if (length, lr) == ("one", lrs[1]):
                t = time.perf_counter()
                sweep = epsilon_sweep(start, setting, data, row, linear, proxy)
                stability_time += time.perf_counter() - t
            m = row.metrics
            print(
                f"η={lr:g} T={setting.num_steps}: |Δ| {m['mean_abs_truth']:.2e} |err| "
                f"{m['mean_abs_error']:.2e} (taylor {m['mean_abs_taylor']:.2e}, method "
                f"{m['mean_abs_method']:.2e}) |FD| {m['mean_abs_fd']:.2e} "
                f"|E| {fmt(m.get('mean_abs_proxy'))} Spearman {m['spearman']:+.3f} "
                f"rel {fmt(m.get('relative_error'), '.3f')} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    steps = {length: configuration(base, lrs[0], length).num_steps for length in LENGTHS}
    info = {
        "base": base,
        "machine": machine(),
        "total": time.perf_counter() - t0,
        "replay": replay_time,
        "library": library_time,
        "cached": cached,
        "replay_original": sum(r.metrics["replay_seconds"] for r in rows),
        "stability_time": stability_time,
        "stability": "; ".join(
            f"at η={lr:g}, T={s}, on the first {STABILITY_SAMPLES} removed samples, mean "
            "|½a''(0)| deviation relative to ε's: "
            + ", ".join(f"{d:.1e} (ε = {e:g})" for e, d in dev.items())
            for lr, s, dev in stability
        ),
        "num_pretrain": len(pool_data.pretrain),
        "sweep": sweep,
        "lrs": lrs,
        "lengths": lengths,
        "steps": steps,
        "proxy": have,
        "threshold": rows[0].metrics.get("threshold", 0.3),
    }
    out.mkdir(parents=True, exist_ok=True)
    table = write_table(rows, info, out)
    example = next(
        (k for k, r in enumerate(rows) if r.lr == lrs[min(1, len(lrs) - 1)] and r.length == "one"),
        0,
    )
    plot = write_plot(rows, out, have, example)
    print(f"wrote {table} and {plot} in {time.perf_counter() - t0:.0f} s")
    return table


def main(argv: list[str] | None = None) -> Path:
    """Parse ``--smoke`` / ``--out`` / ``--cache`` and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny grid (for the test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    parser.add_argument("--cache", type=Path, default=None, help="keep the float64 replays here")
    args = parser.parse_args(argv)
    return run(args.smoke, args.out, args.cache)


if __name__ == "__main__":
    main()

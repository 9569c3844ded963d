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

Writes ``results/error_proxy.md`` and ``results/error_proxy.png`` (``--out DIR``;
``error_proxy_report.py``), from the statistics of ``error_proxy_metrics.py``.
``--cache DIR`` keeps the float64 replays of each configuration (the slow part), so a
rerun only redoes the captures and the scoring.

Run:  python experiments/fidelity/error_proxy.py [--smoke] [--out DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import setting as setting_module  # noqa: E402
from capture import Captured, capture_trajectory  # noqa: E402
from error_proxy_metrics import evaluate  # noqa: E402
from error_proxy_report import fmt, write_plot, write_table  # noqa: E402
from methods import adamw_influence, arguments, attributor_class  # noqa: E402
from protocol import machine  # noqa: E402
from scoring import fresh_model  # noqa: E402
from setting import (  # noqa: E402
    SMOKE,
    Data,
    Setting,
    lr_schedule,
    make_data,
    make_model,
    pretrain,
    query_losses,
    run_trajectory,
)

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
        "epsilon": EPSILON,
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

"""STRIDE's settings, one at a time around the registry's default, on TSLOO and LDS.

The default (``methods.STRIDE_CONFIG``): the output of block 1 (``transformer.h.0``, the
library's 0.625-depth rule for 2 blocks), rank ``r = 16``, ``K = 48`` subsets with
``d = 6`` subsets per sample, the logits injection, 300 Adam steps at lr 1e-3,
``λ = 0.01 · λ_max``. Each other row changes ONE of these (not a full grid): the layer,
the rank, the design ``(K, d)``, the injection, the fit's step count or its learning
rate; the ``λ`` rows
re-run only the Lasso on the default fit's measurements ``u``.

Every row is scored on the same ground truths as ``tsloo.py`` (leave-one-out replays of
all 64 samples) and ``lds.py`` (128 retrainings on random halves, the same subsets).

Writes ``results/stride_sweep.md`` (``--out DIR``); ``--smoke`` runs the smallest setting.

Run:  python experiments/fidelity/stride_sweep.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture import Captured  # noqa: E402
from methods import STRIDE_CONFIG, stride_attributor, stride_config_for  # noqa: E402
from protocol import CACHE, lds_stat, lds_truth, loo_truth, machine, tsloo_stat  # noqa: E402
from scoring import prepare  # noqa: E402
from setting import SMOKE, Setting  # noqa: E402

from dattri_llm import StrideConfig, hash_sample  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LAMBDAS = (0.001, 0.003, 0.03, 0.1)
SUBSETS, FRACTION = 128, 0.5


def variations(default: StrideConfig, smoke: bool) -> list[tuple[str, StrideConfig]]:
    """``(label, config)``: the default, then one change at a time."""
    k, d = default.num_subsets, default.subsets_per_example
    rows = [("default", default)]
    rows += (
        [("layer transformer.h.1", default.replace(layer="transformer.h.1"))] if not smoke else []
    )
    rows += [(f"rank {r}", default.replace(rank=r)) for r in (4, 32)]
    designs = [(32, 4), (64, 8)] if not smoke else [(max(d, k // 2), max(1, d // 2))]
    rows += [(f"K={kk}, d={dd}", default.replace(num_subsets=kk, subsets_per_example=dd))
             for kk, dd in designs]  # fmt: skip
    rows += [("injection residual", default.replace(injection="residual"))]
    rows += [(f"{default.steps // 3} steps", default.replace(steps=max(1, default.steps // 3)))]
    rows += [
        (
            f"lr {default.learning_rate * 10:g}",
            default.replace(learning_rate=default.learning_rate * 10),
        )
    ]
    return rows


def scored_config(attributor, data, train_ids, query_ids) -> dict:
    """Fit, measure, recover; the score matrix ``(N, Q)`` and the seconds of each phase."""
    t = time.perf_counter()
    fit = attributor.fit(data.finetune)
    fit_s = time.perf_counter() - t
    t = time.perf_counter()
    test_ids, u = attributor.measure(data.queries, fit=fit)
    measure_s = time.perf_counter() - t
    t = time.perf_counter()
    result = attributor.recover(u, fit=fit)
    lasso_s = time.perf_counter() - t
    if fit.train_ids != train_ids or test_ids != query_ids:
        raise RuntimeError("the fit's rows or columns are not in the setting's order")
    last = fit.history[-1]
    return {
        "fit": fit,
        "u": u,
        "scores": result.weights.T.double(),
        "fit_s": fit_s,
        "query_s": measure_s + lasso_s,
        "fidelity": f"{fit.history[0]['fidelity']:.3f} → {last['fidelity']:.3f}",
        "stability": last["stability"],
    }


def metrics(scores: torch.Tensor, truth, subsets) -> dict:
    """TSLOO and LDS (mean, s.e.) and the share of non-zero scores."""
    tsloo, lds = tsloo_stat(scores, truth), lds_stat(scores, subsets)
    return {
        "tsloo": (tsloo.mean, tsloo.se),
        "lds": (lds.mean, lds.se),
        "nonzero": float((scores != 0).double().mean()),
    }


def run(setting: Setting, smoke: bool, out: Path) -> Path:
    """The sweep; returns the table's path."""
    t0 = time.perf_counter()
    prepared = prepare(setting)
    data = prepared.data
    truth = loo_truth(prepared.start, setting, data, cache=CACHE)
    count = 12 if smoke else SUBSETS
    subsets = lds_truth(prepared.start, setting, data, count, FRACTION, cache=CACHE)
    truth_s = time.perf_counter() - t0
    print(f"ground truths in {truth_s:.0f} s", flush=True)
    model = prepared.reference_model.eval()
    train_ids = [hash_sample(x) for x in data.finetune]
    query_ids = [hash_sample(q) for q in data.queries]
    default = stride_config_for(STRIDE_CONFIG, setting.num_finetune)
    rows = []
    with tempfile.TemporaryDirectory(prefix="stride_sweep_") as work:
        captured = Captured(Path(work), train_ids, query_ids, {}, {}, setting)
        for label, config in variations(default, smoke):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                attributor = stride_attributor(captured, model, config)
                run_ = scored_config(attributor, data, train_ids, query_ids)
            rows.append({"label": label, "config": config, **run_,
                         **metrics(run_["scores"], truth, subsets)})  # fmt: skip
            r = rows[-1]
            print(f"  {label:<24} TSLOO {r['tsloo'][0]:+.3f} LDS {r['lds'][0]:+.3f} "
                  f"fit {r['fit_s']:.1f} s", flush=True)  # fmt: skip
            if label == "default":
                for lam in LAMBDAS:
                    fit = dataclasses.replace(
                        run_["fit"], config=run_["fit"].config.replace(lasso_lambda=lam)
                    )
                    t = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        weights = attributor.recover(run_["u"], fit=fit).weights.T.double()
                    lasso_s = time.perf_counter() - t
                    rows.append({"label": f"λ = {lam:g}·λ_max (default fit's u)",
                                 "config": fit.config, "fit_s": None, "query_s": lasso_s,
                                 "fidelity": None, "stability": None,
                                 **metrics(weights, truth, subsets)})  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    info = {"setting": setting, "default": default, "total": time.perf_counter() - t0,
            "truth_s": truth_s, "count": count}  # fmt: skip
    return write_table(rows, info, out)


def write_table(rows: list[dict], info: dict, out: Path) -> Path:
    """``stride_sweep.md``."""
    s: Setting = info["setting"]
    c: StrideConfig = info["default"]
    lines = [
        "# STRIDE settings on TSLOO and LDS (CPU scale)",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {machine()}",
        f"- Total run time {info['total']:.0f} s (ground truths {info['truth_s']:.0f} s).",
        f"- Setting: the TSLOO default ({s.num_finetune} fine-tuning samples, {s.num_steps} "
        f"AdamW steps, GPT-2 n_embd={s.n_embd}, n_layer={s.n_layer}); STRIDE fits its operators "
        "on the fine-tuning samples against the final model θ_T.",
        f"- Default: layer `transformer.h.0` (block 1 of {s.n_layer}), rank {c.rank}, "
        f"K={c.num_subsets}, d={c.subsets_per_example} (about "
        f"{s.num_finetune * c.subsets_per_example / c.num_subsets:.0f} samples per subset), "
        f"injection {c.injection}, {c.steps} Adam steps at lr {c.learning_rate:g} "
        f"({c.subsets_per_step} subsets × ({c.fidelity_batch_size} members + "
        f"{c.reference_batch_size} non-members) per step, linearity probe {c.probe_size}), "
        f"λ = {c.lasso_lambda:g}·λ_max, free intercept. Every other row changes one setting "
        "(one-at-a-time, not a grid); the λ rows re-run only the Lasso on the default fit's "
        "measurements.",
        f"- TSLOO: per-query Spearman against the leave-one-out ground truth (`results/tsloo.md`); "
        f"LDS: per-query Spearman over {info['count']} retrainings on random halves "
        "(`results/lds.md`, same subsets). Mean ± standard error over the queries.",
        "- fit s: the operator fit; query s: measuring every query plus the Lasso. Non-zero: "
        "share of the N × Q scores the Lasso left non-zero. Fidelity: the fit's fidelity term "
        "(mean token loss of the drawn members under their subset's operator) at the first "
        "step (operators still the identity) → the last; stability: the last step's KL on "
        "non-members.",
        "",
        "| variation | TSLOO Spearman | LDS | fit s | query s | non-zero | fidelity | stability |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|",
    ]

    def num(value, fmt):
        return "–" if value is None else format(value, fmt)

    for r in rows:
        lines.append(
            f"| {r['label']} | {r['tsloo'][0]:+.3f} ± {r['tsloo'][1]:.3f} | "
            f"{r['lds'][0]:+.3f} ± {r['lds'][1]:.3f} | {num(r['fit_s'], '.1f')} | "
            f"{num(r['query_s'], '.2f')} | {r['nonzero']:.0%} | {r['fidelity'] or '–'} | "
            f"{num(r['stability'], '.4f')} |"
        )
    path = out / "stride_sweep.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path} in {info['total']:.0f} s")
    return path


def main(argv: list[str] | None = None) -> Path:
    """Parse ``--smoke`` / ``--out`` and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="smallest setting")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    args = parser.parse_args(argv)
    setting = Setting(**{**SMOKE.__dict__, "num_removed": SMOKE.num_finetune}) if args.smoke \
        else Setting()  # fmt: skip
    return run(setting, args.smoke, args.out)


if __name__ == "__main__":
    main()

"""K-FAC / EK-FAC attribution throughput on the Grad-Dot workload, against kronfluence.

Workload: exactly that of ``throughput.py`` (imported from it): GPT-NeoX from config
(4 layers, hidden 256, 4 heads, MLP 1024, vocab 1024), 256 random training sequences of
128 tokens, 1 or 16 query sequences, fp32 CPU, batch 16 on both sides, the 16 linear
layers of the transformer blocks, loss = sum over samples of each sequence's mean
next-token loss (empirical Fisher).

Rows (each one whole attribution call: capture, curvature fit, preconditioning, scoring):

* ``dattri_llm`` — ``KFACAttributor`` / ``EKFACAttributor``, ``attribute(train, test)``
  (live: a fit pass over the training set with covariances recorded at capture, then the
  scoring pass), damping ``1e-3`` relative to the mean eigenvalue; ``full`` and ``logra``
  (capture-time Kronecker projection ``k_a = k_g = 64``, the library's default projector);
* ``kronfluence`` — ``FactorArguments(strategy="kfac" | "ekfac", use_empirical_fisher=True)``,
  ``fit_all_factors`` + ``compute_pairwise_scores`` with its default damping, run under
  ``--peer-python``; it has no capture-time projection, so only ``full`` rows.

The two libraries damp differently, so their scores are not expected to agree; the sums of
absolute scores are printed only to show each run scored the same shapes.

Metrics, per configuration in a fresh process after a warm-up call on one batch:
wall seconds of the call, training samples per second, and growth of peak RSS (VmHWM) over
the RSS before the call (see ``throughput.measure``). Medians over interleaved rounds.

Usage: ``python experiments/benchmark/throughput_kfac.py [--peer-python PATH] [--out PATH]
[--repeats R]``. Child mode (internal): ``--worker LIB --method M --proj P --queries N``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from throughput import (
    BATCH,
    K_PROJ,
    LINEAR,
    N_TRAIN,
    QUERY_COUNTS,
    RESULTS,
    SEQ,
    VOCAB,
    aggregate,
    build_data,
    build_model,
    linear_names,
    machine_line,
    measure,
    run_child,
    sum_loss,
)

METHODS = ("kfac", "ekfac")
DAMPING = 1e-3
UNSUPPORTED = {("kronfluence", "logra"): "kronfluence has no capture-time gradient projection"}


def run_dattri_llm(method: str, proj: str, n_queries: int, n_train: int) -> dict:
    from dattri_llm import AttributionArguments, AttributionTask, HookManagerConfig
    from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor

    model = build_model()
    train, test = build_data(n_queries)
    train = train[:n_train]
    projection = None
    if proj == "logra":
        projection = {"__default__": {"style": "logra", "proj_dim": K_PROJ}}
    config = HookManagerConfig(linear_io=[LINEAR], projection_kwargs=projection)
    args = AttributionArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
    )
    cls = KFACAttributor if method == "kfac" else EKFACAttributor
    attributor = cls(args, task=AttributionTask(loss_func=sum_loss, model=model))

    def attribute(train_set):
        return attributor.attribute(
            train_set, test, hook_config=config, damping=DAMPING, relative_damping=True
        )

    attribute(train[:BATCH])  # warm-up
    result = {}
    metrics = measure(lambda: result.setdefault("score", attribute(train)))
    metrics["checksum"] = float(result["score"].scores.double().abs().sum())
    metrics["version"] = f"dattri_llm {version('dattri-llm')}, torch {torch.__version__}"
    return metrics


def run_kronfluence(method: str, proj: str, n_queries: int, n_train: int) -> dict:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task

    model = build_model()
    train, test = build_data(n_queries)
    train = train[:n_train]
    names = linear_names(model)

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return sum_loss(model, batch)

        def compute_measurement(self, batch, model):
            return sum_loss(model, batch)

        def get_influence_tracked_modules(self):
            return names

    task = LMTask()
    model = prepare_model(model, task)
    analyzer = Analyzer(
        "kfac", model, task, cpu=True, disable_tqdm=True, output_dir=tempfile.mkdtemp()
    )
    factor_args = FactorArguments(strategy=method, use_empirical_fisher=True)

    def attribute(tag, train_set):
        analyzer.fit_all_factors(
            tag,
            train_set,
            per_device_batch_size=BATCH,
            factor_args=factor_args,
            overwrite_output_dir=True,
        )
        analyzer.compute_pairwise_scores(
            tag,
            tag,
            test,
            train_set,
            per_device_query_batch_size=BATCH,
            per_device_train_batch_size=BATCH,
            overwrite_output_dir=True,
        )

    attribute("warmup", train[:BATCH])
    metrics = measure(lambda: attribute("run", train))
    scores = analyzer.load_pairwise_scores("run")["all_modules"]
    metrics["checksum"] = float(scores.double().abs().sum())
    metrics["version"] = f"kronfluence {version('kronfluence')}, torch {torch.__version__}"
    return metrics


WORKERS = {"dattri_llm": run_dattri_llm, "kronfluence": run_kronfluence}


def render(rows: list[dict], peer_python: str, total_seconds: float, n_train: int) -> str:
    lines = [
        "# K-FAC / EK-FAC throughput on the Grad-Dot GPT-NeoX workload (CPU)",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine_line()}.",
        f"Peers ran under `{peer_python}`. Produced by "
        f"`experiments/benchmark/throughput_kfac.py` in {total_seconds / 60:.1f} min.",
        "",
        f"Workload (as `throughput.md`): GPT-NeoX from config (4 layers, hidden 256, 4 heads, "
        f"MLP 1024, vocab {VOCAB}), {n_train} training sequences x {SEQ} tokens, fp32, batch "
        f"{BATCH}, 16 hooked linear layers, empirical Fisher. `logra` = capture-time Kronecker "
        f"projection k_a = k_g = {K_PROJ} (library default projector).",
        "dattri_llm: live `attribute` (fit pass with covariances recorded at capture, then the "
        f"scoring pass), damping {DAMPING:g} relative to the mean eigenvalue. kronfluence: "
        "`fit_all_factors` + `compute_pairwise_scores`, default damping, factors written to a "
        "temporary directory. The damping differs, so the score sums are not a cross-check.",
        "Throughput = training samples per second of one attribution call after a warm-up "
        "call; peak memory = growth of peak RSS (VmHWM) over the RSS before the call. Medians "
        "over interleaved rounds, each configuration in a fresh process.",
        "",
        "| library | method | projection | queries | rounds | seconds (median) | samples/s "
        "| peak RSS growth (MiB) | speed vs dattri_llm full | sum of abs scores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours = {
        (r["method"], r["queries"]): r
        for r in rows
        if r["library"] == "dattri_llm" and r["proj"] == "full" and "seconds" in r
    }
    notes = []
    for r in rows:
        if "skipped" in r:
            notes.append(
                f"* {r['library']} / {r['method']} / {r['proj']} / {r['queries']} queries: "
                f"{r['skipped']}"
            )
            continue
        base = ours.get((r["method"], r["queries"]))
        ratio = f"{base['seconds'] / r['seconds']:.2f}x" if base else "-"
        lines.append(
            f"| {r['library']} | {r['method'].upper()} | {r['proj']} | {r['queries']} "
            f"| {r['rounds']} | {r['seconds']:.2f} | {n_train / r['seconds']:.1f} "
            f"| {r['peak_mib']:.0f} | {ratio} | {r['checksum']:.6g} |"
        )
    versions = sorted({r["version"] for r in rows if "version" in r})
    if n_train != N_TRAIN:
        lines += [
            "",
            f"Training set cut from {N_TRAIN} to the first {n_train} sequences so that the whole "
            "benchmark fits in about 8 minutes on this shared 2-core machine; everything else "
            "is the Grad-Dot workload.",
        ]
    lines += [
        "",
        "Versions: " + "; ".join(versions) + ".",
        "LogIX is not compared: `logix-ai` has releases only for Python < 3.11 (this machine "
        "has 3.11).",
    ]
    if notes:
        lines += ["", "Not run:", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    import time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(WORKERS))
    parser.add_argument("--method", choices=METHODS, default="kfac")
    parser.add_argument("--proj", choices=("full", "logra"), default="full")
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument(
        "--peer-python",
        default=sys.executable,
        help="interpreter that has the peer libraries installed",
    )
    parser.add_argument("--out", default=str(RESULTS / "throughput_kfac.md"))
    parser.add_argument(
        "--n-train", type=int, default=N_TRAIN, help="training sequences (first n of the set)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds; medians are reported")
    opts = parser.parse_args()
    if opts.worker:
        result = WORKERS[opts.worker](opts.method, opts.proj, opts.queries, opts.n_train)
        print(json.dumps(result), flush=True)
        return
    start = time.perf_counter()
    runs: dict[tuple[str, str, str, int], list[dict]] = {}
    for _ in range(opts.repeats):
        for method in METHODS:
            for n_queries in QUERY_COUNTS:
                for proj in ("full", "logra"):
                    for library in WORKERS:
                        python = sys.executable if library == "dattri_llm" else opts.peer_python
                        if (library, proj) in UNSUPPORTED:
                            result = {"skipped": UNSUPPORTED[library, proj]}
                        else:
                            extra = ["--method", method, "--n-train", str(opts.n_train)]
                            result = run_child(python, library, proj, n_queries, __file__, extra)
                        runs.setdefault((library, method, proj, n_queries), []).append(result)
                        print(library, method, proj, n_queries, result, flush=True)
    rows = [
        {**aggregate(library, proj, q, results), "method": method}
        for (library, method, proj, q), results in runs.items()
    ]
    Path(opts.out).write_text(
        render(rows, opts.peer_python, time.perf_counter() - start, opts.n_train)
    )
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()

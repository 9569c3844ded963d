"""Throughput benchmark: Grad-Dot on a Pythia-style GPT-NeoX, dattri_llm against peer libraries.

Workload (every library, same model weights, same data, same hooked layers):
GPT-NeoX built from a config (4 layers, hidden 256, 4 heads, MLP 1024, vocab 1024 — the
Pythia vocabulary of 50k is cut so the unhooked output head does not dominate a CPU run),
256 random training sequences of 128 tokens, 1 or 16 query sequences, fp32, Grad-Dot
(plain per-sample gradient inner products at the given weights) over the 16 linear layers of
the transformer blocks (``query_key_value``, ``dense``, ``dense_h_to_4h``, ``dense_4h_to_h``),
loss = sum over samples of each sequence's mean next-token loss, batch size 16 on both sides.

Configurations: ``full`` (unprojected per-sample gradients) and ``logra`` (capture-time
Kronecker projection with ``k_a = k_g = 64``, the library's default projector: dattri's
``random_project`` when installed, else the built-in
``dattri_llm.gradient.ops.projection.random_project``).

Peers (each run in its own interpreter, see ``--peer-python``):
* kronfluence — ``FactorArguments(strategy="identity")`` (no preconditioning = Grad-Dot),
  ``compute_pairwise_scores``; it has no capture-time gradient projection, so no ``logra`` row.
* LogIX (PyPI ``logix-ai``) — recorded as not run when it cannot be imported (its releases
  require Python <3.11).

Metrics, per configuration, in a fresh subprocess after one warm-up call on a small subset:
* throughput = training samples scored per second of wall time of the one attribution call
  (both sides' gradients, the scoring; for kronfluence ``fit_all_factors`` + scores);
* peak memory = growth of the process's peak resident set size (``VmHWM``, reset through
  ``/proc/self/clear_refs`` before the call) over the resident size before the call, i.e. the
  extra host memory the call touched. Model, data and imports are excluded.

Usage: ``python experiments/benchmark/throughput.py [--peer-python PATH] [--out PATH]``.
Child mode (internal): ``--worker {dattri_llm,kronfluence,logix} --proj {full,logra} --queries N``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

N_TRAIN, SEQ, VOCAB, BATCH = 256, 128, 1024, 16
QUERY_COUNTS = (1, 16)
K_PROJ = 64
LINEAR = r"\.(query_key_value|dense|dense_h_to_4h|dense_4h_to_h)$"
RESULTS = Path(__file__).parent / "results"
PEER_SETUP = [
    "Peer environment: a fresh venv, `pip install torch==2.13.0` (the local CPU wheel), then",
    "`pip install kronfluence logix-ai`. logix-ai has no release for Python 3.11. kronfluence",
    "pulled a CUDA torch 2.14 and torchvision; torch was put back to the 2.13.0 CPU wheel and",
    "torchvision removed (its PyPI wheel does not load with the CPU torch, and kronfluence never",
    "imports it); `transformers==5.24.0` added for the model. The machine is shared with other",
    "jobs, so single timings vary by up to ~2x; the medians over interleaved rounds are what to",
    "compare, and only ratios within this table.",
]
# Configurations a peer cannot run at all; they are reported instead of spawned.
UNSUPPORTED = {("kronfluence", "logra"): "kronfluence has no capture-time gradient projection"}
LOGIX_NOTE = (
    "`pip install logix-ai` finds only 0.1.0/0.1.1, which require Python <3.11 "
    "(this machine has 3.11)"
)


# ----------------------------------------------------------------------------- shared setup


def build_model() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPTNeoXForCausalLM(config)
    model.eval()
    return model


def build_data(n_queries: int) -> tuple[list[dict], list[dict]]:
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(1, VOCAB, (N_TRAIN, SEQ), generator=gen)
    test = torch.randint(1, VOCAB, (n_queries, SEQ), generator=gen)
    return [{"input_ids": x} for x in train], [{"input_ids": x} for x in test]


def sum_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    return model(input_ids=ids, labels=ids).loss * len(ids)


def linear_names(model: torch.nn.Module) -> list[str]:
    import re

    return [n for n, m in model.named_modules() if re.search(LINEAR, n)]


def read_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(call) -> dict:
    """Wall time and peak-RSS growth (MiB) of ``call()``."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rss_before = read_status_kib("VmRSS")
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    peak = read_status_kib("VmHWM")
    return {"seconds": seconds, "peak_mib": (peak - rss_before) / 1024}


# ---------------------------------------------------------------------------------- workers


def run_dattri_llm(proj: str, n_queries: int) -> dict:
    from dattri_llm import (
        AttributionArguments,
        AttributionTask,
        HookManagerConfig,
        TracInAttributor,
    )

    model = build_model()
    train, test = build_data(n_queries)
    if proj == "logra":
        config = HookManagerConfig(
            linear_io=[LINEAR],
            projection_kwargs={"__default__": {"style": "logra", "proj_dim": K_PROJ}},
        )
    else:
        config = HookManagerConfig(linear_io=[LINEAR])
    out = tempfile.mkdtemp()
    args = AttributionArguments(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
    )
    attributor = TracInAttributor(args, task=AttributionTask(loss_func=sum_loss, model=model))

    def attribute(train_set, test_set):
        return attributor.attribute(train_set, test_set, hook_config=config)

    attribute(train[:BATCH], test)  # warm-up
    result = {}
    metrics = measure(lambda: result.setdefault("score", attribute(train, test)))
    metrics["checksum"] = float(result["score"].scores.double().abs().sum())
    metrics["version"] = f"dattri_llm {version('dattri-llm')}, torch {torch.__version__}"
    return metrics


def kronfluence_task(names: list[str]) -> object:
    """A kronfluence ``Task``: ``sum_loss`` as training loss and measurement, ``names`` tracked."""
    from kronfluence.task import Task

    class SumLossTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return sum_loss(model, batch)

        def compute_measurement(self, batch, model):
            return sum_loss(model, batch)

        def get_influence_tracked_modules(self):
            return names

    return SumLossTask()


def time_kronfluence(
    analyzer: object, train: list, test: list, factor_args: object, score_args: object
) -> dict:
    """Warm up on one batch, then time ``fit_all_factors`` + ``compute_pairwise_scores``.

    Returns ``measure``'s metrics with the scores' absolute sum and the versions.
    """

    def attribute(tag: str, train_set: list) -> None:
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
            score_args=score_args,
            overwrite_output_dir=True,
        )

    attribute("warmup", train[:BATCH])
    metrics = measure(lambda: attribute("run", train))
    scores = analyzer.load_pairwise_scores("run")["all_modules"]  # (num_queries, num_train)
    metrics["checksum"] = float(scores.double().abs().sum())
    metrics["version"] = f"kronfluence {version('kronfluence')}, torch {torch.__version__}"
    return metrics


def run_kronfluence(proj: str, n_queries: int) -> dict:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments

    model = build_model()
    train, test = build_data(n_queries)
    task = kronfluence_task(linear_names(model))
    model = prepare_model(model, task)
    out = tempfile.mkdtemp()
    analyzer = Analyzer("throughput", model, task, cpu=True, disable_tqdm=True, output_dir=out)
    factor_args = FactorArguments(strategy="identity")
    score_args = ScoreArguments()

    return time_kronfluence(analyzer, train, test, factor_args, score_args)


def run_logix(proj: str, n_queries: int) -> dict:
    try:
        import logix  # noqa: F401
    except ImportError as err:
        return {"skipped": f"LogIX is not installed ({err}); {LOGIX_NOTE}"}
    return {"skipped": "LogIX imports, but no adapter is written for it yet"}


WORKERS = {"dattri_llm": run_dattri_llm, "kronfluence": run_kronfluence, "logix": run_logix}


# ----------------------------------------------------------------------------------- driver


def run_child(
    python: str,
    library: str,
    proj: str,
    n_queries: int,
    script: str = __file__,
    extra: tuple[str, ...] = (),
) -> dict:
    """Run one worker of ``script`` in a fresh ``python``; its JSON result or a skip reason."""
    cmd = [python, script, "--worker", library, "--proj", proj, "--queries", str(n_queries)]
    cmd += list(extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"skipped": f"failed: {tail[0][:200]}"}
    return json.loads(lines[-1])


def aggregate(library: str, proj: str, n_queries: int, results: list[dict]) -> dict:
    """Median seconds and peak over the rounds that ran (or the first skip reason)."""
    row = {"library": library, "proj": proj, "queries": n_queries}
    ran = [r for r in results if "skipped" not in r]
    if not ran:
        return {**row, "skipped": results[0]["skipped"]}
    return {
        **row,
        "seconds": statistics.median(r["seconds"] for r in ran),
        "peak_mib": statistics.median(r["peak_mib"] for r in ran),
        "checksum": ran[0]["checksum"],
        "version": ran[0]["version"],
        "rounds": len(ran),
    }


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def render(rows: list[dict], peer_python: str, total_seconds: float) -> str:
    lines = [
        "# Throughput: Grad-Dot on a Pythia-style GPT-NeoX (CPU)",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine_line()}.",
        f"Peers ran under `{peer_python}`. Produced by `experiments/benchmark/throughput.py` "
        f"in {total_seconds / 60:.1f} min ({max(r.get('rounds', 0) for r in rows)} rounds).",
        "",
        f"Workload: GPT-NeoX from config (4 layers, hidden 256, 4 heads, MLP 1024, vocab {VOCAB}),",
        f"{N_TRAIN} training sequences x {SEQ} tokens, fp32, batch {BATCH}, "
        "16 hooked linear layers;",
        f"`logra` = capture-time Kronecker projection k_a = k_g = {K_PROJ} with the library's",
        "default projector (`DattriProjector(None)`: dattri is not installed here, so the",
        "built-in `dattri_llm.gradient.ops.projection.random_project`, Gaussian).",
        "Throughput = training samples per second of one attribution call (both sides' gradients",
        "and scoring, after a warm-up call). Peak memory = growth of peak RSS (VmHWM) over the RSS",
        "before the call (extra host memory the call touched). Medians over interleaved rounds,",
        "each configuration in a fresh process. Equal score sums confirm the libraries computed",
        "the same Grad-Dot scores.",
        "",
        "| library | projection | queries | seconds (median) | samples/s | peak RSS growth (MiB) "
        "| speed vs dattri_llm | sum of abs scores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ours = {(r["proj"], r["queries"]): r for r in rows if r["library"] == "dattri_llm"}
    notes = []
    for r in rows:
        if "skipped" in r:
            notes.append(f"* {r['library']} / {r['proj']} / {r['queries']} queries: {r['skipped']}")
            continue
        rate = N_TRAIN / r["seconds"]
        base = ours.get((r["proj"], r["queries"]))
        ratio = f"{base['seconds'] / r['seconds']:.2f}x" if base and "seconds" in base else "-"
        lines.append(
            f"| {r['library']} | {r['proj']} | {r['queries']} | {r['seconds']:.2f} | {rate:.1f} "
            f"| {r['peak_mib']:.0f} | {ratio} | {r['checksum']:.6g} |"
        )
    versions = sorted({r["version"] for r in rows if "version" in r})
    lines += ["", "Versions: " + "; ".join(versions) + ".", "", *PEER_SETUP]
    if notes:
        lines += ["", "Not run:", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(WORKERS))
    parser.add_argument("--proj", choices=("full", "logra"), default="full")
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument(
        "--peer-python",
        default=sys.executable,
        help="interpreter that has the peer libraries installed",
    )
    parser.add_argument("--out", default=str(RESULTS / "throughput.md"))
    parser.add_argument("--repeats", type=int, default=2, help="rounds; medians are reported")
    opts = parser.parse_args()
    if opts.worker:
        print(json.dumps(WORKERS[opts.worker](opts.proj, opts.queries)), flush=True)
        return
    start = time.perf_counter()
    runs: dict[tuple[str, str, int], list[dict]] = {}
    missing: dict[str, dict] = {}  # libraries that failed to import: not spawned again
    for _ in range(opts.repeats):  # interleaved rounds, so background load hits all alike
        for proj in ("full", "logra"):
            for n_queries in QUERY_COUNTS:
                for library in WORKERS:
                    python = sys.executable if library == "dattri_llm" else opts.peer_python
                    if (library, proj) in UNSUPPORTED:
                        result = {"skipped": UNSUPPORTED[library, proj]}
                    elif library in missing:
                        result = missing[library]
                    else:
                        result = run_child(python, library, proj, n_queries)
                    if "not installed" in result.get("skipped", ""):
                        missing[library] = result
                    runs.setdefault((library, proj, n_queries), []).append(result)
                    print(library, proj, n_queries, result, flush=True)
    rows = [aggregate(library, proj, q, results) for (library, proj, q), results in runs.items()]
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(render(rows, opts.peer_python, time.perf_counter() - start))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()

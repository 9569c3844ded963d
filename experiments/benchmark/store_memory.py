"""Where the memory of scoring from a store goes: streaming top-k, Grad-Dot and K-FAC.

Workload: the projected store of ``topk.py`` (``--n`` training records of
``--layers`` × ``--dim`` float32 coordinates written in groups of ``--group``
records through ``GradientStorageManager.save_bulk``) and ``--queries`` query
records. Each call runs in a fresh interpreter after one warm-up call on a
small store, with the store directories passed as paths (as a user passes
them), and is cut into phases by wrapping the library's own functions:

* ``open stores``: every ``GradientStorageManager`` the call opens (their
  identifier indexes);
* ``test side``: the test blocks read, transformed and held (then merged);
* ``fit``: ``prepare_scoring`` (K-FAC's covariance pass, damping, inverses);
* ``train loop``: the train blocks streamed and scored; the largest file-backed
  (mapped group pages) and anonymous growth seen after scoring a batch are
  reported apart;
* ``result``: the dense matrix stacked and the score built and saved, or the
  running top-k's result.

Each phase reports its peak (growth of ``VmHWM``, reset through
``/proc/self/clear_refs``, over the resident size at the start of the call)
and what is still held when it ends. The ``index`` row is the traced Python
memory (``tracemalloc``) of one opened store, per indexed record.

Writes ``results/store_memory.md``.
Run:  python experiments/benchmark/store_memory.py [--n 200000]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from topk import write_store  # noqa: E402 - the benchmark's own store writer

RESULTS = Path(__file__).resolve().parent / "results"
K = 10
CALLS = {
    "stream": "streaming top-k (Grad-Dot)",
    "gd": "Grad-Dot attribute_from_cache",
    "kfac": "K-FAC attribute_from_cache",
}


# ---------------------------------------------------------------------------- measuring
def _status() -> dict[str, float]:
    """``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` of this process, in MiB."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class Phases:
    """Peak and held memory of consecutive phases, relative to the start of the call."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self.loop = {"file": 0.0, "anon": 0.0}
        self.start = self.last = _status()
        _reset_peak()

    def mark(self, name: str) -> None:
        """End the running phase (named ``name``) and start the next one."""
        now = self.last = _status()
        base = self.start["VmRSS"]
        self.rows.append([name, now["VmHWM"] - base, now["VmRSS"] - base])
        _reset_peak()

    def sample_loop(self) -> None:
        """Growth of the mapped and anonymous memory since the last mark (a scored batch)."""
        now = _status()
        for key, field in (("file", "RssFile"), ("anon", "RssAnon")):
            self.loop[key] = max(self.loop[key], now[field] - self.last[field])


def _wrap(owner: object, name: str, before: str | None, after: str | None, phases: Phases) -> None:
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before:
            phases.mark(before)
        result = real(*args, **kwargs)
        if after:
            phases.mark(after)
        return result

    setattr(owner, name, wrapped)


def instrument(phases: Phases, attributor: object, streaming: bool) -> None:
    """Cut the call into phases by wrapping the library's functions."""
    from dattri_llm.attribution import scoring, topk
    from dattri_llm.gradient import storage_manager

    store_init = storage_manager.GradientStorageManager.__init__

    def opened(self, *args, **kwargs):
        store_init(self, *args, **kwargs)
        phases.mark(f"open store {Path(self.save_dir).name}")

    storage_manager.GradientStorageManager.__init__ = opened
    _wrap(scoring, "_merge_dense_blocks", "test side (read, held)", "test side (merged)", phases)
    _wrap(type(attributor), "prepare_scoring", "(before fit)", "fit", phases)
    if streaming:  # the train loop ends when the stand-in score is built
        _wrap(type(attributor), "build_score", "train loop", None, phases)
        _wrap(topk.RunningTopK, "result", "(stores released)", "result: top-k", phases)
    else:
        _wrap(scoring, "_stacked", "train loop", "result: stack the matrix", phases)
        _wrap(type(attributor), "build_score", None, "result: build + save score", phases)
    batch_scores = scoring._batch_scores

    def sampled(*args, **kwargs):
        result = batch_scores(*args, **kwargs)
        phases.sample_loop()
        return result

    scoring._batch_scores = sampled


def worker(spec: dict) -> dict:
    """One measurement (run in its own interpreter)."""
    torch.set_num_threads(spec["threads"])
    warnings.simplefilter("ignore")
    from dattri_llm import AttributionArguments, GradientStorageManager
    from dattri_llm.attribution.algorithm.kronecker import KFACAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor

    if spec["what"] == "index":
        gc.collect()
        tracemalloc.start()
        store = GradientStorageManager(spec["train"])
        records = sum(len(entries) for entries in store.index.values())
        traced, peak = tracemalloc.get_traced_memory()
        return {"records": records, "bytes": traced, "peak_bytes": peak}
    args = AttributionArguments(
        output_dir=str(Path(spec["work"]) / "out"),
        use_cpu=True,
        per_device_train_batch_size=spec["batch"],
        per_device_eval_batch_size=spec["batch"],
    )
    attributor = (KFACAttributor if spec["what"] == "kfac" else TracInAttributor)(args)
    if spec["what"] == "stream":
        call = lambda train, test: attributor.top_k_from_cache(train, test, K)  # noqa: E731
    else:
        call = attributor.attribute_from_cache
    call(spec["warm_train"], spec["warm_test"])
    gc.collect()
    phases = Phases()
    instrument(phases, attributor, spec["what"] == "stream")
    start = time.perf_counter()
    result = call(spec["train"], spec["test"])
    seconds = time.perf_counter() - start
    phases.mark("(returned)")
    if spec["what"] == "stream":
        digest = [result.train_ids, result.scores.tolist()]
    else:
        digest = [result.scores.double().sum().item(), result.scores[:4, :4].tolist()]
    return {
        "seconds": seconds,
        "peak": max(row[1] for row in phases.rows),
        "phases": phases.rows,
        "loop": phases.loop,
        "digest": digest,
    }


def run(spec: dict) -> dict:
    """``worker(spec)`` in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker {spec['what']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the report
def report(args: argparse.Namespace, results: dict, total: float) -> str:
    index = results["index"]
    lines = [
        "# Memory of scoring from a store",
        "",
        f"Date: {datetime.date.today()}. Machine: {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {args.threads} torch threads, Python "
        f"{platform.python_version()}. Produced by `experiments/benchmark/store_memory.py` in "
        f"{total / 60:.1f} min.",
        "",
        f"Workload: {args.n:,} training records of {args.layers} layers × {args.dim} "
        f"coordinates (float32, groups of {args.group:,} records), {args.queries} queries, "
        f"blocks of {args.batch:,} records, k = {K}. MiB above the resident size at the start "
        "of the call.",
        "",
        f"Store index: {index['bytes'] / 2**20:.1f} MiB of Python objects for "
        f"{index['records']:,} records ({index['bytes'] / index['records']:.0f} bytes per "
        f"record; {index['peak_bytes'] / 2**20:.1f} MiB at the peak of opening it).",
        "",
    ]
    for what, label in CALLS.items():
        if what not in results:
            continue
        row = results[what]
        lines += [
            f"## {label}: peak {row['peak']:.0f} MiB, {row['seconds']:.1f} s",
            "",
            "| phase | peak | held at its end |",
            "|---|---|---|",
        ]
        lines += [f"| {name} | {peak:.0f} | {held:.0f} |" for name, peak, held in row["phases"]]
        lines += [
            "",
            f"Train loop, largest growth over its start after a scored batch: "
            f"{row['loop']['file']:.0f} MiB file-backed (mapped group pages), "
            f"{row['loop']['anon']:.0f} MiB anonymous.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    """Write the stores, measure each call, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=200_000, help="training records")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64, help="coordinates per layer")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--rank", type=int, default=32, help="directions the records mix")
    parser.add_argument("--group", type=int, default=8192, help="records per stored group")
    parser.add_argument("--query-group", type=int, default=8192, help="queries per group")
    parser.add_argument("--batch", type=int, default=8192, help="records per scored block")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--calls", nargs="+", default=list(CALLS), choices=list(CALLS))
    parser.add_argument("--work", type=Path, default=None, help="folder of the stores (kept)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results")
    parser.add_argument("--out", type=Path, default=RESULTS / "store_memory.md")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return Path()
    begin = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="store_memory_"))
    name = f"{args.n}_{args.layers}x{args.dim}_g{args.group}"
    train, test = work / f"train_{name}", work / f"test_{args.queries}_g{args.query_group}"
    shape = (args.layers, args.dim, args.rank)
    if not train.exists():
        write_store(train, args.n, *shape, args.group, "t")
    if not test.exists():
        write_store(test, args.queries, *shape, args.query_group, "q")
    if not (work / "warm_train").exists():
        write_store(work / "warm_train", 256, *shape, args.group, "t")
        write_store(work / "warm_test", 4, *shape, args.group, "q")
    base = {
        "work": str(work),
        "train": str(train),
        "test": str(test),
        "warm_train": str(work / "warm_train"),
        "warm_test": str(work / "warm_test"),
        "batch": args.batch,
        "threads": args.threads,
    }
    results = {"index": run({**base, "what": "index"})}
    for what in args.calls:
        results[what] = run({**base, "what": what})
    text = report(args, results, time.perf_counter() - begin)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(results))
    print(text)
    return args.out


if __name__ == "__main__":
    main()

"""Top-k attribution over a large store: the full matrix, the exact streaming top-k, an index.

Workload: a synthetic Grad-Dot store of ``--n`` projected training records, each
``--layers`` layers of ``--dim`` coordinates (float32, written in groups of
``--group`` records), and ``--queries`` query records of the same layout. Every
measurement runs in a fresh subprocess, after one warm-up call on a small store:

* full matrix: ``TracInAttributor.attribute_from_cache(train, test)`` then
  ``AttributionScore.top_k(k)``;
* exact streaming top-k: ``TracInAttributor.top_k_from_cache(train, test, k)``;
* index: ``AttributionIndex.build(store, kind=...)`` (build seconds, bytes on
  disk), then ``load`` + ``search(queries, k)`` per search setting (the load is
  timed apart from the search; search seconds are for the whole query batch).

Peak memory = growth of the process's peak resident set size (``VmHWM``, reset
through ``/proc/self/clear_refs``) over its resident size before the call.
recall@k = the share of the exact top-k ids an index returns, averaged over queries.

Writes ``results/topk.md`` and ``results/topk.png``.
Run:  python experiments/benchmark/topk.py [--n 1000000] [--queries 100]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dattri_llm import AttributionArguments, Gradient, GradientRecord, GradientStorageManager
from dattri_llm.attribution.algorithm.tracin import TracInAttributor

RESULTS = Path(__file__).resolve().parent / "results"
K = 10


# ---------------------------------------------------------------------------- the store
def block(start: int, n: int, layers: int, dim: int, rank: int) -> Gradient:
    """``n`` records (seeded by ``start``): ``layers`` dense ``(n, dim)`` rows.

    Projected gradients concentrate in a few directions, so a record is a
    random mix of ``rank`` fixed directions (the same for every record) plus
    isotropic noise of a third of its scale. With ``rank = 0`` records are
    isotropic Gaussian, the worst case of any approximate index.
    """
    gen = torch.Generator().manual_seed(start)
    width = layers * dim
    rows = torch.randn(n, width, generator=gen)
    if rank:
        basis = torch.randn(rank, width, generator=torch.Generator().manual_seed(-1))
        rows = torch.randn(n, rank, generator=gen) @ basis / rank**0.5 + rows / 3
    data = {f"layer{i}": part for i, part in enumerate(rows.split(dim, dim=1))}
    return Gradient(
        {name: "materialized" for name in data}, data, {name: "nn.Linear" for name in data}
    )


def write_store(
    path: Path, n: int, layers: int, dim: int, rank: int, group: int, prefix: str
) -> float:
    """Write ``n`` records in groups of ``group``; return the seconds."""
    start_time = time.perf_counter()
    store = GradientStorageManager(path)
    for start in range(0, n, group):
        size = min(group, n - start)
        ids = [f"{prefix}{start + i}" for i in range(size)]
        store.save_bulk(
            [
                GradientRecord(
                    0, ids, block(start + (prefix == "q") * 10**9, size, layers, dim, rank)
                )
            ]
        )
    return time.perf_counter() - start_time


def store_bytes(directory: Path) -> int:
    """Bytes of every file under ``directory``."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------- measuring
def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measured(call):
    """``(result, seconds, peak MiB growth)`` of ``call()``."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kib("VmRSS")
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    return result, seconds, max(0, _rss_kib("VmHWM") - before) / 1024


def arguments(work: Path, batch: int) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(work / "out"),
        use_cpu=True,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
    )


def worker(spec: dict) -> dict:
    """One measurement (run in its own interpreter)."""
    torch.set_num_threads(spec["threads"])
    work, train, test = Path(spec["work"]), spec["train"], spec["test"]
    attributor = TracInAttributor(arguments(work, spec["batch"]))
    warm_train, warm_test = spec["warm_train"], spec["warm_test"]
    what = spec["what"]
    if what == "full":
        attributor.attribute_from_cache(warm_train, warm_test).top_k(K)
        top, seconds, peak = measured(lambda: attributor.attribute_from_cache(train, test).top_k(K))
        return {"seconds": seconds, "peak": peak, "top": top}
    if what == "stream":
        attributor.top_k_from_cache(warm_train, warm_test, K)
        top, seconds, peak = measured(lambda: attributor.top_k_from_cache(train, test, K))
        return {"seconds": seconds, "peak": peak, "top": top.as_dict()}
    from dattri_llm.attribution.index import AttributionIndex  # needs the index extra

    if what == "build":
        options = spec["options"]
        _, seconds, peak = measured(
            lambda: AttributionIndex.build(train, kind=spec["kind"], path=spec["index"], **options)
        )
        return {"seconds": seconds, "peak": peak, "bytes": store_bytes(Path(spec["index"]))}
    index, load_seconds, _ = measured(lambda: AttributionIndex.load(train, path=spec["index"]))
    rows = []
    for setting in spec["settings"]:
        index.set_search_params(**setting)
        index.search(warm_test, K, check_store=False)
        top, seconds, peak = measured(lambda: index.search(test, K, check_store=False))
        rows.append({"setting": setting, "seconds": seconds, "peak": peak, "top": top.as_dict()})
    return {"load": load_seconds, "rows": rows}


def run(spec: dict, timeout: float) -> dict:
    """``worker(spec)`` in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker {spec['what']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def recall(got: dict, exact: dict) -> float:
    """Mean over queries of |index top-k ∩ exact top-k| / k."""
    shares = [
        len({h for h, _ in got.get(q, [])} & {h for h, _ in pairs}) / len(pairs)
        for q, pairs in exact.items()
    ]
    return sum(shares) / len(shares)


# ---------------------------------------------------------------------------- the report
def plot(rows: list[dict], path: Path) -> None:
    """Seconds per query batch against recall@k, one point per method and setting."""
    import matplotlib  # optional dependency of the benchmark: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for row in rows:
        ax.scatter(row["seconds"], row["recall"], s=30)
        ax.annotate(
            row["label"],
            (row["seconds"], row["recall"]),
            fontsize=7,
            xytext=(4, 2),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("seconds per batch of queries (log)")
    ax.set_ylabel(f"recall@{K}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> Path:
    """Write the store, measure every method, write the report and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1_000_000, help="training records")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64, help="coordinates per layer")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument(
        "--rank",
        type=int,
        default=32,
        help="directions the records mix (0: isotropic Gaussian records)",
    )
    parser.add_argument("--group", type=int, default=8192, help="records per stored group")
    parser.add_argument("--batch", type=int, default=8192, help="records per scored block")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--nlist", type=int, default=1024, help="IVF lists (trained on 256 per list)"
    )
    parser.add_argument("--nprobe", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument(
        "--hnsw-n",
        type=int,
        default=None,
        help="records of the HNSW index (default: --n; its build is slow on CPU)",
    )
    parser.add_argument("--ef-search", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--skip-full", action="store_true", help="no full-matrix row")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker")
    parser.add_argument("--work", type=Path, default=None, help="folder for the stores")
    parser.add_argument("--out", type=Path, default=RESULTS / "topk.md")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return Path()

    begin = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="topk_bench_", dir=args.work))
    try:
        return _measure_all(args, work, begin)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure_all(args: argparse.Namespace, work: Path, begin: float) -> Path:
    train, test = work / "train", work / "test"
    write_seconds = write_store(train, args.n, args.layers, args.dim, args.rank, args.group, "t")
    write_store(test, args.queries, args.layers, args.dim, args.rank, args.group, "q")
    write_store(work / "warm_train", 256, args.layers, args.dim, args.rank, args.group, "t")
    write_store(work / "warm_test", 4, args.layers, args.dim, args.rank, args.group, "q")
    base = {
        "work": str(work),
        "train": str(train),
        "test": str(test),
        "batch": args.batch,
        "threads": args.threads,
        "warm_train": str(work / "warm_train"),
        "warm_test": str(work / "warm_test"),
    }
    rows = []
    stream = run({**base, "what": "stream"}, args.timeout)
    exact = stream["top"]
    rows.append(
        {
            "label": "exact streaming top-k",
            "seconds": stream["seconds"],
            "peak": stream["peak"],
            "recall": 1.0,
            "build": None,
            "bytes": None,
        }
    )
    if not args.skip_full:
        full = run({**base, "what": "full"}, args.timeout)
        assert recall(full["top"], exact) == 1.0, "full matrix and streaming top-k disagree"
        rows.insert(
            0,
            {
                "label": "full matrix + top_k",
                "seconds": full["seconds"],
                "peak": full["peak"],
                "recall": 1.0,
                "build": None,
                "bytes": None,
            },
        )
    nlist = min(args.nlist, args.n)
    indexes = [
        ("flat", {}, [{}], args.n),
        ("ivf", {"nlist": nlist}, [{"nprobe": p} for p in args.nprobe], args.n),
        ("hnsw", {}, [{"ef_search": e} for e in args.ef_search], args.hnsw_n or args.n),
    ]
    for kind, options, settings, n in indexes:
        store = train
        if n != args.n:  # a smaller HNSW: its own store of the first n records
            store = work / f"train_{n}"
            write_store(store, n, args.layers, args.dim, args.rank, args.group, "t")
        exact_n = (
            exact
            if n == args.n
            else run({**base, "train": str(store), "what": "stream"}, args.timeout)["top"]
        )
        spec = {
            **base,
            "train": str(store),
            "index": str(work / f"index_{kind}"),
            "kind": kind,
            "options": options,
        }
        built = run({**spec, "what": "build"}, args.timeout)
        searched = run({**spec, "what": "search", "settings": settings}, args.timeout)
        for row in searched["rows"]:
            setting = ", ".join(f"{k}={v}" for k, v in row["setting"].items())
            label = f"{kind.upper() if kind != 'flat' else 'Flat'}" + (
                f" ({setting})" if setting else ""
            )
            if n != args.n:
                label += f", {n:,} records"
            rows.append(
                {
                    "label": label,
                    "seconds": row["seconds"],
                    "peak": row["peak"],
                    "recall": recall(row["top"], exact_n),
                    "build": built["seconds"],
                    "bytes": built["bytes"],
                    "load": searched["load"],
                }
            )
    return write_report(args, rows, write_seconds, store_bytes(train), time.perf_counter() - begin)


def write_report(
    args, rows: list[dict], write_seconds: float, train_bytes: int, total: float
) -> Path:
    """The Markdown report and the plot."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    plot(rows, png)
    lines = [
        "# Top-k over a large store: full matrix, exact streaming top-k, index",
        "",
        f"Date: {datetime.date.today()}. Machine: {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {args.threads} torch threads, Python "
        f"{platform.python_version()}. Produced by `experiments/benchmark/topk.py` in "
        f"{total / 60:.1f} min.",
        "",
        f"Workload: {args.n:,} training records of {args.layers} layers × {args.dim} "
        f"coordinates (float32; store {train_bytes / 2**30:.2f} GiB, written in "
        f"{write_seconds:.0f} s), each a mix of {args.rank} fixed directions plus isotropic "
        f"noise, {args.queries} queries, k = {K}, Grad-Dot scores, "
        f"blocks of {args.batch} records. Seconds are for the whole batch of queries "
        "(the index's load is apart). Peak = growth of peak RSS over the RSS before the call.",
        "",
        f"| method | seconds | peak (MiB) | recall@{K} | build (s) | index on disk (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        build = "" if row["build"] is None else f"{row['build']:.1f}"
        size = "" if row["bytes"] is None else f"{row['bytes'] / 2**20:.0f}"
        lines.append(
            f"| {row['label']} | {row['seconds']:.2f} | {row['peak']:.0f} | "
            f"{row['recall']:.3f} | {build} | {size} |"
        )
    lines += ["", f"![seconds against recall]({png.name})", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return args.out


if __name__ == "__main__":
    main()

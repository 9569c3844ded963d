"""The run plan's predictions against measured runs: store bytes, peak memory, time.

Workload: GPT-2 and Llama causal LMs built from configs at three widths (the
``scaling.py`` convention: 4 layers, hidden h, ``max(4, h // 64)`` heads, MLP
4h, vocabulary 1024), ``N_TRAIN`` random training sequences and ``N_TEST``
queries of ``SEQ`` tokens, batch ``BATCH``, float32 on CPU, one torch thread,
the linear layers of the transformer blocks hooked (``linear_io=["attn",
"mlp"]``), loss = sum over samples of each sequence's mean next-token loss.
Methods: Grad-Dot (``TracInAttributor``), K-FAC, EK-FAC (default pass plan),
and Grad-Dot with capture-time LoGRA projection (``k_a = k_g = 16``).

Every row runs in a fresh subprocess (glibc's mmap threshold pinned at
128 KiB, so large tensors are unmapped on free):

1. imports, the data, a throwaway forward+backward of a 1-layer model of the
   architecture (it loads the modelling code); the process baseline =
   resident size (``VmRSS``) here;
2. the model; ``measure_capture_seconds`` on one batch (one untimed warm-up,
   one timed repeat): the plan's probe;
3. ``VmHWM`` reset (``/proc/self/clear_refs``), then one live
   ``attribute(train, test)``, timed: measured seconds; measured peak =
   ``VmHWM`` − baseline (so the model's parameters count, the interpreter and
   its libraries do not);
4. Grad-Dot rows only: ``cache`` of both sides into disk stores: measured
   store bytes (the files' sizes).

The plan is ``plan_run(config, ...)`` in the parent process with the same
sizes, hooks and projection, and ``probe=`` the row's measured seconds per
record; predicted peak = ``RunPlan.peak_memory_bytes``.

Writes ``results/plan_accuracy.md`` (and the raw rows as ``plan_accuracy.json``
next to it). ``--from-json PATH`` rebuilds the report from saved rows without
measuring (the plan is recomputed).
Run:  python experiments/benchmark/plan_accuracy.py [--widths 128,256,512]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB, SEQ, BATCH, N_TRAIN, N_TEST = 1024, 64, 8, 64, 8
K_PROJ = 16
DAMPING = 1e-3
HOOKS = ["attn", "mlp"]
METHODS = ("graddot", "kfac", "ekfac", "graddot-logra")
TARGETS = {"store": 0.05, "peak": 0.25, "time": 2.0}


# ---------------------------------------------------------------------------- shared
def build_config(arch: str, hidden: int, layers: int = 4):
    """The GPT-2 / Llama config of width ``hidden`` (``layers`` layers, MLP 4h, vocab 1024)."""
    import transformers

    heads = max(4, hidden // 64)
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_layer=layers,
            n_embd=hidden,
            n_head=heads,
            n_inner=4 * hidden,
            vocab_size=VOCAB,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
        )
    return transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )


def hook_config(method: str):
    from dattri_llm.gradient.hooks.config import HookManagerConfig

    projection = None
    if method.endswith("-logra"):
        projection = {"__default__": {"style": "logra", "proj_dim": K_PROJ}}
    return HookManagerConfig(linear_io=HOOKS, projection_kwargs=projection)


def sum_loss(model, batch):
    ids = batch["input_ids"]
    return model(input_ids=ids, labels=ids).loss * len(ids)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------- worker
def worker(arch: str, hidden: int, method: str) -> dict:
    """One measured row (runs in a fresh process)."""
    import torch
    import transformers

    from dattri_llm import AttributionArguments, AttributionTask
    from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.planning import measure_capture_seconds

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    train = [{"input_ids": x} for x in torch.randint(1, VOCAB, (N_TRAIN, SEQ), generator=gen)]
    test = [{"input_ids": x} for x in torch.randint(1, VOCAB, (N_TEST, SEQ), generator=gen)]
    # a throwaway 1-layer model of the architecture loads its modelling code first
    tiny = transformers.AutoModelForCausalLM.from_config(build_config(arch, 32, layers=1))
    sum_loss(tiny, {"input_ids": train[0]["input_ids"][None]}).backward()
    del tiny
    baseline = _status_kib("VmRSS") * 1024

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(build_config(arch, hidden)).eval()
    hooks = hook_config(method)
    probe_batch = {"input_ids": torch.stack([s["input_ids"] for s in train[:BATCH]])}
    probe = measure_capture_seconds(model, probe_batch, sum_loss, hooks, repeats=1)

    work = Path(tempfile.mkdtemp(prefix="plan_accuracy_"))
    args = AttributionArguments(
        output_dir=str(work / "out"),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
    )
    task = AttributionTask(loss_func=sum_loss, model=model)
    base = method.split("-")[0]
    kwargs: dict = {}
    if base == "graddot":
        attributor = TracInAttributor(args, task=task)
    else:
        cls = KFACAttributor if base == "kfac" else EKFACAttributor
        attributor = cls(args, task=task)
        kwargs = {"damping": DAMPING, "relative_damping": True}

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    start = time.perf_counter()
    score = attributor.attribute(train, test, hook_config=hooks, **kwargs)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024 - baseline
    row = {
        "arch": arch,
        "hidden": hidden,
        "method": method,
        "baseline_bytes": baseline,
        "probe_seconds_per_record": probe,
        "seconds": seconds,
        "peak_bytes": peak,
        "pass_plan": score.algorithm_meta.get("pass_plan"),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
    }
    del score
    if base == "graddot":
        start = time.perf_counter()
        attributor.cache(train, test, cache_dir=str(work / "cache"), hook_config=hooks)
        row["cache_seconds"] = time.perf_counter() - start
        (ckpt,) = sorted((work / "cache").glob("ckpt_*"))
        row["train_store_bytes"] = _dir_bytes(ckpt / "train_grads")
        row["test_store_bytes"] = _dir_bytes(ckpt / "test_grads")
    shutil.rmtree(work, ignore_errors=True)
    return row


def run_row(arch: str, hidden: int, method: str, timeout: float) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", arch, str(hidden), method]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"arch": arch, "hidden": hidden, "method": method, "error": "timed out"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"arch": arch, "hidden": hidden, "method": method, "error": tail}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------- the plan
def plan_for(row: dict):
    from dattri_llm.attribution.planning import plan_run

    method = row["method"].split("-")[0]
    return plan_run(
        build_config(row["arch"], row["hidden"]),
        num_train=N_TRAIN,
        num_test=N_TEST,
        seq_len=SEQ,
        method=method,
        hook_config=hook_config(row["method"]),
        batch_size=BATCH,
        device="cpu",
        probe=row.get("probe_seconds_per_record"),
    )


# ---------------------------------------------------------------------------- the report
def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ratio(predicted: float, measured: float) -> float:
    return predicted / measured if measured else float("nan")


def _verdict(ratio: float, kind: str) -> str:
    target = TARGETS[kind]
    ok = abs(ratio - 1) <= target if kind != "time" else 1 / target <= ratio <= target
    return "yes" if ok else "**no**"


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (
        f"{cpu}, {os.cpu_count()} cores visible (shared), 1 torch thread, Linux "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def render(rows: list[dict], when: str, where: str) -> str:
    out = [
        "# The run plan against measured runs",
        "",
        f"Date: {when}. Machine: {where}.",
        "",
        f"Workload: GPT-2 and Llama from config (4 layers, hidden h, max(4, h/64) heads, MLP 4h, "
        f"vocabulary {VOCAB}), {N_TRAIN} training and {N_TEST} query sequences of {SEQ} random "
        f"tokens, batch {BATCH}, float32, CPU, the linear layers of the blocks hooked; Grad-Dot, "
        f"K-FAC, EK-FAC (default pass plan, damping {DAMPING} relative) and Grad-Dot with LoGRA "
        f"projection k = {K_PROJ} (`graddot-logra`). One run per row, each in a fresh process "
        "(see the script's docstring for how each number is taken). Ratios are predicted / "
        f"measured; targets: store within {TARGETS['store']:.0%}, peak within "
        f"{TARGETS['peak']:.0%}, time within {TARGETS['time']:.0f}x.",
        "",
    ]
    good = [r for r in rows if "error" not in r]
    plans = {(r["arch"], r["hidden"], r["method"]): plan_for(r) for r in good}

    out += [
        "## Store bytes on disk (`cache` of both sides, memmap stores)",
        "",
        "| model | hooks | train predicted | train measured | ratio | test predicted | "
        "test measured | ratio | within 5 % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in good:
        if "train_store_bytes" not in r:
            continue
        p = plans[(r["arch"], r["hidden"], r["method"])]
        tr = _ratio(p.train_store_bytes, r["train_store_bytes"])
        te = _ratio(p.test_store_bytes, r["test_store_bytes"])
        hooks = "LoGRA k=16" if r["method"].endswith("logra") else "unprojected"
        ok = "yes" if max(abs(tr - 1), abs(te - 1)) <= TARGETS["store"] else "**no**"
        out.append(
            f"| {r['arch']}-{r['hidden']} | {hooks} | {p.train_store_bytes:,} | "
            f"{r['train_store_bytes']:,} | {tr:.3f} | {p.test_store_bytes:,} | "
            f"{r['test_store_bytes']:,} | {te:.3f} | {ok} |"
        )

    out += [
        "",
        "## Peak memory (MiB): `RunPlan.peak_memory_bytes` against the growth of peak RSS",
        "",
        "Measured = peak RSS during the model build, the probe and the `attribute` call minus "
        "the resident size after imports (the process baseline, reported apart). Predicted = "
        "parameters + weight gradients (0 here: the frozen probe backpropagates to the hooked "
        "outputs only) + saved activations and backward working set of one batch + the "
        "method's held state (kept blocks, curvature, test side, scores).",
        "",
        "| model | method | params | activations | held state | predicted | measured | "
        "ratio | within 25 % | baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in good:
        p = plans[(r["arch"], r["hidden"], r["method"])]
        ratio = _ratio(p.peak_memory_bytes, r["peak_bytes"])
        held = p.peak_memory_bytes - p.parameter_bytes - p.gradient_bytes - p.activation_bytes
        out.append(
            f"| {r['arch']}-{r['hidden']} | {r['method']} | {_mib(p.parameter_bytes)} | "
            f"{_mib(p.activation_bytes)} | {_mib(held)} | {_mib(p.peak_memory_bytes)} | "
            f"{_mib(r['peak_bytes'])} | {ratio:.2f} | {_verdict(ratio, 'peak')} | "
            f"{_mib(r['baseline_bytes'])} |"
        )

    out += [
        "",
        "## Time (s): the probe-based estimate against one measured `attribute` call",
        "",
        "Predicted = `RunPlan.estimated_seconds` with `probe=` the seconds per record of "
        "`measure_capture_seconds` on one batch of this row's model and hooks, taken in the "
        "same process just before the timed call.",
        "",
        "| model | method | probe s/record | model runs | predicted | measured | ratio | "
        "within 2x |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in good:
        p = plans[(r["arch"], r["hidden"], r["method"])]
        ratio = _ratio(p.estimated_seconds, r["seconds"])
        out.append(
            f"| {r['arch']}-{r['hidden']} | {r['method']} | {r['probe_seconds_per_record']:.4f} "
            f"| {p.passes.model_runs} | {p.estimated_seconds:.2f} | {r['seconds']:.2f} | "
            f"{ratio:.2f} | {_verdict(ratio, 'time')} |"
        )
    failed = [r for r in rows if "error" in r]
    if failed:
        out += ["", "Rows that did not run:", ""]
        out += [f"* {r['arch']}-{r['hidden']} {r['method']}: {r['error']}" for r in failed]
    out += ["", "## Where the plan misses, and why", "", "MISSES", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--widths", default="128,256,512")
    parser.add_argument("--archs", default="gpt2,llama")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_accuracy.md")
    parser.add_argument("--from-json", type=Path)
    opts = parser.parse_args(argv)
    if opts.worker:
        arch, hidden, method = opts.worker
        print(json.dumps(worker(arch, int(hidden), method)), flush=True)
        return
    raw = opts.out.with_suffix(".json")
    if opts.from_json:
        saved = json.loads(opts.from_json.read_text())
        rows, when, where = saved["rows"], saved["date"], saved["machine"]
    else:
        when, where, rows = datetime.date.today().isoformat(), machine(), []
        for hidden in [int(h) for h in opts.widths.split(",")]:
            for arch in opts.archs.split(","):
                for method in opts.methods.split(","):
                    row = run_row(arch, hidden, method, opts.timeout)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    raw.write_text(json.dumps({"date": when, "machine": where, "rows": rows}))
    opts.out.write_text(render(rows, when, where) + "\n")
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()

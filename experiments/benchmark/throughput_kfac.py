"""K-FAC / EK-FAC attribution time as a multiple of Grad-Dot (P) on the same data.

Workload (issue 13): GPT-NeoX from config (4 layers, hidden 128, 4 heads, MLP 4x hidden,
vocab 1024), 128 random training sequences of 128 tokens, 16 query sequences, fp32 CPU,
batch 8 on both sides, the 16 linear layers of the transformer blocks, loss = sum over
samples of each sequence's mean next-token loss (empirical Fisher), one thread
(``torch.set_num_threads(1)``). ``--wide`` switches to hidden 512, 8 heads, 64 sequences.

Configurations (each one whole live ``attribute(train, test)`` call):

* ``graddot`` — ``TracInAttributor`` (one checkpoint = Grad-Dot): the time **P**;
* ``kfac`` / ``ekfac`` — ``KFACAttributor`` / ``EKFACAttributor``, damping ``1e-3`` relative
  to the mean eigenvalue, with the default pass plan (first-pass training gradients kept
  within the default ``kept_gradient_budget``);
* ``kfac-rerun`` / ``ekfac-rerun`` — the same with ``kept_gradient_budget=0`` (the model is
  re-run for every pass);
* ``*-cache`` (only with ``--configs`` / ``--profile``) — ``gradient_cache_residency="memory"``:
  each side collected once into a memory store, then ``attribute_from_cache``;
* ``*-logra`` — capture-time Kronecker projection ``k_a = k_g = 64`` (library default
  projector); ``graddot-logra`` is P for them.

Metrics, per configuration in a fresh process after a warm-up call on one batch: wall
seconds of the call and growth of peak RSS (VmHWM) over the RSS before the call (see
``throughput.measure``). Each configuration runs ``--repeats`` times in interleaved rounds;
medians are reported, with the ratio to the matching Grad-Dot median.

``floor`` (run once per round, in its own process) times the arithmetic no implementation
of the method can skip, at this machine's single-thread BLAS rate, on the workload's layer
shapes: the covariance sums (half of the ``XᵀX`` GEMMs of every batch: the lower triangle),
the transformation of the queries (``G⁻¹·dW·A⁻¹`` or ``U_Gᵀ·dW·U_A``: on the token rows or
on the gradients, whichever is faster, beyond the materialization Grad-Dot also pays),
and for EK-FAC the ``eigh`` of every factor, the rotation of every training sample into the
eigenbasis (the cheaper of the token-row and the dense route, as timed) and the
materialization of the rotated gradient whose squares are summed (a kept run can score
with it, so only a re-run pays it on top of P). ``P + floor`` is then the least time a
kept-gradient run can take; a re-run plan adds the model pass without scoring (P minus
Grad-Dot's own scoring GEMMs, also timed) once per extra pass.

``--profile CONFIG`` runs one configuration in this process under ``cProfile`` and prints
the top functions by cumulative and by own time (``--top`` rows).

Usage: ``python experiments/benchmark/throughput_kfac.py [--wide] [--repeats R] [--out PATH]
[--configs a,b,...] [--note TEXT]`` or ``... --profile ekfac``. Child mode (internal):
``--worker CONFIG``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from throughput import K_PROJ, LINEAR, RESULTS, VOCAB, machine_line, measure, sum_loss

SEQ, BATCH, N_QUERIES, DAMPING = 128, 8, 16, 1e-3
WORKLOADS = {
    "narrow": {"hidden": 128, "heads": 4, "n_train": 128},
    "wide": {"hidden": 512, "heads": 8, "n_train": 64},
}
CONFIGS = (
    "graddot",
    "kfac",
    "ekfac",
    "kfac-rerun",
    "ekfac-rerun",
    "graddot-logra",
    "kfac-logra",
    "ekfac-logra",
)
# through attribute_from_cache (each side collected once into a memory store); --configs only
CACHE_CONFIGS = ("graddot-cache", "kfac-cache", "ekfac-cache")


def build_model(hidden: int, heads: int) -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        num_hidden_layers=4,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPTNeoXForCausalLM(config).eval()


def build_data(n_train: int) -> tuple[list[dict], list[dict]]:
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(1, VOCAB, (n_train, SEQ), generator=gen)
    test = torch.randint(1, VOCAB, (N_QUERIES, SEQ), generator=gen)
    return [{"input_ids": x} for x in train], [{"input_ids": x} for x in test]


def make_call(config: str, workload: dict):
    """``(attribute(train_set), train, test)`` for one configuration."""
    from dattri_llm import AttributionArguments, AttributionTask, HookManagerConfig
    from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor

    method, _, variant = config.partition("-")
    model = build_model(workload["hidden"], workload["heads"])
    train, test = build_data(workload["n_train"])
    projection = None
    if variant == "logra":
        projection = {"__default__": {"style": "logra", "proj_dim": K_PROJ}}
    hooks = HookManagerConfig(linear_io=[LINEAR], projection_kwargs=projection)
    args = AttributionArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
    )
    task = AttributionTask(loss_func=sum_loss, model=model)
    if method == "graddot":
        attributor = TracInAttributor(args, task=task)
        kwargs: dict = {}
    else:
        cls = KFACAttributor if method == "kfac" else EKFACAttributor
        attributor = cls(args, task=task)
        kwargs = {"damping": DAMPING, "relative_damping": True}
        if variant == "rerun":
            kwargs["kept_gradient_budget"] = 0
    if variant == "cache":
        kwargs["gradient_cache_residency"] = "memory"

    def attribute(train_set):
        return attributor.attribute(train_set, test, hook_config=hooks, **kwargs)

    return attribute, train, test


def run_worker(config: str, workload: dict) -> dict:
    torch.set_num_threads(1)
    attribute, train, _ = make_call(config, workload)
    attribute(train[:BATCH])  # warm-up
    result = {}
    metrics = measure(lambda: result.setdefault("score", attribute(train)))
    score = result["score"]
    metrics["checksum"] = float(score.scores.double().abs().sum())
    metrics["plan"] = score.algorithm_meta.get("pass_plan")
    metrics["version"] = f"dattri_llm {version('dattri-llm')}, torch {torch.__version__}"
    return metrics


def layer_shapes(hidden: int) -> list[tuple[int, int]]:
    """``(K, D)`` of the 4 hooked linear layers of one GPT-NeoX block (bias column in K)."""
    return [(hidden + 1, 3 * hidden), (hidden + 1, hidden), (hidden + 1, 4 * hidden),
            (4 * hidden + 1, hidden)]  # fmt: skip


def best_seconds(fn, repeats: int = 3) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def layer_floor(k: int, d: int, gen: torch.Generator) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of one ``(K, D)`` layer's unavoidable GEMMs: per batch, and once per fit."""
    a = torch.randn(BATCH, SEQ, k, generator=gen)
    g = torch.randn(BATCH, SEQ, d, generator=gen)
    a2, g2 = a.reshape(-1, k), g.reshape(-1, d)
    u_a = torch.linalg.qr(torch.randn(k, k, generator=gen))[0]
    u_g = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    dw = torch.bmm(g.transpose(1, 2), a)
    queries = torch.randn(N_QUERIES, d * k, generator=gen)
    per_batch = {
        "covariance": best_seconds(lambda: (a2.T @ a2, g2.T @ g2)) / 2,
        "rotation": min(
            best_seconds(lambda: (a @ u_a, g @ u_g)), best_seconds(lambda: u_g.T @ dw @ u_a)
        ),
        "rotated_materialize": best_seconds(lambda: torch.bmm(g.transpose(1, 2), a)),
        "graddot_scoring": best_seconds(
            lambda: torch.bmm(g.transpose(1, 2), a).reshape(BATCH, -1) @ queries.T
        ),
    }
    sym_a, sym_g = a2.T @ a2, g2.T @ g2
    query_a = torch.randn(N_QUERIES, SEQ, k, generator=gen)
    query_g = torch.randn(N_QUERIES, SEQ, d, generator=gen)
    query_dw = torch.bmm(query_g.transpose(1, 2), query_a)
    once = {
        "eigh": best_seconds(
            lambda: (torch.linalg.eigh(sym_a), torch.linalg.eigh(sym_g)), repeats=1
        ),
        "query_transform": min(  # rotate the token rows, or the (D, K) gradients
            best_seconds(lambda: torch.bmm((query_g @ u_g).transpose(1, 2), query_a @ u_a))
            - best_seconds(lambda: torch.bmm(query_g.transpose(1, 2), query_a)),
            best_seconds(lambda: u_g.T @ query_dw @ u_a),
        ),
    }
    return per_batch, once


def floor_worker(workload: dict) -> dict:
    """Seconds of the unavoidable K-FAC / EK-FAC arithmetic on this workload (see docstring)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    batches, layers = workload["n_train"] // BATCH, 4
    out: dict[str, float] = {}
    for k, d in layer_shapes(workload["hidden"]):
        per_batch, once = layer_floor(k, d, gen)
        for key, seconds in per_batch.items():
            out[key] = out.get(key, 0.0) + seconds * batches * layers
        for key, seconds in once.items():
            out[key] = out.get(key, 0.0) + seconds * layers
    return out


def floor_ratios(p_seconds: float, floor: dict) -> dict[str, float]:
    """Least time of each full configuration in units of P (see the module docstring).

    A kept EK-FAC run could reuse the rotated gradients it materializes for the
    eigenvalue correction in scoring, so its floor counts that materialization
    once (inside P); a re-run materializes it again.
    """
    cov = floor["covariance"] + floor["query_transform"]
    ekfac_extra = cov + floor["eigh"] + floor["rotation"]
    model_pass = p_seconds - floor["graddot_scoring"]
    return {
        "kfac": (p_seconds + cov) / p_seconds,
        "ekfac": (p_seconds + ekfac_extra) / p_seconds,
        "kfac-rerun": (p_seconds + model_pass + cov) / p_seconds,
        "ekfac-rerun": (p_seconds + 2 * model_pass + ekfac_extra + floor["rotated_materialize"])
        / p_seconds,
    }


def profile(config: str, workload: dict, top: int) -> None:
    """Run ``config`` once under cProfile (after a warm-up) and print the top functions."""
    torch.set_num_threads(1)
    attribute, train, _ = make_call(config, workload)
    attribute(train[:BATCH])
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    attribute(train)
    profiler.disable()
    print(f"{config}: {time.perf_counter() - start:.2f} s under the profiler")
    for key in ("cumulative", "tottime"):
        print(f"\n--- top {top} by {key} ---")
        pstats.Stats(profiler).sort_stats(key).print_stats(top)


def run_child(config: str, wide: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", config] + (["--wide"] if wide else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"skipped": f"failed: {tail[0][:300]}"}
    return json.loads(lines[-1])


def reference_of(config: str) -> str:
    """The Grad-Dot configuration a row is divided by (P)."""
    for variant in ("logra", "cache"):
        if config.endswith(variant):
            return f"graddot-{variant}"
    return "graddot"


def render(runs: dict[str, list[dict]], workload: dict, opts: argparse.Namespace) -> str:
    medians = {
        c: {
            "seconds": statistics.median(r["seconds"] for r in rs),
            "peak_mib": statistics.median(r["peak_mib"] for r in rs),
            "all": [r["seconds"] for r in rs],
            "plan": rs[0].get("plan"),
            "checksum": rs[0]["checksum"],
        }
        for c, rs in runs.items()
        if rs and all("skipped" not in r for r in rs)
    }
    lines = [
        f"# K-FAC / EK-FAC time in units of Grad-Dot (P), {opts.workload} workload (CPU)",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine_line()}; each worker "
        "ran with `torch.set_num_threads(1)`.",
        f"Produced by `experiments/benchmark/throughput_kfac.py{' --wide' if opts.wide else ''}"
        f" --repeats {opts.repeats}`.",
        "",
        f"Workload: GPT-NeoX from config (4 layers, hidden {workload['hidden']}, "
        f"{workload['heads']} heads, MLP {4 * workload['hidden']}, vocab {VOCAB}), "
        f"{workload['n_train']} training sequences x {SEQ} tokens, {N_QUERIES} queries, fp32, "
        f"batch {BATCH}, 16 hooked linear layers, empirical Fisher, damping {DAMPING:g} "
        "relative. One live `attribute` call per run after a warm-up call; peak = growth of "
        "peak RSS (VmHWM) over the RSS before the call. Medians of interleaved rounds, each "
        "run in a fresh process.",
    ]
    if opts.note:
        lines += ["", opts.note]
    lines += [
        "",
        "| config | runs (s) | median (s) | x P | peak RSS growth (MiB) | pass plan "
        "| sum of abs scores |",
        "|---|---|---|---|---|---|---|",
    ]
    for config, m in medians.items():
        ref = medians.get(reference_of(config))
        ratio = f"{m['seconds'] / ref['seconds']:.2f}" if ref else "-"
        plan = m["plan"]
        plan_text = (
            "-"
            if not plan
            else f"{plan['passes']} passes ({plan['source_passes']} ran the model), "
            f"{plan['kept_bytes'] / 2**20:.0f} MiB kept"
        )
        runs_text = ", ".join(f"{s:.2f}" for s in m["all"])
        lines.append(
            f"| {config} | {runs_text} | {m['seconds']:.2f} | {ratio} | {m['peak_mib']:.0f} "
            f"| {plan_text} | {m['checksum']:.6g} |"
        )
    failed = [f"* {c}: {rs[0]['skipped']}" for c, rs in runs.items() if "skipped" in rs[0]]
    if failed:
        lines += ["", "Not run:", *failed]
    return "\n".join(lines) + "\n"


def render_floor(runs: dict[str, list[dict]], floors: list[dict]) -> str:
    """The arithmetic floor section: seconds of each part and the least ratio per config."""
    floors = [f for f in floors if "skipped" not in f]
    graddot = [r["seconds"] for r in runs.get("graddot", []) if "skipped" not in r]
    if not floors or not graddot:
        return ""
    floor = {key: statistics.median(f[key] for f in floors) for key in floors[0]}
    p_seconds = statistics.median(graddot)
    parts = ", ".join(f"{key.replace('_', ' ')} {value:.2f} s" for key, value in floor.items())
    lines = [
        "",
        "## Arithmetic floor (`floor`, medians over the rounds)",
        "",
        f"Unavoidable GEMMs on this machine: {parts}. Least time of each full configuration, "
        "in units of this run's P:",
        "",
        "| config | floor (x P) | measured (x P) |",
        "|---|---|---|",
    ]
    for config, ratio in floor_ratios(p_seconds, floor).items():
        measured = [r["seconds"] for r in runs.get(config, []) if "skipped" not in r]
        shown = f"{statistics.median(measured) / p_seconds:.2f}" if measured else "-"
        lines.append(f"| {config} | {ratio:.2f} | {shown} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=(*CONFIGS, *CACHE_CONFIGS, "floor"))
    parser.add_argument("--profile", choices=CONFIGS + CACHE_CONFIGS)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--wide", action="store_true", help="hidden 512, 8 heads, 64 sequences")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--note", default="", help="a line added under the workload text")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    opts.workload = "wide" if opts.wide else "narrow"
    workload = WORKLOADS[opts.workload]
    if opts.worker == "floor":
        print(json.dumps(floor_worker(workload)), flush=True)
        return
    if opts.worker:
        print(json.dumps(run_worker(opts.worker, workload)), flush=True)
        return
    if opts.profile:
        profile(opts.profile, workload, opts.top)
        return
    configs = [c for c in opts.configs.split(",") if c]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    floors: list[dict] = []
    for _ in range(opts.repeats):  # interleaved rounds, so background load hits all alike
        for config in configs:
            result = run_child(config, opts.wide)
            runs[config].append(result)
            print(config, result, flush=True)
        floors.append(run_child("floor", opts.wide))
        print("floor", floors[-1], flush=True)
    out = Path(opts.out or RESULTS / f"throughput_kfac_{opts.workload}.md")
    out.write_text(render(runs, workload, opts) + render_floor(runs, floors))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

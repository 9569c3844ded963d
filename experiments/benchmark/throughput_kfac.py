"""K-FAC / EK-FAC attribution throughput, with kronfluence as a peer when it is installed.

Model (pure PyTorch, so the peer can run in a venv without ``transformers``): a
token MLP language model -- embedding (vocabulary 512, width 128), four residual
blocks ``Linear(128, 512) -> GELU -> Linear(512, 128)``, output head -- on random
token ids, ``--n-train`` training and ``--n-test`` query sequences of ``--seq``
tokens, float32, CPU. Loss: sum over sequences of the mean next-token cross
entropy. Tracked layers: the eight block ``nn.Linear`` layers (the same set for
every row).

Rows (each the whole attribution: capture, fit, preconditioning, scoring):

* ``dattri_llm KFAC/EKFAC full`` -- ``attribute(..., gradient_cache_residency="memory")``
  with factorized capture and covariances recorded at capture (no fit pass);
* ``dattri_llm KFAC/EKFAC k=64`` -- the same with capture-time ``"logra"`` projection
  to ``proj_dim=64`` per factor;
* ``kronfluence KFAC/EKFAC full`` -- ``fit_all_factors`` + ``compute_pairwise_scores``
  (empirical Fisher, CPU), run in ``--peer-python`` (default ``/work/bench-venv``) when
  kronfluence imports there; the row is omitted otherwise.

Reported: median wall time over ``--repeats`` runs and training sequences scored per
second (``n_train / wall``; every query is scored each time). Numbers depend on the
machine and its load (both written to the report).

Usage: ``python experiments/benchmark/throughput_kfac.py [--out PATH] [--n-train N]
[--n-test M] [--seq T] [--repeats R] [--peer-python PATH]``; the peer half runs as
``python throughput_kfac.py --peer kronfluence --method ekfac ...`` and prints seconds.
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
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HIDDEN, BLOCKS = 512, 128, 512, 4
TRACKED = [f"blocks.{i}.{j}" for i in range(BLOCKS) for j in ("up", "down")]


class Block(nn.Module):
    """Residual MLP block ``x + down(gelu(up(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class TokenMLP(nn.Module):
    """Embedding, residual MLP blocks and a head: ``(B, T)`` ids -> ``(B, T, VOCAB)`` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Sum over sequences of the mean next-token cross entropy (per-sample grad = ∇ℓ_i)."""
    logits = model(ids)[:, :-1]
    per_token = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return per_token.mean(dim=1).sum()


def make_setup(n_train: int, n_test: int, seq: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Seeded model and random token data (identical in both venvs)."""
    torch.manual_seed(0)
    model = TokenMLP()
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, VOCAB, (n_train, seq), generator=gen)
    test = torch.randint(0, VOCAB, (n_test, seq), generator=gen)
    return model, train, test


# --------------------------------------------------------------------------- dattri_llm


def run_dattri(method: str, proj_dim: int | None, n_train: int, n_test: int, seq: int) -> float:
    """Seconds for one dattri_llm attribution."""
    from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.task import AttributionTask

    model, train, test = make_setup(n_train, n_test, seq)
    projection = None
    if proj_dim is not None:
        projection = {
            "__default__": {
                "style": "logra",
                "proj_dim": proj_dim,
                "proj_max_batch_size": 8,
                "proj_seed": 0,
            }
        }
    config = HookManagerConfig(hook_types=dict.fromkeys(TRACKED, "linear_io"),
                               projection_kwargs=projection)  # fmt: skip
    cls = KFACAttributor if method == "kfac" else EKFACAttributor
    with tempfile.TemporaryDirectory() as out:
        args = AttributionArguments(
            output_dir=out, use_cpu=True, per_device_train_batch_size=8,
            per_device_eval_batch_size=8,
        )  # fmt: skip
        attributor = cls(args, task=AttributionTask(lambda m, b: lm_loss(m, b), model))
        start = time.perf_counter()
        attributor.attribute(
            list(train), list(test), hook_config=config, gradient_cache_residency="memory",
            damping=1e-3, relative_damping=True,
        )  # fmt: skip
        return time.perf_counter() - start


# --------------------------------------------------------------------------- kronfluence


def run_kronfluence(method: str, n_train: int, n_test: int, seq: int) -> float:
    """Seconds for one kronfluence attribution (run inside the peer venv)."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):  # noqa: D102, ANN001
            return lm_loss(model, batch)

        def compute_measurement(self, batch, model):  # noqa: D102, ANN001
            return lm_loss(model, batch)

        def get_influence_tracked_modules(self):  # noqa: D102
            return TRACKED

    model, train, test = make_setup(n_train, n_test, seq)
    task = LMTask()
    model = prepare_model(model, task)
    factor_args = FactorArguments(strategy=method, use_empirical_fisher=True)
    with tempfile.TemporaryDirectory() as out:
        analyzer = Analyzer(
            analysis_name="bench", model=model, task=task, cpu=True, output_dir=out,
            disable_tqdm=True,
        )  # fmt: skip
        start = time.perf_counter()
        analyzer.fit_all_factors(
            factors_name="f", dataset=list(train), per_device_batch_size=8,
            factor_args=factor_args, overwrite_output_dir=True,
        )  # fmt: skip
        analyzer.compute_pairwise_scores(
            scores_name="s", factors_name="f", query_dataset=list(test),
            train_dataset=list(train), per_device_query_batch_size=8,
            per_device_train_batch_size=8, overwrite_output_dir=True,
        )  # fmt: skip
        return time.perf_counter() - start


def peer_seconds(python: str, method: str, options: argparse.Namespace) -> float | None:
    """Run the kronfluence half in ``python``; ``None`` when it is unavailable or fails."""
    if not Path(python).exists():
        return None
    command = [
        python, __file__, "--peer", "kronfluence", "--method", method,
        "--n-train", str(options.n_train), "--n-test", str(options.n_test),
        "--seq", str(options.seq),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(f"kronfluence {method} failed:\n{result.stderr[-2000:]}", file=sys.stderr)
        return None
    return float(json.loads(result.stdout.strip().splitlines()[-1])["seconds"])


# --------------------------------------------------------------------------- report


def machine() -> str:
    """CPU model, cores, torch threads, torch version and load average."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}"
    )


def main() -> None:
    """Time every row and write the Markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/throughput_kfac.md"))
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-python", default="/work/bench-venv/bin/python")
    parser.add_argument("--peer", choices=["kronfluence"], help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=["kfac", "ekfac"], help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.peer:
        seconds = run_kronfluence(options.method, options.n_train, options.n_test, options.seq)
        print(json.dumps({"seconds": seconds}))
        return

    rows = []
    for method in ("kfac", "ekfac"):
        for proj_dim in (None, 64):
            times = [
                run_dattri(method, proj_dim, options.n_train, options.n_test, options.seq)
                for _ in range(options.repeats)
            ]
            label = "full" if proj_dim is None else f"k={proj_dim}"
            rows.append((f"dattri_llm {method.upper()} {label}", statistics.median(times)))
        peer = [peer_seconds(options.peer_python, method, options) for _ in range(options.repeats)]
        if all(t is not None for t in peer):
            rows.append((f"kronfluence {method.upper()} full", statistics.median(peer)))
    lines = [
        "# K-FAC / EK-FAC attribution throughput",
        "",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}  ",
        f"Machine: {machine()}  ",
        f"Setup: TokenMLP ({BLOCKS} blocks, width {WIDTH}, hidden {HIDDEN}, vocabulary "
        f"{VOCAB}), {len(TRACKED)} tracked nn.Linear layers, {options.n_train} train x "
        f"{options.n_test} query sequences of {options.seq} tokens, float32 CPU; median of "
        f"{options.repeats} runs (capture + fit + preconditioning + scoring).",
        "kronfluence runs in its own venv with its default damping and writes its factors "
        "to a temporary directory; dattri_llm uses relative damping 1e-3 and keeps everything "
        "in memory. Scores of the two libraries are not cross-checked here.",
        "",
        "| method | wall (s) | train sequences / s |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {t:.2f} | {options.n_train / t:.1f} |" for name, t in rows]
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

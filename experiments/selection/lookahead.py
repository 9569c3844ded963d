"""Online look-ahead data selection against offline AdamW-influence selection, on a tiny Llama.

A tiny ``LlamaForCausalLM`` (built from a config, nothing downloaded) is trained
with AdamW on a finite pool of synthetic sequences over 32 tokens, mixed from
sources of different usefulness for one target task, *counting up*
(``s, s+1, s+2, …`` mod 32). The target loss is the mean next-token loss on
held-out count-up sequences. Two mixtures:

* **A** — count-up vs random walk (``±1`` steps of equal odds), half of each per batch;
* **B** — four graded sources, a quarter of each per batch: count-up with token
  noise 0, 0.2 and 0.5 (each position after the first replaced by a uniform
  token with that probability) and the random walk.

Methods, each trained for the same number of AdamW steps and batch size:

* ``none`` — no selection;
* ``grad-dot`` — ``DataSelectionCallback`` with the Grad-Dot score;
* ``look-ahead K`` — the same callback with ``score="lookahead", horizon=K``;
* ``offline`` — :func:`offline_selection`: AdamW-influence scores of a recorded
  reference run, keep the top half of the pool, retrain from the same start.

Every online row drops the bottom half of each batch by score
(``threshold_mode="bottom_fraction"``, threshold 0.5, ``renormalize=True``)
against a validation loader of count-up batches.

Run:  python experiments/selection/lookahead.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    AdamWInfluenceAttributor,
    AttributionArguments,
    DataSelectionCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerStateCallback,
)

HERE = Path(__file__).parent
VOCAB, SEQ, BATCH = 32, 16, 8
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=SEQ,
    attention_dropout=0.0,
)
KEEP_FRACTION = 0.5
VAL_ID_OFFSET, EVAL_ID_OFFSET = 1_000_000, 2_000_000


# ---------------------------------------------------------------------------- data
def counting(n: int, gen: torch.Generator, noise: float = 0.0) -> torch.Tensor:
    """``(n, SEQ)`` count-up sequences from random starts (mod VOCAB); each position after
    the first is replaced by a uniform token with probability ``noise``."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=gen)
    ids = (starts + torch.arange(SEQ)) % VOCAB
    if noise > 0:
        flip = torch.rand(n, SEQ, generator=gen) < noise
        flip[:, 0] = False
        ids = torch.where(flip, torch.randint(0, VOCAB, (n, SEQ), generator=gen), ids)
    return ids


def random_walk(n: int, gen: torch.Generator) -> torch.Tensor:
    """``(n, SEQ)`` walks from random starts with steps ``±1`` of equal odds (mod VOCAB)."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=gen)
    steps = 2 * torch.randint(0, 2, (n, SEQ - 1), generator=gen) - 1
    walk = torch.cat([torch.zeros(n, 1, dtype=torch.long), steps.cumsum(1)], 1)
    return (starts + walk) % VOCAB


Source = Callable[[int, torch.Generator], torch.Tensor]
MIXTURES: dict[str, dict[str, Source]] = {
    "A": {"count-up": counting, "random walk": random_walk},
    "B": {
        "count-up": counting,
        "count-up, noise 0.2": lambda n, g: counting(n, g, 0.2),
        "count-up, noise 0.5": lambda n, g: counting(n, g, 0.5),
        "random walk": random_walk,
    },
}


@dataclass
class Pool:
    """A finite training pool: ``ids (N, SEQ)``, ``source (N,)`` (index into ``names``)."""

    ids: torch.Tensor
    source: torch.Tensor
    names: list[str]

    def batch(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """The model inputs of ``rows``; ``sample_id`` is the pool index."""
        rows = torch.as_tensor(list(rows))
        return tagged(self.ids[rows], rows)

    def members(self, source: int) -> list[int]:
        """Pool indices of one source."""
        return torch.nonzero(self.source == source).flatten().tolist()


def tagged(ids: torch.Tensor, sample_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A causal-LM batch carrying one integer identifier per row."""
    return {"input_ids": ids, "labels": ids, "sample_id": sample_ids}


def make_pool(mixture: str, per_source: int, seed: int) -> Pool:
    """``per_source`` sequences of each source of ``mixture``, drawn with ``seed``."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    sources = MIXTURES[mixture]
    ids = torch.cat([make(per_source, gen) for make in sources.values()])
    source = torch.arange(len(sources)).repeat_interleave(per_source)
    return Pool(ids, source, list(sources))


def epochs(indices: Sequence[int], gen: torch.Generator):
    """Endless stream of ``indices``, reshuffled every pass."""
    while True:
        for i in torch.randperm(len(indices), generator=gen).tolist():
            yield indices[i]


def mixed_schedule(pool: Pool, steps: int, seed: int) -> list[list[int]]:
    """Per step, an equal share of the batch from every source (shuffled epochs per source)."""
    gen = torch.Generator().manual_seed(20_000 + seed)
    share = BATCH // len(pool.names)
    streams = [epochs(pool.members(s), gen) for s in range(len(pool.names))]
    return [[next(stream) for stream in streams for _ in range(share)] for _ in range(steps)]


def uniform_schedule(indices: Sequence[int], steps: int, seed: int) -> list[list[int]]:
    """Batches of ``BATCH`` from shuffled epochs over ``indices`` (the offline kept pool)."""
    stream = epochs(list(indices), torch.Generator().manual_seed(30_000 + seed))
    return [[next(stream) for _ in range(BATCH)] for _ in range(steps)]


@dataclass
class Target:
    """The target task: validation batches (selection) and a held-out evaluation batch."""

    val_batches: list[dict[str, torch.Tensor]]
    eval_batch: dict[str, torch.Tensor]


def make_target(seed: int, val_batches: int = 16, val_size: int = 4, eval_size: int = 64):
    """Count-up validation batches and an evaluation batch, drawn with ``seed``."""
    gen = torch.Generator().manual_seed(40_000 + seed)
    val = []
    for b in range(val_batches):
        first = VAL_ID_OFFSET + b * val_size
        val.append(tagged(counting(val_size, gen), torch.arange(first, first + val_size)))
    eval_ids = torch.arange(EVAL_ID_OFFSET, EVAL_ID_OFFSET + eval_size)
    return Target(val, tagged(counting(eval_size, gen), eval_ids))


# ---------------------------------------------------------------------------- model
class TaggedLM(nn.Module):
    """A causal LM whose forward also takes (and ignores) a ``sample_id`` per row, so that a
    ``HookManager(sample_id_key="sample_id")`` names each captured row by its pool index."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels=None, sample_id=None):  # noqa: ARG002
        return self.lm(input_ids=input_ids, labels=labels)


def build_model(seed: int) -> TaggedLM:
    """A fresh tiny Llama (init seeded); RMSNorm weights frozen, so every trainable
    parameter sits in a hooked ``nn.Linear`` / ``nn.Embedding`` (exact removal and
    exact AdamW-influence coverage)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(50_000 + seed)
    model = TaggedLM(LlamaForCausalLM(LlamaConfig(**LLAMA)))
    for name, param in model.named_parameters():
        if "norm" in name:
            param.requires_grad_(False)
    return model.train()


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean next-token cross-entropy (equal lengths: the mean of per-sequence means)."""
    return model(**batch).loss


@torch.no_grad()
def evaluate(model: nn.Module, batch: dict) -> float:
    """Target loss on the held-out evaluation batch."""
    model.eval()
    loss = float(lm_loss(model, batch))
    model.train()
    return loss


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters AdamW updates (all but the frozen RMSNorm weights)."""
    return [p for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------------------- training
@dataclass
class Trained:
    """One training run: target-loss curve, training-loop seconds (no evaluation), and the
    count of dropped rows per source (online selection)."""

    curve: dict[int, float]
    seconds: float
    dropped: list[int]


CallbackFactory = Callable[[nn.Module, torch.optim.Optimizer], list]


def train(
    model: nn.Module,
    pool: Pool,
    schedule: list[list[int]],
    lr: float,
    target: Target,
    *,
    callbacks: CallbackFactory | None = None,
    eval_every: int = 4,
    **manager_kwargs,
) -> Trained:
    """AdamW over ``schedule`` (constant ``lr``); with ``callbacks`` the loop runs inside a
    ``HookManager`` over every Linear/Embedding layer carrying them."""
    optimizer = torch.optim.AdamW(trainable(model), lr=lr)
    hooked = callbacks(model, optimizer) if callbacks else []
    selector = next((c for c in hooked if isinstance(c, DataSelectionCallback)), None)
    manager = None
    if callbacks:
        config = HookManagerConfig(linear_io=REGISTER_ALL)
        manager = HookManager(model, config, callbacks=hooked, **manager_kwargs)
    curve = {0: evaluate(model, target.eval_batch)}
    dropped = [0] * len(pool.names)
    seconds = 0.0
    with manager.collect(deregister_on_exit=True) if manager else nullcontext():
        for step, rows in enumerate(schedule, start=1):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            lm_loss(model, pool.batch(rows)).backward()
            optimizer.step()
            seconds += time.perf_counter() - start
            if selector is not None:
                for i in selector.last_dropped:
                    dropped[int(pool.source[rows[i]])] += 1
            if step % eval_every == 0 or step == len(schedule):
                curve[step] = evaluate(model, target.eval_batch)
    return Trained(curve, seconds, dropped)


def selection(
    target: Target, score: str, horizon: int | None = None, curvature: bool = True
) -> CallbackFactory:
    """The online selection callback: bottom half of each batch dropped, kept samples
    renormalized, target = one validation batch per step (``curvature``: the look-ahead's
    Gauss–Newton coupling)."""

    def make(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
        extra = {}
        if score == "lookahead":
            extra = dict(
                score="lookahead",
                horizon=horizon,
                optimizer=optimizer,
                max_grad_norm=None,
                lookahead_curvature=curvature,
            )
        return [
            DataSelectionCallback(
                model,
                target="val_loader",
                val_loader=target.val_batches,
                val_loss_fn=lm_loss,
                renormalize=True,
                selection_kwargs={"threshold": KEEP_FRACTION, "threshold_mode": "bottom_fraction"},
                **extra,
            )
        ]

    return make


# ---------------------------------------------------------------------------- offline
@dataclass
class Offline:
    """What :func:`offline_selection` returns: the kept pool indices, every pool sample's
    helpfulness score, the reference run and the seconds of each stage."""

    kept: list[int]
    scores: torch.Tensor
    reference: Trained
    seconds: dict[str, float]


def offline_selection(
    pool: Pool,
    schedule: list[list[int]],
    lr: float,
    target: Target,
    model_at_start: Callable[[], nn.Module],
    keep_fraction: float = KEEP_FRACTION,
    eval_every: int = 4,
) -> Offline:
    """Select a training pool offline with AdamW-influence (the ``K = T`` horizon).

    Recipe:

    1. **Reference run.** Train ``model_at_start()`` on the whole pool along
       ``schedule`` (no selection), recording every step's per-sample gradients
       (``OffloadCallback``, rows named by pool index through
       ``sample_id_key``) and the AdamW moments before/after every update
       (``OptimizerStateCallback``).
    2. **Queries.** At the final parameters ``θ_T``, capture the per-sample
       gradients of the target queries (the validation batches the online
       methods draw their targets from).
    3. **Scores.** ``AdamWInfluenceAttributor.attribute_from_cache(...,
       dynamics=..., propagation="test")`` gives, per (step, sample) row and
       query, the first-order change of the query loss at ``θ_T`` when the
       sample's weight at that step grows, through every later AdamW update.
       Rows are summed over steps (a sample seen in several batches) and over
       queries, and multiplied by the polarity ``-1``: positive = helpful.
       Samples the run never saw score 0.
    4. **Keep** the top ``keep_fraction`` of the pool by score.

    The caller then retrains from the same start on the kept pool.
    """
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="offline_sel_") as tmp:
        train_dir, query_dir = Path(tmp) / "train", Path(tmp) / "queries"
        states: list[OptimizerStateCallback] = []

        def recorders(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
            states.append(OptimizerStateCallback(model, optimizer))
            return [offload(train_dir), states[0]]

        model = model_at_start()
        reference = train(
            model,
            pool,
            schedule,
            lr,
            target,
            callbacks=recorders,
            eval_every=eval_every,
            sample_id_key="sample_id",
        )
        start = time.perf_counter()
        states[0].save(str(train_dir))
        capture_queries(model, target.val_batches, query_dir)
        seconds["queries"] = time.perf_counter() - start
        start = time.perf_counter()
        scores = adamw_influence(train_dir, query_dir, states[0].dynamics(), len(pool.ids), tmp)
        seconds["attribution"] = time.perf_counter() - start
    seconds["reference"] = reference.seconds
    order = torch.argsort(scores, descending=True, stable=True)
    kept = sorted(order[: round(keep_fraction * len(order))].tolist())
    return Offline(kept, scores, reference, seconds)


def offload(directory: Path) -> OffloadCallback:
    """Per-sample gradients of every backward, written to a fresh store at ``directory``."""
    store = GradientStorageManager(str(directory))
    return OffloadCallback(offload_interval=1, file_manager=store, recording_type="per_sample")


def capture_queries(model: nn.Module, batches: list[dict], directory: Path) -> None:
    """Per-sample query gradients at the current parameters (one backward, no update)."""
    manager = HookManager(
        model,
        HookManagerConfig(linear_io=REGISTER_ALL),
        callbacks=[offload(directory)],
        sample_id_key="sample_id",
    )
    queries = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    with manager.collect(deregister_on_exit=True):
        lm_loss(model, queries).backward()
    model.zero_grad(set_to_none=True)


def adamw_influence(
    train_dir: Path, query_dir: Path, dynamics: dict, pool_size: int, scratch: str
) -> torch.Tensor:
    """``(pool_size,)`` helpfulness: AdamW-influence rows summed over steps and queries,
    times the polarity (positive = lowers the target loss)."""
    args = AttributionArguments(output_dir=scratch, use_cpu=True, per_device_train_batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        score = AdamWInfluenceAttributor(args).attribute_from_cache(
            str(train_dir),
            str(query_dir),
            dynamics=dynamics,
            loss_reduction="mean",
            propagation="test",
        )
    ids, matrix = score.agnostic_matrix()
    helps = torch.zeros(pool_size, dtype=torch.float64)
    helps[[int(i) for i in ids]] = score.polarity * matrix.sum(1).double()
    return helps


# ---------------------------------------------------------------------------- the grid
@dataclass
class Cell:
    """One (mixture, learning rate, seed, method) result."""

    mixture: str
    lr: float
    seed: int
    method: str
    curve: dict[int, float]
    seconds_per_step: float
    dropped: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def final(self) -> float:
        """Target loss after the last step."""
        return self.curve[max(self.curve)]

    @property
    def tail(self) -> float:
        """Mean target loss over the last 4 evaluations (less sensitive to the last step)."""
        last = sorted(self.curve)[-4:]
        return sum(self.curve[s] for s in last) / len(last)


def method_names(horizons: Sequence[int], offline: bool = True) -> list[str]:
    """Row names in table order."""
    looks = [f"look-ahead K={k}" for k in horizons]
    return ["none", "grad-dot", *looks, *(["offline"] if offline else [])]


def methods_of(args: argparse.Namespace) -> list[str]:
    """The rows a run with ``args`` produces."""
    return method_names(args.horizons, getattr(args, "offline", True))


def pool_share(mixture: str, steps: int) -> int:
    """Sequences per source: the pool is half the training-sample visits, so the reference run
    sees every sample twice and the offline retraining (half the pool) four times."""
    return max(1, steps * BATCH // (2 * len(MIXTURES[mixture])))


def run_config(mixture: str, lr: float, seed: int, args: argparse.Namespace) -> list[Cell]:
    """Every method on one (mixture, learning rate, seed)."""
    pool = make_pool(mixture, pool_share(mixture, args.steps), seed)
    schedule = mixed_schedule(pool, args.steps, seed)
    target = make_target(seed)
    cells = []

    def record(method: str, run: Trained, **extra) -> None:
        cell = Cell(mixture, lr, seed, method, run.curve, run.seconds / args.steps, **extra)
        cell.dropped = run.dropped
        cells.append(cell)
        print(f"  {mixture} lr={lr:g} seed={seed} {method}: {cell.final:.4f}", flush=True)

    def fit(factory: CallbackFactory | None, rows=schedule) -> Trained:
        model = build_model(seed)
        return train(model, pool, rows, lr, target, callbacks=factory, eval_every=args.eval_every)

    record("none", fit(None))
    record("grad-dot", fit(selection(target, "grad_dot")))
    for k in args.horizons:
        factory = selection(target, args.lookahead_score, k, args.curvature)
        record(f"look-ahead K={k}", fit(factory))
    if not args.offline:
        return cells
    offline = offline_selection(
        pool, schedule, lr, target, lambda: build_model(seed), eval_every=args.eval_every
    )
    if offline.reference.curve != cells[0].curve:
        raise RuntimeError("the recorded reference run diverged from the plain run")
    retrained = fit(None, uniform_schedule(offline.kept, args.steps, seed))
    stages = {**offline.seconds, "retrain": retrained.seconds}
    kept_sources = [int((pool.source[offline.kept] == s).sum()) for s in range(len(pool.names))]
    record("offline", retrained, kept=kept_sources, stage_seconds=stages)
    cells[-1].seconds_per_step = sum(stages.values()) / args.steps
    return cells


# ---------------------------------------------------------------------------- reporting
def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def finals(
    cells: list[Cell], mixture: str, method: str, lr: float, metric: str = "final"
) -> list[float]:
    """One value per seed: ``"final"`` target loss or its ``"tail"`` mean."""
    chosen = [c for c in cells if (c.mixture, c.method, c.lr) == (mixture, method, lr)]
    return [getattr(c, metric) for c in chosen]


def loss_table(
    cells: list[Cell], mixture: str, methods: list[str], lrs: list[float], metric: str = "final"
) -> str:
    """Rows = methods, columns = learning rates, cells = ``metric`` mean ± s.e. over seeds;
    the best mean of each column in bold."""
    stats = {(m, lr): mean_se(finals(cells, mixture, m, lr, metric)) for m in methods for lr in lrs}
    best = {lr: min(stats[m, lr][0] for m in methods) for lr in lrs}
    lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |"]
    lines.append("|---|" + "---|" * len(lrs))
    for m in methods:
        row = []
        for lr in lrs:
            mean, se = stats[m, lr]
            text = f"{mean:.4f} ± {se:.4f}"
            row.append(f"**{text}**" if mean == best[lr] else text)
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def time_table(cells: list[Cell], methods: list[str]) -> str:
    """Mean milliseconds per optimizer step of each method over every run (offline: its
    reference run + query capture + attribution + retraining, per retraining step)."""
    lines = ["| method | ms / step | × none |", "|---|---|---|"]
    base = None
    for m in methods:
        ms = 1000 * mean_se([c.seconds_per_step for c in cells if c.method == m])[0]
        base = base or ms
        lines.append(f"| {m} | {ms:.1f} | {ms / base:.2f} |")
    offline = [c.stage_seconds for c in cells if c.method == "offline"]
    if offline:
        parts = ", ".join(
            f"{k} {sum(s[k] for s in offline) / len(offline):.2f} s" for k in offline[0]
        )
        lines.append("")
        lines.append(f"Offline stages, mean seconds per run: {parts}.")
    return "\n".join(lines)


def composition(cells: list[Cell], n_sources: int) -> list[float]:
    """Share of each source among the samples ``cells`` trained on (online: the kept rows
    of every batch; offline: the kept pool)."""
    counts = [0] * n_sources
    for c in cells:
        if c.method == "offline":
            kept = c.kept
        else:
            visits = BATCH // n_sources * max(c.curve)
            kept = [visits - (c.dropped[s] if c.dropped else 0) for s in range(n_sources)]
        counts = [a + b for a, b in zip(counts, kept)]
    total = sum(counts) or 1
    return [n / total for n in counts]


def composition_table(
    cells: list[Cell], mixture: str, methods: list[str], names: list[str], lrs: list[float]
) -> str:
    """Rows = methods, columns = learning rates, cells = the percent share of each source
    (in ``names`` order, ``/``-separated) among the samples trained on, over the seeds."""
    lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |"]
    lines.append("|---|" + "---|" * len(lrs))
    for m in methods:
        row = []
        for lr in lrs:
            chosen = [c for c in cells if (c.mixture, c.method, c.lr) == (mixture, m, lr)]
            row.append("/".join(f"{100 * x:.0f}" for x in composition(chosen, len(names))))
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def heatmaps(cells: list[Cell], mixtures, methods, lrs, path: Path) -> None:
    """Per mixture: rows = methods (K by K, then the references), columns = learning rates,
    annotated mean final target loss ± s.e.; colour = log2 of the mean over ``none``'s at
    the same learning rate (blue: better than no selection); the best look-ahead ``K`` of
    each column is boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    horizons = [m for m in methods if m.startswith("look-ahead")]
    order = horizons + [m for m in methods if m not in horizons]
    fig, axes = plt.subplots(
        1, len(mixtures), figsize=(4.6 * len(mixtures), 0.45 * len(order) + 1.8), squeeze=False
    )
    for ax, mixture in zip(axes[0], mixtures):
        stats = [[mean_se(finals(cells, mixture, m, lr)) for lr in lrs] for m in order]
        means = torch.tensor([[s[0] for s in row] for row in stats])
        ratio = (means / means[order.index("none")]).log2()
        bound = max(float(ratio.abs().max()), 1e-3)
        image = ax.imshow(ratio, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        for i, row in enumerate(stats):
            for j, (mean, se) in enumerate(row):
                dark = abs(float(ratio[i, j])) > 0.6 * bound
                text = f"{mean:.3f}\n±{se:.3f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")  # fmt: skip
        if horizons:
            for j in range(len(lrs)):
                i = int(means[: len(horizons), j].argmin())
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec="k"))
            ax.axhline(len(horizons) - 0.5, color="k", lw=1)
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_yticks(range(len(order)), order)
        ax.set_xlabel("learning rate")
        ax.set_title(f"mixture {mixture}: final target loss", fontsize=10)
        fig.colorbar(image, ax=ax, label="log2(loss / no selection)", shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paired(cells: list[Cell], mixture: str, lr: float, a: str, b: str) -> tuple[float, float]:
    """Mean ± s.e. over seeds of ``final(a) − final(b)`` (same seed = same pool and init)."""
    by = {(c.method, c.seed): c.final for c in cells if (c.mixture, c.lr) == (mixture, lr)}
    seeds = sorted({seed for method, seed in by if method == a and (b, seed) in by})
    return mean_se([by[a, s] - by[b, s] for s in seeds])


def horizon_table(cells: list[Cell], mixture: str, methods: list[str], lrs: list[float]) -> str:
    """Per learning rate: the look-ahead horizon of lowest mean loss and paired differences
    (negative = the first is lower) against ``offline`` (when run) and ``none``."""
    horizons = [m for m in methods if m.startswith("look-ahead")]
    pairs = [("best", "none"), ("grad-dot", "none"), (horizons[0], "grad-dot")]
    if "offline" in methods:
        pairs = [("best", "offline"), (horizons[0], "offline"), *pairs, ("offline", "none")]
    short = {"best": "best K"} | {m: m.replace("look-ahead ", "") for m in horizons}
    heads = " | ".join(f"{short.get(a, a)} − {b}" for a, b in pairs)
    lines = [f"| lr | best K (mean) | {heads} |", "|---|---|" + "---|" * len(pairs)]
    for lr in lrs:
        best = min(horizons, key=lambda m: mean_se(finals(cells, mixture, m, lr))[0])
        row = []
        for a, b in pairs:
            mean, se = paired(cells, mixture, lr, best if a == "best" else a, b)
            row.append(f"{mean:+.4f} ± {se:.4f}")
        lines.append(f"| {lr:g} | {best.split('=')[1]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def curves(cells: list[Cell], mixtures, methods, lrs, path: Path) -> None:
    """Mean target-loss curve of each method, one panel per (mixture, learning rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(mixtures),
        len(lrs),
        figsize=(3.6 * len(lrs), 3 * len(mixtures)),
        squeeze=False,
        sharey=True,
    )
    for row, mixture in zip(axes, mixtures):
        for ax, lr in zip(row, lrs):
            for m in methods:
                runs = [c.curve for c in cells if (c.mixture, c.method, c.lr) == (mixture, m, lr)]
                steps = sorted(runs[0])
                mean = [sum(r[s] for r in runs) / len(runs) for s in steps]
                style = "--" if m in ("none", "offline", "grad-dot") else "-"
                ax.plot(steps, mean, style, label=m, lw=1.2)
            ax.set_yscale("log")
            ax.set_title(f"mixture {mixture}, lr {lr:g}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("target loss")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine() -> str:
    """CPU model (``lscpu``: model name, family, hypervisor) and ``nproc``."""
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    except OSError:
        pass
    model = fields.get("Model name", platform.processor() or "unknown CPU").strip()
    for key, label in (("CPU family", "family"), ("Hypervisor vendor", "hypervisor")):
        if key in fields:
            model += f", {label} {fields[key].strip()}"
    return f"{model}, nproc {os.cpu_count()}"


def report(cells: list[Cell], args: argparse.Namespace, meta: dict) -> str:
    """The results document's tables (the hand-written reading is kept by :func:`write`)."""
    lrs, methods = args.lrs, methods_of(args)
    lines = [
        "# Online look-ahead vs offline data selection"
        + ("" if getattr(args, "curvature", True) else ": look-ahead without the coupling"),
        "",
        f"Generated by `lookahead.py{' --smoke' if args.smoke else ''}` on {meta['date']}; "
        f"machine: {meta['machine']}; torch {meta['torch']}, {args.threads} thread(s); "
        f"wall time {meta['wall_seconds'] / 60:.1f} min (shared machine).",
        "",
        f"Setting: tiny Llama (hidden {LLAMA['hidden_size']}, {LLAMA['num_hidden_layers']} "
        f"layers, vocab {VOCAB}, sequence {SEQ}); pool = half the sample visits (each sample "
        "seen twice without selection); "
        f"{args.steps} AdamW steps of batch {BATCH}; seeds {args.seeds}; online rows keep the "
        f"top {KEEP_FRACTION:.0%} of each batch, offline keeps the top {KEEP_FRACTION:.0%} of "
        f"the pool. Look-ahead score: `{args.lookahead_score}`, Gauss–Newton coupling "
        f"{'on' if getattr(args, 'curvature', True) else 'off'}. Cells: final held-out target "
        "(count-up) loss, mean ± standard error over seeds; bold = best mean of the column.",
    ]
    for mixture in args.mixtures:
        names = list(MIXTURES[mixture])
        lines += [
            "",
            f"## Mixture {mixture} ({', '.join(names)})",
            "",
            loss_table(cells, mixture, methods, lrs),
            "",
            "Paired differences of final target loss over seeds (negative = the first is "
            "lower; the best K is picked on these same seeds, so its row is optimistic):",
            "",
            horizon_table(cells, mixture, methods, lrs),
            "",
            f"Percent share of each source ({' / '.join(names)}) among the samples trained "
            "on (online: rows kept in the batches; offline: the kept pool), over the seeds:",
            "",
            composition_table(cells, mixture, methods, names, lrs),
            "",
            "Robustness: mean target loss over the last 4 evaluations (the last "
            f"{3 * args.eval_every} steps), mean ± s.e. over seeds:",
            "",
            loss_table(cells, mixture, methods, lrs, metric="tail"),
        ]
    lines += ["", "## Step time", "", time_table(cells, methods), ""]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (``--smoke`` overrides the grid with a seconds-long one)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run of every stage")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--horizons", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--mixtures", nargs="+", default=list(MIXTURES))
    parser.add_argument(
        "--lookahead-score",
        default="lookahead",
        help="score of the look-ahead rows ('grad_dot' to dry-run the harness)",
    )
    parser.add_argument(
        "--no-curvature",
        dest="curvature",
        action="store_false",
        help="look-ahead rows without the Gauss-Newton coupling (lookahead_curvature=False)",
    )
    parser.add_argument(
        "--no-offline", dest="offline", action="store_false", help="skip the offline rows"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--render", action="store_true", help="rewrite the outputs from OUT/lookahead.json"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_every, args.lrs, args.seeds, args.horizons = 4, 2, [3e-3], [0], [1, 2]
    return args


READING = "## Reading"


def write(cells: list[Cell], args: argparse.Namespace, meta: dict) -> None:
    """Plots, ``lookahead.md`` (keeping a hand-written section from ``READING`` on) and the
    raw ``lookahead.json`` under ``args.out``."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    methods = methods_of(args)
    heatmaps(cells, args.mixtures, methods, args.lrs, out / "lookahead_heatmap.png")
    curves(cells, args.mixtures, methods, args.lrs, out / "lookahead_curves.png")
    document = out / "lookahead.md"
    kept = ""
    if document.exists() and READING in document.read_text():
        kept = READING + document.read_text().split(READING, 1)[1]
    document.write_text(report(cells, args, meta) + ("\n" + kept if kept else ""))
    raw = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},  # no machine paths
        "meta": meta,
        "cells": [asdict(c) for c in cells],
    }
    (out / "lookahead.json").write_text(json.dumps(raw, indent=1))


def load(path: Path) -> tuple[list[Cell], argparse.Namespace, dict]:
    """Cells, arguments and run metadata of a written ``lookahead.json``."""
    raw = json.loads(path.read_text())
    cells = []
    for c in raw["cells"]:
        c["curve"] = {int(k): v for k, v in c["curve"].items()}
        cells.append(Cell(**c))
    args = argparse.Namespace(**raw["args"])
    args.out = path.parent
    meta = raw.get("meta") or run_meta(raw["wall_seconds"], args.threads)
    return cells, args, meta


def run_meta(wall: float, threads: int) -> dict:
    """Date, machine, torch version, threads and wall time of a run."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": threads,
        "wall_seconds": wall,
    }


def main(argv: list[str] | None = None) -> list[Cell]:
    """Run the grid (or ``--render`` a written one) and write the outputs."""
    args = parse(argv)
    if args.render:
        cells, saved, meta = load(args.out / "lookahead.json")
        saved.out = args.out
        write(cells, saved, meta)
        return cells
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    cells = []
    for mixture in args.mixtures:
        for lr in args.lrs:
            for seed in args.seeds:
                cells += run_config(mixture, lr, seed, args)
    wall = time.perf_counter() - start
    write(cells, args, run_meta(wall, args.threads))
    print(f"wall {wall:.1f} s -> {args.out}")
    return cells


if __name__ == "__main__":
    main()

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

The setting (sources, mixtures, model, training loop, online selection callback) is in
``mixtures.py``; the result cells, tables, plots and ``lookahead.{md,json}`` in ``report.py``;
this module holds the offline recipe, the grid and the command line.

Run:  python experiments/selection/lookahead.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    AdamWInfluenceAttributor,
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerStateCallback,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixtures import (  # noqa: E402
    BATCH,
    KEEP_FRACTION,
    MIXTURES,
    CallbackFactory,
    Pool,
    Target,
    Trained,
    build_model,
    lm_loss,
    make_pool,
    make_target,
    mixed_schedule,
    selection,
    train,
    uniform_schedule,
)
from report import Cell, load, run_meta, write  # noqa: E402

HERE = Path(__file__).parent


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

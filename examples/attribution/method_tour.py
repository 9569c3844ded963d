"""Method tour: every attributor of dattri_llm on one captured training run.

A tiny GPT-2 (built from a config, no download) is trained with AdamW on the
five-topic corpus of ``examples/quickstart_corpus.py``. The run is captured
ONCE (``tour_run.py``), by hooks around the unchanged training loop:

* ``trajectory/``: raw per-sample gradients of every captured step
  (``HookManager`` + ``OffloadCallback``), the Adam moments before and after
  every update and what each update applied (``OptimizerStateCallback``,
  which reads them at every ``optimizer.step()``; ``training_dynamics.json``)
  and ``lr_schedule.json`` (``write_lr_schedule``);
* ``trajectory_preconditioned/``: the same steps captured preconditioned by
  the optimizer (``HookManager(optimizer=...)``: each sample's Adam update
  direction, LESS's train side), a second manager on the same run;
* ``final_train/``: the training sentences' gradients at the final weights
  ``θ_T`` (one frozen pass, no update), for the single-checkpoint methods;
* ``queries/``: the query sentences' raw gradients at ``θ_T``;
* ``segment_<k>/``: the training sentences' gradients at the end of each
  earlier segment of the run (``--source-segments`` near-equal spans of
  epochs; the weights are copied at each end and captured after training by a
  frozen pass), for SOURCE, whose last segment reads ``final_train/``;
* ``snapshots/``: the parameters and the batch before every step of the WHOLE
  run (``TrajectorySnapshots``) and ``training_dynamics.json``, what every
  update applied from the optimizer's first (a ``TrainingDynamicsCallback`` on
  a third ``HookManager``, hooking one small layer, active in all epochs), for
  MAGIC, which replays the run from ``m = v = 0``.

Then every method is scored from those stores on the same queries (no model
needed), except the methods that capture for themselves, live on the final
model (their seconds include that capture):

* STRIDE reads no gradient: it fits its subset operators against the final
  model and measures the queries through it;
* TRAK needs each training sentence's ``1 − p`` from the training forward
  and the gradients of the margin, not of the loss;
* TrackStar divides each gradient by the trained AdamW's second moment
  (the tour's optimizer) before projecting it.

LoRIF reads the ``θ_T`` stores LoGRA-projected after the run (each factor of
every hooked layer to ``k``; training records at rank ``c``; the top ``r``
singular directions of each layer). MAGIC, the exact metagradient, replays
the whole run from its snapshots and scores the rows of the captured steps
(its seconds: the replay and the reverse sweep; the recording is in the
capture time). Like AdamW-influence it scores helpful sentences negative.

TRAK and TrackStar project every hooked layer to ``--proj-dim`` coordinates
(their curvatures are ``D × D`` per layer). The exact-Hessian influence
function scores ``lm_head`` only: it maps rows onto ``nn.Linear`` weights and
GPT-2's MLPs are HF ``Conv1D`` layers. One table is printed: seconds, peak
memory, and for how many queries the top proponent (the training sentence
with the most helpful score) shares the query's topic. Chance is about 1 in 5.

Every loss is a SUM over the batch of each sentence's mean token loss, so a
captured per-sample gradient is that sentence's own gradient (README, "Loss
reduction"); the trajectory methods, TrackStar and MAGIC are told so with
``loss_reduction="sum"`` (the tour does not clip: MAGIC's ``max_grad_norm=None``).

Run:  python examples/attribution/method_tour.py [--epochs 12 --captured-epochs 2 ...]
      (``--help`` lists the sizes: projection, SOURCE segments, CG iterations, ...)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_llm import (
    AdamWInfluenceAttributor,
    AttributionArguments,
    AttributionScore,
    AttributionTask,
    DataInfAttributor,
    DVEmbAttributor,
    EKFACAttributor,
    GradientRecord,
    GradientStorageManager,
    HookManagerConfig,
    InfluenceFunctionAttributor,
    KFACAttributor,
    LESSAttributor,
    LoRIFAttributor,
    MetagradientAttributor,
    SourceAttributor,
    StrideAttributor,
    StrideConfig,
    TracInAttributor,
    TrackStarAttributor,
    TrajectorySnapshots,
    TrajectoryTracInAttributor,
    TRAKAttributor,
    hash_sample,
    margin_and_weights,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quickstart import WordTokenizer, loss_fn, sentence_losses  # noqa: E402
from quickstart_corpus import CORPUS, QUERIES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tour_run import (  # noqa: E402
    HOOKED_LAYERS,
    Stores,
    Tour,
    make_model,
    segment_ends,
    train_and_capture,
)

# The exact-Hessian influence function maps stored rows onto nn.Linear weights only: GPT-2's
# MLPs are HF Conv1D layers, so it scores the output head (an nn.Linear) alone.
INFLUENCE_LAYER = "lm_head"
# AdamWInfluenceAttributor's rows are −qᵀW·push(g), ``push`` being the change of the
# optimizer state when the sample is REMOVED: a helpful sample scores NEGATIVE. Every
# other method scores helpful samples positive. Each score records its ``polarity``
# (-1 / +1) and ``score.top_k`` ranks by ``polarity * score``, so the tour asks every
# method for its top proponent the same way.


@dataclass(frozen=True)
class Row:
    """One line of the printed table."""

    method: str
    source: str
    seconds: float
    peak_mib: float
    hits: int
    num_queries: int

    @property
    def topic_match(self) -> str:
        """``"hits/queries"``, e.g. ``"8/10"``."""
        return f"{self.hits}/{self.num_queries}"


# ---------------------------------------------------------------------------- the methods
def arguments(tour: Tour, root: Path) -> AttributionArguments:
    """CPU scoring arguments with a throwaway output directory."""
    return AttributionArguments(
        output_dir=tempfile.mkdtemp(dir=root, prefix="scores_"), use_cpu=True, seed=tour.seed
    )


def grad_dot(stores: Stores, tour: Tour) -> AttributionScore:
    """``<g_i(θ_T), q(θ_T)>``."""
    attributor = TracInAttributor(arguments(tour, stores.root))
    return attributor.attribute_from_cache(stores.final_train, stores.queries)


def grad_cos(stores: Stores, tour: Tour) -> AttributionScore:
    """``cos(g_i(θ_T), q(θ_T))``."""
    attributor = TracInAttributor(arguments(tour, stores.root))
    return attributor.attribute_from_cache(stores.final_train, stores.queries, normalized_grad=True)


def tracin(stores: Stores, tour: Tour) -> AttributionScore:
    """``Σ_t η_t c_t <g_i(θ_t), q(θ_T)>`` over the captured steps (queries at ``θ_T`` only):
    trajectory TracIn, each update's learning rate and clip coefficient as recorded."""
    attributor = TrajectoryTracInAttributor(arguments(tour, stores.root))
    return attributor.attribute_from_cache(stores.trajectory, stores.queries)


def kronecker(cls: type) -> Callable[[Stores, Tour], AttributionScore]:
    """K-FAC / EK-FAC influence ``g_i(θ_T)ᵀ (F + λI)⁻¹ q(θ_T)``, Fisher of the training set."""

    def score(stores: Stores, tour: Tour) -> AttributionScore:
        attributor = cls(arguments(tour, stores.root))
        return attributor.attribute_from_cache(
            stores.final_train, stores.queries, damping=tour.damping, relative_damping=True
        )

    score.__doc__ = f"{cls.__name__} scores (relative damping)."
    return score


def less(stores: Stores, tour: Tour) -> AttributionScore:
    """``Σ_t η_t cos(Γ(z_i; θ_t), q(θ_T))``; ``η_t`` from ``lr_schedule.json``."""
    attributor = LESSAttributor(arguments(tour, stores.root))
    return attributor.attribute_from_cache(stores.preconditioned, stores.queries)


def adamw_influence(stores: Stores, tour: Tour) -> AttributionScore:
    """AdamW-influence through the recorded Adam dynamics (query-side sweep); polarity -1."""
    attributor = AdamWInfluenceAttributor(arguments(tour, stores.root))
    return attributor.attribute_from_cache(
        stores.trajectory,
        stores.queries,
        dynamics=stores.dynamics,
        loss_reduction="sum",
        propagation="test",
    )


def dvemb(stores: Stores, tour: Tour) -> AttributionScore:
    """DVEmb ``η_s qᵀ Π_k (I − η_k H_k) g`` (full Hessian, query-side sweep)."""
    attributor = DVEmbAttributor(arguments(tour, stores.root))
    return attributor.attribute_from_cache(
        stores.trajectory,
        stores.queries,
        propagation="test",
        hessian_mode="full",
        loss_reduction="sum",
        learning_rate=None,  # the recorded rates (training_dynamics.json)
    )


def stride(stores: Stores, tour: Tour) -> AttributionScore:
    """STRIDE: no gradients; ``K`` subset operators fitted against the model at ``θ_T`` (the
    sparsity rule's ``K``, ``d = 6``, rank 8, a short fit), then a Lasso per query."""
    config = StrideConfig(
        subsets_per_example=6, rank=8, steps=tour.stride_steps, learning_rate=1e-2, seed=tour.seed
    )
    attributor = StrideAttributor(
        arguments(tour, stores.root), task=AttributionTask(None, stores.model), config=config
    )
    return attributor.attribute(stores.train_set, stores.query_set)


def projected(tour: Tour) -> HookManagerConfig:
    """The tour's hooked layers, each gradient projected to ``proj_dim`` entries at capture."""
    projection = {
        "__default__": {"style": tour.projection, "proj_dim": tour.proj_dim, "proj_seed": tour.seed}
    }
    return HookManagerConfig(linear_io=HOOKED_LAYERS, projection_kwargs=projection)


def next_token_margins(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRAK's ``(f (B,), 1 − p (B,))`` of the batch's next tokens (padding not counted).

    The batches carry no ``labels`` (a sample's id is the hash of its inputs), so they are
    added here: the input ids, ``-100`` at padding.
    """
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return margin_and_weights(model, {**batch, "labels": labels})


def trak(stores: Stores, tour: Tour) -> AttributionScore:
    """TRAK at ``θ_T`` (one model, ``K = 1``): margin gradients, projected, ``(ΦᵀΦ + λI)⁻¹``
    per layer, ``1 − p`` weights; live (the weights come from the training forward)."""
    attributor = TRAKAttributor(
        arguments(tour, stores.root),
        task=AttributionTask(None, stores.model),
        output_func=next_token_margins,
    )
    return attributor.attribute(stores.train_set, stores.query_set, hook_config=projected(tour))


def trackstar(stores: Stores, tour: Tour) -> AttributionScore:
    """TrackStar: cosine of ``R^{-1/2} P (∇L ⊘ d)``, ``d`` from the trained AdamW's second
    moment; live (its captures divide by ``d`` before projecting)."""
    attributor = TrackStarAttributor(
        arguments(tour, stores.root),
        task=AttributionTask(loss_fn, stores.model),
        optimizer=stores.optimizer,
        loss_reduction="sum",
    )
    return attributor.attribute(stores.train_set, stores.query_set, hook_config=projected(tour))


def datainf(stores: Stores, tour: Tour) -> AttributionScore:
    """DataInf ``g_iᵀ H̃⁻¹ q`` at ``θ_T`` (per-layer averaged rank-one inverses, default λ)."""
    attributor = DataInfAttributor(arguments(tour, stores.root))
    return attributor.attribute_from_cache(stores.final_train, stores.queries)


def mean_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The batch's mean sentence loss (the summed loss over the batch size)."""
    return loss_fn(model, batch) / batch["input_ids"].shape[0]


def influence(stores: Stores, tour: Tour) -> AttributionScore:
    """``g_iᵀ (H + λI)⁻¹ q`` on ``lm_head`` only, ``H`` the exact Hessian of the mean training
    loss over its weights (CG with Hessian-vector products on the final model)."""
    head = stores.model.get_submodule(INFLUENCE_LAYER)
    attributor = InfluenceFunctionAttributor(
        arguments(tour, stores.root),
        task=AttributionTask(mean_loss, stores.model),
        hessian_batches=[torch.utils.data.default_collate(stores.train_set)],
        damping=tour.influence_damping,
        max_params=sum(p.numel() for p in head.parameters()),
        solver_options={"max_iter": tour.influence_iterations},
    )
    return attributor.attribute_from_cache(
        stores.final_train, stores.queries, layer_name=INFLUENCE_LAYER
    )


def source(stores: Stores, tour: Tour) -> AttributionScore:
    """SOURCE: EK-FAC per segment (relative damping), ``η̄_ℓ`` the segment's summed learning
    rates, training gradients at each segment end, queries at ``θ_T``."""
    attributor = SourceAttributor(
        arguments(tour, stores.root),
        segment_learning_rates=stores.segment_rates,
        damping=tour.damping,
        relative_damping=True,
    )
    return attributor.attribute_from_cache(stores.segments, stores.queries)


def logra_copy(source: Path, target: Path, tour: Tour, low_rank: int | None) -> Path:
    """``source``'s gradients LoGRA-projected post hoc (each factor of every hooked layer to
    ``lorif_k``, ``D = k²``) into a new store ``target``, its records at rank ``low_rank``
    (``None``: the projected factors as they are). Same seed, so both sides share the maps."""
    projection = {
        "__default__": {"style": "logra", "proj_dim": tour.lorif_k, "proj_seed": tour.seed}
    }
    origin = GradientStorageManager(str(source))
    store = GradientStorageManager(str(target), low_rank=low_rank)
    store.declare_projection(projection)
    for location in origin.locations():
        store.save_bulk(
            [
                GradientRecord(
                    r.step, r.input_hash, r.gradient.project(None, projection), r.sample_id_key
                )
                for r in origin.load_records(location)
            ]
        )
    return target


def lorif(stores: Stores, tour: Tour) -> AttributionScore:
    """LoRIF ``g_iᵀ(GᵀG/N + λI)⁻¹q`` at ``θ_T``: the ``θ_T`` stores LoGRA-projected to ``k``
    per factor, training records at rank ``c``, the top ``r`` singular directions of ``G``
    (per layer, default λ); its seconds include the projection of both stores."""
    work = Path(tempfile.mkdtemp(dir=stores.root, prefix="lorif_"))
    train = logra_copy(stores.final_train, work / "train", tour, low_rank=tour.lorif_c)
    queries = logra_copy(stores.queries, work / "queries", tour, low_rank=None)
    attributor = LoRIFAttributor(
        arguments(tour, stores.root), rank=tour.lorif_c, svd_rank=tour.lorif_r
    )
    return attributor.attribute_from_cache(train, queries)


def magic(stores: Stores, tour: Tour) -> AttributionScore:
    """MAGIC, the exact metagradient ``dL_q(θ_T)/dw_i`` through every AdamW update of the
    whole run (replayed from its snapshots, full Hessian, lr schedule and weight decay as
    recorded; no clip); the queries are data; polarity -1."""
    attributor = MetagradientAttributor(
        arguments(tour, stores.root),
        task=AttributionTask(loss_fn, stores.model),
        sample_loss_func=sentence_losses,
        sample_target_func=sentence_losses,
    )
    steps = TrajectorySnapshots(stores.snapshots).steps()
    return attributor.attribute_from_cache(
        stores.snapshots,
        stores.query_set,
        selected_training_steps=steps[-len(stores.lrs) :],  # the captured epochs' rows
        loss_reduction="sum",
        max_grad_norm=None,  # the tour does not clip
    )


@dataclass(frozen=True)
class Method:
    """A table entry: how to score and what it reads."""

    score: Callable[[Stores, Tour], AttributionScore]
    source: str


METHODS: dict[str, Method] = {
    "Grad-Dot": Method(grad_dot, "theta_T"),
    "Grad-Cos": Method(grad_cos, "theta_T"),
    "TracIn": Method(tracin, "trajectory"),
    "K-FAC": Method(kronecker(KFACAttributor), "theta_T"),
    "EK-FAC": Method(kronecker(EKFACAttributor), "theta_T"),
    "LoRIF": Method(lorif, "theta_T (LoGRA-projected)"),
    "LESS": Method(less, "trajectory (preconditioned)"),
    "AdamW-influence": Method(adamw_influence, "trajectory + Adam moments"),
    "DVEmb": Method(dvemb, "trajectory"),
    "STRIDE": Method(stride, "theta_T model (no gradients)"),
    "TRAK": Method(trak, "theta_T model (live)"),
    "TrackStar": Method(trackstar, "theta_T model + AdamW (live)"),
    "DataInf": Method(datainf, "theta_T"),
    "InfluenceFunc": Method(influence, "theta_T (lm_head only)"),
    "SOURCE": Method(source, "segment ends"),
    "MAGIC": Method(magic, "whole-run snapshots (replay)"),
}


# ---------------------------------------------------------------------------- measuring
def _rss_kib(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process in KiB (``None`` off Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Return freed heap to the OS, then reset the peak RSS to the current RSS (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: freed memory would hide new peaks
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _max_rss_kib() -> int:
    """``resource.getrusage`` peak RSS in KiB (macOS reports bytes, Linux KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


MEMORY_NOTE = (
    "peak MiB: rise of the process's peak resident set size during the scoring call "
    "(Linux VmHWM, reset before each method through /proc/self/clear_refs; elsewhere the "
    "resource.getrusage ru_maxrss delta, 0 when a method stays below an earlier peak)"
)


def measured(method: Method, stores: Stores, tour: Tour) -> tuple[AttributionScore, float, float]:
    """``(score, seconds, peak MiB)`` of one scoring call."""
    gc.collect()
    reset = _reset_peak_rss()
    before = _rss_kib("VmRSS") if reset else _max_rss_kib()
    start = time.perf_counter()
    score = method.score(stores, tour)
    seconds = time.perf_counter() - start
    after = _rss_kib("VmHWM") if reset else _max_rss_kib()
    return score, seconds, max(0, after - before) / 1024


def topic_hits(
    score: AttributionScore, topic_of: Mapping[str, str], queries: Sequence[tuple[str, str]]
) -> int:
    """Queries whose top proponent (largest ``polarity × score``) shares the query's topic."""
    # {query id: [(train id, score)]}: each query's most helpful sample, rows summed over steps.
    top = score.top_k(1, test_ids=[query_id for query_id, _ in queries])
    return sum(topic_of[top[query_id][0][0]] == topic for query_id, topic in queries)


def print_table(rows: list[Row], tour: Tour, capture_seconds: float) -> None:
    """The tour's table with its footnotes."""
    print(f"\n{'method':<16} {'scored from':<28} {'seconds':>8} {'peak MiB':>9}  same topic")
    for row in rows:
        print(
            f"{row.method:<16} {row.source:<28} {row.seconds:>8.2f} {row.peak_mib:>9.1f}"
            f"  {row.topic_match:>10}"
        )
    notes = [
        "same topic: queries whose top proponent (the most helpful training sentence, its rows "
        f"summed over the captured steps) shares the query's topic; chance is about "
        f"1/{len(CORPUS)}.",
        "AdamW-influence scores helpful sentences NEGATIVE (rows -q^T W push, push = the "
        "removal perturbation; its scores carry polarity -1): score.top_k ranks by "
        "polarity x score, so its top proponent is its most negative row.",
        "LESS: a sentence's Adam update direction is dominated by the momentum its whole batch "
        "shares, so the rows of one step barely differ and its top proponent follows the batch.",
        "theta_T: training gradients at the final weights; trajectory: the steps of the last "
        f"{tour.captured_epochs} of {tour.epochs} epochs; queries at the final weights.",
        f"seconds: scoring from the stores only (training + the one capture, SOURCE's "
        f"segment stores and MAGIC's recording included: {capture_seconds:.1f} s); CPU, "
        f"{torch.get_num_threads()} torch thread(s). STRIDE's seconds are its whole run: the "
        f"operator fit ({tour.stride_steps} steps) against the final model, the query "
        "measurement and the Lasso. TRAK's and TrackStar's include their own capture (a "
        "forward and backward of every sentence per pass).",
        f"TRAK: one model (theta_T, K = 1), margin gradients; TRAK and TrackStar: every hooked "
        f"layer projected to {tour.proj_dim} coordinates ({tour.projection} projection).",
        f"InfluenceFunc: lm_head only (the exact Hessian maps rows onto nn.Linear weights; "
        f"GPT-2's MLPs are Conv1D), H = the Hessian of the mean training loss, "
        f"{tour.influence_iterations} CG iterations, damping {tour.influence_damping:g}.",
        f"SOURCE: {tour.source_segments} segment(s) ending at epochs "
        f"{segment_ends(tour)}; per segment EK-FAC at its end and eta-bar = its steps' summed "
        "learning rates (AdamW's rates, read as SGD step sizes).",
        f"LoRIF: k = {tour.lorif_k} per factor, c = {tour.lorif_c}, r = {tour.lorif_r}: the "
        "theta_T stores LoGRA-projected after the run (each layer's two factors to k, "
        "D = k^2 per layer), training records at rank c, the top r singular directions of "
        "each layer's training matrix, damping 0.1 x the layer's mean eigenvalue; its "
        "seconds include projecting both stores.",
        "MAGIC: the exact metagradient dL_q(theta_T)/dw_i through every AdamW update of the "
        "whole run, replayed from the first (full Hessian, the recorded learning rates and "
        "weight decay, no clip; polarity -1 like AdamW-influence). Rows of the captured steps "
        "only: the reverse sweep stops at the earliest. Its seconds are the replay and the "
        "reverse sweep; recording (the parameters and batch before every step, every update "
        "through a HookManager on one small layer) is in the capture time. Its rows grow "
        "going back through the updates, so their sum follows the earliest captured steps.",
        MEMORY_NOTE + ".",
    ]
    print("\n" + "\n".join(f"* {note}" for note in notes))


# ---------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> Tour:
    """The :class:`Tour` from the command line."""
    default = Tour()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=default.epochs)
    parser.add_argument("--captured-epochs", type=int, default=default.captured_epochs)
    parser.add_argument("--queries", type=int, default=default.num_queries)
    parser.add_argument("--n-embd", type=int, default=default.n_embd)
    parser.add_argument("--stride-steps", type=int, default=default.stride_steps)
    parser.add_argument("--proj-dim", type=int, default=default.proj_dim)
    parser.add_argument("--projection", choices=("mask", "dense"), default=default.projection)
    parser.add_argument("--source-segments", type=int, default=default.source_segments)
    parser.add_argument("--influence-iterations", type=int, default=default.influence_iterations)
    parser.add_argument("--lorif-k", type=int, default=default.lorif_k)
    parser.add_argument("--lorif-svd-rank", type=int, default=default.lorif_r)
    args = parser.parse_args(argv)
    if not 1 <= args.captured_epochs <= args.epochs:
        parser.error("--captured-epochs must be between 1 and --epochs")
    if not 1 <= args.source_segments <= args.epochs:
        parser.error("--source-segments must be between 1 and --epochs (one checkpoint each)")
    if min(args.proj_dim, args.influence_iterations, args.lorif_k, args.lorif_svd_rank) < 1:
        parser.error("--proj-dim, --influence-iterations, --lorif-k, --lorif-svd-rank must be >= 1")
    if not 1 <= args.queries <= len(QUERIES):
        parser.error(f"--queries must be between 1 and {len(QUERIES)}")
    return Tour(
        epochs=args.epochs,
        captured_epochs=args.captured_epochs,
        num_queries=args.queries,
        n_embd=args.n_embd,
        stride_steps=args.stride_steps,
        proj_dim=args.proj_dim,
        projection=args.projection,
        source_segments=args.source_segments,
        influence_iterations=args.influence_iterations,
        lorif_k=args.lorif_k,
        lorif_r=args.lorif_svd_rank,
    )


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Train and capture once, score every method, print the table; return its rows."""
    tour = parse_args(argv)
    torch.set_num_threads(1)  # a model this small runs fastest (and reproducibly) on one thread
    pairs = [(topic, s) for topic, sentences in CORPUS.items() for s in sentences]
    queries = QUERIES[: tour.num_queries]
    tokenizer = WordTokenizer([s for _, s in pairs] + [q for _, q in QUERIES])
    train_set = [tokenizer.encode(s) for _, s in pairs]
    query_set = [tokenizer.encode(q) for _, q in queries]
    # Samples are keyed by the content hash of the model inputs.
    topic_of = {hash_sample(x): topic for x, (topic, _) in zip(train_set, pairs)}
    query_topics = [(hash_sample(q), topic) for q, (topic, _) in zip(query_set, queries)]

    model = make_model(tour, len(tokenizer.vocab) + 1)
    print(
        f"{len(train_set)} training sentences in {len(CORPUS)} topics, {len(queries)} queries; "
        f"{tour.epochs} epochs, the last {tour.captured_epochs} captured"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="method_tour_") as work:
        start = time.perf_counter()
        stores = train_and_capture(model, train_set, query_set, tour, Path(work))
        capture_seconds = time.perf_counter() - start
        for name, method in METHODS.items():
            score, seconds, peak = measured(method, stores, tour)
            hits = topic_hits(score, topic_of, query_topics)
            rows.append(Row(name, method.source, seconds, peak, hits, len(queries)))
    print_table(rows, tour, capture_seconds)
    return rows


if __name__ == "__main__":
    main()

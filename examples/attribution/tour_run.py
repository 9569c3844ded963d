"""The method tour's run: its sizes (``Tour``), the tiny GPT-2, and the ONE captured training run.

``train_and_capture`` trains with AdamW and writes every store the tour's methods read
(``Stores``); ``method_tour.py`` scores them. See that script's docstring for what each
store holds.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerStateCallback,
    TrainingDynamicsCallback,
    TrajectorySnapshots,
)
from dattri_llm.attribution.utils import write_lr_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quickstart import MAX_LEN, loss_fn  # noqa: E402
from quickstart_corpus import QUERIES  # noqa: E402

# Hooked (and scored) layers: the MLPs of the transformer blocks and the output head.
HOOKED_LAYERS = [r"\.mlp\.", r"^lm_head$"]
# The metagradient's record of every update: a HookManager on this one small layer only lets
# a TrainingDynamicsCallback see each backward of the whole run (it captures nothing else).
DYNAMICS_LAYER = r"^transformer\.h\.0\.attn\.c_proj$"


@dataclass(frozen=True)
class Tour:
    """Sizes and hyperparameters of the run."""

    epochs: int = 12
    captured_epochs: int = 2
    num_queries: int = len(QUERIES)
    n_embd: int = 64
    batch_size: int = 16
    learning_rate: float = 1e-2
    weight_decay: float = 0.01
    damping: float = 0.1  # K-FAC / EK-FAC: relative to the mean eigenvalue
    stride_steps: int = 100  # STRIDE's operator fit
    proj_dim: int = 256  # TRAK / TrackStar: each hooked layer's gradient projected to this size
    # "mask" keeps proj_dim random coordinates; "dense" (a Gaussian matrix, TRAK's choice) was
    # 6-14x slower on this model, with ~1 GB peak memory at --n-embd 32
    projection: str = "mask"
    source_segments: int = 3  # SOURCE: segments of the whole run, a checkpoint at each end
    # exact-Hessian influence: λ of (H + λI) and the conjugate-gradient iterations; at the
    # default size 30 iterations come within 0.4% of a 120-iteration solve (16% at λ = 1e-3)
    influence_damping: float = 1e-2
    influence_iterations: int = 30
    # LoRIF: each factor LoGRA-projected to k (D = k² per layer), training records stored at
    # rank c, the top r singular directions of each layer's training matrix kept
    lorif_k: int = 32
    lorif_c: int = 1
    lorif_r: int = 64
    seed: int = 0


@dataclass
class Stores:
    """The captured run: store directories, the Adam dynamics and the per-step learning rates;
    the final model, its optimizer and the raw sentences for the live methods (STRIDE, TRAK,
    TrackStar); SOURCE's summed learning rate per segment."""

    root: Path
    dynamics: Mapping[int, dict]
    lrs: dict[int, float]
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    train_set: list[dict] | None = None
    query_set: list[dict] | None = None
    segment_rates: list[float] = field(default_factory=list)

    @property
    def trajectory(self) -> Path:
        """Raw per-sample gradients of every captured step."""
        return self.root / "trajectory"

    @property
    def preconditioned(self) -> Path:
        """Per-sample Adam update directions of the same steps."""
        return self.root / "trajectory_preconditioned"

    @property
    def final_train(self) -> Path:
        """Training-sentence gradients at ``θ_T``."""
        return self.root / "final_train"

    @property
    def queries(self) -> Path:
        """Query gradients at ``θ_T``."""
        return self.root / "queries"

    @property
    def snapshots(self) -> Path:
        """The whole run's parameters and batch before every step, with
        ``training_dynamics.json`` (every update), for the metagradient's replay."""
        return self.root / "snapshots"

    @property
    def segments(self) -> list[Path]:
        """SOURCE's training stores, one per segment end; the last is ``final_train`` (θ_T)."""
        earlier = [self.root / f"segment_{k}" for k in range(len(self.segment_rates) - 1)]
        return [*earlier, self.final_train]


# ---------------------------------------------------------------------------- model and data
def make_model(tour: Tour, vocab_size: int) -> GPT2LMHeadModel:
    """A two-block GPT-2 from a config: untied head, no dropout."""
    torch.manual_seed(tour.seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=MAX_LEN,
        n_embd=tour.n_embd,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def offloading(model: torch.nn.Module, directory: Path, **kwargs) -> HookManager:
    """A ``HookManager`` writing every backward's per-sample gradients to a fresh store."""
    store = GradientStorageManager(str(directory))
    offload = OffloadCallback(offload_interval=1, file_manager=store, recording_type="per_sample")
    config = HookManagerConfig(linear_io=HOOKED_LAYERS)
    return HookManager(model, config=config, callbacks=[offload], **kwargs)


def frozen_pass(model: torch.nn.Module, samples: list[dict], store: Path, batch_size: int) -> None:
    """Capture the gradients of ``samples`` at the current weights into ``store`` (no update)."""
    model.eval()
    with offloading(model, store).collect(deregister_on_exit=True):
        for start in range(0, len(samples), batch_size):
            batch = torch.utils.data.default_collate(samples[start : start + batch_size])
            loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    model.train()


# ---------------------------------------------------------------------------- the captured run
def train_and_capture(
    model: torch.nn.Module,
    train_set: list[dict],
    query_set: list[dict],
    tour: Tour,
    root: Path,
) -> Stores:
    """Train with AdamW (linearly decaying lr); capture the last epochs and ``θ_T``; record
    the whole run's snapshots and updates (the metagradient replays it from the first)."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=tour.learning_rate, weight_decay=tour.weight_decay
    )
    loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=tour.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(tour.seed),
    )
    total = tour.epochs * len(loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 - 0.9 * t / total)
    stores = Stores(root=root, dynamics={}, lrs={})
    ends = segment_ends(tour)
    step_lrs: list[float] = []  # every step's learning rate, for SOURCE's segment sums
    snapshots: list[dict] = []  # the weights at every segment end but the last (θ_T)
    replay = TrajectorySnapshots(stores.snapshots)
    updates = TrainingDynamicsCallback(model, optimizer)
    whole_run = HookManager(
        model, config=HookManagerConfig(linear_io=[DYNAMICS_LAYER]), callbacks=[updates]
    )

    def one_epoch(after_step: Callable[[], None] = lambda: None) -> None:
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            replay.save_parameters(len(step_lrs), model)  # θ_t before the step's backward
            replay.save_batch(len(step_lrs), batch)
            loss_fn(model, batch).backward()  # summed loss
            optimizer.step()
            step_lrs.append(optimizer.param_groups[0]["lr"])
            after_step()
            schedule.step()
        if len(step_lrs) // len(loader) in ends[:-1]:
            snapshots.append(copy.deepcopy(model.state_dict()))

    raw = offloading(model, stores.trajectory)
    states = OptimizerStateCallback(model, optimizer)
    raw.add_callback(states)
    preconditioned = offloading(model, stores.preconditioned, optimizer=optimizer)

    def record_step() -> None:
        step = raw.steps_collected - 1  # the step the backward just completed
        stores.lrs[step] = optimizer.param_groups[0]["lr"]

    model.train()
    with whole_run.collect(deregister_on_exit=True):  # every update, from the first
        for _ in range(tour.epochs - tour.captured_epochs):
            one_epoch()
        with raw.collect(deregister_on_exit=True), preconditioned.collect(deregister_on_exit=True):
            for _ in range(tour.captured_epochs):
                one_epoch(record_step)
    updates.save(stores.snapshots)  # training_dynamics.json beside the snapshots
    for directory in (stores.trajectory, stores.preconditioned):
        write_lr_schedule(directory, stores.lrs)
    states.save(stores.trajectory)
    stores.dynamics = states.dynamics()

    frozen_pass(model, train_set, stores.final_train, tour.batch_size)
    frozen_pass(model, query_set, stores.queries, len(query_set))
    stores.segment_rates = summed_rates(step_lrs, ends, len(loader))
    capture_segments(model, snapshots, train_set, stores, tour.batch_size)
    stores.model, stores.optimizer = model.eval(), optimizer
    stores.train_set, stores.query_set = train_set, query_set
    return stores


def segment_ends(tour: Tour) -> list[int]:
    """SOURCE's segment ends (in epochs): ``source_segments`` near-equal spans of the run."""
    count = tour.source_segments
    return [round((k + 1) * tour.epochs / count) for k in range(count)]


def summed_rates(step_lrs: list[float], ends: list[int], steps_per_epoch: int) -> list[float]:
    """``η̄_ℓ`` per segment: the sum of the learning rates of its steps."""
    bounds = [end * steps_per_epoch for end in ends]
    return [sum(step_lrs[start:stop]) for start, stop in zip([0, *bounds], bounds)]


def capture_segments(
    model: torch.nn.Module,
    snapshots: list[dict],
    train_set: list[dict],
    stores: Stores,
    batch_size: int,
) -> None:
    """The training gradients at each earlier segment end (a frozen pass on a copy of the model)."""
    replica = copy.deepcopy(model)
    for state, directory in zip(snapshots, stores.segments[:-1], strict=True):
        replica.load_state_dict(state)
        frozen_pass(replica, train_set, directory, batch_size)

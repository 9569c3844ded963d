"""The look-ahead selection experiment's setting: data sources, mixtures, pool, target, model,
training loop and the online selection callback (used by ``lookahead.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    DataSelectionCallback,
    HookManager,
    HookManagerConfig,
)

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

"""Shared pieces of the ``torchrun`` examples: process group, tiny model, data, scoring.

The training loop itself lives in each script (``ddp.py``, ``fsdp1.py``,
``fsdp2.py``): it is the user's own loop, untouched by the capture.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
    hash_sample,
)

VOCAB, SEQ, N_TRAIN, BATCH, EPOCHS = 97, 12, 32, 4, 2

# Every eligible layer except the position embedding (its gradient is shared by the batch).
CAPTURE = HookManagerConfig(linear_io=[r"^(?!transformer\.wpe$)"])


def start() -> tuple[int, torch.device]:
    """Join the ``torchrun`` process group: NCCL on GPUs, gloo on CPU; ``(rank, device)``."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), device


def store_dir() -> Path:
    """The shared store root: the first argument, else ``./distributed_grads``."""
    return Path(sys.argv[1] if len(sys.argv) > 1 else "distributed_grads")


def build_model() -> GPT2LMHeadModel:
    """A tiny GPT-2 from a config (no download), identical on every rank."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train_ids() -> torch.Tensor:
    """``(N_TRAIN, SEQ)`` token ids (the same on every rank)."""
    return torch.randint(1, VOCAB, (N_TRAIN, SEQ), generator=torch.Generator().manual_seed(1))


def my_batches(rank: int, epoch: int) -> DataLoader:
    """This rank's batches of ``epoch`` (a ``DistributedSampler`` shard, as usual)."""
    data = train_ids()
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=rank, seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(data, batch_size=BATCH, sampler=sampler)


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Sum of per-sample mean losses: each captured gradient is that sample's own."""
    return model(input_ids=ids, labels=ids).loss * len(ids)


def capture_store(rank: int) -> tuple[GradientStorageManager, list[OffloadCallback]]:
    """The one store every rank writes (rank ``r`` into ``rank_<r>/``) and its callback."""
    store = GradientStorageManager(store_dir() / "train")
    return store, [OffloadCallback(offload_interval=1, file_manager=store)]


def score_on_rank_0(rank: int, device: torch.device) -> None:
    """After every rank has written, leave the group; rank 0 captures two queries and scores.

    The queries are captured outside the process group, so they go to the root of
    their own store: a store written by rank 0 alone *inside* a 2-rank group would
    record a world size of 2 and be refused as missing rank 1's shard.
    """
    dist.barrier()  # every rank's groups are indexed before anyone reads
    dist.destroy_process_group()
    if rank != 0:
        return
    model = build_model().to(device)  # queries at the initial weights θ_0
    queries = torch.stack([train_ids()[5], torch.randint(1, VOCAB, (SEQ,))]).to(device)
    test = GradientStorageManager(store_dir() / "test")
    with HookManager(model, CAPTURE, [OffloadCallback(1, test)]).collect(deregister_on_exit=True):
        loss_fn(model, queries).backward()
    args = AttributionArguments(output_dir=str(store_dir() / "scores"), use_cpu=True)
    score = TracInAttributor(args).attribute_from_cache(store_dir() / "train", test.save_dir)
    ids, matrix = score.agnostic_matrix()  # (num_train, num_test), summed over steps
    train = GradientStorageManager(store_dir() / "train")
    print(f"ranks wrote {sorted(p.name for p in train.save_dir.glob('rank_*'))}")
    print(f"steps {train.available_steps()}, scores (num_train, num_test) {tuple(matrix.shape)}")
    top = ids[int(matrix[:, 0].argmax())]
    print(f"query 0 is train row 5; its top proponent is {'row 5' if top == row_id(5) else top}")


def row_id(row: int) -> str:
    """Store identifier of training row ``row`` (content hash of the forward's inputs)."""
    ids = train_ids()[row]
    return hash_sample({"input_ids": ids, "labels": ids})

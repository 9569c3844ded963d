"""Fork worker and single-process replay for the DDP / FSDP1 / FSDP2 capture tests (gloo, CPU).

Every rank trains ``BlockNet`` with its own SGD loop on its ``DistributedSampler``
shard (``shuffle=False``: rank ``r`` gets rows ``r, r + W, ...``) in batches of
``BATCH``, captures with a ``HookManager`` + ``OffloadCallback`` into one store
(``rank_<r>/`` per rank). Each *wrap* puts the model under one data-parallel
wrapper the way a user would; the *uneven* variant makes rank 1 skip the ``side``
layer at every step (DDP and FSDP1: FSDP2's reduce-scatter aborts when the ranks'
gradients differ in which parameters they cover) and, under DDP, run one extra
batch under ``no_sync()``.

`capture_reference` replays the same run in one process: the update is SGD with
``LR / WORLD`` on the summed sum-loss gradient of the ranks' batches (what
DDP's and FSDP's rank averaging apply), each rank's batch its own forward when
ranks differ, else one forward of the global batch.
"""

from __future__ import annotations

import torch
from ddp_capture_helpers import BATCH, LR, N_SAMPLES, STEPS, WORLD, rank_rows, step_rows
from torch import nn

WRAPS = ("ddp", "fsdp1", "fsdp2")
EXTRA_BATCH_RANK = 1
EXTRA_ROWS = list(range(N_SAMPLES, N_SAMPLES + BATCH))  # rank 1's extra batch (uneven DDP)
LAYERS = ("inp", "blocks.0.fc", "blocks.0.ln", "blocks.1.fc", "blocks.1.ln", "side", "head")


class Block(nn.Module):
    """``LayerNorm(tanh(Linear(x)))`` on ``(B, T, 8)``: the FSDP wrapping unit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, 8) -> (B, T, 8)``."""
        return self.ln(torch.tanh(self.fc(x)))


class BlockNet(nn.Module):
    """``(B, T, 4) -> (B, T, 3)``: input projection, two blocks, an optional ``side`` layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.use_side = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``side`` is added only while ``use_side`` is set (a layer a rank may skip)."""
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if self.use_side:
            h = h + torch.tanh(self.side(h))
        return self.head(h)


def build() -> BlockNet:
    """The seeded initial model (identical on every rank and in the replay)."""
    torch.manual_seed(0)
    return BlockNet()


def data() -> torch.Tensor:
    """``(N_SAMPLES + BATCH, 3, 4)`` rows: the training set plus rank 1's extra batch."""
    return torch.randn(N_SAMPLES + BATCH, 3, 4, generator=torch.Generator().manual_seed(1))


def queries() -> torch.Tensor:
    """``(3, 3, 4)`` query rows."""
    return torch.randn(3, 3, 4, generator=torch.Generator().manual_seed(2))


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Sum loss: every sample's gradient is its own."""
    return model(batch).pow(2).sum()


def uses_side(rank: int, uneven: bool) -> bool:
    """Whether ``rank`` runs the ``side`` layer (rank 1 skips it in the uneven run)."""
    return not uneven or rank == 0


def has_extra_batch(wrap: str, uneven: bool) -> bool:
    """Rank 1 runs an extra batch only in the uneven DDP run (FSDP forwards are collective)."""
    return uneven and wrap == "ddp"


def hook_config():
    """Every linear_io-capable layer of `BlockNet`."""
    from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig

    return HookManagerConfig(linear_io=REGISTER_ALL)


def _wrap(net: BlockNet, wrap: str, uneven: bool) -> nn.Module:
    """``net`` under DDP, FSDP1 (auto-wrapping each `Block`) or FSDP2 (``fully_shard``)."""
    if wrap == "ddp":
        return nn.parallel.DistributedDataParallel(net, find_unused_parameters=uneven)
    if wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block)
    return fully_shard(net)


def capture_worker(rank: int, wrap: str, uneven: bool, init_method: str, store_dir: str) -> None:
    """One rank: wrap `BlockNet`, hook it, train ``STEPS`` SGD steps on its shard, capture."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.storage_manager import GradientStorageManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        rows = data()[:N_SAMPLES]
        sampler = DistributedSampler(rows, num_replicas=WORLD, rank=rank, shuffle=False)
        batches = list(DataLoader(rows, batch_size=BATCH, sampler=sampler))
        net = build()
        net.use_side = uses_side(rank, uneven)
        store = GradientStorageManager(store_dir)
        callbacks = [OffloadCallback(1, store)]
        # FSDP1 flattens the parameters: hook the plain model before wrapping it.
        manager = HookManager(net, hook_config(), callbacks) if wrap == "fsdp1" else None
        model = _wrap(net, wrap, uneven)
        manager = manager or HookManager(model, hook_config(), callbacks)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        with manager.collect(deregister_on_exit=True):
            for batch in batches:
                optimizer.zero_grad(set_to_none=True)
                loss(model, batch).backward()
                optimizer.step()
            if has_extra_batch(wrap, uneven) and rank == EXTRA_BATCH_RANK:
                with model.no_sync():  # e.g. a remainder batch only this rank has
                    loss(model, data()[EXTRA_ROWS]).backward()
    finally:
        dist.destroy_process_group()


def capture_reference(store_dir: str, wrap: str, uneven: bool) -> None:
    """The same run replayed in one process into ``store_dir`` (see the module docstring).

    Every forward is captured in its own ``collect()`` so that it is its own group,
    as each rank's record is in the merged store (records of one step written
    together would be read back concatenated, which needs equal layer sets).
    """
    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.storage_manager import GradientStorageManager

    net, rows = build(), data()
    store = GradientStorageManager(store_dir)
    manager = HookManager(net, hook_config(), callbacks=[OffloadCallback(1, store)])
    optimizer = torch.optim.SGD(net.parameters(), lr=LR / WORLD)

    def capture(batch: torch.Tensor, step: int, use_side: bool) -> None:
        manager.reset_steps(step)
        net.use_side = use_side
        with manager.collect():  # gradients accumulate over the ranks' forwards
            loss(net, batch).backward()

    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        if uneven:
            for rank in range(WORLD):
                capture(rows[rank_rows(rank, step)], step, uses_side(rank, uneven))
        else:
            capture(rows[step_rows(step)], step, True)
        optimizer.step()
    if has_extra_batch(wrap, uneven):
        capture(rows[EXTRA_ROWS], STEPS, uses_side(EXTRA_BATCH_RANK, uneven))
    manager.remove()


def capture_queries(store_dir: str) -> None:
    """Query gradients at the initial parameters (single process, every layer)."""
    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.storage_manager import GradientStorageManager

    net = build()
    store = GradientStorageManager(store_dir)
    with HookManager(net, hook_config(), [OffloadCallback(1, store)]).collect(
        deregister_on_exit=True
    ):
        loss(net, queries()).backward()

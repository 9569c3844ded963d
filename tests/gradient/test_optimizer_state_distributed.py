"""Optimizer-aware capture under DDP, FSDP1 and FSDP2 (2 gloo processes on CPU).

Each rank trains ``Net`` for ``STEPS`` AdamW steps on its own batches with a
``HookManager(optimizer=...)`` (preconditioned capture: a ``"mask"`` layer and
unprojected layers) and an ``OptimizerStateCallback`` (pre/post Adam moments,
``record_post`` after every step). The single-process replay runs every rank's
batch as its own backward (the same shapes, so the same per-sample arithmetic),
divides the summed gradient by ``WORLD`` (what the wrappers' averaging applies)
and steps once. Every capture and every pre/post moment must be bit-for-bit
equal (``torch.equal``): the ranks' averaged gradients equal the replay's
(halving is exact), AdamW is elementwise so a shard updates like the same
slice of the whole tensor, and the sharded reads move values without
arithmetic (an all-gather, or a sum with ``-0.0`` everywhere else).

FSDP1 with ``use_orig_params=False`` is refused with ``NotImplementedError``
naming ``use_orig_params=True``, at construction when the wrapper is given and
at the first forward when the plain model was hooked before wrapping.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from free_port import free_port
from torch import nn

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.optimizer_state_callback import OptimizerStateCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager

WORLD, BATCH, STEPS = 2, 2, 3
RUNS = ("ddp", "fsdp1", "fsdp1_prewrap", "fsdp2")
LAYERS = ("emb", "blocks.0.fc", "blocks.0.ln", "blocks.1.fc", "blocks.1.ln", "head")
PROJECTION = {"blocks.0.fc": {"style": "mask", "proj_dim": 10, "proj_seed": 3}}
ADAMW = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


class Block(nn.Module):
    """``LayerNorm(tanh(Linear(x)))``: the FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(torch.tanh(self.fc(x)))


class Net(nn.Module):
    """Embedding → two blocks → Linear without bias, on ``(B, T)`` ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(
        0, 11, (BATCH, 5), generator=torch.Generator().manual_seed(10 * step + rank)
    )


def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).pow(2).sum()


def projection(run: str = "") -> dict[str, dict]:
    """``PROJECTION`` under the names the run's manager reports (FSDP1 wrapper segments)."""
    if run != "fsdp1":
        return PROJECTION
    return {name.replace("0.", "0._fsdp_wrapped_module."): c for name, c in PROJECTION.items()}


def config(run: str = "") -> HookManagerConfig:
    return HookManagerConfig(linear_io=REGISTER_ALL, projection_kwargs=projection(run))


class Keep(HookManagerCallback):
    """Every record's captures, in order: ``[{layer: (B, k)}, ...]``."""

    def __init__(self) -> None:
        self.captures: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, record) -> None:
        data = record.gradient.data
        self.captures.append({plain(name): value.clone() for name, value in data.items()})


def plain(name: str) -> str:
    """A layer name without FSDP1's wrapper segments (a manager built on the wrapper)."""
    return name.replace("_fsdp_wrapped_module.", "")


def _wrap(net: Net, run: str) -> nn.Module:
    if run == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    if run.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            net,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block)
    return fully_shard(net)


def _train(rank: int, run: str) -> dict:
    """One run on this rank: wrap, hook, ``STEPS`` AdamW steps; what it captured and read."""
    net = build()
    holder: list[torch.optim.Optimizer] = []
    if run == "fsdp1_prewrap":  # hook the plain model, wrap it afterwards
        keep, moments = Keep(), OptimizerStateCallback(net, lambda: holder[0], **_osc())
        manager = HookManager(net, config(), [keep, moments], optimizer=lambda: holder[0])
        model = _wrap(net, run)
    else:
        model = _wrap(net, run)
        keep, moments = Keep(), OptimizerStateCallback(model, lambda: holder[0], **_osc(run))
        manager = HookManager(model, config(run), [keep, moments], optimizer=lambda: holder[0])
    holder.append(torch.optim.AdamW(model.parameters(), **ADAMW))
    optimizer = holder[0]
    sharded = False
    with manager.collect(deregister_on_exit=True):
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss(model, batch(step, rank)).backward()
            optimizer.step()
            moments.record_post(step)
            sharded |= any(
                _local(p).numel() != q.numel()
                for p, q in zip(model.parameters(), build().parameters(), strict=True)
            )
    snapshot = moments.snapshot
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {
        "shapes": {n: snapshot.shapes(n) for n in LAYERS},
        "held": all(id(p) in held for n in LAYERS for _, p in snapshot.parameters(n)),
        "captures": keep.captures,
        "pre": _plain_entries(moments.pre),
        "post": _plain_entries(moments.post),
        "sharded": sharded,
        "wrapper": type(model).__name__,
    }


def _plain_entries(entries: dict[int, dict]) -> dict[int, dict]:
    return {
        step: {**entry, "moments": {plain(n): m for n, m in entry["moments"].items()}}
        for step, entry in entries.items()
    }


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a parameter (a DTensor's local shard)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _osc(run: str = "") -> dict:
    return {"projection_kwargs": projection(run)}


def _refusals() -> dict[str, str]:
    """FSDP1 ``use_orig_params=False``: the errors at construction and at the first forward."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    messages = {}
    fsdp = FullyShardedDataParallel(build(), device_id=torch.device("cpu"), use_orig_params=False)
    optimizer = torch.optim.AdamW(fsdp.parameters())
    for label, make in (
        ("manager", lambda: HookManager(fsdp, config(), optimizer=optimizer)),
        ("callback", lambda: OptimizerStateCallback(fsdp, optimizer).snapshot),
    ):
        try:
            make()
        except NotImplementedError as err:
            messages[label] = str(err)
    net = build()
    holder: list[torch.optim.Optimizer] = []
    manager = HookManager(net, config(), optimizer=lambda: holder[0])
    fsdp = FullyShardedDataParallel(net, device_id=torch.device("cpu"), use_orig_params=False)
    holder.append(torch.optim.AdamW(fsdp.parameters()))
    with manager.collect(deregister_on_exit=True):
        try:
            loss(fsdp, batch(0, 0))
        except NotImplementedError as err:
            messages["forward"] = str(err)
    return messages


def worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # FSDP on CPU / gloo warns about its device
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        results = {run: _train(rank, run) for run in RUNS}
        results["refusals"] = _refusals()
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def replay() -> dict:
    """The single-process run: per step, each rank's batch its own backward, one update."""
    net = build()
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
    keep, moments = Keep(), OptimizerStateCallback(net, optimizer, **_osc())
    manager = HookManager(net, config(), [keep, moments], optimizer=optimizer)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for rank in range(WORLD):
            manager.reset_steps(step)  # both backwards are records of step `step`
            with manager.collect():
                loss(net, batch(step, rank)).backward()
        for p in net.parameters():
            p.grad /= WORLD
        optimizer.step()
        moments.record_post(step)
    manager.remove()
    captures = {(s, r): keep.captures[s * WORLD + r] for s in range(STEPS) for r in range(WORLD)}
    return {"captures": captures, "pre": moments.pre, "post": moments.post}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.distributed.fsdp  # noqa: F401  (imported before the fork, not in each rank)

    out = tmp_path_factory.mktemp("optimizer_state_distributed")
    mp.start_processes(
        worker,
        args=(f"tcp://127.0.0.1:{free_port()}", str(out)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return ranks, replay()


@pytest.mark.parametrize("run", RUNS)
def test_preconditioned_capture_equals_single_process(results, run):
    ranks, reference = results
    expected_wrapper = {"ddp": "DistributedDataParallel", "fsdp2": "FSDPNet"}
    for rank, result in enumerate(ranks):
        got = result[run]
        assert got["wrapper"] == expected_wrapper.get(run, "FullyShardedDataParallel")
        assert got["sharded"] == (run != "ddp"), "FSDP must hold parameter shards"
        assert got["held"], "parameters() are the ones the optimizer holds"
        full = build()
        for name in LAYERS:
            module = full.get_submodule(name)
            want = [(r, p.shape) for r, p in module.named_parameters()]
            assert got["shapes"][name] == want, name
        assert len(got["captures"]) == STEPS
        for step, captures in enumerate(got["captures"]):
            assert sorted(captures) == sorted(LAYERS)
            for name in LAYERS:
                want = reference["captures"][(step, rank)][name]
                assert captures[name].shape == want.shape
                assert torch.equal(captures[name], want), (run, rank, step, name)
        assert reference["captures"][(0, rank)]["blocks.0.fc"].shape == (BATCH, 10)


@pytest.mark.parametrize("run", RUNS)
def test_optimizer_state_callback_moments_equal_single_process(results, run):
    ranks, reference = results
    for result in ranks:
        got = result[run]
        for side in ("pre", "post"):
            assert sorted(got[side]) == list(range(STEPS))
            for step in range(STEPS):
                entry, want = got[side][step], reference[side][step]
                for key in ("step", "lr", "betas", "eps", "weight_decay"):
                    assert entry[key] == want[key], (run, side, step, key)
                assert sorted(entry["moments"]) == sorted(LAYERS)
                for name in LAYERS:
                    for a, b in zip(entry["moments"][name], want["moments"][name], strict=True):
                        assert torch.equal(a, b), (run, side, step, name)
    # the moments moved: post differs from pre, and the first pre is all zeros
    first = reference["pre"][0]["moments"]["blocks.1.fc"][0]
    assert torch.equal(first, torch.zeros_like(first))
    assert not torch.equal(reference["post"][0]["moments"]["blocks.1.fc"][0], first)


def test_fsdp1_without_orig_params_is_refused(results):
    ranks, _ = results
    for result in ranks:
        messages = result["refusals"]
        assert sorted(messages) == ["callback", "forward", "manager"]
        for message in messages.values():
            assert "use_orig_params=True" in message

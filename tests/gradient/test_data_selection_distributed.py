"""DataSelectionCallback under DDP and FSDP1 (2 gloo processes) on one global batch.

DDP equals single-process selection; each FSDP rank's gradient shard equals its
part of an independent backward over the kept samples only.
"""

from __future__ import annotations

import data_selection_helpers as h
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from free_port import free_port

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.callbacks.data_selection_callback import DataSelectionCallback
from dattri_llm.gradient.hooks.manager import HookManager

WORLD, LOCAL = 2, 4
RENORMALIZE = (False, True)


def fixed_target() -> object:
    net = h.build()
    cap = CaptureCallback()
    with HookManager(net, callbacks=[cap]).collect(deregister_on_exit=True):
        h.batch_loss(net, h.batch(99, 3), "sum").backward()
    return cap.record.gradient


def selection(net, target, renormalize: bool) -> DataSelectionCallback:
    # threshold 0 is invariant to the per-rank 1/B vs global 1/N loss scale
    return DataSelectionCallback(
        net, target="fixed", target_gradient=target, renormalize=renormalize
    )


def worker(rank: int, init: str, out: str, target) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        for renormalize in RENORMALIZE:
            net = h.build()
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            ids, labels = h.batch(7, WORLD * LOCAL)
            rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
            sel = selection(ddp, target, renormalize)
            with HookManager(ddp, callbacks=[sel]).collect():
                h.batch_loss(ddp, (ids[rows], labels[rows]), "mean").backward()
            grads = {n: p.grad.clone() for n, p in net.named_parameters()}
            result = {"grads": grads, "dropped": sel.last_dropped}
            torch.save(result, f"{out}/rank{rank}_{renormalize}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    """Both renormalize settings run once on 2 gloo ranks; ``(target, directory)``."""
    out = tmp_path_factory.mktemp("ddp_selection")
    target = fixed_target()
    mp.start_processes(
        worker,
        args=(f"tcp://127.0.0.1:{free_port()}", str(out), target),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    return target, out


@pytest.mark.slow
@pytest.mark.parametrize("renormalize", RENORMALIZE)
def test_ddp_selection_equals_single_process_on_the_global_batch(ddp_results, renormalize):
    target, out = ddp_results
    net = h.build()
    data = h.batch(7, WORLD * LOCAL)
    sel = selection(net, target, renormalize)
    with HookManager(net, callbacks=[sel]).collect():
        h.batch_loss(net, data, "mean").backward()
    assert sel.last_dropped, "the fixed target must make some samples negative"
    results = [torch.load(out / f"rank{r}_{renormalize}.pt") for r in range(WORLD)]
    global_dropped = sorted(i + r * LOCAL for r, res in enumerate(results) for i in res["dropped"])
    assert global_dropped == sel.last_dropped
    for n, p in net.named_parameters():
        for res in results:
            torch.testing.assert_close(res["grads"][n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def unwrapped(name: str) -> str:
    """A parameter name of the FSDP-wrapped model as in the plain model."""
    return name.replace("_fsdp_wrapped_module.", "")


def fsdp_worker(rank: int, init: str, out: str, target) -> None:
    """Hook the plain model, wrap it in FSDP1 (``norm`` its own unit), select, save grads.

    Saved: this rank's local gradient numel, the dropped local indices, and the
    full gradients all-gathered from the shards (``summon_full_params``).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        net = h.build()
        manager = HookManager(net)
        fsdp = FullyShardedDataParallel(
            net,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.LayerNorm}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        sel = selection(fsdp, target, renormalize=False)
        manager.add_callback(sel)
        ids, labels = h.batch(7, WORLD * LOCAL)
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
        with manager.collect():
            h.batch_loss(fsdp, (ids[rows], labels[rows]), "sum").backward()
        local_numel = {
            unwrapped(n): 0 if p.grad is None else p.grad.numel()
            for n, p in fsdp.named_parameters()
        }
        with FullyShardedDataParallel.summon_full_params(fsdp, with_grads=True):
            full = {unwrapped(n): p.grad.clone() for n, p in fsdp.named_parameters()}
        result = {"full": full, "local_numel": local_numel, "dropped": sel.last_dropped}
        torch.save(result, f"{out}/fsdp_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp_selection_edits_each_shard_like_a_kept_only_backward(tmp_path):
    target = fixed_target()
    mp.start_processes(
        fsdp_worker,
        args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path), target),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    net = h.build()
    data = h.batch(7, WORLD * LOCAL)
    target_sum = h.summed(h.per_sample(net, h.batch(99, 3)))
    scores = sum(h.layer_dots(h.per_sample(net, data), target_sum).values())
    dropped = h.expected_drop(scores, 0.0, "hard")
    assert dropped, "the fixed target must make some samples negative"
    kept = [i for i in range(WORLD * LOCAL) if i not in dropped]
    # FSDP averages the ranks' sum-loss gradients: the kept samples' sum over WORLD
    kept_sum = h.kept_gradient(net.state_dict(), data, kept, "sum")
    expected = {n: g / WORLD for n, g in kept_sum.items()}
    results = [torch.load(tmp_path / f"fsdp_rank{r}.pt") for r in range(WORLD)]
    global_dropped = sorted(i + r * LOCAL for r, res in enumerate(results) for i in res["dropped"])
    assert global_dropped == dropped
    held = {n: [res["local_numel"][n] for res in results] for n, _ in net.named_parameters()}
    assert all(sum(h_n) == p.numel() for (n, h_n), p in zip(held.items(), net.parameters()))
    assert any(0 < k < sum(h_n) for h_n in held.values() for k in h_n), held  # a split param
    for res in results:
        for n, g in expected.items():
            torch.testing.assert_close(res["full"][n], g, rtol=1e-5, atol=1e-6, msg=n)

"""DataSelectionCallback under DDP (2 gloo processes) equals single-process selection."""

from __future__ import annotations

import socket

import data_selection_helpers as h
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.callbacks.data_selection_callback import DataSelectionCallback
from dattri_llm.gradient.hooks.manager import HookManager

WORLD, LOCAL = 2, 4
RENORMALIZE = (False, True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        args=(f"tcp://127.0.0.1:{_free_port()}", str(out), target),
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

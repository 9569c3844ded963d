"""Fork worker for the 2-process FSDP ``GradientStreamer`` tests (gloo, CPU).

Each rank builds one streamer per *run* ``(label, argument overrides,
streamer overrides)`` from the same model builder, dataset and loss, lets the
streamer wrap the model in FSDP, iterates one pass and saves what it saw to
``<out_dir>/<label>_rank<r>.pt``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

WORLD = 2
BATCH = 2
WRAPPED_PREFIX = "_fsdp_wrapped_module."

Run = tuple[str, dict, dict]


def fsdp_stream_worker(
    rank: int,
    init_method: str,
    out_dir: str,
    runs: list[Run],
    build: Callable[[], nn.Module],
    data: list,
    loss_fn: Callable,
) -> None:
    """One rank: for every run, stream one pass under FSDP and save the blocks.

    Saved per run: the wrapper class, the names of the FSDP units (inner-module
    paths), the parameter numel this rank holds, the blocks as
    ``(step, ids, {layer: dense (B, d)})``, the full parameters after the pass and,
    when updating, the optimizer's ``(weight_decay, number of parameters)`` groups.
    """
    import torch.distributed as dist

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.streaming import GradientStreamer

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        for label, arg_overrides, streamer_overrides in runs:
            net = build()
            args = AttributionArguments(output_dir=out_dir, use_cpu=True, **arg_overrides)
            streamer = GradientStreamer(
                net, data, args, batch_size=BATCH, loss_fn=loss_fn, **streamer_overrides
            )
            with streamer:
                blocks = [
                    (step, ids, dict(block.materialize().data)) for step, block, ids in streamer
                ]
            saved = {
                "wrapper": type(streamer.forward_model).__name__,
                "units": fsdp_unit_names(streamer.forward_model),
                "local_numel": sum(p.numel() for p in net.parameters()),
                "blocks": blocks,
                "params": full_parameters(streamer.forward_model, net),
                "groups": optimizer_groups(streamer) if streamer.enable_update else None,
            }
            torch.save(saved, f"{out_dir}/{label}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def optimizer_groups(streamer: object) -> list[tuple[float, int]]:
    """``(weight_decay, number of parameters)`` of each optimizer parameter group."""
    return [(g["weight_decay"], len(g["params"])) for g in streamer.optimizer.param_groups]


def fsdp_unit_names(wrapper: nn.Module) -> list[str]:
    """Paths (in the unwrapped model, ``""`` = root) of the FSDP instances in ``wrapper``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return sorted(
        strip_wrapper_prefixes(name)
        for name, module in wrapper.named_modules()
        if isinstance(module, FullyShardedDataParallel)
    )


def full_parameters(wrapper: nn.Module, net: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of ``net``'s parameters, keyed by unwrapped-model names."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(wrapper):
        return {
            strip_wrapper_prefixes(name): param.detach().clone()
            for name, param in net.named_parameters()
        }


def strip_wrapper_prefixes(name: str) -> str:
    """``"_fsdp_wrapped_module.0._fsdp_wrapped_module.weight"`` → ``"0.weight"``."""
    return name.replace(WRAPPED_PREFIX, "")

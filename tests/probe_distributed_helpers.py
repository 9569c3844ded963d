"""Fork worker for the 2-process "query probes between training steps" tests (gloo, CPU).

Every *scenario* trains the same tiny model from the same seed twice on each
rank, through a wrapper the caller built (DDP with or without
``gradient_as_bucket_view``, FSDP with ``keep_low_precision_grads`` mixed
precision): once with query probes between the training steps and once
without. The rank saves both final parameter sets (and what the probed run
observed) to ``<out_dir>/<scenario>_rank<r>.pt``; an exception is saved as its
``repr`` instead, so one failing scenario does not hide the others.

* ``attribute`` scenarios run the public path: ``TracInAttributor.attribute(...,
  enable_update=True, loop_over_test=True)`` against ``loop_over_test=False``
  (queries taken once at θ_0, before any gradient exists).
* ``raise`` scenarios drive the two streamers as ``attribute`` does (a deferred
  trajectory and a query probe sharing its hooks and wrapper) and take one
  probe, after the second training batch, whose query loss raises
  `QueryLossError` on its second batch; training then goes on to the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from attribution_helpers import MLP
from torch import nn

WORLD = 2
BATCH = 2
ACCUMULATION = 2  # probes fall between the micro-batches of a window, too
N_TRAIN = 16  # 8 rows per rank: 4 batches, 2 optimizer steps
N_QUERIES = 3  # 2 probe batches per probe
LR = 0.5
RAISE_AFTER_BATCH = 1  # the probe of the "raise" scenarios follows training batch 1


class QueryLossError(Exception):
    """Raised by the failing query loss of the ``raise`` scenarios."""


@dataclass(frozen=True)
class Scenario:
    """A wrapper to train through (``wrap(net)``) and the path that takes the probes."""

    name: str
    wrap: Callable[[nn.Module], nn.Module]
    path: str  # "attribute" or "raise"
    fsdp: bool = False


def wrap_ddp(bucket_view: bool) -> Callable[[nn.Module], nn.Module]:
    def wrap(net: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=bucket_view)

    return wrap


def wrap_fsdp_mixed(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> Callable:
    def wrap(net: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        policy = MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, keep_low_precision_grads=True
        )
        return FullyShardedDataParallel(
            net, use_orig_params=True, device_id=torch.device("cpu"), mixed_precision=policy
        )

    return wrap


SCENARIOS = [
    Scenario("ddp_bucket_view", wrap_ddp(True), "attribute"),
    Scenario("ddp_grad_copy", wrap_ddp(False), "attribute"),
    Scenario("ddp_bucket_view_raise", wrap_ddp(True), "raise"),
    Scenario("fsdp_bf16", wrap_fsdp_mixed(torch.bfloat16, torch.bfloat16), "attribute", True),
    Scenario("fsdp_fp16", wrap_fsdp_mixed(torch.float16, torch.float32), "attribute", True),
    Scenario("fsdp_bf16_raise", wrap_fsdp_mixed(torch.bfloat16, torch.bfloat16), "raise", True),
]


def rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 4, generator=gen), torch.randn(n, 3, 3, generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def train_rows() -> list[dict[str, torch.Tensor]]:
    return rows(N_TRAIN, 1)


def query_rows() -> list[dict[str, torch.Tensor]]:
    return rows(N_QUERIES, 2)


def initial_parameters() -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in fresh_net().named_parameters()}


def fresh_net() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def dict_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).float().sum()


def failing_query_loss() -> Callable:
    """``dict_loss``, except that its second call raises (before touching the model)."""
    calls = []

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        calls.append(None)
        if len(calls) == 2:
            raise QueryLossError("query loss failed on purpose")
        return dict_loss(model, batch)

    return loss


def make_args(out_dir: str):
    from dattri_llm.attribution.arguments import AttributionArguments

    return AttributionArguments(
        output_dir=out_dir,
        use_cpu=True,
        optim="sgd",
        learning_rate=LR,
        lr_scheduler_type="constant",
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
    )


def full_parameters(net: nn.Module, wrapper: nn.Module, fsdp: bool) -> dict[str, torch.Tensor]:
    """``net``'s parameters (gathered from every FSDP shard) as CPU copies."""
    if not fsdp:
        return {name: p.detach().clone() for name, p in net.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(wrapper):
        return {name: p.detach().clone() for name, p in net.named_parameters()}


def attribute_run(scenario: Scenario, out_dir: str, probes: bool) -> dict:
    """Train through ``attribute``; with ``probes`` the queries are re-taken at every θ_t."""
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.task import AttributionTask

    net = fresh_net()
    wrapper = scenario.wrap(net)
    task = AttributionTask(dict_loss, wrapper)
    score = TracInAttributor(make_args(out_dir), task=task).attribute(
        train_rows(), query_rows(), enable_update=True, loop_over_test=probes
    )
    return {
        "params": full_parameters(net, wrapper, scenario.fsdp),
        "query_at": score.algorithm_meta["query_at"],
        "scores_shape": tuple(score.scores.shape),
    }


def gradient_state(net: nn.Module) -> list[tuple[torch.dtype, torch.Size, torch.Tensor] | None]:
    """``(dtype, shape, values)`` of each parameter's ``.grad`` (``None`` without one)."""
    return [
        None if p.grad is None else (p.grad.dtype, p.grad.shape, p.grad.detach().clone())
        for p in net.parameters()
    ]


def streamer_run(scenario: Scenario, out_dir: str, probes: bool) -> dict:
    """Train with two streamers as ``attribute`` pairs them; probe once, with a failing loss."""
    from dattri_llm.gradient.streaming import GradientStreamer

    net = fresh_net()
    wrapper = scenario.wrap(net)
    args = make_args(out_dir)
    train = GradientStreamer(
        net,
        train_rows(),
        args,
        batch_size=BATCH,
        enable_update=True,
        loss_fn=dict_loss,
        forward_model=wrapper,
        defer_update=True,
    )
    test = GradientStreamer(
        net,
        query_rows(),
        args,
        batch_size=BATCH,
        loss_fn=failing_query_loss(),
        hook_manager=train.hook_manager,
        forward_model=train.forward_model,
        shard=False,
    )
    test.role = "query"
    saved: dict = {}
    with train, test:
        for index, _block in enumerate(train):
            if probes and index == RAISE_AFTER_BATCH:
                saved["before"] = gradient_state(net)
                try:
                    list(test)
                except Exception as exc:  # noqa: BLE001  (the test checks which one came out)
                    saved["raised"] = repr(exc)
                saved["after"] = gradient_state(net)
    saved["params"] = full_parameters(net, wrapper, scenario.fsdp)
    return saved


def run_scenario(scenario: Scenario, out_dir: str) -> dict:
    """``{"plain": ..., "probed": ...}`` of one scenario, or ``{"error": repr}``."""
    run = attribute_run if scenario.path == "attribute" else streamer_run
    try:
        return {
            "plain": run(scenario, f"{out_dir}/{scenario.name}_plain", probes=False),
            "probed": run(scenario, f"{out_dir}/{scenario.name}_probed", probes=True),
        }
    except Exception as exc:  # noqa: BLE001  (saved for the test to report)
        return {"error": repr(exc)}


def probe_worker(rank: int, port: int, out_dir: str, names: list[str]) -> None:
    """One rank: run the named scenarios in order and save each one's outcome."""
    import torch.distributed as dist

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for scenario in SCENARIOS:
            if scenario.name in names:
                outcome = run_scenario(scenario, out_dir)
                torch.save(outcome, f"{out_dir}/{scenario.name}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()

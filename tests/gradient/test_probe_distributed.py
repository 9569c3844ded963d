"""Query probes between training steps leave a distributed trajectory bit-identical.

Two gloo ranks (CPU) train a tiny MLP through a wrapper the caller built, with
``attribute(..., enable_update=True, loop_over_test=True)`` re-taking the
queries after every training batch (its update deferred until the probe is
done), and again without those probes. The final parameters must be equal bit
for bit: under DDP with ``gradient_as_bucket_view`` the probe's own backward
rewrites the bucket the training gradients are views of, and FSDP with
``keep_low_precision_grads`` keeps bf16/fp16 gradients on fp32 parameters,
which a plain ``.grad =`` refuses. A query loss that raises mid-probe must come
out as itself, with every ``.grad`` handed back (dtype, shape, values) and
training able to go on to the same end point. See ``probe_distributed_helpers``.
"""

from __future__ import annotations

import pytest
import torch
from free_port import free_port

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """``scenario name -> [rank 0 outcome, rank 1 outcome]`` from one 2-rank run."""
    import torch.distributed.fsdp  # noqa: F401  (imported before the fork, not in each rank)
    import torch.multiprocessing as mp
    import transformers  # noqa: F401
    from probe_distributed_helpers import SCENARIOS, WORLD, probe_worker

    import dattri_llm.attribution.algorithm.tracin  # noqa: F401

    out = tmp_path_factory.mktemp("probes")
    names = [scenario.name for scenario in SCENARIOS]
    mp.start_processes(
        probe_worker,
        args=(free_port(), str(out), names),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    return {name: [torch.load(out / f"{name}_rank{r}.pt") for r in range(WORLD)] for name in names}


def _completed(outcomes, name: str) -> list[dict]:
    ranks = outcomes[name]
    for rank, outcome in enumerate(ranks):
        assert "error" not in outcome, f"rank {rank}: {outcome.get('error')}"
    return ranks


def _assert_bit_identical(plain: dict, probed: dict) -> None:
    from probe_distributed_helpers import initial_parameters

    start = initial_parameters()
    assert probed.keys() == plain.keys() == start.keys()
    for name, value in probed.items():
        assert not torch.equal(value, start[name]), f"{name} did not train"
        assert torch.equal(value, plain[name]), (
            f"{name} moved by {(value - plain[name]).abs().max().item():.3g} because of the probes"
        )


@pytest.mark.parametrize("name", ["ddp_bucket_view", "ddp_grad_copy", "fsdp_bf16", "fsdp_fp16"])
def test_probes_between_steps_leave_training_bit_identical(outcomes, name):
    from probe_distributed_helpers import N_QUERIES, N_TRAIN

    for outcome in _completed(outcomes, name):
        plain, probed = outcome["plain"], outcome["probed"]
        assert plain["query_at"] == "theta_0" and probed["query_at"] == "theta_t"
        assert probed["scores_shape"] == (N_TRAIN, N_QUERIES)  # every rank's rows, gathered
        _assert_bit_identical(plain["params"], probed["params"])


@pytest.mark.parametrize(
    ("name", "grad_dtype"),
    [("ddp_bucket_view_raise", torch.float32), ("fsdp_bf16_raise", torch.bfloat16)],
)
def test_failing_query_loss_propagates_and_hands_back_the_gradients(outcomes, name, grad_dtype):
    for outcome in _completed(outcomes, name):
        probed = outcome["probed"]
        assert probed["raised"] == "QueryLossError('query loss failed on purpose')"
        before, after = probed["before"], probed["after"]
        # Mid-window, so training gradients are present (an FSDP rank has none for the
        # parameters outside its shard); FSDP keeps the ones it reduced in bf16.
        present = [i for i, entry in enumerate(before) if entry is not None]
        assert present
        assert [i for i, entry in enumerate(after) if entry is not None] == present
        for i in present:
            (dtype, shape, values), (dtype_after, shape_after, values_after) = before[i], after[i]
            assert dtype == dtype_after == grad_dtype
            assert shape_after == shape
            assert torch.equal(values_after, values)
        # Training went on from the handed-back gradients to the probe-free end point.
        _assert_bit_identical(outcome["plain"]["params"], probed["params"])

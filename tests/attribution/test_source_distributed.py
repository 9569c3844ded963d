"""SOURCE under a process group: every rank's score equals the single-process score.

Two gloo ranks (CPU, see ``source_distributed_helpers``) each stream their
unpadded shard of 7 training samples (4 and 3) against 3 queries over
``L = 2`` checkpoints, the model wrapped in DDP. Each segment's K-FAC /
EK-FAC fit (covariances; EK-FAC's eigenvalue correction) must cover both
shards, the query propagation is computed on every rank from the whole query
set, and the rows of each segment are gathered in training-set order, so
every rank returns the single-process score: rows (ids, checkpoint steps) and
columns exactly, values with ``rtol = 1e-5`` relative to the largest score
(float32 per-sample gradients of batches of another composition, fit sums in
another order). Cases: K-FAC, EK-FAC, EK-FAC with relative damping, live; EK-FAC from
whole stores every rank reads (written by one process; the fit's sums and
counts both grow two-fold, so the means are unchanged). ``fsdp="full_shard"``
and a task given an FSDP wrapper are refused on every rank, and ``WORLD_SIZE=2``
without a process group in one process, with a ``ValueError``.

Before the fix (the refusal simply removed) each rank returned only its own
shard's rows (8 and 6 of 14); the values of those rows already matched (the
Kronecker accumulators and EK-FAC's eigenvalue sums are all-reduced whenever
a process group exists). Were the fits left unreduced, each rank fitting its
shard, the scores would differ by 56-66 % of the largest score (80 % with
only EK-FAC's eigenvalue correction left unreduced).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from free_port import free_port
from source_distributed_helpers import (
    CASES,
    N_TRAIN,
    RATES,
    WORLD,
    run_case,
    score_stores,
    worker,
    write_stores,
)

pytest.importorskip("transformers")  # the live streamer seeds through transformers.set_seed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``([rank results], {case: single-process result})``."""
    assert "WORLD_SIZE" not in os.environ  # the single-process runs below are unsharded
    root = tmp_path_factory.mktemp("source_distributed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stores = write_stores(str(root / "stores"))
        mp.start_processes(
            worker,
            args=(f"tcp://127.0.0.1:{free_port()}", str(root), stores),
            nprocs=WORLD,
            join=True,
            start_method="fork",
        )
        ranks = [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]
        single = {case: run_case(case, str(root / f"single_{case}")) for case in CASES}
        single["ekfac_from_cache"] = score_stores("ekfac", str(root / "single_cache"), stores)
    return ranks, single


def _assert_same_score(got: dict, expected: dict) -> None:
    assert got["test_ids"] == expected["test_ids"]
    assert got["row_ids"] == expected["row_ids"]
    assert got["row_steps"] == expected["row_steps"]
    scale = expected["scores"].abs().max().item()
    torch.testing.assert_close(got["scores"], expected["scores"], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("case", [*CASES, "ekfac_from_cache"])
def test_every_rank_returns_the_single_process_score(runs, case):
    ranks, single = runs
    expected = single[case]
    # one row per (sample, segment), checkpoint order, samples in dataset order
    assert expected["row_steps"] == [k for k in range(len(RATES)) for _ in range(N_TRAIN)]
    assert expected["scores"].abs().max() > 0
    for result in ranks:
        _assert_same_score(result[case], expected)


@pytest.mark.parametrize(
    ("key", "what"),
    [("fsdp_error", "args.fsdp=['full_shard']"), ("fsdp_wrapper_error", "an FSDP-wrapped task")],
)
def test_fsdp_is_refused_on_every_rank(runs, key, what):
    ranks, _ = runs
    for result in ranks:
        assert result[key] is not None
        assert what in result[key] and "Use DDP" in result[key]


def test_a_sharded_training_set_without_a_process_group_is_refused(tmp_path, monkeypatch):
    """``WORLD_SIZE=2`` in one process: the sampler would shard, the fits could not be summed."""
    from source_distributed_helpers import make_attributor, queries, train_set

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    attributor = make_attributor("ekfac", str(tmp_path))
    with pytest.raises(ValueError, match="WORLD_SIZE=2 shards the training set"):
        attributor.attribute(train_set(), queries())

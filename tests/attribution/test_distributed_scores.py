"""A sharded live ``attribute`` returns and saves the complete score on every rank.

Two gloo ranks (CPU, see ``distributed_scores_helpers``) each stream their
unpadded shard of 7 training samples (4 and 3) against 3 queries. After the
gather every rank's score must equal the single-process score of the same
call: the same rows in the same order (ids, steps, token positions), the same
columns, and the same values; rank 0's saved score file must equal it.
Cases, with the model wrapped in DDP: Grad-Dot, TracIn over two checkpoints
and K-FAC, each at instance and token granularity, Grad-Dot scored from a
``"memory"`` store per rank (the ranks' stores gathered) and Grad-Dot from a
``"disk"`` store both ranks share (each rank scores it whole; rows in the
store's order, rank 0's shard first, so that case is compared row by row
after matching rows by identity). The train set holds one sample twice (on
different ranks): live, it appears twice, as in the single-process run; from
a store, which holds each (sample, step) once, once, as in the single-process
store.

FSDP: Grad-Dot and K-FAC at both granularities again with
``fsdp="full_shard"`` (the streamer wraps the model in
``FullyShardedDataParallel``; checked), each against the single-process score
of the same call without ``fsdp`` (one process has no process group to shard
over, and that call is the DDP case's reference). The calls that would wrap
the model twice (an ensemble of checkpoints, a collected store, a second call
on the same model: FSDP shards in place, for good) are refused on both ranks
with an error naming the fix; the fix, a task given an FSDP wrapper (and a
loader through ``summon_full_params``), is run for TracIn over two
checkpoints and the ``"memory"`` store and gives the single-process score.

Values: the ids, steps, token positions and columns are compared exactly;
the scores with ``rtol=1e-5`` (relative to the largest score). Each row is one
sample's inner products, but the per-sample gradients come out of float32
kernels run on batches of different composition (rank 0 pairs samples 0 and
2, one process samples 0 and 1), which round differently in the last bits;
K-FAC also all-reduces its covariances across the ranks, another summation
order. Observed differences are ~1e-7 relative (the single-process run itself
gives its duplicated sample two rows that differ by as much), under FSDP as
under DDP. The tolerance is far below the gaps between the scores (checked),
so a row in the wrong place cannot pass.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp
from distributed_scores_helpers import (
    CASES,
    FSDP_CASES,
    N_TRAIN,
    SHARED_STORE_CASES,
    TWINS,
    WRAPPED_CASES,
    attributor,
    run_case,
    train_set,
    worker,
)
from free_port import free_port
from kfac_distributed_helpers import WORLD, queries

from dattri_llm.attribution.gather import gather_results

pytest.importorskip("transformers")  # the live streamer seeds through transformers.set_seed


ALL_CASES = sorted([*CASES, *TWINS])


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """``([rank results], single-process results)``: one 2-rank run of every case."""
    assert "WORLD_SIZE" not in os.environ  # the single-process runs below are unsharded
    import torch.distributed.fsdp  # noqa: F401  (imported before the fork, not in each rank)

    root = tmp_path_factory.mktemp("distributed_scores")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP on CPU / gloo warns about its device
        mp.start_processes(
            worker,
            args=(f"tcp://127.0.0.1:{free_port()}", str(root)),
            nprocs=WORLD,
            join=True,
            start_method="fork",
        )
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]
    single = {case: run_case(case, str(root / f"single_{case}")) for case in CASES}
    return ranks, single


@pytest.fixture(scope="module")
def runs(distributed):
    """``{case: ([rank results], single-process result)}``; a twin has its case's reference."""
    ranks, single = distributed
    return {
        case: ([result[case] for result in ranks], single[TWINS.get(case, case)])
        for case in ALL_CASES
    }


def _in_store_order(got: dict, expected: dict) -> dict:
    """``got``'s rows in ``expected``'s order (a shared store lists rank 0's shard first)."""
    tokens = got["row_tokens"] or [0] * len(got["row_ids"])
    row_of = {key: row for row, key in enumerate(zip(got["row_ids"], got["row_steps"], tokens))}
    assert len(row_of) == len(tokens)  # each (sample, step, position) once
    wanted = zip(expected["row_ids"], expected["row_steps"], expected["row_tokens"] or tokens)
    rows = [row_of[key] for key in wanted]
    assert sorted(rows) == list(range(len(tokens)))
    return {
        "scores": got["scores"][rows],
        "row_ids": [got["row_ids"][r] for r in rows],
        "row_steps": [got["row_steps"][r] for r in rows],
        "row_tokens": None if got["row_tokens"] is None else [got["row_tokens"][r] for r in rows],
        "test_ids": got["test_ids"],
    }


def _assert_same_score(got: dict, expected: dict, case: str) -> None:
    if TWINS.get(case, case) in SHARED_STORE_CASES:
        got = _in_store_order(got, expected)
    for key in ("row_ids", "row_steps", "row_tokens", "test_ids"):
        assert got[key] == expected[key], key
    scale = expected["scores"].abs().max().item()
    torch.testing.assert_close(got["scores"], expected["scores"], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL_CASES)
def test_every_rank_returns_the_single_process_score(runs, case):
    ranks, single = runs[case]
    twin = TWINS.get(case, case)
    for rank, got in enumerate(ranks):
        _assert_same_score(got, single, case)
        # one group of rows per sample and checkpoint; the duplicated sample twice, no more
        # (once from a store, which holds each (sample, step) once)
        firsts = [
            h
            for i, h in enumerate(got["row_ids"])
            if got["row_tokens"] is None or got["row_tokens"][i] == 0
        ]
        checkpoints = 2 if "2ckpt" in twin else 1
        copies = 1 if twin.endswith("store") else 2  # a store holds (sample, step) once
        assert len(firsts) == (N_TRAIN - 2 + copies) * checkpoints, rank
        counts = Counter(firsts)
        assert len(counts) == N_TRAIN - 1
        assert max(counts.values()) == copies * checkpoints
    # the tolerance is far below the differences between the rows of different samples
    scores, scale = single["scores"], single["scores"].abs().max()
    tokens = single["row_tokens"] or [0] * len(single["row_ids"])
    keys = list(zip(single["row_ids"], single["row_steps"], tokens))
    for i, j in itertools.combinations(range(len(keys)), 2):
        if keys[i] != keys[j]:
            assert (scores[i] - scores[j]).abs().max() > 1e-4 * scale, (keys[i], keys[j])


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL_CASES)
def test_each_case_runs_under_its_wrapper(runs, case):
    if case in FSDP_CASES:
        expected = ["FullyShardedDataParallel"]
    elif case in WRAPPED_CASES:
        expected = []  # the task's own FullyShardedDataParallel: the streamers wrap nothing
    else:
        expected = ["DistributedDataParallel"]
    ranks, _ = runs[case]
    assert [got["wrappers"] for got in ranks] == [expected] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL_CASES)
def test_rank_zero_saves_the_complete_score(runs, case):
    ranks, single = runs[case]
    _assert_same_score(ranks[0]["saved"], single, case)
    if TWINS.get(case, case) not in SHARED_STORE_CASES:
        assert ranks[0]["wrote_score"] and not ranks[1]["wrote_score"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["grad_dot_token", "grad_dot_token_fsdp"])
def test_token_rows_of_a_sample_stay_together(runs, case):
    ranks, single = runs[case]
    tokens = ranks[0]["row_tokens"]
    assert tokens == single["row_tokens"] == [0, 1, 2] * N_TRAIN


@pytest.mark.slow
def test_fsdp_refuses_to_wrap_a_model_twice_on_every_rank(distributed):
    ranks, _ = distributed
    refused = [result["refusals"] for result in ranks]
    assert refused[0] == refused[1]  # every rank raises, none is left waiting in a collective
    assert sorted(refused[0]) == ["again", "collected", "ensemble"]
    assert refused[0]["ensemble"].startswith("ValueError: args.fsdp=['full_shard']")
    assert "an ensemble of 2 checkpoints" in refused[0]["ensemble"]
    assert "gradient_cache_residency" in refused[0]["collected"]
    for label in ("ensemble", "collected"):
        assert "summon_full_params(wrapper, writeback=True)" in refused[0][label]
    assert refused[0]["again"].startswith("RuntimeError: SkipNet was already wrapped")
    assert "pass the wrapper" in refused[0]["again"]


@pytest.mark.parametrize(
    ("case", "call", "match"),
    [
        ("tracin_2ckpt_instance", "attribute", "an ensemble of 2 checkpoints"),
        ("grad_dot_memory_store", "attribute", "gradient_cache_residency"),
        ("grad_dot_instance", "cache", "gradient_cache_residency"),
    ],
)
def test_fsdp_refuses_a_call_that_wraps_twice_before_any_work(
    tmp_path, monkeypatch, case, call, match
):
    # as under a 2-rank process group; refused before a checkpoint is loaded or a model run
    monkeypatch.setattr("dattri_llm.attribution.runs.dist_world_size", lambda: 2)
    method, options = attributor(case, str(tmp_path), fsdp="full_shard")
    with pytest.raises(ValueError, match=f"(?s){match}.*freshly built model.*use DDP"):
        if call == "cache":
            method.cache(train_set(), queries())
        else:
            method.attribute(train_set(), queries(), **options)
    assert method.task.current_checkpoint_idx is None  # no checkpoint was loaded


def test_sharded_without_a_process_group_warns_and_keeps_the_shard():
    result = (torch.ones(2, 1), ["a", "b"], [0, 0], ["q"], None)
    with pytest.warns(UserWarning, match="shard only.*init_process_group"):
        assert gather_results([result], num_samples=4, world_size=2, rank=0) == [result]
    assert gather_results([result], num_samples=2, world_size=1, rank=0) == [result]


def _rank_result(samples: list[int], steps: list[int], tokens: int | None) -> tuple:
    """A rank's result whose rows name their sample (and position) in the scores."""
    per = 1 if tokens is None else tokens
    ids = [f"s{i}" for i in samples for _ in range(per)]
    row_steps = [s for s in steps for _ in range(per)]
    positions = None if tokens is None else list(range(tokens)) * len(samples)
    values = torch.tensor([[10.0 * i + p] for i in samples for p in range(per)])
    return values, ids, row_steps, ["q"], positions


@pytest.mark.parametrize("tokens", [None, 2])
def test_merge_interleaves_shards_into_sampler_order_per_step(tokens):
    from dattri_llm.attribution.gather import _merge

    # N=7 over 2 ranks in batches of 2, two epochs: rank 0 holds 0,2,4,6 (steps 0,0,1,1),
    # rank 1 holds 1,3,5 (steps 0,0,1); the epochs are steps 0-1 and 2-3.
    rank0 = _rank_result([0, 2, 4, 6] * 2, [0, 0, 1, 1, 2, 2, 3, 3], tokens)
    rank1 = _rank_result([1, 3, 5] * 2, [0, 0, 1, 2, 2, 3], tokens)
    scores, ids, steps, test_ids, positions = _merge([rank0, rank1], 7, unique=False)
    order = [0, 1, 2, 3, 4, 5, 6] * 2
    per = 1 if tokens is None else tokens
    assert ids == [f"s{i}" for i in order for _ in range(per)]
    assert steps == [s for s in [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3] for _ in range(per)]
    assert positions == (None if tokens is None else [0, 1] * 14)
    assert scores[:, 0].tolist() == [10.0 * i + p for i in order for p in range(per)]
    assert test_ids == ["q"]


def test_merge_from_stores_keeps_one_group_per_sample_and_step():
    from dattri_llm.attribution.gather import _merge

    # sample 2 sits on both ranks at step 0 (a padded sampler); the store keeps it once,
    # at its last place (rank 1's position 3)
    rank0 = _rank_result([0, 2], [0, 0], None)
    rank1 = _rank_result([1, 2], [0, 0], None)
    _, ids, _, _, _ = _merge([rank0, rank1], 4, unique=True)
    assert ids == ["s0", "s1", "s2"]
    _, ids, _, _, _ = _merge([rank0, rank1], 4, unique=False)
    assert ids == ["s0", "s1", "s2", "s2"]


def test_merge_aligns_columns_and_refuses_other_test_samples():
    from dattri_llm.attribution.gather import _merge

    rank0 = (torch.tensor([[1.0, 2.0]]), ["a"], [0], ["q1", "q2"], None)
    rank1 = (torch.tensor([[4.0, 3.0]]), ["b"], [0], ["q2", "q1"], None)
    scores, ids, _, test_ids, _ = _merge([rank0, rank1], 2, unique=False)
    assert test_ids == ["q1", "q2"] and ids == ["a", "b"]
    assert scores.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    other = (torch.tensor([[4.0]]), ["b"], [0], ["q3"], None)
    with pytest.raises(ValueError, match="rank 1 scored other test samples"):
        _merge([rank0, other], 2, unique=False)

"""The live path shards the train set over ranks without padding.

Sampler: with ``WORLD_SIZE`` ranks, rank ``r`` of a ``GradientStreamer``
streams ``perm[r::world_size]`` (``perm`` = ``torch.randperm(n, seed)`` with
shuffling, ``range(n)`` without), so the ranks' batches hold every sample
exactly once, and every rank runs the same number of batches.

Distributed (2 gloo ranks, DDP-wrapped, see ``unpadded_sharding_helpers``):
with 7 and 5 training samples, the K-FAC / EK-FAC fits on every rank equal the
single-process fit on the whole train set (a padded shard would count a
repeated sample twice), and the K-FAC, EK-FAC and Grad-Dot scores, gathered
from the ranks, hold the train set once on every rank and equal the
single-process rows.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp
from free_port import free_port
from kfac_distributed_helpers import KFAC_LAYERS, WORLD, reference
from torch import nn
from unpadded_sharding_helpers import TRAIN_SIZES, run_methods, train_set, worker

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.streaming import GradientStreamer

pytest.importorskip("transformers")  # the live streamer seeds through transformers.set_seed

SEED = 3


# --------------------------------------------------------------------------- sampler


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.full((2,), float(i)), "index": torch.tensor(i)} for i in range(n)]


def _rank_batches(
    tmp_path, monkeypatch, n: int, world: int, rank: int, shuffle: bool, batch_size: int
) -> list[list[int]]:
    """Dataset indices of each batch ``rank``'s streamer loads (no process group needed)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    args = AttributionArguments(output_dir=str(tmp_path), use_cpu=True, data_seed=SEED)
    model = nn.Linear(2, 1)
    streamer = GradientStreamer(
        model,
        _rows(n),
        args,
        batch_size=batch_size,
        loss_fn=lambda m, b: m(b["x"]).sum(),
        forward_model=model,  # not wrapped: the loader is all this test reads
    )
    return [batch["index"].tolist() for batch in streamer._make_loader(shuffle=shuffle)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n", "world"), [(7, 2), (8, 2), (7, 3), (5, 3), (11, 3)])
def test_ranks_hold_every_sample_exactly_once(tmp_path, monkeypatch, n, world, shuffle):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SEED)).tolist()
    order = perm if shuffle else list(range(n))
    per_rank = [
        _rank_batches(tmp_path, monkeypatch, n, world, rank, shuffle, batch_size=2)
        for rank in range(world)
    ]
    for rank, batches in enumerate(per_rank):
        assert [i for batch in batches for i in batch] == order[rank::world]
        assert all(0 < len(batch) <= 2 for batch in batches)
    assert Counter(i for batches in per_rank for b in batches for i in b) == Counter(range(n))
    assert len({len(batches) for batches in per_rank}) == 1  # wrapped models: same batch count


def test_a_rank_one_sample_short_splits_its_last_batch(tmp_path, monkeypatch):
    # 5 samples over 2 ranks in batches of 2: rank 0 holds 3 (2 batches), rank 1 holds 2.
    batches = [_rank_batches(tmp_path, monkeypatch, 5, 2, r, False, 2) for r in range(2)]
    assert batches == [[[0, 2], [4]], [[1], [3]]]


@pytest.mark.parametrize(("n", "batch_size"), [(7, 1), (1, 2)])
def test_shards_too_small_for_a_common_batch_count_raise_on_every_rank(
    tmp_path, monkeypatch, n, batch_size
):
    for rank in range(WORLD):
        with pytest.raises(ValueError, match=rf"cannot split {n} samples over 2 ranks"):
            _rank_batches(tmp_path, monkeypatch, n, WORLD, rank, False, batch_size)


# --------------------------------------------------------------------------- 2 ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{n: ([rank results], single-process result)}`` (one 2-rank run for all sizes)."""
    assert "WORLD_SIZE" not in os.environ  # the single-process runs below are unsharded
    root = tmp_path_factory.mktemp("unpadded_sharding")
    mp.start_processes(
        worker,
        args=(f"tcp://127.0.0.1:{free_port()}", str(root)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]
    return {
        n: ([result[n] for result in ranks], run_methods(str(root / f"single_n{n}"), train_set(n)))
        for n in TRAIN_SIZES
    }


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    expected = expected.to(actual.dtype)
    scale = expected.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
@pytest.mark.parametrize("n", TRAIN_SIZES)
def test_fit_on_every_rank_equals_the_single_process_fit(runs, n, method):
    ranks, single = runs[n]
    ref = reference(train_set(n), direct=False)
    for name in KFAC_LAYERS:  # the single-process fit is the fit on the whole train set
        if method == "kfac":
            _close(single[method]["raw_fit"][0][name][0], ref["A"][name], 1e-5)
        else:
            _close(single[method]["raw_fit"][0][name]["lam"], ref["lam"][name], 1e-4)
    for result in ranks:
        factors, fisher = result[method]["raw_fit"]
        expected, expected_fisher = single[method]["raw_fit"]
        assert sorted(factors) == sorted(expected) and fisher == expected_fisher == {}
        for name in KFAC_LAYERS:
            if method == "kfac":
                _close(factors[name][0], expected[name][0], 1e-6)
                _close(factors[name][1], expected[name][1], 1e-6)
            else:
                _close(factors[name]["lam"], expected[name]["lam"], 1e-5)


@pytest.mark.parametrize("method", ["kfac", "ekfac", "grad_dot"])
@pytest.mark.parametrize("n", TRAIN_SIZES)
def test_rank_rows_cover_the_train_set_once_with_the_single_process_scores(runs, n, method):
    ranks, single = runs[n]
    expected = single[method]
    if method != "grad_dot":
        _close(expected["scores"].double(), reference(train_set(n), False)["scores"][method], 1e-4)
    assert len(set(expected["row_ids"])) == n
    for result in ranks:  # the ranks' rows r, r+2, ... gathered: every rank holds all rows
        got = result[method]
        assert got["test_ids"] == expected["test_ids"]
        assert got["row_ids"] == expected["row_ids"]  # dataset order, each sample once
        scale = expected["scores"].abs().max().item()
        torch.testing.assert_close(got["scores"], expected["scores"], rtol=1e-5, atol=1e-6 * scale)

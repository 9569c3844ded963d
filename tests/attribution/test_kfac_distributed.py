"""Distributed K-FAC / EK-FAC fits where ranks hold different layers or batch counts.

Two gloo ranks fit and score (see ``kfac_distributed_helpers``): the live
``attribute`` path with ``WORLD_SIZE=2`` (sharded by the attributor, DDP-wrapped,
rank 1 never running the ``side`` branch), and uneven per-rank shards under the
process group (3 batches against 1). On every rank the fitted factors (K-FAC
``A``, ``G``; EK-FAC ``Λ``; the dense Fisher under ``"direct"``) equal those of
the single-process fit on the union of the data (fp32, tight) and an
independent float64 reference, and each rank's score rows (every row, gathered,
on the live path) equal the single-process ones.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from free_port import free_port
from kfac_distributed_helpers import (
    FISHER_LAYER,
    KFAC_LAYERS,
    METHODS,
    SCENARIO_OPTIONS,
    WORLD,
    arguments,
    per_rank_train,
    reference,
    run_attribute,
    union_of_live_shards,
    worker,
)

pytest.importorskip("transformers")  # the live streamer seeds through transformers.set_seed

UNIONS = {
    "live": union_of_live_shards,
    "per_rank": lambda: [row for shard in per_rank_train() for row in shard],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{scenario: ([rank results], single-process result, reference)}``, run once each."""
    assert "WORLD_SIZE" not in os.environ  # the single-process fits below run unsharded
    root = tmp_path_factory.mktemp("kfac_distributed")
    out = {}
    for scenario in SCENARIO_OPTIONS:
        mp.start_processes(
            worker,
            args=(scenario, f"tcp://127.0.0.1:{free_port()}", str(root)),
            nprocs=WORLD,
            join=True,
            start_method="fork",
        )
        ranks = [torch.load(root / f"{scenario}_rank{r}.pt") for r in range(WORLD)]
        union = UNIONS[scenario]()
        single = {
            method: run_attribute(
                method,
                arguments(str(root / f"single_{scenario}_{method}")),
                union,
                **SCENARIO_OPTIONS[scenario],
            )
            for method in METHODS
        }
        direct = SCENARIO_OPTIONS[scenario].get("non_kfac_strategy") == "direct"
        out[scenario] = (ranks, single, reference(union, direct))
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    expected = expected.to(actual.dtype)
    scale = expected.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


def _check_fit(method: str, fit: tuple, expected_fit: tuple, ref: dict, direct: bool) -> None:
    """``fit`` equals the single-process ``expected_fit`` (tight) and the reference."""
    factors, fisher = fit
    single_factors, single_fisher = expected_fit
    assert sorted(factors) == sorted(single_factors) == sorted(KFAC_LAYERS)
    assert sorted(fisher) == sorted(single_fisher) == ([FISHER_LAYER] if direct else [])
    for name in KFAC_LAYERS:
        if method == "kfac":
            for index, key in enumerate(("A", "G")):
                _close(factors[name][index], single_factors[name][index], 1e-6)
                _close(factors[name][index], ref[key][name], 1e-5)
        else:
            _close(factors[name]["lam"], single_factors[name]["lam"], 1e-5)
            _close(factors[name]["lam"], ref["lam"][name], 1e-4)
    for name, matrix in fisher.items():
        _close(matrix, single_fisher[name], 1e-6)
        _close(matrix, ref["fisher"][name], 1e-5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scenario", sorted(SCENARIO_OPTIONS))
def test_distributed_fit_equals_single_process_fit_on_union(runs, scenario, method):
    ranks, single, ref = runs[scenario]
    direct = SCENARIO_OPTIONS[scenario].get("non_kfac_strategy") == "direct"
    for result in ranks:
        _check_fit(method, result[method]["raw_fit"], single[method]["raw_fit"], ref, direct)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scenario", sorted(SCENARIO_OPTIONS))
def test_each_rank_scores_its_rows_as_the_single_process_fit(runs, scenario, method):
    ranks, single, ref = runs[scenario]
    expected = single[method]
    _close(expected["scores"].double(), ref["scores"][method], 1e-4)
    row_of = {row_id: i for i, row_id in enumerate(expected["row_ids"])}
    if scenario == "live":  # the sharded live path gathers: every rank holds every row
        assert all(sorted(r[method]["row_ids"]) == sorted(row_of) for r in ranks)
    else:  # each rank scored its own train set
        assert sorted(i for r in ranks for i in r[method]["row_ids"]) == sorted(row_of)
    for result in ranks:
        got = result[method]
        assert got["test_ids"] == expected["test_ids"]
        rows = [row_of[row_id] for row_id in got["row_ids"]]
        scale = expected["scores"].abs().max().item()
        torch.testing.assert_close(
            got["scores"], expected["scores"][rows], rtol=1e-5, atol=1e-6 * scale
        )


@pytest.mark.parametrize("method", METHODS)
def test_live_ranks_rerun_the_same_number_of_blocks(runs, method):
    """Rank 0's larger blocks keep fewer first-pass blocks; the ranks agree on the re-runs."""
    ranks, _, _ = runs["live"]
    plans = [result[method]["plan"] for result in ranks]
    assert plans[0]["recomputed_blocks"] == plans[1]["recomputed_blocks"] > 0, plans
    assert plans[0]["kept_blocks"] == plans[1]["kept_blocks"] == 1, plans


def test_accumulators_reduce_the_union_of_the_ranks_layers():
    from kfac_distributed_helpers import accumulator_worker

    mp.start_processes(
        accumulator_worker,
        args=(f"tcp://127.0.0.1:{free_port()}",),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )

"""DDP capture end to end: 2 gloo ranks write one store, merged on read, equal the reference.

Each rank trains ``STEPS`` SGD steps of a DDP-wrapped model on its
``DistributedSampler`` shard with a ``HookManager`` + ``OffloadCallback`` into one
shared directory (``rank_<r>/`` per rank). The parent re-opens the directory and
checks every sample's stored gradient against ``torch.func`` at the parameters
the replicas held at that step, then scores the merged store with TracIn.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from capture_helpers import dense, flat_reference
from ddp_capture_helpers import (
    BATCH,
    CASES,
    LR,
    N_SAMPLES,
    STEPS,
    WORLD,
    Case,
    ddp_worker,
    hook_config,
    param_grad_worker,
    parameter_trajectory,
    per_sample_reference,
    scale_input,
    scale_model,
    step_rows,
    train_and_capture,
)
from free_port import free_port

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.hashing import hash_sample


def _flat_reference(case: Case, grads: dict, layer_types: dict[str, str]) -> dict:
    """``{layer: (B, d)}`` in the materialize layout, for the case's hooked layers."""
    batch = next(iter(grads.values())).shape[0]
    return {layer: flat_reference(grads, layer, layer_types[layer], batch) for layer in case.layers}


def _capture_queries(case: Case, state: dict, queries: torch.Tensor, store_dir) -> None:
    """One frozen capture step of ``queries`` at ``state`` (single process)."""
    model = case.build()
    model.load_state_dict(state)
    store = GradientStorageManager(str(store_dir))
    manager = HookManager(model, hook_config(case), callbacks=[OffloadCallback(1, store)])
    with manager.collect(deregister_on_exit=True):
        case.loss(model, case.inputs(queries)).backward()


@pytest.fixture(scope="module", params=sorted(CASES))
def ddp_run(request, tmp_path_factory):
    """Run the 2-rank DDP capture once per case; return the case, its directory and θ_t."""
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(f"ddp_{case.name}")
    states = parameter_trajectory(case)  # also imports everything before the fork
    mp.start_processes(
        ddp_worker,
        args=(case.name, f"tcp://127.0.0.1:{free_port()}", str(root / "train")),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    return case, root, states


def test_each_rank_writes_its_own_shard_directory(ddp_run):
    case, root, _ = ddp_run
    train = root / "train"
    assert sorted(p.name for p in train.iterdir()) == [f"rank_{r}" for r in range(WORLD)]
    store = GradientStorageManager(str(train))
    data = case.data()
    for row in range(N_SAMPLES):
        (entry,) = store.index[hash_sample(case.inputs(data[row]))]
        assert entry["file"].startswith(f"rank_{row % WORLD}/"), (row, entry)


def test_merged_store_matches_single_device_reference_at_each_step(ddp_run):
    case, root, states = ddp_run
    data = case.data()
    store = GradientStorageManager(str(root / "train"))
    assert store.available_steps() == list(range(STEPS))
    grads = [per_sample_reference(case, state, data) for state in states]
    layer_types = None
    seen = set()
    for row in range(N_SAMPLES):
        inputs = case.inputs(data[row])
        step = row // (WORLD * BATCH)
        ((stored_step, sample_idx),) = store.lookup(inputs)
        assert store.lookup_by_hash(hash_sample(inputs)) == [(stored_step, sample_idx)]
        assert stored_step == step, (row, stored_step)
        gradient = store.load_sample(inputs, step, sample_idx)
        assert gradient.batch_size == 1 and set(gradient.data) == set(case.layers)
        layer_types = gradient.layer_types
        expected = _flat_reference(case, grads[step], layer_types)
        for layer in case.layers:
            actual = dense(gradient, layer)[0]
            want = expected[layer][row]
            scale = want.abs().max().item()
            torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-5 * scale)
            seen.add((row, layer))
    assert len(seen) == N_SAMPLES * len(case.layers)
    # The step-1 rows really are at θ_1: at θ_0 they differ well beyond the tolerance.
    at_theta0 = _flat_reference(case, grads[0], layer_types)
    at_theta1 = _flat_reference(case, grads[1], layer_types)
    rows = step_rows(1)
    assert any(
        not torch.allclose(at_theta0[layer][rows], at_theta1[layer][rows], rtol=1e-3)
        for layer in case.layers
    )


def test_tracin_over_merged_store_equals_single_process_capture(ddp_run, tmp_path):
    case, root, states = ddp_run
    data = case.data()
    queries = case.queries()
    _capture_queries(case, states[0], queries, tmp_path / "test")
    single = tmp_path / "single"
    # One process, the global batch per step: LR / WORLD on the sum-loss gradient is DDP's update.
    train_and_capture(
        case.build(), case, [data[step_rows(s)] for s in range(STEPS)], str(single), LR / WORLD
    )
    ddp_score = TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path / "out_ddp"), use_cpu=True)
    ).attribute_from_cache(root / "train", tmp_path / "test")
    single_score = TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path / "out_single"), use_cpu=True)
    ).attribute_from_cache(single, tmp_path / "test")
    train_ids = [hash_sample(case.inputs(data[row])) for row in range(N_SAMPLES)]
    test_ids = [hash_sample(case.inputs(q)) for q in queries]
    assert sorted(ddp_score.row_train_ids) == sorted(train_ids)
    assert sorted(ddp_score.row_steps) == sorted(single_score.row_steps)
    assert sorted(ddp_score.test_ids) == sorted(test_ids)
    aware = ddp_score.query(train_ids, test_ids, trajectory="aware")
    expected = single_score.query(train_ids, test_ids, trajectory="aware")
    scale = expected.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(aware, expected, rtol=1e-5, atol=1e-5 * scale)
    # ... and both equal the reference gram <g_i(θ_step(i)), g_q(θ_0)>.
    query_grads = per_sample_reference(case, states[0], queries)
    steps = [row // (WORLD * BATCH) for row in range(N_SAMPLES)]
    (record,) = GradientStorageManager(str(tmp_path / "test")).load_all_by_hash(test_ids[0])
    layer_types = record.gradient.layer_types
    query_flat = _flat_reference(case, query_grads, layer_types)
    train_flat = [
        _flat_reference(case, per_sample_reference(case, s, data), layer_types) for s in states
    ]
    gram = torch.stack(
        [
            sum(train_flat[steps[row]][layer][row] @ query_flat[layer].T for layer in case.layers)
            for row in range(N_SAMPLES)
        ]
    )
    torch.testing.assert_close(aware, gram, rtol=1e-5, atol=1e-5 * scale)


def test_param_grad_record_under_ddp_is_the_all_reduced_gradient(tmp_path):
    mp.start_processes(
        param_grad_worker,
        args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    store = GradientStorageManager(str(tmp_path))
    model = scale_model()
    for rank in range(WORLD):
        model(scale_input(rank)).sum().backward()  # accumulates the ranks' gradients
    averaged = model[1].w.grad / WORLD  # DDP averages over ranks
    for rank in range(WORLD):
        (record,) = store.load_all_by_hash(hash_sample({"_arg0": scale_input(rank)[0]}))
        torch.testing.assert_close(record.gradient.data["1.w"], averaged, rtol=1e-6, atol=0)

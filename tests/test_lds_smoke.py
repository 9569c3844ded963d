"""Smoke test: the LDS experiment's smallest setting runs end to end and writes a table."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dattri_llm.gradient.state.snapshots import TrajectorySnapshots

FIDELITY = Path(__file__).resolve().parents[1] / "experiments" / "fidelity"


def test_subset_retraining_without_one_sample_is_the_leave_one_out_replay():
    sys.path.insert(0, str(FIDELITY))
    try:
        from setting import (
            SMOKE,
            make_data,
            make_model,
            run_subset_trajectory,
            run_trajectory,
        )
    finally:
        sys.path.remove(str(FIDELITY))
    torch.manual_seed(0)
    data = make_data(SMOKE)
    removed = 3
    loo, subset = make_model(SMOKE, data.vocab_size), make_model(SMOKE, data.vocab_size)
    subset.load_state_dict(loo.state_dict())
    run_trajectory(loo, SMOKE, data, removed=removed)
    kept = [i for i in range(SMOKE.num_finetune) if i != removed]
    run_subset_trajectory(subset, SMOKE, data, kept)
    for a, b in zip(loo.parameters(), subset.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_lds_smoke_writes_table_and_plot(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(FIDELITY / "lds.py"),
            "--smoke",
            "--out",
            str(tmp_path),
            "--cache",
            str(tmp_path / "cache"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "lds.md").read_text(encoding="utf-8")
    assert (tmp_path / "lds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([+-]\d\.\d{3}) ± \d\.\d{3} \|", table, flags=re.M))
    methods = ("Random", "Grad-Dot", "TracIn", "EK-FAC", "STRIDE", "TRAK (k=32)", "DataInf",
               "Metagradient (exact ∂L/∂w, MAGIC)", "TrackStar (k²=1024 mask)",
               "SOURCE (L=4)")  # fmt: skip
    for method in methods:
        assert method in rows, table
        assert -1.0 <= float(rows[method]) <= 1.0
    assert "Exact leave-one-out Δ as scores" in rows
    assert "Machine:" in table and "12 random subsets of 4 of the 8" in table


def _fidelity_modules(*names: str):
    sys.path.insert(0, str(FIDELITY))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(FIDELITY))


def test_library_leave_one_out_is_the_explicit_replay_and_resumes(tmp_path):
    """protocol.loo_truth (evaluation.leave_one_out over run_subset_trajectory) gives the
    Δ of explicit run_trajectory(removed=i) replays bit for bit; a rerun trains nothing."""
    protocol, scoring, setting = _fidelity_modules("protocol", "scoring", "setting")
    prepared = scoring.prepare(setting.SMOKE)
    p = prepared
    truth = protocol.loo_truth(p.start, p.setting, p.data, cache=tmp_path)
    model = scoring.fresh_model(p.start, p.setting, p.data)
    setting.run_trajectory(model, p.setting, p.data)
    reference = setting.query_losses(model, p.data)
    for row, removed in enumerate(p.data.removed):
        model = scoring.fresh_model(p.start, p.setting, p.data)
        setting.run_trajectory(model, p.setting, p.data, removed=removed)
        assert torch.equal(truth.delta[row], setting.query_losses(model, p.data) - reference)
    assert truth.removed == p.data.removed
    calls = []
    original = protocol.train_fn_for

    def counting(*args, **kwargs):
        fn = original(*args, **kwargs)
        return lambda kept, seed: calls.append(kept) or fn(kept, seed)

    protocol.train_fn_for = counting
    try:
        again = protocol.loo_truth(p.start, p.setting, p.data, cache=tmp_path)
    finally:
        protocol.train_fn_for = original
    assert calls == [] and torch.equal(again.delta, truth.delta)


def test_capture_records_the_reference_trajectory_snapshots(tmp_path):
    """Captured.snapshots holds θ_t before every update, θ_T, and every step's batch."""
    scoring, setting = _fidelity_modules("scoring", "setting")
    prepared = scoring.prepare(setting.SMOKE)
    captured = scoring.capture_with_model(prepared, tmp_path)
    snapshots = TrajectorySnapshots(captured.snapshots)
    steps = setting.SMOKE.num_steps
    assert snapshots.steps() == list(range(steps))
    p = prepared
    model = scoring.fresh_model(p.start, p.setting, p.data)
    batches = setting.batch_order(p.setting)
    seen = []

    def check(step: int) -> None:
        stored = scoring.fresh_model(p.start, p.setting, p.data)
        snapshots.load_parameters(step, stored)
        for a, b in zip(model.parameters(), stored.parameters()):
            assert torch.equal(a, b)
        batch = snapshots.load_batch(step)
        expected = setting.collate([p.data.finetune[i] for i in batches[step]])
        assert all(torch.equal(batch[k], expected[k]) for k in expected)
        seen.append(step)

    setting.run_trajectory(model, p.setting, p.data, before_step=check)
    assert seen == list(range(steps))
    final = scoring.fresh_model(p.start, p.setting, p.data)
    snapshots.load_parameters(steps, final)
    for name, value in final.named_parameters():
        assert torch.equal(value, p.reference[name]) or not value.requires_grad

"""Smoke test: the LDS experiment's smallest setting runs end to end and writes a table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
        [sys.executable, str(FIDELITY / "lds.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "lds.md").read_text(encoding="utf-8")
    assert (tmp_path / "lds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([+-]\d\.\d{3}) ± \d\.\d{3} \|", table, flags=re.M))
    for method in ("Random", "Grad-Dot", "TracIn", "EK-FAC", "STRIDE"):
        assert method in rows, table
        assert -1.0 <= float(rows[method]) <= 1.0
    assert "Exact leave-one-out Δ as scores" in rows
    assert "Machine:" in table and "12 random subsets of 4 of the 8" in table

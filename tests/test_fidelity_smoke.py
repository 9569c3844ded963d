"""Smoke test: the TSLOO experiment's smallest setting runs end to end and writes a table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "fidelity" / "tsloo.py"


@pytest.mark.parametrize("setting, stem", [("default", "tsloo"), ("trainer", "tsloo_trainer")])
def test_tsloo_smoke_writes_table_and_plot(tmp_path, setting, stem):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--setting", setting, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / f"{stem}.md").read_text(encoding="utf-8")
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([+-]\d\.\d{3}) ± \d\.\d{3} \|", table, flags=re.M))
    for method in ("Random", "Grad-Dot", "Grad-Cos", "K-FAC", "EK-FAC", "TracIn", "LESS"):
        assert method in rows, table
        assert -1.0 <= float(rows[method]) <= 1.0
    # float32 and float64 replays of a 4-step trajectory rank the removals identically
    assert float(rows["Noise ceiling (float32 vs float64 TSLOO)"]) > 0.99, table
    assert "Sign convention" in table and "Machine:" in table
    if setting == "trainer":  # the Trainer defaults: mean loss, clip 1.0, no-decay groups
        assert "clipped at 1.0" in table and "no-decay group" in table
        assert "AdamW-influence (full)" in rows

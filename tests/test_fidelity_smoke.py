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
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--setting",
            setting,
            "--out",
            str(tmp_path),
            "--cache",
            str(tmp_path / "cache"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / f"{stem}.md").read_text(encoding="utf-8")
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([+-]\d\.\d{3}) ± \d\.\d{3} \|", table, flags=re.M))
    methods = ("Random", "Grad-Dot", "Grad-Cos", "K-FAC", "EK-FAC", "TracIn", "LESS", "TRAK (k=32)",
               "DataInf", "Influence function (lm_head only)")  # fmt: skip
    for method in methods:
        assert method in rows, table
        assert -1.0 <= float(rows[method]) <= 1.0
    # float32 and float64 replays of a 4-step trajectory rank the removals identically
    assert float(rows["Noise ceiling (float32 vs float64 TSLOO)"]) > 0.99, table
    assert "Sign convention" in table and "Machine:" in table
    # the library's bootstrap 95 % interval beside every mean, the mean inside it
    cis = re.findall(r"^\| ([^|]+?) \| ([+-]\d\.\d{3}) ± \d\.\d{3} \| \[([+-]\d\.\d{3}), "
                     r"([+-]\d\.\d{3})\] \|", table, flags=re.M)  # fmt: skip
    assert len(cis) == len(rows), table
    for _name, mean, low, high in cis:
        assert float(low) <= float(mean) <= float(high)
    assert list((tmp_path / "cache").glob("*/loo_float32/results/loo-*.json")), "no resumable cache"
    if setting == "trainer":  # the Trainer defaults: mean loss, clip 1.0, no-decay groups
        assert "clipped at 1.0" in table and "no-decay group" in table
        assert "AdamW-influence (full)" in rows

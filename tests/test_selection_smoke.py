"""Smoke test: the look-ahead selection experiment's ``--smoke`` run writes its tables and plots."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "selection" / "lookahead.py"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # 35-80 s on 2 shared cores
def test_lookahead_smoke_writes_tables_and_plots(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("lookahead_heatmap.png", "lookahead_curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    table = (tmp_path / "lookahead.md").read_text(encoding="utf-8")
    for mixture in ("A", "B"):
        assert f"## Mixture {mixture}" in table
    for method in ("none", "grad-dot", "look-ahead K=1", "look-ahead K=2", "offline"):
        cells = re.findall(rf"^\| {re.escape(method)} \| \**(\d+\.\d{{4}}) ± ", table, re.M)
        assert len(cells) == 4, (method, table)  # final and tail-mean tables, per mixture
    assert table.count("| lr | best K (mean) | best K − offline |") == 2
    assert "## Step time" in table and "torch" in table and "wall time" in table
    raw = json.loads((tmp_path / "lookahead.json").read_text(encoding="utf-8"))
    assert len(raw["cells"]) == 2 * 5
    offline = [c for c in raw["cells"] if c["method"] == "offline"]
    # the offline rule keeps exactly half of each 16-sequence smoke pool
    assert [sum(c["kept"]) for c in offline] == [8, 8]

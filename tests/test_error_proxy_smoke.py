"""Smoke test: the error-proxy experiment's tiny grid runs end to end and writes its report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "fidelity" / "error_proxy.py"


@pytest.mark.slow  # ~20 s alone, about a minute on shared cores
def test_error_proxy_smoke_writes_table_and_plot(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "error_proxy.md").read_text(encoding="utf-8")
    assert (tmp_path / "error_proxy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Machine:" in table and "Wall time" in table and "torch" in table
    # one row per configuration of the 2 × 2 smoke grid, with AdamW-influence's Spearman
    rows = re.findall(r"^\| (0\.0\d+) \| (\d+) \| .*? \| ([+-]\d\.\d{3}) ± ", table, flags=re.M)
    assert len(rows) == 4, table
    assert {int(steps) for _, steps, _ in rows} == {2, 4}
    assert all(-1.0 <= float(s) <= 1.0 for _, _, s in rows)
    assert "## Across configurations" in table
    # the proxy's columns are filled exactly when the library has it
    from importlib import import_module

    sys.path.insert(0, str(SCRIPT.parent))
    has_proxy = import_module("error_proxy").proxy_available()
    assert ("**not run**" in table) != has_proxy, table

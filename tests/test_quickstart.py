"""Smoke test: examples/quickstart.py runs and its top proponents share the query's topic."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


@pytest.mark.slow
def test_quickstart_top_proponents_share_the_query_topic():
    result = subprocess.run(
        [sys.executable, str(QUICKSTART)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Grad-Cos scores (TracInAttributor" in out and "algorithm 'GradCos'" in out, out
    queries = re.findall(r"^query \[(\w+)\]", out, flags=re.M)
    top1 = re.findall(r"^  1\. \S+\s+\[(\w+)\s*\]", out, flags=re.M)
    assert len(queries) == len(top1) == 10, out
    hits = sum(q == t for q, t in zip(queries, top1))
    assert hits >= 7, out  # chance level is 2/10
    assert f"for {hits}/10 queries" in out

"""Each ```python block of README.md is a complete program: it runs alone in an empty directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", flags=re.M | re.S)
HEADING = re.compile(r"^#+ (.*)$", flags=re.M)


def readme_python_blocks() -> list[tuple[str, str]]:
    """``(section heading, code)`` of every ```python block of the README, in order."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for match in PYTHON_BLOCK.finditer(text):
        headings = HEADING.findall(text, 0, match.start())
        blocks.append((headings[-1] if headings else "top", match.group(1)))
    return blocks


BLOCKS = readme_python_blocks()


def test_readme_has_the_documented_snippets():
    sections = [section for section, _ in BLOCKS]
    assert any("Capture from your own loop" in s for s in sections), sections
    assert any("One call, live" in s for s in sections), sections
    assert any("behind an output" in s for s in sections), sections


@pytest.mark.parametrize(
    "code", [code for _, code in BLOCKS], ids=[section for section, _ in BLOCKS]
)
def test_readme_python_block_runs(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"README block failed:\n{code}\n{result.stderr[-3000:]}"

"""The README's "From the command line" section runs: its program, then each of its commands."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from dattri_llm.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def section_blocks() -> tuple[str, list[list[str]]]:
    """``(python program, [argv of each dattri-llm command])`` of the section."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## From the command line")
    section = text[start : text.index("\n## ", start + 1)]
    program = re.search(r"^```python\n(.*?)^```$", section, flags=re.M | re.S).group(1)
    bash = re.search(r"^```bash\n(.*?)^```$", section, flags=re.M | re.S).group(1)
    commands = []
    for line in bash.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            assert words[0] == "dattri-llm", line
            commands.append(words[1:])
    return program, commands


def test_readme_command_line_section_runs(tmp_path, monkeypatch, capsys):
    program, commands = section_blocks()
    assert [c[0] for c in commands] == ["capture", "attribute", "top-k", "report"]
    (tmp_path / "program.py").write_text(program, encoding="utf-8")
    subprocess.run([sys.executable, "program.py"], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert main([*argv, "--quiet"]) == 0
    page = (tmp_path / "report" / "report.html").read_text(encoding="utf-8")
    assert "the cat sat on the warm mat" in page

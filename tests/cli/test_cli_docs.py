"""docs/cli.md is the generated reference: it cannot drift from the dataclasses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dattri_llm.cli.arguments import COMMANDS, RunArguments
from dattri_llm.cli.docs import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_committed_reference_equals_the_generated_one():
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/cli.md is stale: python -m dattri_llm.cli.docs > docs/cli.md"
    )


def test_reference_lists_every_command_and_option():
    text = render()
    for command, (_, classes) in COMMANDS.items():
        assert f"## `dattri-llm {command}`" in text
        for cls in (RunArguments, *classes):
            for field in dataclasses.fields(cls):
                assert f"`--{field.name}`" in text
    assert "`dattri-llm train`" not in text

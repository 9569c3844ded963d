"""A tiny model, corpus and capture run shared by the command-line tests."""

from __future__ import annotations

import pytest
from cli_helpers import PROMPTS, QUERIES, TRAIN, capture_argv, write_jsonl, write_model

from dattri_llm.cli import main


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """``{"root", "model", "train", "query", "prompts", "capture"}``: files and one capture run."""
    root = tmp_path_factory.mktemp("cli")
    paths = {
        "root": root,
        "model": write_model(root / "model"),
        "train": write_jsonl(root / "train.jsonl", [{"text": t} for t in TRAIN]),
        "query": write_jsonl(root / "query.jsonl", [{"text": t} for t in QUERIES]),
        "prompts": write_jsonl(root / "prompts.jsonl", PROMPTS),
    }
    paths["capture"] = root / "captured"
    assert main(capture_argv(paths, paths["capture"])) == 0
    return paths

"""The stores and sample texts of a ``capture`` output directory."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dattri_llm.cli.capture import SAMPLE_FILES, STORE_DIRS
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.output import CONFIG_FILE
from dattri_llm.gradient.store.index import INDEX_FILE

__all__ = ["capture_stores", "sample_texts"]


def capture_stores(store: str) -> tuple[str, str]:
    """``(train store, query store)`` directories; ``CLIError`` unless ``store`` is a capture."""
    root = Path(store).expanduser()
    if not root.is_dir():
        raise CLIError(f"--store {root} not found")
    config = root / CONFIG_FILE
    recorded = yaml.safe_load(config.read_text(encoding="utf-8")) if config.is_file() else None
    if not isinstance(recorded, dict) or recorded.get("command") != "capture":
        raise CLIError(f"--store {root} is not the output directory of `dattri-llm capture`")
    dirs = tuple(root / STORE_DIRS[side] for side in ("train", "query"))
    for directory in dirs:
        if not (directory / INDEX_FILE).is_file():
            raise CLIError(f"--store {root}: gradient store {directory} is missing or empty")
    return str(dirs[0]), str(dirs[1])


def sample_texts(store: str, side: str) -> dict[str, str]:
    """``{sample id: text}`` of one side (``{}`` when the capture wrote none)."""
    path = Path(store).expanduser() / SAMPLE_FILES[side]
    if not path.is_file():
        return {}
    texts = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        text = row.get("text")
        if text is None:
            text = f"{row.get('prompt', '')} ▸ {row.get('completion', '')}"
        texts[row["id"]] = text
    return texts

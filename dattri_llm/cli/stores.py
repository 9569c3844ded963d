"""The stores, sample texts, settings and re-tokenized samples of a ``capture`` output directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dattri_llm.cli.arguments import CaptureArguments, DataArguments, ModelArguments
from dattri_llm.cli.data import TokenizedSet, tokenize
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.model import load_tokenizer
from dattri_llm.cli.output import CONFIG_FILE, SAMPLE_FILES, STORE_DIRS
from dattri_llm.gradient.store.index import INDEX_FILE

__all__ = [
    "capture_arguments",
    "capture_config",
    "capture_stores",
    "captured_sets",
    "config_arguments",
    "display_text",
    "is_trained",
    "sample_rows",
    "sample_texts",
]


def capture_config(store: str) -> dict[str, Any]:
    """The resolved ``config.yaml`` of a capture; ``CLIError`` unless ``store`` is a capture."""
    root = Path(store).expanduser()
    if not root.is_dir():
        raise CLIError(f"--store {root} not found")
    config = root / CONFIG_FILE
    recorded = yaml.safe_load(config.read_text(encoding="utf-8")) if config.is_file() else None
    if not isinstance(recorded, dict) or recorded.get("command") != "capture":
        raise CLIError(f"--store {root} is not the output directory of `dattri-llm capture`")
    return recorded


def is_trained(store: str) -> bool:
    """Whether a capture recorded a training run (``capture --train``), not a frozen pass."""
    return bool(capture_config(store).get("train", False))


def capture_stores(store: str) -> tuple[str, str]:
    """``(train store, query store)`` directories; ``CLIError`` unless ``store`` is a capture."""
    capture_config(store)
    root = Path(store).expanduser()
    dirs = tuple(root / STORE_DIRS[side] for side in ("train", "query"))
    for directory in dirs:
        if not (directory / INDEX_FILE).is_file():
            raise CLIError(f"--store {root}: gradient store {directory} is missing or empty")
    return str(dirs[0]), str(dirs[1])


def config_arguments(cls: type, config: dict[str, Any], **override: Any) -> Any:
    """An instance of the dataclass ``cls`` from a recorded config's fields (``override`` wins)."""
    names = set(cls.__dataclass_fields__)
    return cls(**{**{k: v for k, v in config.items() if k in names}, **override})


def capture_arguments(store: str) -> tuple[ModelArguments, CaptureArguments, dict[str, Any]]:
    """The model and layer selection a capture ran with, and its whole resolved config."""
    config = capture_config(store)
    model = config_arguments(ModelArguments, config)
    return model, config_arguments(CaptureArguments, config), config


def sample_rows(store: str, side: str) -> list[dict[str, Any]]:
    """The rows of one side's samples file (``[]`` when the capture wrote none)."""
    path = Path(store).expanduser() / SAMPLE_FILES[side]
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def sample_texts(store: str, side: str) -> dict[str, str]:
    """``{sample id: text}`` of one side (``{}`` when the capture wrote none)."""
    return {row["id"]: display_text(row) for row in sample_rows(store, side)}


def display_text(sample: dict[str, Any]) -> str:
    """One line of a sample's text, prompt ▸ completion, or chat messages (role: content)."""
    if "messages" in sample:
        return " | ".join(f"{m['role']}: {m['content']}" for m in sample["messages"])
    text = sample.get("text")
    if text is None:
        text = f"{sample.get('prompt', '')} ▸ {sample.get('completion', '')}"
    return text


def captured_sets(store: str, tokenizer: Any | None = None) -> dict[str, TokenizedSet]:
    """Both sides' samples tokenized again as the capture did, ids checked against the capture.

    ``tokenizer`` defaults to the capture's (``CLIError`` when it cannot be
    loaded, or when it does not give the captured identifiers back).
    """
    model_args, _capture, config = capture_arguments(store)
    tokenizer = load_tokenizer(model_args) if tokenizer is None else tokenizer
    sets = {}
    for side in ("train", "query"):
        rows = sample_rows(store, side)
        if not rows:
            raise CLIError(f"--store {store}: {SAMPLE_FILES[side]} is missing or empty")
        prompted = "prompt" in rows[0]
        data = config_arguments(
            DataArguments,
            config,
            text_field="text",
            prompt_field="prompt" if prompted else None,
            completion_field="completion" if prompted else None,
            messages_field="messages" if "messages" in rows[0] else None,
        )
        records = [
            {k: row[k] for k in ("text", "prompt", "completion", "messages") if k in row}
            for row in rows
        ]
        tokenized = tokenize(records, tokenizer, data, side)
        if tokenized.ids != [row["id"] for row in rows]:
            raise CLIError(
                f"--store {store}: the tokenizer {model_args.tokenizer or model_args.model!r} "
                f"does not give back the captured {side} samples (their ids differ)"
            )
        sets[side] = tokenized
    return sets

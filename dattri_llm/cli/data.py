"""Data loading: a local file or saved dataset → tokenized samples ready to stream.

Accepted: a ``.jsonl`` / ``.json`` file (one object a line, or a list of
objects), a ``.txt`` file (one sample a line, field ``text``), a ``.parquet``
file, or a ``datasets.save_to_disk`` directory. Each sample becomes
``{"input_ids", "attention_mask", "labels"}`` right-padded to the longest
sample of its set; padding and, with a prompt/completion pair, the prompt's
tokens (with chat messages, every message but the assistant's) get label
``-100`` (no loss). Identifiers are the library's content
hashes of the model inputs (``input_ids`` and ``attention_mask``), so they equal
the ids the stores record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dattri_llm.cli.arguments import DataArguments
from dattri_llm.cli.errors import CLIError
from dattri_llm.utils.hashing import hash_sample, occurrence_ids

__all__ = ["TokenizedSet", "load_records", "tokenize"]

IGNORE_INDEX = -100


@dataclass
class TokenizedSet:
    """One set's samples (padded tensors), identifiers and texts, in file order."""

    samples: list[dict[str, torch.Tensor]]
    ids: list[str]
    texts: list[dict[str, str]]


def load_records(path: str) -> list[dict[str, Any]]:
    """The records of a local data file or a ``save_to_disk`` directory."""
    source = Path(path).expanduser()
    if not source.exists():
        raise CLIError(f"data file {source} not found")
    if source.is_dir() or source.suffix.lower() == ".parquet":
        return _dataset_records(source)
    suffix = source.suffix.lower()
    text = source.read_text(encoding="utf-8")
    if suffix == ".txt":
        return [{"text": line} for line in text.splitlines() if line.strip()]
    if suffix in (".jsonl", ".json"):
        return _json_records(source, text)
    raise CLIError(f"{source}: unknown data format {suffix!r}; use .jsonl, .json, .txt or .parquet")


def _dataset_records(source: Path) -> list[dict[str, Any]]:
    """The records of a ``.parquet`` file or a ``save_to_disk`` directory (needs ``datasets``)."""
    try:  # optional dependency: only these two formats need it
        import datasets
    except ImportError as err:
        raise CLIError(
            f"{source}: reading parquet files and saved datasets needs the datasets package; "
            'pip install "dattri_llm[cli]" (or use a .jsonl / .txt file)'
        ) from err
    if source.suffix.lower() == ".parquet" and not source.is_dir():
        return [dict(row) for row in datasets.Dataset.from_parquet(str(source))]
    try:
        loaded = datasets.load_from_disk(str(source))
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(f"{source} is not a datasets.save_to_disk directory: {err}") from err
    if isinstance(loaded, datasets.DatasetDict):
        raise CLIError(
            f"{source} holds a DatasetDict with splits {list(loaded)}; point at one split"
        )
    return [dict(row) for row in loaded]


def _json_records(source: Path, text: str) -> list[dict[str, Any]]:
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            records = json.loads(stripped)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise CLIError(f"{source} is not valid JSON lines: {err}") from err
    if not all(isinstance(r, dict) for r in records):
        raise CLIError(f"{source}: every record must be a JSON object")
    return records


def _field(record: dict[str, Any], name: str, where: str) -> str:
    if name not in record:
        raise CLIError(
            f"{where}: no field {name!r} (fields: {sorted(record)}); set --text_field "
            "or --prompt_field/--completion_field"
        )
    return str(record[name])


def tokenize(
    records: list[dict[str, Any]], tokenizer: Any, args: DataArguments, name: str
) -> TokenizedSet:
    """Token ids, attention masks and labels of ``records`` (``name``: the set, for errors)."""
    if not records:
        raise CLIError(f"the {name} set is empty")
    rows, texts = [], []
    for i, record in enumerate(records):
        where = f"{name} record {i}"
        if args.messages_field is not None:
            ids, labels = chat_tokens(record, tokenizer, args.messages_field, where)
            ids, labels = ids[: args.max_length], labels[: args.max_length]
            texts.append({"messages": record[args.messages_field]})
        elif args.prompt_field is not None:
            prompt = _field(record, args.prompt_field, where)
            completion = _field(record, args.completion_field, where)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
            ids = (prompt_ids + completion_ids)[: args.max_length]
            labels = ([IGNORE_INDEX] * len(prompt_ids) + completion_ids)[: args.max_length]
            texts.append({"prompt": prompt, "completion": completion})
        else:
            text = _field(record, args.text_field, where)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.max_length]
            labels = list(ids)
            texts.append({"text": text})
        if len(ids) < 2 or all(label == IGNORE_INDEX for label in labels[1:]):
            raise CLIError(f"{where} has no token to score (needs 2+ tokens, one not masked)")
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    samples = []
    for ids, labels in rows:
        fill = width - len(ids)
        samples.append(
            {
                "input_ids": torch.tensor(ids + [pad] * fill),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * fill),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * fill),
            }
        )
    ids = occurrence_ids([hash_sample(model_inputs(s)) for s in samples])
    return TokenizedSet(samples, ids, texts)


def chat_tokens(
    record: dict[str, Any], tokenizer: Any, field_name: str, where: str
) -> tuple[list[int], list[int]]:
    """Token ids and labels of a chat record, only the assistant messages' tokens scored.

    Each message's tokens are the ones the chat template adds for it: the ids
    of ``messages[: i + 1]`` extend those of ``messages[:i]``, which must be a
    prefix (``CLIError`` otherwise: the template rewrites earlier turns).
    """
    messages = record.get(field_name)
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise CLIError(
            f"{where}: field {field_name!r} must be a list of {{'role', 'content'}} messages "
            f"(fields: {sorted(record)})"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise CLIError(
            "--messages_field needs a tokenizer with a chat template (tokenizer.chat_template "
            "is unset); use --text_field or --prompt_field/--completion_field instead"
        )
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        prefix = _chat_ids(tokenizer, messages[: i + 1])
        if prefix[: len(ids)] != ids:
            raise CLIError(
                f"{where}: the chat template renders message {i} by changing the tokens of "
                "the earlier ones, so its tokens cannot be told apart; use "
                "--prompt_field/--completion_field"
            )
        added = prefix[len(ids) :]
        scored = message["role"] == "assistant"
        labels += list(added) if scored else [IGNORE_INDEX] * len(added)
        ids = prefix
    return ids, labels


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (a flat list)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def model_inputs(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fields the model is called with (what a sample's identifier hashes)."""
    return {"input_ids": sample["input_ids"], "attention_mask": sample["attention_mask"]}

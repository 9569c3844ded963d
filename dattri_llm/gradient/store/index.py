"""The store's index: the append-only ``index.jsonl`` log and the live identifier map.

The log gets one compact, fsynced line per group; reading stops (with a
`UserWarning`) at a truncated last line, and the writer repairs that tail
before appending. In memory, `StoreIndex` maps ``identifier → occurrences``,
holds each (step, identifier) pair once and tracks which rows of every group
are still indexed; the identifier of a sample is its content hash or its
``sample_id_key`` value.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dattri_llm.gradient.model.container import GradientRecord
from dattri_llm.gradient.store.format import stored_hashes
from dattri_llm.utils.hashing import hash_sample

INDEX_FILE = "index.jsonl"

# --------------------------------------------------------------------------- the log


def read_log(path: Path) -> list[dict[str, Any]]:
    """Decoded lines of an index log, up to the first line that does not decode.

    Blank lines are skipped; an undecodable line (a truncated last line from an
    interrupted write) stops the reading of this log with a `UserWarning`.
    """
    entries = []
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.warn(
                f"gradient store index {path}: ignoring line {number} and anything after it "
                f"(a truncated last line from an interrupted write, or a corrupt index); the "
                f"groups it described are not indexed, earlier records are intact.",
                UserWarning,
                stacklevel=4,
            )
            break
    return entries


def repair_log_tail(path: Path) -> None:
    """Before appending: terminate a complete last line, cut an unterminated partial one."""
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:])
    except (json.JSONDecodeError, UnicodeDecodeError):
        with open(path, "r+b") as fh:
            fh.truncate(start)
            fh.flush()
            os.fsync(fh.fileno())
        return
    with open(path, "ab") as fh:
        fh.write(b"\n")
        fh.flush()
        os.fsync(fh.fileno())


def append_log_line(path: Path, line: Mapping[str, Any]) -> None:
    """Append one compact JSON line in a single write, flushed and fsynced."""
    data = (json.dumps(line, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- identifiers


def stringify_identifier(value: object) -> str:
    """An identifier as ``str``: one-element tensors / arrays by their item, else ``str()``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return str(value.item())
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        return str(value.item())
    return str(value)


def record_identifiers(record: GradientRecord) -> list[str]:
    """``record``'s identifiers as a list of ``str`` (one for a single identifier)."""
    hashes = stored_hashes(record)
    return [hashes] if isinstance(hashes, str) else hashes


def sample_identifier(inputs: object, key: str | int | None) -> str:
    """Identifier of one sample's inputs under the identifier scheme ``key``."""
    if key is None:
        return hash_sample(inputs)
    if isinstance(key, int) and not isinstance(inputs, Mapping):
        if not isinstance(inputs, Sequence) or not -len(inputs) <= key < len(inputs):
            raise KeyError(
                f"sample_id_key={key} (positional argument) is not in the given inputs of "
                f"type {type(inputs).__name__}."
            )
        return stringify_identifier(inputs[key])
    if isinstance(key, int):
        for candidate in (f"_arg{key}", key):
            if candidate in inputs:
                return stringify_identifier(inputs[candidate])
        raise KeyError(
            f"sample_id_key={key}: inputs have neither '_arg{key}' nor {key}; "
            f"fields: {sorted(map(str, inputs))}."
        )
    if key not in inputs:
        raise KeyError(
            f"sample_id_key={key!r} is missing from the inputs; fields: {sorted(map(str, inputs))}."
        )
    return stringify_identifier(inputs[key])


def check_indexable(records: list[GradientRecord], save_dir: Path) -> None:
    """`TypeError` / `ValueError` unless ``records`` form one group the index can describe.

    The group must be non-empty, hold `GradientRecord` s only, one identifier
    per sample for list identifiers, and a single ``sample_id_key``.
    """
    if not records:
        raise ValueError(f"save_bulk: no records to save (store {save_dir}).")
    for position, record in enumerate(records):
        if not isinstance(record, GradientRecord):
            raise TypeError(
                f"save_bulk: records[{position}] is a {type(record).__name__}, not a "
                f"GradientRecord."
            )
        if isinstance(record.input_hash, str):
            continue  # one identifier for the whole batch: indexed once, read back whole
        batch = record.gradient.batch_size
        if len(record.input_hash) != batch:
            raise ValueError(
                f"save_bulk: records[{position}] (step {record.step}) has "
                f"{len(record.input_hash)} identifiers but its gradient has batch size "
                f"{batch}; pass one identifier per sample in batch order."
            )
    keys = {record.sample_id_key for record in records}
    if len(keys) > 1:
        raise ValueError(
            f"save_bulk: records mix sample_id_key values {sorted(map(repr, keys))}; a "
            f"store uses one identifier scheme."
        )


def _keep_rows(record: GradientRecord, rows: list[int]) -> GradientRecord:
    """``record`` restricted to the samples at ``rows`` (its other rows were re-saved later)."""
    hashes = list(record.input_hash)
    return GradientRecord(
        step=record.step,
        input_hash=[hashes[k] for k in rows],
        gradient=record.gradient.slice("batch", rows),
        sample_id_key=record.sample_id_key,
    )


# --------------------------------------------------------------------------- the live index


@dataclass
class _GroupInfo:
    """Per record of a group: its step, identifiers and the rows still indexed (live)."""

    steps: list[int]
    identifiers: list[list[str]]
    live: list[set[int]] = field(default_factory=list)


class StoreIndex:
    """Live ``identifier → occurrences`` map and the indexed rows of every group.

    Indexing a group drops the earlier occurrences of its (step, identifier)
    pairs; a group left without an indexed row is forgotten, and ``on_forget``
    (when set) is called with its location so that its residency releases it.
    ``revision`` counts the changes: equal revisions mean an unchanged index.
    """

    def __init__(self) -> None:
        self.occurrences: dict[str, list[dict[str, Any]]] = {}
        self.groups: dict[str, _GroupInfo] = {}
        self.on_forget: Callable[[str], None] | None = None
        self.revision = 0

    def add_group(self, location: str, described: list[tuple[int, list[str]]]) -> None:
        """Index a group; its (step, identifier) pairs replace earlier occurrences."""
        self.revision += 1
        if location in self.groups:  # the same handle written again (save of the same pair)
            self.forget_group(location)
        for step, identifiers in described:
            for identifier in identifiers:
                self._supersede(identifier, step)
        info = _GroupInfo([step for step, _ in described], [ids for _, ids in described])
        self.groups[location] = info
        for idx, (step, identifiers) in enumerate(described):
            info.live.append(set(range(len(identifiers))))
            for sample_idx, identifier in enumerate(identifiers):
                self.occurrences.setdefault(identifier, []).append(
                    {"file": location, "idx": idx, "step": step, "sample_idx": sample_idx}
                )

    def _supersede(self, identifier: str, step: int) -> None:
        """Drop the indexed occurrences of ``identifier`` at ``step`` (a newer save replaces it)."""
        entries = self.occurrences.get(identifier)
        if not entries:
            return
        kept = [e for e in entries if e["step"] != step]
        for entry in entries:
            if entry["step"] == step:
                self._drop_row(entry)
        if kept:
            self.occurrences[identifier] = kept
        else:
            del self.occurrences[identifier]

    def _drop_row(self, entry: Mapping[str, Any]) -> None:
        info = self.groups[entry["file"]]
        info.live[entry["idx"]].discard(entry["sample_idx"])
        if not any(info.live):
            self.forget_group(entry["file"])

    def forget_group(self, location: str) -> None:
        """Remove a group from the bookkeeping (and its entries from the index)."""
        self.revision += 1
        info = self.groups.pop(location)
        for idx, identifiers in enumerate(info.identifiers):
            for sample_idx in info.live[idx]:
                identifier = identifiers[sample_idx]
                kept = [
                    e
                    for e in self.occurrences.get(identifier, [])
                    if not (e["file"] == location and e["idx"] == idx)
                ]
                if kept:
                    self.occurrences[identifier] = kept
                else:
                    self.occurrences.pop(identifier, None)
        if self.on_forget is not None:
            self.on_forget(location)

    def relocate(self, old: str, new: str) -> None:
        """Re-point an indexed group's location and index entries from ``old`` to ``new``."""
        info = self.groups.pop(old, None)
        if info is None:  # a new group that went straight to disk: indexed by the caller
            return
        self.revision += 1
        self.groups[new] = info
        for identifier in {i for ids in info.identifiers for i in ids}:
            for entry in self.occurrences.get(identifier, []):
                if entry["file"] == old:
                    entry["file"] = new

    def available_steps(self) -> list[int]:
        """Distinct steps of the indexed records, ascending."""
        return sorted(
            {
                step
                for info in self.groups.values()
                for step, live in zip(info.steps, info.live)
                if live
            }
        )

    def records_by_step(self, location: str, wanted: set[int]) -> dict[int, list[int]]:
        """``{step: record idxs}`` of a group's records at the ``wanted`` steps with a live row."""
        info = self.groups[location]
        by_step: dict[int, list[int]] = {}
        for idx, (step, live) in enumerate(zip(info.steps, info.live)):
            if step in wanted and live:
                by_step.setdefault(step, []).append(idx)
        return by_step

    def keep_live_rows(self, location: str, records: list[GradientRecord]) -> list[GradientRecord]:
        """``records`` of a group with the samples that were re-saved later left out (in place)."""
        info = self.groups[location]
        for idx, (identifiers, live) in enumerate(zip(info.identifiers, info.live)):
            if live and len(live) < len(identifiers):
                records[idx] = _keep_rows(records[idx], sorted(live))
        return records

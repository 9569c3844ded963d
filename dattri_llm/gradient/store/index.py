"""The store's index: the append-only ``index.jsonl`` log and the live identifier map.

The log gets one compact, fsynced line per group; reading stops (with a
`UserWarning`) at a truncated last line, and the writer repairs that tail
before appending; a store is opened by reading its log one line at a time.
In memory, `StoreIndex` maps ``identifier → occurrences``, holds each (step,
identifier) pair once and tracks which rows of every group are still indexed,
in numpy columns (one row per indexed sample) plus one dict from identifier to
its first row; `IndexView` shows it as the read-only mapping of occurrence
dicts. The identifier of a sample is its content hash or its ``sample_id_key``
value.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from collections.abc import (
    Callable,
    ItemsView,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
    ValuesView,
)
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dattri_llm.gradient.model.container import GradientRecord
from dattri_llm.gradient.store.format import stored_hashes
from dattri_llm.utils.hashing import hash_sample

INDEX_FILE = "index.jsonl"

# --------------------------------------------------------------------------- the log


def read_log(path: Path) -> Iterator[dict[str, Any]]:
    """Decoded lines of an index log, one at a time, up to the first line that does not decode.

    Blank lines are skipped; an undecodable line (a truncated last line from an
    interrupted write) stops the reading of this log with a `UserWarning`. The
    file is read line by line, so opening a store holds one decoded line at a
    time besides the index it builds.
    """
    with open(path, "rb") as log:
        yield from _decoded_lines(path, log)


def _decoded_lines(path: Path, lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.warn(
                f"gradient store index {path}: ignoring line {number} and anything after it "
                f"(a truncated last line from an interrupted write, or a corrupt index); the "
                f"groups it described are not indexed, earlier records are intact.",
                UserWarning,
                stacklevel=5,
            )
            return
        yield entry


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

_NONE = -1
_COMPACT_MIN_ROWS = 1024  # forgotten rows are dropped once above this and the indexed rows


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` with room for at least ``size`` entries (capacity doubled, new entries zero)."""
    if size <= len(array):
        return array
    bigger = np.zeros(max(size, 2 * len(array), 64), dtype=array.dtype)
    bigger[: len(array)] = array
    return bigger


class StoreIndex:
    """Live ``identifier → occurrences`` index of a store, held in columns.

    Indexing a group drops the earlier occurrences of its (step, identifier)
    pairs; a group left without an indexed row is forgotten, and ``on_forget``
    (when set) is called with its location so that its residency releases it.
    ``revision`` counts the changes: equal revisions mean an unchanged index.

    Layout (a few dozen bytes per indexed sample besides its identifier, where
    a dict of occurrence dicts took about 500): one *row* per indexed sample
    occurrence, one *record* per stored `GradientRecord` and one *group* per
    stored group, each kept in numpy columns; a group's records and a record's
    rows are contiguous. ``_heads`` maps an identifier to its first live row
    and ``_row_next`` chains its live rows in indexing order; ``_row_ids``
    holds each row's identifier (the same ``str`` object as the ``_heads``
    key). Rows of forgotten groups are dropped from the columns once they
    outnumber the indexed ones. :attr:`occurrences` shows it all as the
    read-only ``{identifier: [{"file", "idx", "step", "sample_idx"}, ...]}``
    mapping the store has always exposed.
    """

    def __init__(self) -> None:
        self.groups: dict[str, int] = {}  # location -> group number
        self.on_forget: Callable[[str], None] | None = None
        self.revision = 0
        self._heads: dict[str, int] = {}
        self._row_ids: list[str] = []
        self._row_record = np.zeros(0, dtype=np.int64)
        self._row_sample = np.zeros(0, dtype=np.int32)
        self._row_next = np.zeros(0, dtype=np.int64)
        self._row_live = np.zeros(0, dtype=bool)
        self._rec_group = np.zeros(0, dtype=np.int64)
        self._rec_step = np.zeros(0, dtype=np.int64)
        self._rec_first_row = np.zeros(0, dtype=np.int64)
        self._rec_live = np.zeros(0, dtype=np.int64)
        self._grp_first_record = np.zeros(0, dtype=np.int64)
        self._grp_live = np.zeros(0, dtype=np.int64)
        self._files: list[str | None] = []  # group number -> location (None: forgotten)
        self._rows = self._records = 0
        self._dead_rows = 0  # rows of forgotten groups, still in the columns
        self._steps: tuple[int, list[int]] | None = None  # (revision, available steps)

    @property
    def occurrences(self) -> Mapping[str, list[dict[str, Any]]]:
        """Read-only live view ``identifier → [{"file", "idx", "step", "sample_idx"}, ...]``.

        Identifiers in indexing order (one whose occurrences were all dropped
        and that was indexed again comes last), each one's occurrences in
        indexing order; the entries are built on access.
        """
        return IndexView(self)

    # ----------------------------------------------------------------- changes
    def add_group(self, location: str, described: list[tuple[int, list[str]]]) -> None:
        """Index a group; its (step, identifier) pairs replace earlier occurrences."""
        self.revision += 1
        if location in self.groups:  # the same handle written again (save of the same pair)
            self.forget_group(location)
        heads = self._heads
        for step, identifiers in described:
            for identifier in identifiers:
                if identifier in heads:
                    self._supersede(identifier, step)
        rows = sum(len(identifiers) for _, identifiers in described)
        self._append_group(location, described, rows)
        if self._dead_rows > max(_COMPACT_MIN_ROWS, self._rows - self._dead_rows):
            self._compact()

    def _append_group(
        self, location: str, described: list[tuple[int, list[str]]], rows: int
    ) -> None:
        group, first_record, first_row = len(self._files), self._records, self._rows
        records = len(described)
        self._files.append(location)
        self.groups[location] = group
        self._grp_first_record = _grown(self._grp_first_record, group + 1)
        self._grp_live = _grown(self._grp_live, group + 1)
        self._grp_first_record[group] = first_record
        self._grp_live[group] = rows
        end_record = first_record + records
        for name in ("_rec_group", "_rec_step", "_rec_first_row", "_rec_live"):
            setattr(self, name, _grown(getattr(self, name), end_record))
        counts = np.fromiter((len(ids) for _, ids in described), dtype=np.int64, count=records)
        self._rec_group[first_record:end_record] = group
        self._rec_step[first_record:end_record] = [step for step, _ in described]
        self._rec_first_row[first_record:end_record] = first_row + np.cumsum(counts) - counts
        self._rec_live[first_record:end_record] = counts
        end_row = first_row + rows
        for name in ("_row_record", "_row_sample", "_row_next", "_row_live"):
            setattr(self, name, _grown(getattr(self, name), end_row))
        self._row_record[first_row:end_row] = np.repeat(
            np.arange(first_record, end_record, dtype=np.int64), counts
        )
        self._row_sample[first_row:end_row] = np.arange(rows) - np.repeat(
            self._rec_first_row[first_record:end_record] - first_row, counts
        )
        self._row_next[first_row:end_row] = _NONE
        self._row_live[first_row:end_row] = True
        heads, row_ids, row_next = self._heads, self._row_ids, self._row_next
        row = first_row
        for _, identifiers in described:
            for identifier in identifiers:
                head = heads.get(identifier)
                if head is None:
                    heads[identifier] = row
                    row_ids.append(identifier)
                else:  # another occurrence: chained after the identifier's last live row
                    tail = head
                    while row_next[tail] != _NONE:
                        tail = int(row_next[tail])
                    row_next[tail] = row
                    row_ids.append(row_ids[head])
                row += 1
        self._records, self._rows = end_record, end_row

    def _supersede(self, identifier: str, step: int) -> None:
        """Drop the indexed occurrences of ``identifier`` at ``step`` (a newer save replaces it)."""
        row, previous = self._heads[identifier], _NONE
        while row != _NONE:
            following = int(self._row_next[row])
            if self._rec_step[self._row_record[row]] == step:
                self._unlink(identifier, row, previous, following)
                self._drop_row(row)
            else:
                previous = row
            row = following

    def _unlink(self, identifier: str, row: int, previous: int, following: int) -> None:
        """Take ``row`` out of ``identifier``'s chain (``previous`` precedes it there)."""
        if previous == _NONE:
            if following == _NONE:
                del self._heads[identifier]
            else:
                self._heads[identifier] = following
        else:
            self._row_next[previous] = following
        self._row_next[row] = _NONE

    def _drop_row(self, row: int) -> None:
        """Mark ``row`` as no longer indexed; forget its group once none of its rows is."""
        self._row_live[row] = False
        record = int(self._row_record[row])
        group = int(self._rec_group[record])
        self._rec_live[record] -= 1
        self._grp_live[group] -= 1
        if self._grp_live[group] == 0:
            self.forget_group(self._files[group])

    def forget_group(self, location: str) -> None:
        """Remove a group from the bookkeeping (and its entries from the index)."""
        self.revision += 1
        group = self.groups.pop(location)
        first, end = self._row_range(group)
        for row in (first + np.flatnonzero(self._row_live[first:end])).tolist():
            identifier = self._row_ids[row]
            previous, current = _NONE, self._heads[identifier]
            while current != row:
                previous, current = current, int(self._row_next[current])
            self._unlink(identifier, row, previous, int(self._row_next[row]))
        self._row_live[first:end] = False
        records = self._record_range(group)
        self._rec_live[records[0] : records[1]] = 0
        self._grp_live[group] = 0
        self._files[group] = None
        self._dead_rows += end - first
        if self.on_forget is not None:
            self.on_forget(location)

    def relocate(self, old: str, new: str) -> None:
        """Re-point an indexed group's location and index entries from ``old`` to ``new``."""
        group = self.groups.pop(old, None)
        if group is None:  # a new group that went straight to disk: indexed by the caller
            return
        self.revision += 1
        self.groups[new] = group
        self._files[group] = new

    def _compact(self) -> None:
        """Drop the rows, records and groups of forgotten groups from the columns."""
        kept_groups = np.array(sorted(self.groups.values()), dtype=np.int64)
        records, rows = self._records, self._rows
        group_records = np.diff(np.append(self._grp_first_record[: len(self._files)], records))
        record_rows = np.diff(np.append(self._rec_first_row[:records], rows))
        kept_records = _ranges([self._record_range(g) for g in kept_groups.tolist()])
        kept_rows = _ranges([self._row_range(g) for g in kept_groups.tolist()])
        new_row = np.full(rows, _NONE, dtype=np.int64)
        new_row[kept_rows] = np.arange(len(kept_rows))
        new_record = np.full(records, _NONE, dtype=np.int64)
        new_record[kept_records] = np.arange(len(kept_records))
        new_group = np.full(len(self._files), _NONE, dtype=np.int64)
        new_group[kept_groups] = np.arange(len(kept_groups))

        row_next = self._row_next[kept_rows]
        chained = row_next != _NONE
        row_next[chained] = new_row[row_next[chained]]
        self._row_next = row_next
        self._row_record = new_record[self._row_record[kept_rows]]
        self._row_sample = self._row_sample[kept_rows]
        self._row_live = self._row_live[kept_rows]
        self._row_ids = [self._row_ids[row] for row in kept_rows.tolist()]
        counts = record_rows[kept_records]
        self._rec_first_row = np.cumsum(counts) - counts
        self._rec_group = new_group[self._rec_group[kept_records]]
        self._rec_step = self._rec_step[kept_records]
        self._rec_live = self._rec_live[kept_records]
        counts = group_records[kept_groups]
        self._grp_first_record = np.cumsum(counts) - counts
        self._grp_live = self._grp_live[kept_groups]
        self._files = [self._files[g] for g in kept_groups.tolist()]
        self.groups = {location: int(new_group[g]) for location, g in self.groups.items()}
        self._heads = {identifier: int(new_row[row]) for identifier, row in self._heads.items()}
        self._rows, self._records, self._dead_rows = len(kept_rows), len(kept_records), 0

    # ----------------------------------------------------------------- reading
    def _record_start(self, group: int) -> int:
        """First record number of a group (the record count past the last group)."""
        return int(self._grp_first_record[group]) if group < len(self._files) else self._records

    def _row_start(self, record: int) -> int:
        """First row number of a record (the row count past the last record)."""
        return int(self._rec_first_row[record]) if record < self._records else self._rows

    def _record_range(self, group: int) -> tuple[int, int]:
        """``[first, end)`` record numbers of a group."""
        return self._record_start(group), self._record_start(group + 1)

    def _row_range(self, group: int) -> tuple[int, int]:
        """``[first, end)`` row numbers of a group."""
        first, end = self._record_range(group)
        return self._row_start(first), self._row_start(end)

    def entries(self, identifier: str) -> list[dict[str, Any]]:
        """The occurrence dicts of an identifier in indexing order (`KeyError` if not indexed)."""
        row = self._heads[identifier]
        found = []
        while row != _NONE:
            record = int(self._row_record[row])
            group = int(self._rec_group[record])
            found.append(
                {
                    "file": self._files[group],
                    "idx": record - int(self._grp_first_record[group]),
                    "step": int(self._rec_step[record]),
                    "sample_idx": int(self._row_sample[row]),
                }
            )
            row = int(self._row_next[row])
        return found

    def rows(
        self, steps: Iterable[int] | None = None, chunk: int = 65536
    ) -> Iterator[tuple[str, int, str, int, int]]:
        """``(identifier, step, location, idx, sample_idx)`` of every live occurrence.

        In indexing order (identifiers as :attr:`occurrences` lists them, each
        one's occurrences in order); ``steps`` keeps those at these steps. Built
        from the columns ``chunk`` identifiers at a time, as plain tuples.
        """
        wanted = None if steps is None else np.array(sorted({int(s) for s in steps}))
        pairs = iter(self._heads.items())
        while True:
            batch = list(itertools.islice(pairs, chunk))
            if not batch:
                return
            rows = np.fromiter((row for _, row in batch), dtype=np.int64, count=len(batch))
            positions = np.arange(len(batch))
            found, found_at = [rows], [positions]
            while True:  # the further occurrences of each identifier, one per round
                following = self._row_next[rows]
                chained = following != _NONE
                if not chained.any():
                    break
                rows, positions = following[chained], positions[chained]
                found.append(rows)
                found_at.append(positions)
            rows, positions = np.concatenate(found), np.concatenate(found_at)
            if len(found) > 1:  # identifier by identifier, each one's rounds in order
                order = np.argsort(positions, kind="stable")
                rows, positions = rows[order], positions[order]
            records = self._row_record[rows]
            at_step = self._rec_step[records]
            if wanted is not None:
                kept = np.isin(at_step, wanted)
                rows, positions, records, at_step = (
                    rows[kept],
                    positions[kept],
                    records[kept],
                    at_step[kept],
                )
            groups = self._rec_group[records]
            yield from zip(
                [batch[p][0] for p in positions.tolist()],
                at_step.tolist(),
                [self._files[g] for g in groups.tolist()],
                (records - self._grp_first_record[groups]).tolist(),
                self._row_sample[rows].tolist(),
            )

    def iter_entries(self) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        """``(identifier, occurrence dicts)`` of every identifier, in indexing order."""
        for identifier, occurrences in itertools.groupby(self.rows(), key=lambda row: row[0]):
            yield (
                identifier,
                [
                    {"file": location, "idx": idx, "step": step, "sample_idx": sample_idx}
                    for _, step, location, idx, sample_idx in occurrences
                ],
            )

    def available_steps(self) -> list[int]:
        """Distinct steps of the indexed records, ascending."""
        if self._steps is None or self._steps[0] != self.revision:
            live = self._rec_live[: self._records] > 0
            self._steps = (self.revision, np.unique(self._rec_step[: self._records][live]).tolist())
        return list(self._steps[1])

    def records_by_step(self, location: str, wanted: set[int]) -> dict[int, list[int]]:
        """``{step: record idxs}`` of a group's records at the ``wanted`` steps with a live row."""
        first, end = self._record_range(self.groups[location])
        by_step: dict[int, list[int]] = {}
        steps = self._rec_step[first:end].tolist()
        live = self._rec_live[first:end].tolist()
        for idx, (step, count) in enumerate(zip(steps, live)):
            if step in wanted and count:
                by_step.setdefault(step, []).append(idx)
        return by_step

    def keep_live_rows(self, location: str, records: list[GradientRecord]) -> list[GradientRecord]:
        """``records`` of a group with the samples that were re-saved later left out (in place)."""
        first, end = self._record_range(self.groups[location])
        for idx, record in enumerate(range(first, end)):
            live = int(self._rec_live[record])
            start, stop = self._row_start(record), self._row_start(record + 1)
            if live and live < stop - start:
                kept = np.flatnonzero(self._row_live[start:stop]).tolist()
                records[idx] = _keep_rows(records[idx], kept)
        return records


def _ranges(ranges: list[tuple[int, int]]) -> np.ndarray:
    """The numbers of every ``[first, end)`` range, concatenated."""
    if not ranges:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(first, end, dtype=np.int64) for first, end in ranges])


class IndexView(Mapping[str, list[dict[str, Any]]]):
    """Read-only live mapping ``identifier → occurrences`` over a `StoreIndex`.

    ``view[identifier]`` builds the list of ``{"file", "idx", "step",
    "sample_idx"}`` dicts; iteration gives the identifiers in indexing order.
    It follows the index: later saves show through.
    """

    def __init__(self, index: StoreIndex) -> None:
        self._index = index

    def __getitem__(self, identifier: str) -> list[dict[str, Any]]:
        """The occurrences of ``identifier`` (`KeyError` when it is not indexed)."""
        return self._index.entries(identifier)

    def __contains__(self, identifier: object) -> bool:
        """Whether ``identifier`` is indexed."""
        return identifier in self._index._heads

    def __iter__(self) -> Iterator[str]:
        """The identifiers, in indexing order."""
        return iter(self._index._heads)

    def __len__(self) -> int:
        """Number of indexed identifiers."""
        return len(self._index._heads)

    def items(self) -> ItemsView[str, list[dict[str, Any]]]:
        """``(identifier, occurrences)`` pairs, built in bulk (`StoreIndex.iter_entries`)."""
        return _Items(self)

    def values(self) -> ValuesView[list[dict[str, Any]]]:
        """The occurrence lists, built in bulk (`StoreIndex.iter_entries`)."""
        return _Values(self)

    def __repr__(self) -> str:
        """The number of identifiers (the entries are built on access)."""
        return f"{type(self).__name__}({len(self)} identifiers)"


class _Items(ItemsView):
    """Items of an `IndexView`, iterated through `StoreIndex.iter_entries`."""

    def __iter__(self) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        return self._mapping._index.iter_entries()


class _Values(ValuesView):
    """Values of an `IndexView`, iterated through `StoreIndex.iter_entries`."""

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return (entries for _, entries in self._mapping._index.iter_entries())

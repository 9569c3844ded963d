"""The store's identifier index is compact and answers as the dict of occurrences did.

The index keeps its occurrences in columns (a few dozen bytes per sample plus
its identifier, where a dict of occurrence dicts took about 500 bytes), and
`GradientStorageManager.index` still reads as the read-only mapping
``identifier → [{"file", "idx", "step", "sample_idx"}, ...]``, with the same
supersede, forget and relocate semantics as the plain-dict index it replaced.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Mapping

import pytest
import torch

from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.store import index as index_module
from dattri_llm.gradient.store.index import StoreIndex

RECORDS = 20_000
BYTES_PER_RECORD = 250  # the dict of occurrence dicts took ~440 on the same store


def _write(path, records: int, group: int) -> None:
    store = GradientStorageManager(path)
    row = torch.zeros(1, 2)
    for start in range(0, records, group):
        size = min(group, records - start)
        gradient = Gradient({"l": "materialized"}, {"l": row.expand(size, 2)}, {"l": "nn.Linear"})
        store.save_bulk([GradientRecord(0, [f"sample-{start + i}" for i in range(size)], gradient)])


def test_the_index_of_an_opened_store_stays_under_its_bytes_per_record(tmp_path):
    _write(tmp_path / "s", RECORDS, 1000)
    gc.collect()
    tracemalloc.start()
    try:
        store = GradientStorageManager(tmp_path / "s")
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(store.index) == RECORDS
    assert store.index["sample-123"] == [
        {"file": store.locations()[0], "idx": 0, "step": 0, "sample_idx": 123}
    ]
    assert held / RECORDS < BYTES_PER_RECORD, f"{held / RECORDS:.0f} bytes per record"


def test_the_index_is_a_read_only_mapping(tmp_path):
    _write(tmp_path / "s", 5, 2)
    index = GradientStorageManager(tmp_path / "s").index
    assert isinstance(index, Mapping) and not isinstance(index, dict)
    with pytest.raises(TypeError):
        index["sample-0"] = []  # type: ignore[index]
    assert "sample-4" in index and "nope" not in index and len(index) == 5
    assert dict(index) == {key: index[key] for key in index}


# ---------------------------------------------------------------------------- the semantics
class _Reference:
    """The index as plain dicts: what the store exposed before it held columns."""

    def __init__(self) -> None:
        self.occurrences: dict[str, list[dict]] = {}
        self.groups: dict[str, list] = {}  # location -> [steps, identifiers, live sets]
        self.forgotten: list[str] = []

    def add_group(self, location, described) -> None:
        if location in self.groups:
            self.forget_group(location)
        for step, identifiers in described:
            for identifier in identifiers:
                entries = self.occurrences.get(identifier)
                if not entries:
                    continue
                kept = [e for e in entries if e["step"] != step]
                for entry in entries:
                    if entry["step"] == step:
                        live = self.groups[entry["file"]][2]
                        live[entry["idx"]].discard(entry["sample_idx"])
                        if not any(live):
                            self.forget_group(entry["file"])
                if kept:
                    self.occurrences[identifier] = kept
                else:
                    del self.occurrences[identifier]
        live = [set(range(len(ids))) for _, ids in described]
        self.groups[location] = [[s for s, _ in described], [i for _, i in described], live]
        for idx, (step, identifiers) in enumerate(described):
            for sample_idx, identifier in enumerate(identifiers):
                self.occurrences.setdefault(identifier, []).append(
                    {"file": location, "idx": idx, "step": step, "sample_idx": sample_idx}
                )

    def forget_group(self, location) -> None:
        _steps, identifiers, live = self.groups.pop(location)
        for idx, rows in enumerate(live):
            for sample_idx in rows:
                identifier = identifiers[idx][sample_idx]
                kept = [
                    e
                    for e in self.occurrences.get(identifier, [])
                    if not (e["file"] == location and e["idx"] == idx)
                ]
                if kept:
                    self.occurrences[identifier] = kept
                else:
                    self.occurrences.pop(identifier, None)
        self.forgotten.append(location)

    def relocate(self, old, new) -> None:
        if old not in self.groups:
            return
        self.groups[new] = self.groups.pop(old)
        for entries in self.occurrences.values():
            for entry in entries:
                if entry["file"] == old:
                    entry["file"] = new

    def state(self) -> tuple:
        steps = {
            s for steps, _, live in self.groups.values() for s, rows in zip(steps, live) if rows
        }
        by_step = {}
        for location, (steps_, _, live) in self.groups.items():
            found: dict[int, list[int]] = {}
            for idx, (step, rows) in enumerate(zip(steps_, live)):
                if rows:
                    found.setdefault(step, []).append(idx)
            by_step[location] = found
        kept_rows = {
            location: [
                sorted(rows) if rows and len(rows) < len(ids) else None
                for ids, rows in zip(identifiers, live)
            ]
            for location, (_, identifiers, live) in self.groups.items()
        }
        return list(self.occurrences.items()), sorted(steps), by_step, kept_rows


def _state(index: StoreIndex) -> tuple:
    wanted = set(range(9))
    by_step = {location: index.records_by_step(location, wanted) for location in index.groups}
    kept_rows = {}
    for location in index.groups:  # what keep_live_rows keeps of each record (None: all)
        first, end = index._record_range(index.groups[location])
        kept: list = [None] * (end - first)
        index.keep_live_rows(location, [(kept, idx) for idx in range(end - first)])
        kept_rows[location] = kept
    return list(index.occurrences.items()), index.available_steps(), by_step, kept_rows


def _note_kept(record: tuple, rows: list[int]) -> tuple:
    """Stand-in of ``_keep_rows``: notes the kept rows in the probe ``(list, idx)``."""
    kept, idx = record
    kept[idx] = rows
    return record


@pytest.mark.parametrize("seed", range(40))
def test_the_columns_answer_as_the_dict_of_occurrences(monkeypatch, seed):
    """Random saves (re-saved pairs, rewritten and relocated groups) read back the same."""
    monkeypatch.setattr(index_module, "_COMPACT_MIN_ROWS", seed % 3)  # compact often
    monkeypatch.setattr(index_module, "_keep_rows", _note_kept)
    rng = random.Random(seed)
    index, reference = StoreIndex(), _Reference()
    forgotten: list[str] = []
    index.on_forget = forgotten.append
    locations: list[str] = []
    for number in range(60):
        if locations and rng.random() < 0.2:
            old, new = rng.choice(locations), f"moved{number}"
            index.relocate(old, new)
            reference.relocate(old, new)
            locations.append(new)
        else:
            location = rng.choice(locations) if locations and rng.random() < 0.15 else f"g{number}"
            described = [
                (rng.randint(0, 4), [f"id{rng.randint(0, 12)}" for _ in range(rng.randint(1, 5))])
                for _ in range(rng.randint(1, 4))
            ]
            index.add_group(location, [(s, list(ids)) for s, ids in described])
            reference.add_group(location, [(s, list(ids)) for s, ids in described])
            locations.append(location)
        assert _state(index) == reference.state()
        assert forgotten == reference.forgotten
        rows = [
            (key, e["step"], e["file"], e["idx"], e["sample_idx"])
            for key, entries in reference.occurrences.items()
            for e in entries
        ]
        assert list(index.rows(chunk=3)) == rows
        assert list(index.rows({1, 2})) == [row for row in rows if row[1] in {1, 2}]

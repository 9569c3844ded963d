"""Where a store's groups live: files under ``save_dir`` (``"disk"``) or RAM (memory, tiered).

`DiskResidency` writes each group into the per-rank write directory (sidecars
first, then the group files, then its index line) and re-opens a store by
merging every directory. `RamResidency` keeps groups in a `TensorCache`; a
tiered one spills the oldest to ``save_dir/tiered_spill_*``. Both hand out
location handles, read a group back as stored and define the store order.
"""

from __future__ import annotations

import os
import re
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.store.format import (
    GROUP_FILE_SUFFIXES,
    group_suffix,
    load_group_file,
    mmap_files,
    primary_file,
    write_group_at,
    write_group_file,
)
from dattri_llm.gradient.store.index import (
    INDEX_FILE,
    StoreIndex,
    append_log_line,
    read_log,
    record_identifiers,
    repair_log_tail,
)
from dattri_llm.gradient.store.ranks import ProcessRank, RankShards, rank_write_dir, store_dirs
from dattri_llm.gradient.store.sidecars import SIDECAR_FILE, StoreSettings
from dattri_llm.options import CacheResidency, DiskFormat
from dattri_llm.utils.cache import TensorCache

TIERED_BUDGET_FRACTION = 0.5
_FALLBACK_HOST_BYTES = 16 * 1024**3
_BATCH_RE = re.compile(r"^batch_(\d+)\.")
_RAM_SEQ_RE = re.compile(r"(?:mem|entry)_(\d+)")
_UNSAFE_NAME_CHAR = re.compile(r"[^A-Za-z0-9_.\-]")


def total_host_bytes() -> int:
    """Total physical host memory in bytes (16 GiB when the platform does not report it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _FALLBACK_HOST_BYTES


# --------------------------------------------------------------------------- disk


def _next_batch_number(directory: Path) -> int:
    """1 + the highest ``batch_<digits>.*`` id in ``directory`` (0 when there is none)."""
    numbers = [int(m.group(1)) for p in directory.iterdir() if (m := _BATCH_RE.match(p.name))]
    return max(numbers, default=-1) + 1


def _claim_exclusively(path: Path) -> bool:
    """Create ``path`` empty unless it exists (atomic: one of several claimants wins)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def file_safe_identifier(identifier: str) -> str:
    """``identifier`` usable inside a file name: characters other than ``[A-Za-z0-9_.-]`` are
    percent-escaped (as UTF-8 bytes), so distinct identifiers give distinct names."""
    return _UNSAFE_NAME_CHAR.sub(
        lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode("utf-8")), identifier
    )


def _natural_key(text: str) -> tuple:
    """Sort key ordering ``batch_2`` before ``batch_10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", text))


class DiskResidency:
    """Groups in files under ``save_dir``, indexed by one ``index.jsonl`` per write directory.

    The write directory (``save_dir`` or ``save_dir/rank_<r>``) is resolved at
    the first save; auto-named groups are claimed with an exclusive create, so
    writers sharing a directory never overwrite each other's groups.
    """

    def __init__(
        self,
        save_dir: Path,
        disk_format: DiskFormat,
        settings: StoreSettings,
        index: StoreIndex,
        ranks: RankShards,
        process: ProcessRank,
    ) -> None:
        self._save_dir = save_dir
        self._process = process
        self._disk_format = disk_format
        self._settings = settings
        self._index = index
        self._ranks = ranks
        self.write_dir: Path | None = None
        self._write_prefix = ""
        self._next_batch = 0

    @property
    def resident_bytes(self) -> int:
        """0: nothing is held in RAM."""
        return 0

    def check_open(self) -> None:
        """Nothing to check: a disk store stays usable after `close`."""

    def close(self) -> None:
        """Nothing to release (a no-op)."""

    def open_existing(self) -> None:
        """Merge the sidecars and index logs of the root and every rank directory.

        Also notes the rank directories that a ``ranks.json`` world size needs
        but that hold no indexed group (`RankShards.check_complete` raises on reads).
        """
        for directory in store_dirs(self._save_dir):
            log = directory / INDEX_FILE
            if not log.exists():
                continue
            if not (directory / SIDECAR_FILE).exists():
                raise ValueError(
                    f"gradient store {directory} has an index ({INDEX_FILE}) but no "
                    f"{SIDECAR_FILE}; it is not a complete gradient store."
                )
            self._settings.merge_directory(directory, bool(self._index.groups))
            indexed = False
            for line in read_log(log):  # one decoded line at a time
                described = [
                    (int(r["step"]), [str(h) for h in r["hashes"]]) for r in line["records"]
                ]
                self._index.add_group(line["file"], described)
                indexed = True
            self._ranks.note_directory(directory, indexed)
        self._ranks.finish_opening()

    def write(self, records: list[GradientRecord], base: str | None) -> str:
        """Write one group (``base``, or the next ``batch_<NNNNNN>``) and its log line.

        Returns its location (the handle relative to ``save_dir``).
        """
        write_dir = self._resolve_write_dir()
        self._settings.fix_id_scheme(records[0].sample_id_key)
        self._settings.write()  # sidecars before the first log line
        suffix = group_suffix(records, self._disk_format)
        if base is None:
            handle = self._claim_batch_handle(write_dir, suffix)
        else:
            handle = write_dir / (base + suffix)
        try:
            write_group_at(handle, records)
        except BaseException:
            if base is None:
                for path in (primary_file(handle), *mmap_files(handle)):
                    path.unlink(missing_ok=True)
            raise
        location = self._write_prefix + handle.name
        append_log_line(
            write_dir / INDEX_FILE,
            {
                "file": location,
                "records": [
                    {"idx": i, "step": int(r.step), "hashes": record_identifiers(r)}
                    for i, r in enumerate(records)
                ],
            },
        )
        self._ranks.mark_written(self._write_prefix)
        return location

    def _claim_batch_handle(self, write_dir: Path, suffix: str) -> Path:
        """Next ``batch_<NNNNNN>`` handle, its primary file created exclusively.

        Numbers another writer of the directory has taken meanwhile are skipped.
        """
        while True:
            base = f"batch_{self._next_batch:06d}"
            self._next_batch += 1
            if any((write_dir / (base + ext)).exists() for ext in GROUP_FILE_SUFFIXES):
                continue
            handle = write_dir / (base + suffix)
            if _claim_exclusively(primary_file(handle)):
                return handle

    def _resolve_write_dir(self) -> Path:
        """Per-rank write directory, created and prepared at the first save."""
        if self.write_dir is not None:
            return self.write_dir
        write_dir, self._write_prefix = rank_write_dir(self._save_dir, self._process)
        repair_log_tail(write_dir / INDEX_FILE)
        self._next_batch = _next_batch_number(write_dir)
        self._settings.attach(write_dir, (write_dir / INDEX_FILE).exists())
        self.write_dir = write_dir
        return write_dir

    def read(self, location: str) -> list[GradientRecord]:
        """Every record of the group at ``location``, exactly as stored."""
        return load_group_file(self._save_dir / location)

    @staticmethod
    def order(location: str) -> tuple:
        """Store order: root groups, then ``rank_*`` ones, each in natural name order."""
        return ("/" in location, _natural_key(location))


# --------------------------------------------------------------------------- RAM


def _gradient_nbytes(records: Sequence[GradientRecord]) -> int:
    return sum(int(r.gradient.nbytes) for r in records)


def _shallow_copy(record: GradientRecord) -> GradientRecord:
    """A record whose `Gradient` dicts are fresh (payload tensors shared)."""
    g = record.gradient
    gradient = Gradient(
        representation=dict(g.representation),
        data=dict(g.data),
        layer_types=dict(g.layer_types),
        indexing=dict(g.indexing),
        validate_on_init=False,
    )
    hashes = record.input_hash
    return GradientRecord(
        step=record.step,
        input_hash=hashes if isinstance(hashes, str) else list(hashes),
        gradient=gradient,
        sample_id_key=record.sample_id_key,
    )


class _RamGroup(NamedTuple):
    """A RAM-resident group: its save sequence number and records."""

    seq: int
    records: list[GradientRecord]


def _ram_group_nbytes(group: _RamGroup) -> int:
    return _gradient_nbytes(group.records)


class RamResidency:
    """Groups held in RAM (``"memory"``); beyond the budget the oldest spill to disk (``"tiered"``).

    Locations are ``mem_<seq:08d>`` keys, re-pointed in the index at
    ``tiered_spill_*/entry_<seq:08d>.<mmap|pt>`` when a group spills. `close`
    releases every group and removes the spill directory.
    """

    def __init__(
        self,
        save_dir: Path,
        residency: CacheResidency,
        budget_bytes: int | None,
        disk_format: DiskFormat,
        index: StoreIndex,
    ) -> None:
        self._save_dir = save_dir
        self._residency = residency
        self._budget_bytes = budget_bytes
        self._disk_format = disk_format
        self._index = index
        self._next_seq = 0
        self._cache_keys: dict[str, str] = {}  # location of a RAM group -> its cache key
        self._ram_locations: dict[str, str] = {}  # cache key -> location
        self._closed = False
        self._created_root = False
        self._cache = TensorCache(
            residency,
            budget=budget_bytes,
            spill_dir=self._make_spill_dir,
            writer=self._spill_writer,
            reader=self._spill_reader,
            on_spill=self._on_spill,
            nbytes_fn=_ram_group_nbytes,
        )
        self._finalizer = weakref.finalize(self, self._cache.close)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the groups currently held in RAM."""
        return self._cache.nbytes

    def check_open(self) -> None:
        """`RuntimeError` once the store is closed."""
        if self._closed:
            raise RuntimeError(
                f"gradient store {self._save_dir} ({self._residency}) is closed; its groups "
                f"were released. Create a new GradientStorageManager."
            )

    def close(self) -> None:
        """Release the groups and remove the spill directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._cache.close()
        if self._created_root:
            try:
                self._save_dir.rmdir()  # only if the spill left it empty
            except OSError:
                pass

    def write(self, records: list[GradientRecord], base: str | None) -> str:
        """Hold one group (payloads moved to CPU); returns its location (``base`` is unused).

        A group beyond a ``"memory"`` store's budget → `MemoryError`.
        """
        seq = self._next_seq
        self._next_seq += 1
        location = f"mem_{seq:08d}"
        stored = [
            GradientRecord(
                step=int(r.step),
                input_hash=r.input_hash if isinstance(r.input_hash, str) else list(r.input_hash),
                gradient=r.gradient.to("cpu"),
                sample_id_key=r.sample_id_key,
            )
            for r in records
        ]
        self._cache_keys[location] = location
        self._ram_locations[location] = location
        if not self._cache.put(location, _RamGroup(seq, stored)):
            del self._cache_keys[location], self._ram_locations[location]
            raise MemoryError(
                f"gradient group of {_gradient_nbytes(stored)} bytes does not fit the memory "
                f"store's budget ({self._budget_bytes} bytes, {self.resident_bytes} held); raise "
                f"budget_bytes or use residency='tiered' / 'disk'."
            )
        location = self._ram_locations[location]  # a spill file if it went straight to disk
        return location

    def read(self, location: str) -> list[GradientRecord]:
        """Fresh records of the group at ``location``, sharing the stored tensors."""
        return [_shallow_copy(r) for r in self._cache.get(self._cache_keys[location]).records]

    def discard(self, location: str) -> None:
        """Release a group the index no longer refers to."""
        key = self._cache_keys.pop(location, None)
        if key is not None:
            del self._ram_locations[key]
            self._cache.discard(key)

    @staticmethod
    def order(location: str) -> tuple:
        """Store order: save order."""
        return (int(_RAM_SEQ_RE.match(location.rsplit("/", 1)[-1]).group(1)),)

    def _make_spill_dir(self) -> Path:
        if not self._save_dir.exists():
            self._created_root = True
        self._save_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="tiered_spill_", dir=self._save_dir))

    def _spill_writer(self, path: Path, group: _RamGroup) -> Path:
        """Write a spilled group as ``entry_<seq>`` in the store's disk format."""
        return write_group_file(
            path.parent / f"entry_{group.seq:08d}", group.records, self._disk_format
        )

    @staticmethod
    def _spill_reader(path: Path) -> _RamGroup:
        seq = int(_RAM_SEQ_RE.match(path.name).group(1))
        return _RamGroup(seq, load_group_file(path))

    def _on_spill(self, key: str, path: Path) -> None:
        """Re-point a spilled group's location and index entries at its spill file."""
        old = self._ram_locations[key]
        new = Path(path).relative_to(self._save_dir).as_posix()
        self._ram_locations[key] = new
        self._cache_keys[new] = self._cache_keys.pop(old)
        self._index.relocate(old, new)

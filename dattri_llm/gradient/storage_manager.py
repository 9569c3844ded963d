"""`GradientStorageManager`: the store's front, composing its index, settings, ranks and residency.

It checks arguments and records, turns a save into a group written by the
residency and indexed by `StoreIndex`, and answers reads through the index. The
parts live in :mod:`dattri_llm.gradient.store` (on-disk layout documented
there); their public names are re-exported here. The process rank is looked up
through this module's globals ``dist_rank`` / ``dist_world_size`` at the first
write, so patching ``storage_manager.dist_rank`` reaches the store.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.lowrank import LowRank, check_low_rank, low_rank_gradient
from dattri_llm.gradient.store.format import (
    DISK_FORMATS,
    FORMAT_VERSION,
    load_group_file,
    write_group_file,
)
from dattri_llm.gradient.store.index import (
    INDEX_FILE,
    StoreIndex,
    check_indexable,
    record_identifiers,
    sample_identifier,
    stringify_identifier,
)
from dattri_llm.gradient.store.ranks import RANKS_FILE, RankShards
from dattri_llm.gradient.store.residency import (
    TIERED_BUDGET_FRACTION,
    DiskResidency,
    RamResidency,
    file_safe_identifier,
    total_host_bytes,
)
from dattri_llm.gradient.store.sidecars import (
    PROJECTION_FILE,
    SIDECAR_FILE,
    StoreSettings,
    projection_record,
)
from dattri_llm.options import CacheResidency, DiskFormat
from dattri_llm.utils.cache import CACHE_RESIDENCIES
from dattri_llm.utils.distributed import dist_rank, dist_world_size

__all__ = [
    "DISK_FORMATS",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "PROJECTION_FILE",
    "RANKS_FILE",
    "SIDECAR_FILE",
    "TIERED_BUDGET_FRACTION",
    "GradientStorageManager",
    "load_group_file",
    "projection_record",
    "write_group_file",
]


class _ThisProcess:
    """This process's rank and world size, read from this module's globals at call time."""

    @staticmethod
    def rank() -> int | None:
        """``dist_rank()`` (``None`` outside a process group)."""
        return dist_rank()

    @staticmethod
    def world_size() -> int:
        """``dist_world_size()``."""
        return dist_world_size()


class GradientStorageManager:
    """Store of `GradientRecord` groups with an ``identifier → occurrences`` index.

    Args:
        save_dir: root directory of the store. For ``"disk"`` it is created on
            the first save; an existing *file* at that path → `ValueError`.
        residency: ``"disk"`` (persistent, re-openable; per-rank indexes
            merged), ``"memory"`` (RAM only, `MemoryError` when a group exceeds
            ``budget_bytes``) or ``"tiered"`` (RAM up to ``budget_bytes``,
            default `TIERED_BUDGET_FRACTION` of the total host RAM, oldest
            groups spilled to ``save_dir/tiered_spill_*``, removed by `close`).
        budget_bytes: RAM budget of ``"memory"`` / ``"tiered"`` stores (ignored
            for ``"disk"``).
        disk_format: ``"memmap"`` (raw bytes + metadata, read back as
            copy-on-write memory maps) or ``"pickle"`` (``torch.save`` of the
            record list, read back with ``weights_only=True``).
        low_rank: extension (keyword-only). ``c >= 1`` stores every
            matrix-form layer (factorized linear family and conv, see
            ``lowrank.has_matrix_form``) of each saved record as its top-``c``
            singular triplets (a ``lowrank.LowRank`` payload); other layers are
            stored as given. ``c`` is recorded in ``index_meta.json``
            (``"low_rank"``); opening a store that records another ``c``, or
            giving ``c`` for a store that already holds full-rank records →
            `ValueError`. ``None`` (default) adopts the store's recorded ``c``,
            if any.

    Saving a (step, identifier) pair that is already indexed replaces the
    earlier occurrence (also one saved by an earlier run into the directory),
    so re-running a capture never doubles a score. Each rank of a process group
    records the world size in its ``rank_<r>/ranks.json``; reading a store that
    lacks one of those ranks' indexed directories → `ValueError` naming it.
    The manager does not decide *when* to save (see `OffloadCallback`). It is
    not thread-safe; a single `AsyncGradientWriter` thread may own it while open.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        *,
        residency: CacheResidency = "disk",
        budget_bytes: int | None = None,
        disk_format: DiskFormat = "memmap",
        low_rank: int | None = None,
    ) -> None:
        low_rank = check_low_rank(low_rank, "GradientStorageManager: low_rank")
        if residency not in CACHE_RESIDENCIES:
            raise ValueError(
                f"GradientStorageManager: unknown residency {residency!r}; it must be one of "
                f"{list(CACHE_RESIDENCIES)}."
            )
        if disk_format not in DISK_FORMATS:
            raise ValueError(
                f"GradientStorageManager: unknown disk_format {disk_format!r}; it must be one of "
                f"{list(DISK_FORMATS)}."
            )
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
        ):
            raise ValueError(
                f"GradientStorageManager: budget_bytes must be a non-negative int or None, got "
                f"{budget_bytes!r}."
            )
        self._save_dir = Path(save_dir).expanduser()
        if residency != "memory" and self._save_dir.exists() and not self._save_dir.is_dir():
            raise ValueError(
                f"GradientStorageManager: save_dir {self._save_dir} is an existing file, not a "
                f"directory; pass a directory path (it is created on the first save)."
            )
        if residency == "tiered" and budget_bytes is None:
            budget_bytes = int(total_host_bytes() * TIERED_BUDGET_FRACTION)
        self._residency = residency
        self._disk_format = disk_format
        self._budget_bytes = budget_bytes
        self._index = StoreIndex()
        self._settings = StoreSettings(self._save_dir)
        self._ranks = RankShards(self._save_dir)
        self._backend: DiskResidency | RamResidency
        if residency == "disk":
            self._backend = DiskResidency(
                self._save_dir, disk_format, self._settings, self._index, self._ranks, _ThisProcess
            )
            self._backend.open_existing()
        else:
            self._backend = RamResidency(
                self._save_dir, residency, budget_bytes, disk_format, self._index
            )
            self._index.on_forget = self._backend.discard
        if low_rank is not None:
            self._settings.declare_low_rank(low_rank, bool(self._index.groups))

    # ----------------------------------------------------------------- properties
    @property
    def save_dir(self) -> Path:
        """Root directory of the store."""
        return self._save_dir

    @property
    def residency(self) -> str:
        """``"disk"``, ``"memory"`` or ``"tiered"``."""
        return self._residency

    @property
    def disk_format(self) -> str:
        """``"memmap"`` or ``"pickle"``."""
        return self._disk_format

    @property
    def budget_bytes(self) -> int | None:
        """RAM budget of a ``"memory"`` / ``"tiered"`` store (``None`` = unbounded)."""
        return self._budget_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of the groups currently held in RAM (0 for ``"disk"``)."""
        return self._backend.resident_bytes

    @property
    def sample_id_key(self) -> str | int | None:
        """Field identifiers are read from (``None`` = content hash)."""
        return self._settings.sample_id_key

    @property
    def gradient_accumulation_steps(self) -> int:
        """Declared accumulation window of the stored records (1 when undeclared)."""
        return self._settings.gradient_accumulation_steps

    @property
    def low_rank(self) -> int | None:
        """``c`` of a low-rank store (records kept as rank-``c`` factors); ``None`` = full rank."""
        return self._settings.low_rank

    @property
    def projection(self) -> dict[str, dict] | None:
        """Declared capture projection ``{name or "__default__": settings}``.

        Resolved by `projection_record`; ``{}`` = declared unprojected, ``None``
        = never declared (unknown, e.g. a store written by the reference design).
        """
        return self._settings.projection

    @property
    def index(self) -> Mapping[str, list[dict[str, Any]]]:
        """Merged live index ``identifier → [{"file", "idx", "step", "sample_idx"}, ...]``.

        A read-only mapping that follows the store (later saves show through);
        each lookup builds fresh occurrence dicts from the compact index the
        store keeps. A store missing a rank directory its ``ranks.json`` needs
        → `ValueError`.
        """
        self._ranks.check_complete()
        return self._index.occurrences

    def index_rows(
        self, steps: Iterable[int] | None = None
    ) -> Iterator[tuple[str, int, str, int, int]]:
        """``(identifier, step, file, idx, sample_idx)`` of every indexed occurrence.

        The entries of :attr:`index` as plain tuples, in its order (identifier
        by identifier), only those at ``steps`` when given: the cheap way to
        walk a large index whole. A store missing a rank directory its
        ``ranks.json`` needs → `ValueError`.
        """
        self._ranks.check_complete()
        return self._index.rows(steps)

    @property
    def revision(self) -> int:
        """A counter that changes whenever :attr:`index` changes (cheap to compare)."""
        return self._index.revision

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Release RAM-held groups and remove a tiered spill directory (idempotent).

        A no-op for ``"disk"`` stores. A closed ``"memory"`` / ``"tiered"``
        store raises `RuntimeError` on further use.
        """
        self._backend.close()

    def __enter__(self) -> GradientStorageManager:
        """Return ``self``."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """`close` on exit."""
        self.close()

    def __repr__(self) -> str:
        """Root, residency, format and counts."""
        return (
            f"GradientStorageManager('{self._save_dir}', residency={self._residency!r}, "
            f"disk_format={self._disk_format!r}, groups={len(self._index.groups)}, "
            f"identifiers={len(self._index.occurrences)})"
        )

    # ----------------------------------------------------------------- declarations
    def declare_gradient_accumulation_steps(self, n: int) -> None:
        """Record the accumulation window the stored records were merged over.

        ``n < 1`` or a value conflicting with an earlier declaration (or the
        on-disk value) → `ValueError`; the same value again is a no-op.
        """
        self._settings.declare_gradient_accumulation_steps(n)

    def declare_low_rank(self, rank: int) -> None:
        """Store every later save's matrix-form layers as rank-``rank`` factors (see ``low_rank``).

        The same ``rank`` again is a no-op; another ``c`` than the store's, or a
        store that already holds full-rank records → `ValueError`.
        """
        rank = check_low_rank(rank, "declare_low_rank: rank")
        self._settings.declare_low_rank(rank, bool(self._index.groups))

    def declare_projection(
        self, projection: Mapping[str, Mapping[str, Any]] | None, projector: Any = None
    ) -> None:
        """Record the capture projection of the stored gradients (``None`` = unprojected).

        ``projection`` is a ``projection_kwargs`` dict; it is stored resolved
        by `projection_record` (with ``projector``, the capture's projection
        factory) in ``projection.json`` of a ``"disk"`` store and in memory
        otherwise. A record differing from an earlier declaration (or the
        on-disk value) → `ValueError`; the same record again is a no-op.
        """
        self._settings.declare_projection(projection_record(projection, projector))

    # ----------------------------------------------------------------- writing
    def save(self, record: GradientRecord) -> str:
        """Save one single-identifier record as its own group; returns its location.

        On disk the group is named ``step_<step:06d>_<identifier>`` (so saving
        the same pair again replaces the file). A record whose ``input_hash``
        is a list → `TypeError` (use `save_bulk`).
        """
        if not isinstance(record, GradientRecord):
            raise TypeError(f"save expects a GradientRecord, got {type(record).__name__}.")
        if not isinstance(record.input_hash, str):
            raise TypeError(
                f"save: {record!r} has a list of {len(record.input_hash)} identifiers (a "
                f"per-batch record); use save_bulk([record]) instead."
            )
        base = f"step_{int(record.step):06d}_{file_safe_identifier(record.input_hash)}"
        return self._save_group([record], base)

    def save_bulk(self, records: Sequence[GradientRecord]) -> str:
        """Save ``records`` as one group (payloads moved to CPU) and index every identifier.

        Returns the group's location: a path relative to ``save_dir`` (disk,
        ``[rank_<r>/]batch_<NNNNNN>.<mmap|pt>``) or an opaque ``mem_XXXXXXXX``
        key (RAM). A list ``input_hash`` whose length differs from the
        gradient's batch size, or a ``sample_id_key`` that differs from the
        store's → `ValueError` (checked before anything is written); a single
        string identifier may hold a batch of any size (indexed once, at
        ``sample_idx`` 0). For a ``"memory"`` store a group beyond
        ``budget_bytes`` → `MemoryError` (nothing indexed).
        """
        return self._save_group(list(records), None)

    def _save_group(self, records: list[GradientRecord], base: str | None) -> str:
        self._backend.check_open()
        check_indexable(records, self._save_dir)
        self._settings.check_id_scheme(records[0].sample_id_key)
        records = self._at_store_rank(records)
        location = self._backend.write(records, base)
        self._settings.fix_id_scheme(records[0].sample_id_key)
        self._index.add_group(location, [(int(r.step), record_identifiers(r)) for r in records])
        return location

    def _at_store_rank(self, records: list[GradientRecord]) -> list[GradientRecord]:
        """``records`` with their matrix-form layers at the store's rank ``c`` (if any).

        Records already holding low-rank payloads declare their ``c`` to the
        store (refused when it differs, or when the store is full-rank and not empty).
        """
        ranks = {
            value.rank
            for record in records
            for value in record.gradient.data.values()
            if isinstance(value, LowRank)
        }
        for rank in sorted(ranks):
            if rank != self.low_rank:
                self.declare_low_rank(rank)
        if self.low_rank is None:
            return records
        return [
            GradientRecord(
                step=r.step,
                input_hash=r.input_hash,
                gradient=low_rank_gradient(r.gradient, self.low_rank),
                sample_id_key=r.sample_id_key,
            )
            for r in records
        ]

    # ----------------------------------------------------------------- reading
    def _identifier(self, inputs: object) -> str:
        """Identifier of one sample's inputs under the store's identifier scheme."""
        return sample_identifier(inputs, self.sample_id_key)

    def _occurrences(self, identifier: object) -> list[dict[str, Any]]:
        self._ranks.check_complete()
        identifier = stringify_identifier(identifier)
        entries = self._index.occurrences.get(identifier)
        if not entries:
            examples = sorted(self._index.occurrences)[:3]
            raise KeyError(
                f"identifier {identifier!r} not in index of gradient store {self._save_dir} "
                f"({len(self._index.occurrences)} identifiers indexed, e.g. {examples}; stored "
                f"steps {self.available_steps()}). Check the identifier scheme (sample_id_key="
                f"{self.sample_id_key!r})."
            )
        return entries

    def lookup(self, inputs: object) -> list[tuple[int, int]]:
        """Sorted ``(step, sample_idx)`` occurrences of one sample given its inputs."""
        return self.lookup_by_hash(self._identifier(inputs))

    def lookup_by_hash(self, input_hash: object) -> list[tuple[int, int]]:
        """Sorted ``(step, sample_idx)`` occurrences of an identifier (unknown → `KeyError`)."""
        return sorted((e["step"], e["sample_idx"]) for e in self._occurrences(input_hash))

    def load_sample(self, inputs: object, step: int, sample_idx: int) -> Gradient:
        """The sample's gradient (batch size 1) at ``(step, sample_idx)``, given its inputs."""
        return self.load_sample_by_hash(self._identifier(inputs), step, sample_idx)

    def load_sample_by_hash(self, input_hash: object, step: int, sample_idx: int) -> Gradient:
        """Gradient (batch size 1) of an identifier's occurrence ``(step, sample_idx)``.

        No such occurrence → `KeyError` listing the available pairs.
        """
        entries = self._occurrences(input_hash)
        for entry in entries:
            if entry["step"] == step and entry["sample_idx"] == sample_idx:
                record = self._read_group(entry["file"])[entry["idx"]]
                return record.gradient.slice("batch", sample_idx)
        available = sorted((e["step"], e["sample_idx"]) for e in entries)
        raise KeyError(
            f"identifier {stringify_identifier(input_hash)!r} at (step={step}, "
            f"sample_idx={sample_idx}) is not in index; available (step, sample_idx): "
            f"{available}."
        )

    def load_all(self, inputs: object) -> list[GradientRecord]:
        """Every whole record containing the sample (given its inputs), sorted by step."""
        return self.load_all_by_hash(self._identifier(inputs))

    def load_all_by_hash(self, input_hash: object) -> list[GradientRecord]:
        """Every whole record containing an identifier, sorted by step (unknown → `KeyError`)."""
        by_location: dict[str, set[int]] = {}
        for entry in self._occurrences(input_hash):
            by_location.setdefault(entry["file"], set()).add(entry["idx"])
        found = []
        for location in sorted(by_location, key=self._backend.order):
            records = self.load_records(location)
            found.extend(records[idx] for idx in sorted(by_location[location]))
        return sorted(found, key=lambda r: r.step)

    def available_steps(self) -> list[int]:
        """Distinct steps of the indexed records, ascending."""
        self._ranks.check_complete()
        return self._index.available_steps()

    def locations(self) -> list[str]:
        """Every indexed group location in store order (root, then ranks; save order in RAM)."""
        self._ranks.check_complete()
        return sorted(self._index.groups, key=self._backend.order)

    def iter_steps(self, steps: int | Iterable[int]) -> list[tuple[str, dict[int, list[int]]]]:
        """Groups holding any of ``steps``: ``[(location, {step: sorted record idxs})]``.

        Ordered by location (store order); each location appears once. Records
        whose every sample was re-saved later are left out.
        """
        wanted = {int(steps)} if isinstance(steps, int) else {int(s) for s in steps}
        plan = []
        for location in self.locations():
            by_step = self._index.records_by_step(location, wanted)
            if by_step:
                plan.append((location, dict(sorted(by_step.items()))))
        return plan

    def group_path(self, location: str) -> Path:
        """Filesystem path of a ``"disk"`` store's group handle (relative to ``save_dir``)."""
        return self._save_dir / location

    def load_records(self, file_relpath: str) -> list[GradientRecord]:
        """All records of one group, in stored order, holding only their indexed samples.

        A sample whose (step, identifier) pair was saved again later is left
        out of its older record. Disk groups are read from their files
        (memmap views or ``weights_only`` unpickling); RAM groups are returned
        as fresh records sharing the stored tensors.
        """
        return self._index.keep_live_rows(file_relpath, self._read_group(file_relpath))

    def _read_group(self, location: str) -> list[GradientRecord]:
        """Every record of a group exactly as stored."""
        self._backend.check_open()
        self._ranks.check_complete()
        if location not in self._index.groups:
            raise KeyError(
                f"gradient store {self._save_dir} has no group {location!r} in its index; "
                f"{len(self._index.groups)} groups are indexed (see locations())."
            )
        return self._backend.read(location)

"""Gradient store: groups of `GradientRecord` s plus an index ``identifier → occurrences``.

A *group* is one unit of writing (one `GradientStorageManager.save` /
`GradientStorageManager.save_bulk` call) holding one or more records. The index
maps every sample identifier (content hash or ``sample_id_key`` value) to its
occurrences ``{"file": location, "idx": record position, "step": int,
"sample_idx": row}``; each (step, identifier) pair is held once, the newest
save replacing earlier ones.

On-disk layout of a ``"disk"`` store (the reference design's format 2; the write
directory is ``save_dir``, or ``save_dir/rank_<r>/`` under a process group)::

    index_meta.json          {"format": 2, "sample_id_key", "gradient_accumulation_steps"}
    ranks.json               rank directories only: {"rank": r, "world_size": n}
    projection.json          the declared capture projection (`projection_record`), if any
    index.jsonl              one compact line per group:
                             {"file": handle, "records": [{"idx", "step", "hashes"}, ...]}
    batch_<NNNNNN>.mmap.bin  save_bulk memmap group: raw tensor bytes, 8-byte aligned parts
    batch_<NNNNNN>.mmap.meta torch.save'd {"format": 2, "records": [...]} (part specs)
    batch_<NNNNNN>.pt        save_bulk pickle group: torch.save(list of GradientRecord)
    step_<step>_<id>.*       save() groups (identifier made file-system safe)

Handles (``file`` of the index) are paths relative to ``save_dir``; a memmap
group's handle is ``<base>.mmap`` (backed by ``.mmap.bin`` + ``.mmap.meta``).

Completeness: a rank directory's ``ranks.json`` records the world size of the
run that wrote it. Reading a store in which some indexed rank directory
declares world size ``n`` needs an indexed ``rank_0 .. rank_{n-1}``; a missing
one makes every read raise `ValueError` naming it (a partial score would be
silent). Stores without ``ranks.json`` (the reference design's) are read as
they are.

Crash safety: group files and sidecars are written under a temporary name,
fsynced and renamed *before* the group's log line is appended (and fsynced),
so a killed writer leaves at most an unindexed file or a truncated last log
line, which readers ignore with a `UserWarning`. Auto-named group files are
claimed with an exclusive create, so writers sharing a directory never
overwrite each other's groups.

Reading never runs code from the files: pickle groups and ``.mmap.meta`` files
load with ``torch.load(weights_only=True)``, only this library's record classes
allowed besides tensors and plain containers.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.lowrank import LowRank, check_low_rank, low_rank_gradient
from dattri_llm.gradient.ops.projection import DattriProjector
from dattri_llm.options import CacheResidency, DiskFormat
from dattri_llm.utils.atomic import atomic_torch_save, atomic_write
from dattri_llm.utils.cache import CACHE_RESIDENCIES, TensorCache
from dattri_llm.utils.distributed import dist_rank, dist_world_size
from dattri_llm.utils.hashing import hash_sample

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

DISK_FORMATS = ("pickle", "memmap")
FORMAT_VERSION = 2
TIERED_BUDGET_FRACTION = 0.5

INDEX_FILE = "index.jsonl"
SIDECAR_FILE = "index_meta.json"
PROJECTION_FILE = "projection.json"
RANKS_FILE = "ranks.json"
MMAP_SUFFIX = ".mmap"
PICKLE_SUFFIX = ".pt"
_BIN, _META = ".bin", ".meta"
_GROUP_FILE_SUFFIXES = (PICKLE_SUFFIX, MMAP_SUFFIX + _BIN, MMAP_SUFFIX + _META)
_ALIGN = 8
_FALLBACK_HOST_BYTES = 16 * 1024**3
_BATCH_RE = re.compile(r"^batch_(\d+)\.")
_RAM_SEQ_RE = re.compile(r"(?:mem|entry)_(\d+)")
_RANK_DIR_RE = re.compile(r"^rank_(\d+)$")
_UNSAFE_NAME_CHAR = re.compile(r"[^A-Za-z0-9_.\-]")
_SAFE_GLOBALS = [GradientRecord, Gradient, Factorized, LowRank]
_DEFAULT_PROJECTION = {"style": "logra", "proj_seed": 0, "include_bias": True}
_DEFAULT_FACTORIES = (
    "dattri.func.projection.random_project",
    "dattri_llm.gradient.ops.projection.random_project",
)


def _total_host_bytes() -> int:
    """Total physical host memory in bytes (16 GiB when the platform does not report it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _FALLBACK_HOST_BYTES


# --------------------------------------------------------------------------- safe loading


def _safe_torch_load(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` allowing this library's record classes.

    A file needing any other object is refused with `ValueError` (nothing in it runs).
    """
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = next(
            (line.strip() for line in str(err).splitlines() if "Unsupported" in line),
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        raise ValueError(
            f"gradient store file {path} was refused: it holds objects other than tensors, "
            f"plain containers and dattri_llm gradient records ({reason}). Store files are "
            f"loaded with weights_only=True so that opening one never runs code from it; only "
            f"open stores written by dattri_llm or the reference design."
        ) from None


# --------------------------------------------------------------------------- group files


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: object, path: Path) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gradient group {path}: unknown tensor dtype {name!r} in its metadata.")
    return dtype


def _memmap_compatible(records: Sequence[GradientRecord]) -> bool:
    """Whether every payload is a tensor or a `Factorized` (else the group is pickled)."""
    return all(
        isinstance(value, (torch.Tensor, Factorized))
        for record in records
        for value in record.gradient.data.values()
    )


def _group_suffix(records: Sequence[GradientRecord], disk_format: str) -> str:
    """Handle suffix of a group: ``.mmap`` for memmap-able groups in memmap format, else ``.pt``."""
    if disk_format == "memmap" and _memmap_compatible(records):
        return MMAP_SUFFIX
    return PICKLE_SUFFIX


def _stored_hashes(record: GradientRecord) -> str | list[str]:
    hashes = record.input_hash
    return str(hashes) if isinstance(hashes, str) else [str(h) for h in hashes]


class _BinLayout:
    """Collects tensor parts of a memmap group and their ``{byte_off, nbytes, shape, dtype}``."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, torch.Tensor]] = []
        self.size = 0

    def add(self, tensor: torch.Tensor) -> dict[str, Any]:
        tensor = tensor.detach().to("cpu")
        spec = {
            "byte_off": self.size,
            "nbytes": tensor.numel() * tensor.element_size(),
            "shape": list(tensor.shape),
            "dtype": _dtype_name(tensor.dtype),
        }
        self.parts.append((self.size, tensor))
        self.size += -(-spec["nbytes"] // _ALIGN) * _ALIGN
        return spec

    def layer(self, value: torch.Tensor | Factorized) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            return {"kind": "dense", "parts": {"data": self.add(value)}}
        return {
            "kind": "low_rank" if isinstance(value, LowRank) else "factorized",
            "parts": {
                "activation": self.add(value.activation),
                "pre_activation_grad": self.add(value.pre_activation_grad),
            },
            "module_kwargs": value.module_kwargs,
            "batch_first": bool(value.batch_first),
        }

    def record(self, record: GradientRecord) -> dict[str, Any]:
        gradient = record.gradient
        return {
            "step": int(record.step),
            "input_hash": _stored_hashes(record),
            "sample_id_key": record.sample_id_key,
            "representation": dict(gradient.representation),
            "layer_types": dict(gradient.layer_types),
            "indexing": {name: gradient.indexing.get(name, "batch") for name in gradient.data},
            "layers": {name: self.layer(value) for name, value in gradient.data.items()},
        }

    def write(self, fh: Any) -> None:
        position = 0
        for offset, tensor in self.parts:
            fh.write(b"\0" * (offset - position))
            flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
            if flat.numel():
                fh.write(flat.view(torch.uint8).numpy())
            position = offset + flat.numel() * flat.element_size()
        fh.write(b"\0" * (self.size - position))


def _mmap_files(handle: Path) -> tuple[Path, Path]:
    """``(<handle>.bin, <handle>.meta)`` of a memmap group handle ``<base>.mmap``."""
    return handle.with_name(handle.name + _BIN), handle.with_name(handle.name + _META)


def _primary_file(handle: Path) -> Path:
    """The file whose exclusive creation claims a group handle."""
    return _mmap_files(handle)[0] if handle.name.endswith(MMAP_SUFFIX) else handle


def _write_group_at(handle: Path, records: Sequence[GradientRecord]) -> None:
    """Write ``records`` at ``handle`` (format from its suffix), each file atomically."""
    if not handle.name.endswith(MMAP_SUFFIX):
        atomic_torch_save(list(records), handle)
        return
    layout = _BinLayout()
    meta = {"format": FORMAT_VERSION, "records": [layout.record(r) for r in records]}
    bin_path, meta_path = _mmap_files(handle)
    atomic_write(bin_path, layout.write)
    atomic_torch_save(meta, meta_path)


def write_group_file(
    base: str | os.PathLike, records: Sequence[GradientRecord], disk_format: str
) -> Path:
    """Write ``records`` as one group at ``base`` + its suffix; returns the handle path.

    The suffix is ``.mmap`` (files ``.mmap.bin`` + ``.mmap.meta``) for a memmap
    group and ``.pt`` for a pickle group (``disk_format="pickle"``, or a payload
    that is neither a tensor nor a `Factorized`). An existing group at that
    handle is replaced.
    """
    base = Path(base)
    handle = base.with_name(base.name + _group_suffix(records, disk_format))
    _write_group_at(handle, records)
    return handle


def _part_view(buffer: torch.Tensor | None, spec: Mapping[str, Any], path: Path) -> torch.Tensor:
    """One tensor part of a memmap group (a copy-on-write view of the mapped bytes)."""
    dtype = _parse_dtype(spec["dtype"], path)
    shape = list(spec["shape"])
    offset, nbytes = int(spec["byte_off"]), int(spec["nbytes"])
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = buffer[offset : offset + nbytes]
    if offset % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


def _decode_layer(
    layer: Mapping[str, Any], buffer: torch.Tensor | None, path: Path
) -> torch.Tensor | Factorized:
    parts = layer["parts"]
    if layer["kind"] == "dense":
        return _part_view(buffer, parts["data"], path)
    if layer["kind"] not in ("factorized", "low_rank"):
        raise ValueError(f"gradient group {path}: unknown layer kind {layer['kind']!r}.")
    payload_type = LowRank if layer["kind"] == "low_rank" else Factorized
    return payload_type(
        _part_view(buffer, parts["activation"], path),
        _part_view(buffer, parts["pre_activation_grad"], path),
        module_kwargs=layer.get("module_kwargs"),
        batch_first=layer.get("batch_first", True),
    )


def _decode_record(
    entry: Mapping[str, Any], buffer: torch.Tensor | None, path: Path
) -> GradientRecord:
    layers = entry["layers"]
    gradient = Gradient(
        representation=dict(entry["representation"]),
        data={name: _decode_layer(layer, buffer, path) for name, layer in layers.items()},
        layer_types=dict(entry["layer_types"]),
        indexing=dict(entry.get("indexing") or {}),
        validate_on_init=False,
    )
    return GradientRecord(
        step=entry["step"],
        input_hash=entry["input_hash"],
        gradient=gradient,
        sample_id_key=entry.get("sample_id_key"),
    )


def _part_specs(meta: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for entry in meta["records"]:
        for layer in entry["layers"].values():
            yield from layer["parts"].values()


def _read_memmap(handle: Path) -> list[GradientRecord]:
    bin_path, meta_path = _mmap_files(handle)
    meta = _safe_torch_load(meta_path)
    found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
    if found != FORMAT_VERSION:
        raise ValueError(
            f"gradient group {meta_path} has format {found!r}, but this dattri_llm reads memmap "
            f"groups of format {FORMAT_VERSION}; re-create the store with this library version."
        )
    size = os.path.getsize(bin_path)
    needed = max((int(s["byte_off"]) + int(s["nbytes"]) for s in _part_specs(meta)), default=0)
    if size < needed:
        raise ValueError(
            f"gradient group {bin_path} is truncated: {meta_path.name} describes {needed} bytes "
            f"but the file has {size}."
        )
    buffer = (
        torch.from_file(str(bin_path), shared=False, size=size, dtype=torch.uint8) if size else None
    )
    return [_decode_record(entry, buffer, handle) for entry in meta["records"]]


def _read_pickle(path: Path) -> list[GradientRecord]:
    loaded = _safe_torch_load(path)
    records = loaded if isinstance(loaded, list) else [loaded]
    for position, record in enumerate(records):
        if not isinstance(record, GradientRecord):
            raise ValueError(
                f"gradient group {path}: item {position} is a {type(record).__name__}, not a "
                f"GradientRecord; the file is not a gradient group."
            )
    return records


def load_group_file(path: str | os.PathLike) -> list[GradientRecord]:
    """All records of one group given its handle path (``<base>.mmap`` or a pickle file)."""
    path = Path(path)
    return _read_memmap(path) if path.name.endswith(MMAP_SUFFIX) else _read_pickle(path)


# --------------------------------------------------------------------------- index files


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _write_json(path: Path, value: Any) -> None:
    data = json.dumps(value, indent=1).encode("utf-8")
    atomic_write(path, lambda fh: fh.write(data))


def _read_log(path: Path) -> list[dict[str, Any]]:
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


def _repair_log_tail(path: Path) -> None:
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


def _append_log_line(path: Path, line: Mapping[str, Any]) -> None:
    """Append one compact JSON line in a single write, flushed and fsynced."""
    data = (json.dumps(line, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _file_safe_identifier(identifier: str) -> str:
    """``identifier`` usable inside a file name: characters other than ``[A-Za-z0-9_.-]`` are
    percent-escaped (as UTF-8 bytes), so distinct identifiers give distinct names."""
    return _UNSAFE_NAME_CHAR.sub(
        lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode("utf-8")), identifier
    )


# --------------------------------------------------------------------------- helpers


def _stringify_identifier(value: object) -> str:
    """An identifier as ``str``: one-element tensors / arrays by their item, else ``str()``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return str(value.item())
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        return str(value.item())
    return str(value)


def _record_identifiers(record: GradientRecord) -> list[str]:
    hashes = _stored_hashes(record)
    return [hashes] if isinstance(hashes, str) else hashes


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


def _keep_rows(record: GradientRecord, rows: list[int]) -> GradientRecord:
    """``record`` restricted to the samples at ``rows`` (its other rows were re-saved later)."""
    hashes = list(record.input_hash)
    return GradientRecord(
        step=record.step,
        input_hash=[hashes[k] for k in rows],
        gradient=record.gradient.slice("batch", rows),
        sample_id_key=record.sample_id_key,
    )


def _natural_key(text: str) -> tuple:
    """Sort key ordering ``batch_2`` before ``batch_10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", text))


def _rank_of(directory: Path) -> int | None:
    """``r`` for a ``rank_<r>`` directory, ``None`` for the root (or another name)."""
    match = _RANK_DIR_RE.match(directory.name)
    return None if match is None else int(match.group(1))


def _declared_world_size(directory: Path) -> int:
    """World size recorded in ``directory/ranks.json`` (0 when there is none).

    A file without a positive int ``world_size`` → `ValueError` naming it.
    """
    path = directory / RANKS_FILE
    if not path.exists():
        return 0
    world_size = _read_json(path).get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"gradient store rank file {path} has world_size={world_size!r}, not a positive "
            f"int; the file is corrupt. Delete it to read that rank directory as it is."
        )
    return world_size


@dataclass
class _GroupInfo:
    """Per record of a group: its step, identifiers and the rows still indexed (live)."""

    steps: list[int]
    identifiers: list[list[str]]
    live: list[set[int]] = field(default_factory=list)


class _RamGroup(NamedTuple):
    """A RAM-resident group: its save sequence number and records."""

    seq: int
    records: list[GradientRecord]


def _ram_group_nbytes(group: _RamGroup) -> int:
    return _gradient_nbytes(group.records)


# --------------------------------------------------------------------------- projection record


def _projector_name(projector: Any) -> str:
    """``module.qualname`` of the projection factory in use (the default one resolved)."""
    factory = DattriProjector.coerce(projector).factory
    named = factory if hasattr(factory, "__qualname__") else type(factory)
    return f"{named.__module__}.{named.__qualname__}"


class _NotJSONable(Exception):
    """A value that a JSON record cannot describe."""


def _json_scalar(value: Any) -> Any:
    """``value`` as a JSON scalar (NumPy scalars unwrapped), or `_NotJSONable`."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _NotJSONable


def _resolve_layer_projection(proj_kwargs: Mapping[str, Any], projector: Any) -> dict:
    """One layer's settings with the defaults filled in; ``device`` and non-JSON values dropped."""
    entry: dict[str, Any] = dict(_DEFAULT_PROJECTION)
    for key, value in proj_kwargs.items():
        try:
            if key != "device":
                entry[key] = _json_scalar(value)
        except _NotJSONable:
            continue
    if entry["style"] != "mask":  # masks gather exact entries: no projector involved
        if "projector" not in entry:
            entry["projector"] = _projector_name(projector)
        if entry["projector"] in _DEFAULT_FACTORIES:
            entry.setdefault("proj_type", "normal")  # both built-in factories' default
    return entry


def projection_record(
    projection_kwargs: Mapping[str, Mapping[str, Any]] | None, projector: Any = None
) -> dict[str, dict]:
    """JSON-able record of a capture's projection settings, as stored by a store.

    Args:
        projection_kwargs: ``{layer name or "__default__": proj_kwargs}`` (see
            ``HookManagerConfig``); ``None`` = unprojected.
        projector: the capture's projection factory (a callable, a
            ``DattriProjector`` or ``None`` = the default factory, resolved to
            the one actually in use: dattri's ``random_project`` when dattri is
            installed, else the built-in one).

    Returns:
        ``{name or "__default__": settings}``; each entry has ``style``,
        ``proj_seed`` and ``include_bias`` filled with their defaults, the
        other JSON-able keys verbatim (``device`` dropped), and for projected
        (non-``"mask"``) styles ``"projector"``, the ``module.qualname`` of the
        factory that made the matrices (plus ``proj_type``, default
        ``"normal"``, for the two built-in factories). ``{}`` for an
        unprojected capture. Resolving a record again returns it unchanged.
    """
    if not projection_kwargs:
        return {}
    return {
        str(layer): _resolve_layer_projection(proj_kwargs, projector)
        for layer, proj_kwargs in projection_kwargs.items()
    }


# --------------------------------------------------------------------------- the manager


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
            budget_bytes = int(_total_host_bytes() * TIERED_BUDGET_FRACTION)
        self._residency = residency
        self._disk_format = disk_format
        self._budget_bytes = budget_bytes
        self._index: dict[str, list[dict[str, Any]]] = {}
        self._groups: dict[str, _GroupInfo] = {}
        self._sample_id_key: str | int | None = None
        self._id_scheme_fixed = False
        self._accumulation_steps: int | None = None
        self._low_rank: int | None = None  # set below, after the store's own record
        self._projection: dict[str, dict] | None = None
        self._write_dir: Path | None = None
        self._write_prefix = ""
        self._missing_ranks: list[int] = []  # rank directories a ranks.json needs, not indexed
        self._declared_world: tuple[Path, int] | None = None  # (ranks.json, its world size)
        self._next_batch = 0
        self._next_seq = 0
        self._written_meta: dict[str, Any] | None = None
        self._written_projection: dict[str, dict] | None = None
        self._cache: TensorCache | None = None
        self._cache_keys: dict[str, str] = {}  # location of a RAM group -> its cache key
        self._ram_locations: dict[str, str] = {}  # cache key -> location
        self._closed = False
        self._created_root = False
        if residency == "disk":
            self._open_existing()
        if low_rank is not None:
            self._require_low_rank_compatible(low_rank)
            self._low_rank = low_rank
        if residency != "disk":
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
        return 0 if self._cache is None else self._cache.nbytes

    @property
    def sample_id_key(self) -> str | int | None:
        """Field identifiers are read from (``None`` = content hash)."""
        return self._sample_id_key

    @property
    def gradient_accumulation_steps(self) -> int:
        """Declared accumulation window of the stored records (1 when undeclared)."""
        return self._accumulation_steps or 1

    @property
    def low_rank(self) -> int | None:
        """``c`` of a low-rank store (records kept as rank-``c`` factors); ``None`` = full rank."""
        return self._low_rank

    @property
    def projection(self) -> dict[str, dict] | None:
        """Declared capture projection ``{name or "__default__": settings}``.

        Resolved by `projection_record`; ``{}`` = declared unprojected, ``None``
        = never declared (unknown, e.g. a store written by the reference design).
        """
        return self._projection

    @property
    def index(self) -> dict[str, list[dict[str, Any]]]:
        """Merged live index ``identifier → [{"file", "idx", "step", "sample_idx"}, ...]``.

        The manager's own dict, updated by every save: do not mutate it. A
        store missing a rank directory its ``ranks.json`` needs → `ValueError`.
        """
        self._check_complete()
        return self._index

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Release RAM-held groups and remove a tiered spill directory (idempotent).

        A no-op for ``"disk"`` stores. A closed ``"memory"`` / ``"tiered"``
        store raises `RuntimeError` on further use.
        """
        if self._cache is None or self._closed:
            return
        self._closed = True
        self._cache.close()
        if self._created_root:
            try:
                self._save_dir.rmdir()  # only if the spill left it empty
            except OSError:
                pass

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
            f"disk_format={self._disk_format!r}, groups={len(self._groups)}, "
            f"identifiers={len(self._index)})"
        )

    # ----------------------------------------------------------------- declarations
    def declare_gradient_accumulation_steps(self, n: int) -> None:
        """Record the accumulation window the stored records were merged over.

        ``n < 1`` or a value conflicting with an earlier declaration (or the
        on-disk value) → `ValueError`; the same value again is a no-op.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an int >= 1, got {n!r} (store "
                f"{self._save_dir})."
            )
        if self._accumulation_steps is not None and self._accumulation_steps != n:
            raise ValueError(
                f"gradient store {self._save_dir} holds records with "
                f"gradient_accumulation_steps={self._accumulation_steps}; cannot declare {n}. "
                f"Use a fresh directory or the store's convention."
            )
        self._accumulation_steps = n
        self._write_sidecars()

    def declare_low_rank(self, rank: int) -> None:
        """Store every later save's matrix-form layers as rank-``rank`` factors (see ``low_rank``).

        The same ``rank`` again is a no-op; another ``c`` than the store's, or a
        store that already holds full-rank records → `ValueError`.
        """
        rank = check_low_rank(rank, "declare_low_rank: rank")
        self._require_low_rank_compatible(rank)
        self._low_rank = rank
        self._write_sidecars()

    def _require_low_rank_compatible(self, rank: int) -> None:
        """`ValueError` unless records of rank ``rank`` may join this store."""
        if self._low_rank is not None and self._low_rank != rank:
            raise ValueError(
                f"gradient store {self._save_dir} holds low-rank records of rank c="
                f"{self._low_rank}; cannot add records of rank c={rank}. Stores of different c "
                f"cannot be mixed: use low_rank={self._low_rank} or a fresh directory."
            )
        if self._low_rank is None and self._groups:
            raise ValueError(
                f"gradient store {self._save_dir} already holds full-rank records; cannot make "
                f"it a low-rank store (c={rank}). Use a fresh directory for low_rank={rank}."
            )

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
        record = projection_record(projection, projector)
        if self._projection is not None and self._projection != record:
            raise ValueError(
                f"gradient store {self._save_dir} holds gradients captured with projection "
                f"{self._projection}; cannot declare {record}. Capture with the store's "
                f"projection_kwargs (and projector) or use a fresh directory."
            )
        self._projection = record
        self._write_sidecars()

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
        base = f"step_{int(record.step):06d}_{_file_safe_identifier(record.input_hash)}"
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
        self._check_open()
        self._validate_records(records)
        records = self._at_store_rank(records)
        key = records[0].sample_id_key
        if self._residency == "disk":
            location = self._write_disk_group(records, key, base)
        else:
            location = self._write_ram_group(records)
        self._fix_id_scheme(key)
        self._add_group_entries(location, [(int(r.step), _record_identifiers(r)) for r in records])
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
            if rank != self._low_rank:
                self.declare_low_rank(rank)
        if self._low_rank is None:
            return records
        return [
            GradientRecord(
                step=r.step,
                input_hash=r.input_hash,
                gradient=low_rank_gradient(r.gradient, self._low_rank),
                sample_id_key=r.sample_id_key,
            )
            for r in records
        ]

    def _validate_records(self, records: list[GradientRecord]) -> None:
        if not records:
            raise ValueError(f"save_bulk: no records to save (store {self._save_dir}).")
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
        key = records[0].sample_id_key
        if self._id_scheme_fixed and key != self._sample_id_key:
            raise ValueError(
                f"gradient store {self._save_dir} identifies samples by sample_id_key="
                f"{self._sample_id_key!r} but the record has sample_id_key={key!r}; use one "
                f"scheme per store (or another directory)."
            )

    def _fix_id_scheme(self, key: str | int | None) -> None:
        if not self._id_scheme_fixed:
            self._sample_id_key, self._id_scheme_fixed = key, True
            self._write_sidecars()

    def _write_disk_group(
        self, records: list[GradientRecord], key: str | int | None, base: str | None
    ) -> str:
        write_dir = self._resolve_write_dir()
        if not self._id_scheme_fixed:
            self._sample_id_key, self._id_scheme_fixed = key, True
        self._write_sidecars()  # sidecars before the first log line
        suffix = _group_suffix(records, self._disk_format)
        if base is None:
            handle = self._claim_batch_handle(write_dir, suffix)
        else:
            handle = write_dir / (base + suffix)
        try:
            _write_group_at(handle, records)
        except BaseException:
            if base is None:
                for path in (_primary_file(handle), *_mmap_files(handle)):
                    path.unlink(missing_ok=True)
            raise
        location = self._write_prefix + handle.name
        _append_log_line(
            write_dir / INDEX_FILE,
            {
                "file": location,
                "records": [
                    {"idx": i, "step": int(r.step), "hashes": _record_identifiers(r)}
                    for i, r in enumerate(records)
                ],
            },
        )
        self._missing_ranks = [r for r in self._missing_ranks if f"rank_{r}/" != self._write_prefix]
        return location

    def _claim_batch_handle(self, write_dir: Path, suffix: str) -> Path:
        """Next ``batch_<NNNNNN>`` handle, its primary file created exclusively.

        Numbers another writer of the directory has taken meanwhile are skipped.
        """
        while True:
            base = f"batch_{self._next_batch:06d}"
            self._next_batch += 1
            if any((write_dir / (base + ext)).exists() for ext in _GROUP_FILE_SUFFIXES):
                continue
            handle = write_dir / (base + suffix)
            if _claim_exclusively(_primary_file(handle)):
                return handle

    def _write_ram_group(self, records: list[GradientRecord]) -> str:
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

    def _resolve_write_dir(self) -> Path:
        """Per-rank write directory, created and prepared at the first save."""
        if self._write_dir is not None:
            return self._write_dir
        rank = dist_rank()
        self._write_prefix = "" if rank is None else f"rank_{rank}/"
        write_dir = self._save_dir if rank is None else self._save_dir / f"rank_{rank}"
        write_dir.mkdir(parents=True, exist_ok=True)
        if rank is not None:
            self._write_rank_file(write_dir, rank)
        _repair_log_tail(write_dir / INDEX_FILE)
        self._next_batch = _next_batch_number(write_dir)
        has_log = (write_dir / INDEX_FILE).exists()
        self._written_meta = self._read_sidecar(write_dir / SIDECAR_FILE, has_log)
        self._written_projection = self._read_sidecar(write_dir / PROJECTION_FILE, has_log)
        self._write_dir = write_dir
        return write_dir

    @staticmethod
    def _write_rank_file(write_dir: Path, rank: int) -> None:
        """Record ``{"rank", "world_size"}`` of this run in ``write_dir/ranks.json``."""
        content = {"rank": rank, "world_size": dist_world_size()}
        path = write_dir / RANKS_FILE
        if not path.exists() or _read_json(path) != content:
            _write_json(path, content)

    @staticmethod
    def _read_sidecar(path: Path, has_log: bool) -> dict[str, Any] | None:
        return _read_json(path) if has_log and path.exists() else None

    def _meta(self) -> dict[str, Any]:
        meta = {
            "format": FORMAT_VERSION,
            "sample_id_key": self._sample_id_key,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        if self._low_rank is not None:
            meta["low_rank"] = self._low_rank
        return meta

    def _write_sidecars(self) -> None:
        """Rewrite changed sidecars atomically (disk, once the identifier scheme is known)."""
        if self._write_dir is None or not self._id_scheme_fixed:
            return
        meta = self._meta()
        if meta != self._written_meta:
            _write_json(self._write_dir / SIDECAR_FILE, meta)
            self._written_meta = meta
        if self._projection is not None and self._projection != self._written_projection:
            _write_json(self._write_dir / PROJECTION_FILE, self._projection)
            self._written_projection = self._projection

    # ----------------------------------------------------------------- index bookkeeping
    def _add_group_entries(self, location: str, described: list[tuple[int, list[str]]]) -> None:
        """Index a group; its (step, identifier) pairs replace earlier occurrences."""
        if location in self._groups:  # the same handle written again (save of the same pair)
            self._forget_group(location)
        for step, identifiers in described:
            for identifier in identifiers:
                self._supersede(identifier, step)
        info = _GroupInfo([step for step, _ in described], [ids for _, ids in described])
        self._groups[location] = info
        for idx, (step, identifiers) in enumerate(described):
            info.live.append(set(range(len(identifiers))))
            for sample_idx, identifier in enumerate(identifiers):
                self._index.setdefault(identifier, []).append(
                    {"file": location, "idx": idx, "step": step, "sample_idx": sample_idx}
                )

    def _supersede(self, identifier: str, step: int) -> None:
        """Drop the indexed occurrences of ``identifier`` at ``step`` (a newer save replaces it)."""
        entries = self._index.get(identifier)
        if not entries:
            return
        kept = [e for e in entries if e["step"] != step]
        for entry in entries:
            if entry["step"] == step:
                self._drop_row(entry)
        if kept:
            self._index[identifier] = kept
        else:
            del self._index[identifier]

    def _drop_row(self, entry: Mapping[str, Any]) -> None:
        info = self._groups[entry["file"]]
        info.live[entry["idx"]].discard(entry["sample_idx"])
        if not any(info.live):
            self._forget_group(entry["file"])

    def _forget_group(self, location: str) -> None:
        """Remove a group from the bookkeeping (and its entries from the index)."""
        info = self._groups.pop(location)
        for idx, identifiers in enumerate(info.identifiers):
            for sample_idx in info.live[idx]:
                identifier = identifiers[sample_idx]
                kept = [
                    e
                    for e in self._index.get(identifier, [])
                    if not (e["file"] == location and e["idx"] == idx)
                ]
                if kept:
                    self._index[identifier] = kept
                else:
                    self._index.pop(identifier, None)
        key = self._cache_keys.pop(location, None)
        if key is not None:
            del self._ram_locations[key]
            self._cache.discard(key)

    def _location_order(self, location: str) -> tuple:
        """Store order: root groups, then ``rank_*`` ones (disk); save order (RAM)."""
        if self._cache is not None:
            return (int(_RAM_SEQ_RE.match(location.rsplit("/", 1)[-1]).group(1)),)
        return ("/" in location, _natural_key(location))

    # ----------------------------------------------------------------- opening
    def _store_dirs(self) -> list[Path]:
        """The root, then every ``rank_*`` directory in sorted (lexicographic) order."""
        if not self._save_dir.is_dir():
            return []
        return [self._save_dir] + sorted(p for p in self._save_dir.glob("rank_*") if p.is_dir())

    def _open_existing(self) -> None:
        """Merge the sidecars and index logs of the root and every rank directory.

        Also notes the rank directories that a ``ranks.json`` world size needs
        but that hold no indexed group (`_check_complete` raises on reads).
        """
        indexed_ranks: set[int] = set()
        for directory in self._store_dirs():
            log = directory / INDEX_FILE
            if not log.exists():
                continue
            sidecar = directory / SIDECAR_FILE
            if not sidecar.exists():
                raise ValueError(
                    f"gradient store {directory} has an index ({INDEX_FILE}) but no "
                    f"{SIDECAR_FILE}; it is not a complete gradient store."
                )
            self._merge_meta(_read_json(sidecar), sidecar)
            projection = directory / PROJECTION_FILE
            if projection.exists():
                self._merge_projection(_read_json(projection), projection)
            lines = _read_log(log)
            for line in lines:
                described = [
                    (int(r["step"]), [str(h) for h in r["hashes"]]) for r in line["records"]
                ]
                self._add_group_entries(line["file"], described)
            rank = None if directory == self._save_dir else _rank_of(directory)
            if rank is None:
                continue
            if lines:
                indexed_ranks.add(rank)
            declared = _declared_world_size(directory)
            if declared > (0 if self._declared_world is None else self._declared_world[1]):
                self._declared_world = (directory / RANKS_FILE, declared)
        world_size = 0 if self._declared_world is None else self._declared_world[1]
        self._missing_ranks = [r for r in range(world_size) if r not in indexed_ranks]

    def _check_complete(self) -> None:
        """`ValueError` naming the rank directories the store needs but lacks (see `RANKS_FILE`)."""
        if not self._missing_ranks:
            return
        missing = ", ".join(f"rank_{r}/" for r in self._missing_ranks)
        path, world_size = self._declared_world
        raise ValueError(
            f"gradient store {self._save_dir} is missing the shard of rank(s) "
            f"{self._missing_ranks}: {path} records a run of {world_size} ranks, but "
            f"{missing} holds no indexed gradients, so scores would silently leave out that "
            f"rank's samples. Copy the missing rank directory (from the machine that ran it) "
            f"into {self._save_dir}, or re-run the capture into this store (re-saved samples "
            f"replace their earlier records). To score only the ranks present, delete the "
            f"{RANKS_FILE} files of its rank directories."
        )

    def _merge_meta(self, meta: dict[str, Any], path: Path) -> None:
        if "sample_id_key" not in meta:
            raise ValueError(
                f"gradient store settings {path} lack the required key 'sample_id_key'; the "
                f"file is corrupt."
            )
        key = meta["sample_id_key"]
        if self._id_scheme_fixed and key != self._sample_id_key:
            raise ValueError(
                f"gradient store {self._save_dir}: {path} uses sample_id_key={key!r} but "
                f"another part of the store uses {self._sample_id_key!r}."
            )
        self._sample_id_key, self._id_scheme_fixed = key, True
        n = meta.get("gradient_accumulation_steps", 1)
        if self._accumulation_steps is not None and n != self._accumulation_steps:
            raise ValueError(
                f"gradient store {self._save_dir}: {path} declares gradient_accumulation_steps="
                f"{n} but another part of the store declares {self._accumulation_steps}."
            )
        self._accumulation_steps = n
        self._merge_low_rank(meta.get("low_rank"), path)

    def _merge_low_rank(self, rank: int | None, path: Path) -> None:
        """Adopt the ``c`` recorded in ``path``; another ``c`` (or full rank) elsewhere → error."""
        if self._groups and rank != self._low_rank:
            ours = "full rank" if self._low_rank is None else f"c={self._low_rank}"
            raise ValueError(
                f"gradient store {self._save_dir}: {path} records low_rank={rank} but another "
                f"part of the store holds {ours}; stores of different c cannot be mixed."
            )
        self._low_rank = rank

    def _merge_projection(self, record: dict[str, dict], path: Path) -> None:
        if self._projection is not None and record != self._projection:
            raise ValueError(
                f"gradient store {self._save_dir}: {path} declares projection {record} but "
                f"another part of the store declares {self._projection}."
            )
        self._projection = record

    # ----------------------------------------------------------------- RAM residency
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
        info = self._groups.pop(old, None)
        if info is None:  # a new group that went straight to disk: indexed by the caller
            return
        self._groups[new] = info
        for identifier in {i for ids in info.identifiers for i in ids}:
            for entry in self._index.get(identifier, []):
                if entry["file"] == old:
                    entry["file"] = new

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"gradient store {self._save_dir} ({self._residency}) is closed; its groups "
                f"were released. Create a new GradientStorageManager."
            )

    # ----------------------------------------------------------------- reading
    def _identifier(self, inputs: object) -> str:
        """Identifier of one sample's inputs under the store's identifier scheme."""
        key = self._sample_id_key
        if key is None:
            return hash_sample(inputs)
        if isinstance(key, int) and not isinstance(inputs, Mapping):
            if not isinstance(inputs, Sequence) or not -len(inputs) <= key < len(inputs):
                raise KeyError(
                    f"sample_id_key={key} (positional argument) is not in the given inputs of "
                    f"type {type(inputs).__name__}."
                )
            return _stringify_identifier(inputs[key])
        if isinstance(key, int):
            for candidate in (f"_arg{key}", key):
                if candidate in inputs:
                    return _stringify_identifier(inputs[candidate])
            raise KeyError(
                f"sample_id_key={key}: inputs have neither '_arg{key}' nor {key}; "
                f"fields: {sorted(map(str, inputs))}."
            )
        if key not in inputs:
            raise KeyError(
                f"sample_id_key={key!r} is missing from the inputs; fields: "
                f"{sorted(map(str, inputs))}."
            )
        return _stringify_identifier(inputs[key])

    def _occurrences(self, identifier: object) -> list[dict[str, Any]]:
        self._check_complete()
        identifier = _stringify_identifier(identifier)
        entries = self._index.get(identifier)
        if not entries:
            examples = sorted(self._index)[:3]
            raise KeyError(
                f"identifier {identifier!r} not in index of gradient store {self._save_dir} "
                f"({len(self._index)} identifiers indexed, e.g. {examples}; stored steps "
                f"{self.available_steps()}). Check the identifier scheme (sample_id_key="
                f"{self._sample_id_key!r})."
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
            f"identifier {_stringify_identifier(input_hash)!r} at (step={step}, "
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
        for location in sorted(by_location, key=self._location_order):
            records = self.load_records(location)
            found.extend(records[idx] for idx in sorted(by_location[location]))
        return sorted(found, key=lambda r: r.step)

    def available_steps(self) -> list[int]:
        """Distinct steps of the indexed records, ascending."""
        self._check_complete()
        return sorted(
            {
                step
                for info in self._groups.values()
                for step, live in zip(info.steps, info.live)
                if live
            }
        )

    def locations(self) -> list[str]:
        """Every indexed group location in store order (root, then ranks; save order in RAM)."""
        self._check_complete()
        return sorted(self._groups, key=self._location_order)

    def iter_steps(self, steps: int | Iterable[int]) -> list[tuple[str, dict[int, list[int]]]]:
        """Groups holding any of ``steps``: ``[(location, {step: sorted record idxs})]``.

        Ordered by location (store order); each location appears once. Records
        whose every sample was re-saved later are left out.
        """
        wanted = {int(steps)} if isinstance(steps, int) else {int(s) for s in steps}
        plan = []
        for location in self.locations():
            info = self._groups[location]
            by_step: dict[int, list[int]] = {}
            for idx, (step, live) in enumerate(zip(info.steps, info.live)):
                if step in wanted and live:
                    by_step.setdefault(step, []).append(idx)
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
        records = self._read_group(file_relpath)
        info = self._groups[file_relpath]
        for idx, (identifiers, live) in enumerate(zip(info.identifiers, info.live)):
            if live and len(live) < len(identifiers):
                records[idx] = _keep_rows(records[idx], sorted(live))
        return records

    def _read_group(self, location: str) -> list[GradientRecord]:
        """Every record of a group exactly as stored."""
        self._check_open()
        self._check_complete()
        if location not in self._groups:
            raise KeyError(
                f"gradient store {self._save_dir} has no group {location!r} in its index; "
                f"{len(self._groups)} groups are indexed (see locations())."
            )
        if self._cache is None:
            return load_group_file(self.group_path(location))
        return [_shallow_copy(r) for r in self._cache.get(self._cache_keys[location]).records]

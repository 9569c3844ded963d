"""Gradient store: groups of `GradientRecord` s plus an index ``identifier → occurrences``.

A *group* is one unit of writing (one call of `GradientStorageManager.save_bulk`)
holding one or more records. The index maps every sample identifier (content
hash or ``sample_id_key`` value) to its occurrences
``{"file": location, "idx": record position, "step": int, "sample_idx": row}``.

On-disk layout of a ``"disk"`` store (the write directory is ``save_dir``, or
``save_dir/rank_<r>/`` under an initialised process group)::

    store.json       settings sidecar: format version, sample_id_key,
                     gradient_accumulation_steps, projection (rewritten atomically)
    index.jsonl      append-only log, one line per group:
                     {"file": name, "records": [{"idx", "step", "ids"}, ...]}
    group_<n>.mmap   memmap group: magic, header length, JSON header, raw bytes
    group_<n>.pt     pickle group (``torch.save``)

Crash safety: a group file is written under a temporary name, fsynced and
renamed *before* its log line is appended (and fsynced), so a killed writer
leaves at most an unindexed file or a truncated last log line, which readers
ignore with a `UserWarning`.

Every group carries a self-describing JSON header (format version, per record
the step, identifiers and per layer its representation, layer type, indexing,
``module_kwargs`` and the dtype/shape of every tensor). Reading checks the
version and, for pickle groups, that the loaded tensors match the header.
Memmap groups are read back as copy-on-write memory-mapped views (no
unpickling); a group whose payloads or ``module_kwargs`` cannot be described
in JSON falls back to pickle.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.options import CacheResidency, DiskFormat
from dattri_llm.utils.atomic import atomic_write
from dattri_llm.utils.cache import CACHE_RESIDENCIES, TensorCache, available_host_bytes

__all__ = [
    "DISK_FORMATS",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "SIDECAR_FILE",
    "GradientStorageManager",
    "load_group_file",
    "projection_record",
    "write_group_file",
]

DISK_FORMATS = ("pickle", "memmap")
FORMAT_VERSION = 1

SIDECAR_FILE = "store.json"
INDEX_FILE = "index.jsonl"
_MAGIC = b"DTLLMGRP"
_PREAMBLE = len(_MAGIC) + 8
_ALIGN = 64
_SUFFIX = {"memmap": ".mmap", "pickle": ".pt"}
_GROUP_RE = re.compile(r"^group_(\d+)\.")
_RANK_DIR_RE = re.compile(r"^rank_(\d+)$")
_TUPLE_TAG = "__tuple__"
_DEFAULT_PROJECTION = {"style": "logra", "proj_seed": 0, "include_bias": True}
_DEFAULT_FACTORIES = (
    "dattri.func.projection.random_project",
    "dattri_llm.gradient.ops.projection.random_project",
)


# --------------------------------------------------------------------------- JSON encoding


class _NotJSONable(Exception):
    """A value that the primitives-only header cannot describe."""


def _encode_json(value: Any) -> Any:
    """JSON-able form of ``value``; tuples become ``{"__tuple__": [...]}`` (restored on read)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [_encode_json(v) for v in value]}
    if isinstance(value, list):
        return [_encode_json(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or _TUPLE_TAG in value:
            raise _NotJSONable
        return {k: _encode_json(v) for k, v in value.items()}
    raise _NotJSONable


def _decode_json(value: Any) -> Any:
    """Inverse of `_encode_json`."""
    if isinstance(value, list):
        return [_decode_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE_TAG}:
            return tuple(_decode_json(v) for v in value[_TUPLE_TAG])
        return {k: _decode_json(v) for k, v in value.items()}
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str, path: Path) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gradient group {path}: unknown tensor dtype {name!r} in its header.")
    return dtype


# --------------------------------------------------------------------------- group encoding


class _GroupEncoder:
    """Splits records into a JSON header, a tensor list and (pickle-only) objects."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.tensor_descs: list[dict[str, Any]] = []
        self.objects: list[Any] = []

    def tensor(self, value: torch.Tensor, record: int, layer: str, role: str) -> int:
        value = value.detach().to("cpu")
        self.tensors.append(value)
        self.tensor_descs.append(
            {
                "dtype": _dtype_name(value.dtype),
                "shape": list(value.shape),
                "record": record,
                "layer": layer,
                "role": role,
            }
        )
        return len(self.tensors) - 1

    def obj(self, value: Any) -> dict[str, int]:
        self.objects.append(value)
        return {"object": len(self.objects) - 1}

    def payload(self, value: Any, record: int, layer: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            return {"kind": "tensor", "tensor": self.tensor(value, record, layer, "tensor")}
        if isinstance(value, Factorized):
            try:
                kwargs: Any = {"json": _encode_json(value.module_kwargs)}
            except _NotJSONable:
                kwargs = self.obj(value.module_kwargs)
            return {
                "kind": "factorized",
                "activation": self.tensor(value.activation, record, layer, "activation"),
                "pre_activation_grad": self.tensor(
                    value.pre_activation_grad, record, layer, "pre_activation_grad"
                ),
                "module_kwargs": kwargs,
                "batch_first": bool(value.batch_first),
            }
        return {"kind": "object", **self.obj(value)}

    def record(self, record: GradientRecord, position: int) -> dict[str, Any]:
        gradient = record.gradient
        layers = [
            {
                "name": name,
                "representation": gradient.representation[name],
                "layer_type": gradient.layer_types[name],
                "indexing": gradient.indexing.get(name, "batch"),
                "payload": self.payload(value, position, name),
            }
            for name, value in gradient.data.items()
        ]
        hashes = record.input_hash
        return {
            "step": int(record.step),
            "input_hash": str(hashes) if isinstance(hashes, str) else [str(h) for h in hashes],
            "sample_id_key": record.sample_id_key,
            "layers": layers,
        }


def _encode_group(
    records: Sequence[GradientRecord], disk_format: str
) -> tuple[dict[str, Any], list[torch.Tensor], list[Any]]:
    """``(header, tensors, objects)``; a memmap group with objects falls back to pickle."""
    encoder = _GroupEncoder()
    described = [encoder.record(r, i) for i, r in enumerate(records)]
    fmt = "pickle" if encoder.objects else disk_format
    header = {
        "format_version": FORMAT_VERSION,
        "format": fmt,
        "records": described,
        "tensors": encoder.tensor_descs,
    }
    return header, encoder.tensors, encoder.objects


def _decode_payload(
    payload: dict[str, Any], tensors: list[torch.Tensor], objects: list[Any]
) -> Any:
    kind = payload["kind"]
    if kind == "tensor":
        return tensors[payload["tensor"]]
    if kind == "object":
        return objects[payload["object"]]
    kwargs = payload["module_kwargs"]
    module_kwargs = _decode_json(kwargs["json"]) if "json" in kwargs else objects[kwargs["object"]]
    return Factorized(
        tensors[payload["activation"]],
        tensors[payload["pre_activation_grad"]],
        module_kwargs=module_kwargs,
        batch_first=payload["batch_first"],
    )


def _decode_group(
    header: dict[str, Any], tensors: list[torch.Tensor], objects: list[Any]
) -> list[GradientRecord]:
    records = []
    for described in header["records"]:
        layers = described["layers"]
        gradient = Gradient(
            representation={x["name"]: x["representation"] for x in layers},
            data={x["name"]: _decode_payload(x["payload"], tensors, objects) for x in layers},
            layer_types={x["name"]: x["layer_type"] for x in layers},
            indexing={x["name"]: x["indexing"] for x in layers},
            validate_on_init=False,
        )
        records.append(
            GradientRecord(
                step=described["step"],
                input_hash=described["input_hash"],
                gradient=gradient,
                sample_id_key=described["sample_id_key"],
            )
        )
    return records


# --------------------------------------------------------------------------- group files


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """Raw bytes of a CPU tensor as a ``uint8`` array (no copy when already contiguous)."""
    flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _write_memmap(fh: Any, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    offset = 0
    for desc, tensor in zip(header["tensors"], tensors):
        desc["offset"] = offset
        desc["nbytes"] = tensor.numel() * tensor.element_size()
        offset = _align(offset + desc["nbytes"])
    header["data_nbytes"] = offset
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    data_start = _align(_PREAMBLE + len(header_bytes))
    fh.write(_MAGIC)
    fh.write(len(header_bytes).to_bytes(8, "little"))
    fh.write(header_bytes)
    position = _PREAMBLE + len(header_bytes)
    for desc, tensor in zip(header["tensors"], tensors):
        target = data_start + desc["offset"]
        fh.write(b"\0" * (target - position))
        if desc["nbytes"]:
            fh.write(_tensor_bytes(tensor))
        position = target + desc["nbytes"]
    fh.write(b"\0" * (data_start + offset - position))


def write_group_file(path: Path, records: Sequence[GradientRecord], disk_format: str) -> Path:
    """Write ``records`` as one group file atomically; returns the path actually written.

    The suffix of ``path`` is replaced by the format's (``.mmap`` / ``.pt``):
    a memmap group whose payloads are not all tensors / `Factorized` with
    JSON-able ``module_kwargs`` is written with pickle.
    """
    header, tensors, objects = _encode_group(records, disk_format)
    path = Path(path).with_suffix(_SUFFIX[header["format"]])
    if header["format"] == "memmap":
        atomic_write(path, lambda fh: _write_memmap(fh, header, tensors))
    else:
        payload = {"header": header, "tensors": tensors, "objects": objects}
        atomic_write(path, lambda fh: torch.save(payload, fh))
    return path


def _check_version(header: Mapping[str, Any], path: Path) -> None:
    found = header.get("format_version")
    if found != FORMAT_VERSION:
        raise ValueError(
            f"gradient store file {path} was written with store format version {found!r}, "
            f"but this dattri_llm reads version {FORMAT_VERSION}; re-create the store with "
            f"this library version."
        )


def _memmap_view(buffer: np.ndarray | None, desc: dict[str, Any], path: Path) -> torch.Tensor:
    dtype = _parse_dtype(desc["dtype"], path)
    shape = desc["shape"]
    if desc["nbytes"] == 0:
        return torch.empty(shape, dtype=dtype)
    raw = buffer[desc["offset"] : desc["offset"] + desc["nbytes"]]
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _read_memmap(path: Path) -> list[GradientRecord]:
    with open(path, "rb") as fh:
        fh.seek(len(_MAGIC))
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len).decode("utf-8"))
    _check_version(header, path)
    data_start = _align(_PREAMBLE + header_len)
    data_nbytes = header["data_nbytes"]
    if os.path.getsize(path) < data_start + data_nbytes:
        raise ValueError(
            f"gradient group {path} is truncated: its header describes "
            f"{data_start + data_nbytes} bytes but the file has {os.path.getsize(path)}."
        )
    buffer = None
    if data_nbytes:
        buffer = np.memmap(path, dtype=np.uint8, mode="c", offset=data_start, shape=(data_nbytes,))
    tensors = [_memmap_view(buffer, desc, path) for desc in header["tensors"]]
    return _decode_group(header, tensors, [])


def _read_pickle(path: Path) -> list[GradientRecord]:
    payload = torch.load(path, map_location="cpu", weights_only=False)
    header, tensors = payload["header"], payload["tensors"]
    _check_version(header, path)
    if len(tensors) != len(header["tensors"]):
        raise ValueError(
            f"gradient group {path}: header describes {len(header['tensors'])} tensors but "
            f"the file holds {len(tensors)}."
        )
    for desc, tensor in zip(header["tensors"], tensors):
        if _dtype_name(tensor.dtype) != desc["dtype"] or list(tensor.shape) != desc["shape"]:
            raise ValueError(
                f"gradient group {path}: layer {desc['layer']!r} ({desc['role']}) of record "
                f"{desc['record']} is {_dtype_name(tensor.dtype)} {list(tensor.shape)} but the "
                f"header says {desc['dtype']} {desc['shape']}; the file is corrupt."
            )
    return _decode_group(header, tensors, payload["objects"])


def load_group_file(path: str | Path) -> list[GradientRecord]:
    """All records of one group file (memmap or pickle, detected from the file's magic)."""
    path = Path(path)
    with open(path, "rb") as fh:
        magic = fh.read(len(_MAGIC))
    return _read_memmap(path) if magic == _MAGIC else _read_pickle(path)


# --------------------------------------------------------------------------- index files


def _natural_key(location: str) -> tuple:
    """Sort key ordering ``group_2`` before ``group_10`` and root groups before ``rank_*``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", location))


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _read_log(path: Path) -> list[dict[str, Any]]:
    """Complete lines of an index log; an unterminated last line is dropped with a warning."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    tail = lines.pop()
    if tail:
        warnings.warn(
            f"gradient store index {path}: ignoring a truncated last line (an interrupted "
            f"write); the group it described is not indexed, earlier records are intact.",
            UserWarning,
            stacklevel=3,
        )
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"gradient store index {path}: line {number} is not valid JSON ({err}); the "
                f"index is corrupt."
            ) from None
    return entries


def _truncate_partial_tail(path: Path) -> None:
    """Cut an unterminated last line off a log before appending to it."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)
            fh.flush()
            os.fsync(fh.fileno())


# --------------------------------------------------------------------------- helpers


def _stringify_identifier(value: object) -> str:
    """An identifier as ``str``: one-element tensors / arrays by their item, else ``str()``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return str(value.item())
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        return str(value.item())
    return str(value)


def _record_identifiers(record: GradientRecord) -> list[str]:
    hashes = record.input_hash
    return [str(hashes)] if isinstance(hashes, str) else [str(h) for h in hashes]


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


def _next_group_number(directory: Path) -> int:
    numbers = [int(m.group(1)) for p in directory.iterdir() if (m := _GROUP_RE.match(p.name))]
    return max(numbers, default=-1) + 1


# --------------------------------------------------------------------------- projection record


def _projector_name(projector: Any) -> str | None:
    """``module.qualname`` of a projection factory; ``None`` for the default factory."""
    from dattri_llm.gradient.ops.projection import DattriProjector

    if isinstance(projector, DattriProjector):
        projector = projector.factory
    if projector is None:
        return None
    named = projector if hasattr(projector, "__qualname__") else type(projector)
    name = f"{named.__module__}.{named.__qualname__}"
    return None if name in _DEFAULT_FACTORIES else name


def _json_scalar(value: Any) -> Any:
    """``value`` as a JSON scalar (NumPy scalars unwrapped), or `_NotJSONable`."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _NotJSONable


def _resolve_layer_projection(proj_kwargs: Mapping[str, Any], projector: str | None) -> dict:
    """One layer's settings with the defaults filled in; ``device`` and non-JSON values dropped."""
    entry: dict[str, Any] = dict(_DEFAULT_PROJECTION)
    for key, value in proj_kwargs.items():
        try:
            if key != "device":
                entry[key] = _json_scalar(value)
        except _NotJSONable:
            continue
    if entry["style"] != "mask":  # masks gather exact entries: no projector involved
        if projector is not None:
            entry["projector"] = projector
        if "projector" not in entry:
            entry.setdefault("proj_type", "normal")  # the default factory's default
    return entry


def projection_record(
    projection_kwargs: Mapping[str, Mapping[str, Any]] | None, projector: Any = None
) -> dict[str, dict]:
    """JSON-able record of a capture's projection settings, as stored by a store.

    Args:
        projection_kwargs: ``{layer name or "__default__": proj_kwargs}`` (see
            ``HookManagerConfig``); ``None`` = unprojected.
        projector: the capture's projection factory (a callable, a
            ``DattriProjector`` or ``None`` = the default factory).

    Returns:
        ``{name or "__default__": settings}``; each entry has ``style``,
        ``proj_seed`` and ``include_bias`` filled with their defaults, the
        other JSON-able keys verbatim (``device`` dropped), and for projected
        (non-``"mask"``) styles either ``"projector"`` (the factory's
        ``module.qualname`` when it is not the default factory) or
        ``proj_type`` (default ``"normal"``). ``{}`` for an unprojected capture.
        Resolving a record again returns it unchanged.
    """
    if not projection_kwargs:
        return {}
    name = _projector_name(projector)
    return {
        str(layer): _resolve_layer_projection(proj_kwargs, name)
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
            default half the available host RAM, oldest groups spilled to a
            temporary subdirectory of ``save_dir`` removed by `close`).
        budget_bytes: RAM budget of ``"memory"`` / ``"tiered"`` stores (ignored
            for ``"disk"``).
        disk_format: ``"memmap"`` (raw bytes + JSON header, read back as
            copy-on-write memory maps) or ``"pickle"`` (``torch.save``; only
            open trusted directories).

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
    ) -> None:
        if residency not in CACHE_RESIDENCIES:
            raise ValueError(
                f"GradientStorageManager: unknown residency {residency!r}; expected one of "
                f"{CACHE_RESIDENCIES}."
            )
        if disk_format not in DISK_FORMATS:
            raise ValueError(
                f"GradientStorageManager: unknown disk_format {disk_format!r}; expected one of "
                f"{DISK_FORMATS}."
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
            budget_bytes = available_host_bytes() // 2
        self._residency = residency
        self._disk_format = disk_format
        self._budget_bytes = budget_bytes
        self._index: dict[str, list[dict[str, Any]]] = {}
        self._groups: dict[str, list[int]] = {}  # location -> step of each record
        self._sample_id_key: str | int | None = None
        self._id_scheme_fixed = False
        self._accumulation_steps: int | None = None
        self._projection: dict[str, dict] | None = None
        self._write_dir: Path | None = None
        self._write_prefix = ""
        self._next_group = 0
        self._written_settings: dict[str, Any] | None = None
        self._cache: TensorCache | None = None
        self._closed = False
        self._created_root = False
        if residency == "disk":
            self._open_existing()
        else:
            self._cache = TensorCache(
                residency,
                budget=budget_bytes,
                spill_dir=self._make_spill_dir,
                writer=self._spill_writer,
                reader=load_group_file,
                nbytes_fn=_gradient_nbytes,
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
    def projection(self) -> dict[str, dict] | None:
        """Declared capture projection ``{name or "__default__": settings}``.

        Resolved by `projection_record`; ``{}`` = declared unprojected, ``None``
        = never declared (unknown).
        """
        return self._projection

    @property
    def index(self) -> dict[str, list[dict[str, Any]]]:
        """Merged live index ``identifier → [{"file", "idx", "step", "sample_idx"}, ...]``.

        The manager's own dict, updated by every save: do not mutate it.
        """
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

    # ----------------------------------------------------------------- writing
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
        self._write_settings()

    def declare_projection(
        self, projection: Mapping[str, Mapping[str, Any]] | None, projector: Any = None
    ) -> None:
        """Record the capture projection of the stored gradients (``None`` = unprojected).

        ``projection`` is a ``projection_kwargs`` dict; it is stored resolved
        by `projection_record` (with ``projector``, the capture's projection
        factory) in the sidecar of a ``"disk"`` store and in memory otherwise.
        A record differing from an earlier declaration (or the on-disk value)
        → `ValueError`; the same record again is a no-op.
        """
        record = projection_record(projection, projector)
        if self._projection is not None and self._projection != record:
            raise ValueError(
                f"gradient store {self._save_dir} holds gradients captured with projection "
                f"{self._projection}; cannot declare {record}. Capture with the store's "
                f"projection_kwargs (and projector) or use a fresh directory."
            )
        self._projection = record
        self._write_settings()

    def save(self, record: GradientRecord) -> str:
        """Save one single-identifier record as its own group; returns its location.

        A record whose ``input_hash`` is a list → `TypeError` (use `save_bulk`).
        """
        if not isinstance(record, GradientRecord):
            raise TypeError(f"save expects a GradientRecord, got {type(record).__name__}.")
        if not isinstance(record.input_hash, str):
            raise TypeError(
                f"save: {record!r} has a list of {len(record.input_hash)} identifiers (a "
                f"per-batch record); use save_bulk([record]) instead."
            )
        return self.save_bulk([record])

    def save_bulk(self, records: Sequence[GradientRecord]) -> str:
        """Save ``records`` as one group (payloads moved to CPU) and index every identifier.

        Returns the group's location: a path relative to ``save_dir`` (disk) or
        an opaque ``mem_XXXXXXXX`` key (RAM). A list ``input_hash`` whose length
        differs from the gradient's batch size, or a ``sample_id_key`` that
        differs from the store's → `ValueError`; for a ``"memory"`` store a group
        beyond ``budget_bytes`` → `MemoryError` (nothing indexed).
        """
        self._check_open()
        records = list(records)
        self._validate_records(records)
        key = records[0].sample_id_key
        if self._residency == "disk":
            location = self._write_disk_group(records, key)
        else:
            location = self._write_ram_group(records)
        self._fix_id_scheme(key)
        self._add_group(location, records)
        return location

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
                self._check_single_sample(record, position)
            else:
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

    @staticmethod
    def _check_single_sample(record: GradientRecord, position: int) -> None:
        """``ValueError`` unless a single-identifier record holds one sample (batch size 1)."""
        try:
            batch = record.gradient.batch_size
        except ValueError:  # only batch-level param_grad layers: no sample axis to check
            return
        if batch != 1:
            raise ValueError(
                f"save_bulk: records[{position}] (step {record.step}) has the single identifier "
                f"{record.input_hash!r} but its gradient has batch size {batch}; pass a list "
                f"with one identifier per sample in batch order."
            )

    def _fix_id_scheme(self, key: str | int | None) -> None:
        if not self._id_scheme_fixed:
            self._sample_id_key = key
            self._id_scheme_fixed = True
            self._write_settings()

    def _write_disk_group(self, records: list[GradientRecord], key: str | int | None) -> str:
        write_dir = self._resolve_write_dir()
        if not self._id_scheme_fixed:
            self._sample_id_key, self._id_scheme_fixed = key, True
        self._write_settings()  # sidecar before the first log line
        path = write_group_file(self._claim_group_path(write_dir), records, self._disk_format)
        line = {
            "file": path.name,
            "records": [
                {"idx": i, "step": int(r.step), "ids": _record_identifiers(r)}
                for i, r in enumerate(records)
            ],
        }
        with open(write_dir / INDEX_FILE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return self._write_prefix + path.name

    def _claim_group_path(self, write_dir: Path) -> Path:
        """Next unused ``group_<n>`` path (skipping files another manager of this dir wrote)."""
        while True:
            name = f"group_{self._next_group:08d}"
            self._next_group += 1
            if not any((write_dir / (name + suffix)).exists() for suffix in _SUFFIX.values()):
                return write_dir / name

    def _write_ram_group(self, records: list[GradientRecord]) -> str:
        location = f"mem_{self._next_group:08d}"
        stored = [
            GradientRecord(
                step=int(r.step),
                input_hash=r.input_hash if isinstance(r.input_hash, str) else list(r.input_hash),
                gradient=r.gradient.to("cpu"),
                sample_id_key=r.sample_id_key,
            )
            for r in records
        ]
        if not self._cache.put(location, stored):
            raise MemoryError(
                f"gradient group of {_gradient_nbytes(stored)} bytes does not fit the memory "
                f"store's budget ({self._budget_bytes} bytes, {self.resident_bytes} held); raise "
                f"budget_bytes or use residency='tiered' / 'disk'."
            )
        self._next_group += 1
        return location

    def _resolve_write_dir(self) -> Path:
        """Per-rank write directory, created and prepared at the first save."""
        if self._write_dir is not None:
            return self._write_dir
        from dattri_llm.utils.distributed import dist_rank

        rank = dist_rank()
        self._write_prefix = "" if rank is None else f"rank_{rank}/"
        write_dir = self._save_dir / self._write_prefix if rank is not None else self._save_dir
        write_dir.mkdir(parents=True, exist_ok=True)
        _truncate_partial_tail(write_dir / INDEX_FILE)
        self._next_group = _next_group_number(write_dir)
        sidecar = write_dir / SIDECAR_FILE
        self._written_settings = _read_json(sidecar) if sidecar.exists() else None
        self._write_dir = write_dir
        return write_dir

    def _settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {"format_version": FORMAT_VERSION}
        if self._id_scheme_fixed:
            settings["sample_id_key"] = self._sample_id_key
        if self._accumulation_steps is not None:
            settings["gradient_accumulation_steps"] = self._accumulation_steps
        if self._projection is not None:
            settings["projection"] = self._projection
        return settings

    def _write_settings(self) -> None:
        """Rewrite the sidecar atomically when the settings changed (disk, after the first save)."""
        if self._write_dir is None:
            return
        settings = self._settings()
        if settings == self._written_settings:
            return
        data = json.dumps(settings, indent=1).encode("utf-8")
        atomic_write(self._write_dir / SIDECAR_FILE, lambda fh: fh.write(data))
        self._written_settings = settings

    def _add_group(self, location: str, records: Sequence[GradientRecord]) -> None:
        self._add_group_entries(location, [(int(r.step), _record_identifiers(r)) for r in records])

    def _add_group_entries(self, location: str, described: list[tuple[int, list[str]]]) -> None:
        self._groups[location] = [step for step, _ in described]
        for idx, (step, identifiers) in enumerate(described):
            for sample_idx, identifier in enumerate(identifiers):
                self._index.setdefault(identifier, []).append(
                    {"file": location, "idx": idx, "step": step, "sample_idx": sample_idx}
                )

    # ----------------------------------------------------------------- opening
    def _store_dirs(self) -> list[tuple[Path, str]]:
        """Root and every ``rank_<r>`` directory (ascending rank) with their location prefix."""
        if not self._save_dir.is_dir():
            return []
        ranks = sorted(
            (int(m.group(1)), p)
            for p in self._save_dir.iterdir()
            if p.is_dir() and (m := _RANK_DIR_RE.match(p.name))
        )
        return [(self._save_dir, "")] + [(p, f"{p.name}/") for _, p in ranks]

    def _open_existing(self) -> None:
        """Merge the sidecars and index logs of the root and every rank directory."""
        for directory, prefix in self._store_dirs():
            sidecar, log = directory / SIDECAR_FILE, directory / INDEX_FILE
            if sidecar.exists():
                self._merge_settings(_read_json(sidecar), sidecar)
            elif log.exists():
                raise ValueError(
                    f"gradient store {directory} has an index ({log.name}) but no "
                    f"{SIDECAR_FILE}; it was not written by this library."
                )
            if log.exists():
                for line in _read_log(log):
                    described = [(int(r["step"]), list(r["ids"])) for r in line["records"]]
                    self._add_group_entries(prefix + line["file"], described)

    def _merge_settings(self, settings: dict[str, Any], path: Path) -> None:
        _check_version(settings, path)
        if "sample_id_key" in settings:
            key = settings["sample_id_key"]
            if self._id_scheme_fixed and key != self._sample_id_key:
                raise ValueError(
                    f"gradient store {self._save_dir}: {path} uses sample_id_key={key!r} but "
                    f"another part of the store uses {self._sample_id_key!r}."
                )
            self._sample_id_key, self._id_scheme_fixed = key, True
        if "gradient_accumulation_steps" in settings:
            n = settings["gradient_accumulation_steps"]
            if self._accumulation_steps is not None and n != self._accumulation_steps:
                raise ValueError(
                    f"gradient store {self._save_dir}: {path} declares "
                    f"gradient_accumulation_steps={n} but another part of the store declares "
                    f"{self._accumulation_steps}."
                )
            self._accumulation_steps = n
        if "projection" in settings:
            record = settings["projection"]
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
        return Path(tempfile.mkdtemp(prefix=".spill_", dir=self._save_dir))

    def _spill_writer(self, path: Path, records: list[GradientRecord]) -> Path:
        return write_group_file(path, records, self._disk_format)

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
            from dattri_llm.utils.hashing import hash_sample

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
        identifier = _stringify_identifier(identifier)
        entries = self._index.get(identifier)
        if not entries:
            raise KeyError(
                f"identifier {identifier!r} is not in gradient store {self._save_dir} "
                f"({len(self._index)} identifiers indexed)."
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
                record = self.load_records(entry["file"])[entry["idx"]]
                return record.gradient.slice("batch", sample_idx)
        available = sorted((e["step"], e["sample_idx"]) for e in entries)
        raise KeyError(
            f"identifier {_stringify_identifier(input_hash)!r} has no occurrence at "
            f"(step={step}, sample_idx={sample_idx}); available (step, sample_idx): {available}."
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
        for location in sorted(by_location, key=_natural_key):
            records = self.load_records(location)
            found.extend(records[idx] for idx in sorted(by_location[location]))
        return sorted(found, key=lambda r: r.step)

    def available_steps(self) -> list[int]:
        """Distinct stored steps, ascending."""
        return sorted({step for steps in self._groups.values() for step in steps})

    def locations(self) -> list[str]:
        """Every group location, in store order (root first, then ranks; ascending group)."""
        return sorted(self._groups, key=_natural_key)

    def iter_steps(self, steps: int | Iterable[int]) -> list[tuple[str, dict[int, list[int]]]]:
        """Groups holding any of ``steps``: ``[(location, {step: sorted record idxs})]``.

        Ordered by location (store order); each location appears once.
        """
        wanted = {int(steps)} if isinstance(steps, int) else {int(s) for s in steps}
        plan = []
        for location in self.locations():
            by_step: dict[int, list[int]] = {}
            for idx, step in enumerate(self._groups[location]):
                if step in wanted:
                    by_step.setdefault(step, []).append(idx)
            if by_step:
                plan.append((location, dict(sorted(by_step.items()))))
        return plan

    def group_path(self, location: str) -> Path:
        """Filesystem path of a ``"disk"`` store's group (``location`` relative to ``save_dir``)."""
        return self._save_dir / location

    def load_records(self, file_relpath: str) -> list[GradientRecord]:
        """All records of one group, in stored order.

        Disk groups are read from their file (memmap views or unpickled);
        RAM groups are returned as fresh records sharing the stored tensors.
        """
        self._check_open()
        if file_relpath not in self._groups:
            raise KeyError(
                f"gradient store {self._save_dir} has no group {file_relpath!r}; "
                f"{len(self._groups)} groups are indexed."
            )
        if self._cache is None:
            return load_group_file(self.group_path(file_relpath))
        return [_shallow_copy(r) for r in self._cache.get(file_relpath)]

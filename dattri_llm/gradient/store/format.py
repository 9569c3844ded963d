"""Binary codec of a store's group files: a list of `GradientRecord` s as one group.

A memmap group is ``<base>.mmap.bin`` (raw tensor bytes, 8-byte aligned parts)
plus ``<base>.mmap.meta`` (``torch.save``'d part specs); a pickle group is
``<base>.pt``. Reading never runs code from the files: both load with
``torch.load(weights_only=True)``, only this library's record classes allowed
besides tensors and plain containers.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.model.lowrank import LowRank
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.utils.atomic import atomic_torch_save, atomic_write

DISK_FORMATS = ("pickle", "memmap")
FORMAT_VERSION = 2

MMAP_SUFFIX = ".mmap"
PICKLE_SUFFIX = ".pt"
_BIN, _META = ".bin", ".meta"
GROUP_FILE_SUFFIXES = (PICKLE_SUFFIX, MMAP_SUFFIX + _BIN, MMAP_SUFFIX + _META)
_ALIGN = 8
_SAFE_GLOBALS = [GradientRecord, Gradient, Factorized, LowRank]


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


def group_suffix(records: Sequence[GradientRecord], disk_format: str) -> str:
    """Handle suffix of a group: ``.mmap`` for memmap-able groups in memmap format, else ``.pt``."""
    if disk_format == "memmap" and _memmap_compatible(records):
        return MMAP_SUFFIX
    return PICKLE_SUFFIX


def stored_hashes(record: GradientRecord) -> str | list[str]:
    """``record``'s identifiers as stored: one ``str``, or a list of ``str`` in batch order."""
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
            "input_hash": stored_hashes(record),
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


def mmap_files(handle: Path) -> tuple[Path, Path]:
    """``(<handle>.bin, <handle>.meta)`` of a memmap group handle ``<base>.mmap``."""
    return handle.with_name(handle.name + _BIN), handle.with_name(handle.name + _META)


def primary_file(handle: Path) -> Path:
    """The file whose exclusive creation claims a group handle."""
    return mmap_files(handle)[0] if handle.name.endswith(MMAP_SUFFIX) else handle


def write_group_at(handle: Path, records: Sequence[GradientRecord]) -> None:
    """Write ``records`` at ``handle`` (format from its suffix), each file atomically."""
    if not handle.name.endswith(MMAP_SUFFIX):
        atomic_torch_save(list(records), handle)
        return
    layout = _BinLayout()
    meta = {"format": FORMAT_VERSION, "records": [layout.record(r) for r in records]}
    bin_path, meta_path = mmap_files(handle)
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
    handle = base.with_name(base.name + group_suffix(records, disk_format))
    write_group_at(handle, records)
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
    bin_path, meta_path = mmap_files(handle)
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

"""Keyed tensor caches with a memory budget and an optional spill directory.

`TensorCache` keeps tensors (or containers of tensors) under hashable keys in
one of three residencies (`CACHE_RESIDENCIES`):

* ``"memory"`` — entries live in memory; `TensorCache.put` refuses (returns
  ``False``) an entry that would exceed the budget.
* ``"disk"`` — every entry is written to the spill directory and read back on
  access.
* ``"tiered"`` — entries live in memory up to the budget; the oldest
  (first-inserted) entries spill to disk to make room, and an entry larger
  than the whole budget goes straight to disk.

Spill directory lifecycle: a given path is created on the first spill and is
left in place, with its files, by `TensorCache.close` (the caller owns it); a
callable or ``None`` spill dir is created lazily (``None`` → a fresh temporary
directory) and removed, with its files, by `TensorCache.close` (or at garbage
collection). `TensorCache.discard` and `TensorCache.clear` always delete the
files of the entries they drop.

Spill safety: the default writer stores tensors and plain containers only
(tensors, numbers, strings, bytes, ``None``, torch dtypes / devices / sizes
inside dict / list / tuple / set), through
`dattri_llm.utils.atomic.atomic_torch_save` (a killed write leaves no partial
file), and the default reader loads with ``torch.load(weights_only=True)``, so
a tampered spill file cannot run code. A spill that fails leaves the entry
being evicted in memory and propagates the error: no entry is lost silently.
"""

from __future__ import annotations

import itertools
import pickle
import shutil
import tempfile
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from dattri_llm.options import CacheResidency
from dattri_llm.utils.atomic import atomic_torch_save

CACHE_RESIDENCIES = ("disk", "memory", "tiered")
DEFAULT_CACHE_FRACTION = 0.35

# Leaves the default spill writer accepts: what ``torch.load(weights_only=True)`` rebuilds.
_SPILLABLE_LEAF_TYPES = (
    torch.Tensor,
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
)
_SPILLABLE_CONTAINERS = (dict, OrderedDict, list, tuple, set, frozenset)

_FALLBACK_HOST_BYTES = 16 * 1024**3
_MEMINFO = "/proc/meminfo"


def tensor_nbytes(value: object) -> int:
    """Bytes held by ``value``: a tensor's ``numel · element_size``, an object's
    integer ``nbytes``, or the recursive sum over a dict / list / tuple; else 0."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_nbytes(v) for v in value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int) and not isinstance(nbytes, bool):
        return nbytes
    return 0


def available_host_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or 16 GiB when unreadable."""
    try:
        with open(_MEMINFO, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _FALLBACK_HOST_BYTES


class CacheBudget:
    """Byte budget of a cache: a fixed cap, or a fraction of the memory free at creation.

    ``total()`` is ``limit_bytes`` when given; otherwise ``fraction`` × the free
    memory of a CUDA ``device`` (``torch.cuda.mem_get_info``) or ``fraction`` ×
    the available host RAM (``device=None`` or a non-CUDA device), **measured
    once, when the budget is created**. The bytes a cache holds are counted
    against that fixed total (``fits(nbytes, held)``); re-measuring as the cache
    fills would count its own entries twice (once as ``held``, once as memory
    no longer free) and spill too early. The same puts therefore always give
    the same spills. Create a new budget to follow memory freed or used since.
    """

    __slots__ = ("_device", "_fraction", "_limit_bytes", "_total")

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        fraction: float = DEFAULT_CACHE_FRACTION,
        limit_bytes: int | None = None,
    ) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"CacheBudget: fraction must be in (0, 1], got {fraction!r}.")
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(
                f"CacheBudget: limit_bytes must be >= 0 (or None for a fraction of free "
                f"memory), got {limit_bytes!r}."
            )
        self._device = None if device is None else torch.device(device)
        self._fraction = float(fraction)
        self._limit_bytes = None if limit_bytes is None else int(limit_bytes)
        self._total = self._limit_bytes if self._limit_bytes is not None else self._measure()

    def _measure(self) -> int:
        """``fraction`` × the memory free now on the budget's device (host RAM by default)."""
        if self._device is not None and self._device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self._device)
            return int(self._fraction * free)
        return int(self._fraction * available_host_bytes())

    @property
    def device(self) -> torch.device | None:
        """Device whose memory the budget tracks (``None`` = host RAM)."""
        return self._device

    def total(self) -> int:
        """Budget in bytes: ``limit_bytes``, or the fraction of free memory measured at creation."""
        return self._total

    def fits(self, nbytes: int, held: int = 0) -> bool:
        """Whether ``nbytes`` more bytes fit next to ``held`` bytes already used."""
        return held + nbytes <= self.total()

    def __repr__(self) -> str:
        """Short description of the budget rule."""
        rule = (
            f"limit_bytes={self._limit_bytes}"
            if self._limit_bytes is not None
            else f"fraction={self._fraction}, total={self._total}"
        )
        return f"CacheBudget(device={self._device}, {rule})"


def _unspillable_part(value: object, where: str = "value") -> str | None:
    """Where in ``value`` an object the default writer cannot spill sits (``None``: all fine).

    Accepted: `_SPILLABLE_LEAF_TYPES` leaves inside dict / OrderedDict / list /
    tuple / set / frozenset (exact container types: a namedtuple or dataclass is
    refused). Returns e.g. ``"value['a'][1] (Factorized)"``.
    """
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _SPILLABLE_LEAF_TYPES:
        return None
    if kind not in _SPILLABLE_CONTAINERS:
        return f"{where} ({kind.__name__})"
    if isinstance(value, dict):
        items = [(f"{where}[{k!r}]", v) for k, v in value.items()]
        items += [(f"{where} key {k!r}", k) for k in value]
    else:
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    for inner_where, inner in items:
        found = _unspillable_part(inner, inner_where)
        if found is not None:
            return found
    return None


def _check_spillable(key: Hashable, value: object) -> None:
    """Raise ``TypeError`` unless the default writer can spill ``value`` safely."""
    found = _unspillable_part(value)
    if found is not None:
        raise TypeError(
            f"TensorCache.put({key!r}): the default spill writer stores tensors and plain "
            f"containers (dict / list / tuple / set of tensors, numbers, strings, None) only, "
            f"so that spill files load with torch.load(weights_only=True); got {found}. Pass "
            "writer= and reader= for other objects, or use residency 'memory'."
        )


def _default_writer(path: Path, value: object) -> None:
    """``torch.save`` through a temporary file, fsynced and renamed (never half-written)."""
    atomic_torch_save(value, path)


def _default_reader(path: Path) -> object:
    """``torch.load(weights_only=True)`` to CPU: tensors and plain containers, no code run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(
            f"TensorCache: refusing to load spill file {path}: it holds objects other than "
            f"tensors and plain containers, which weights_only loading does not run ({error}). "
            "The file was not written by this cache's default writer; delete it."
        ) from error


def _as_budget(budget: CacheBudget | int | None) -> CacheBudget | None:
    if budget is None or isinstance(budget, CacheBudget):
        return budget
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(
            f"TensorCache: budget must be a CacheBudget, an int byte cap or None, "
            f"got {type(budget).__name__}."
        )
    return CacheBudget(limit_bytes=budget)


class TensorCache:
    """Keyed store of tensors / containers held in memory, on disk, or both (tiered).

    Args:
        residency: ``"memory"``, ``"disk"`` or ``"tiered"`` (see module docstring).
        budget: byte budget of the in-memory part: a `CacheBudget`, an ``int``
            byte cap, or ``None`` (unbounded).
        spill_dir: directory for on-disk entries: a path (kept on close), a
            callable returning one, or ``None`` for a private temporary
            directory (both created lazily and removed on close).
        writer: ``writer(path, value) -> Path | None`` writes one entry
            (default: ``torch.save`` through `atomic_torch_save`, tensors and
            plain containers only, checked by `put` for ``"disk"``/``"tiered"``);
            it may return the path it actually wrote. If it raises, the entry
            stays where it was (an evicted entry stays in memory) and the error
            propagates.
        reader: ``reader(path) -> value`` (default ``torch.load(weights_only=True)``
            to CPU).
        on_spill: ``on_spill(key, path)`` called after an entry is written to disk.
        nbytes_fn: sizes an entry in bytes (default `tensor_nbytes`).
    """

    def __init__(
        self,
        residency: CacheResidency = "memory",
        *,
        budget: CacheBudget | int | None = None,
        spill_dir: str | Path | Callable[[], Path] | None = None,
        writer: Callable[[Path, Any], Path | None] | None = None,
        reader: Callable[[Path], Any] | None = None,
        on_spill: Callable[[Hashable, Path], None] | None = None,
        nbytes_fn: Callable[[Any], int] | None = None,
    ) -> None:
        if residency not in CACHE_RESIDENCIES:
            raise ValueError(
                f"TensorCache: unknown residency {residency!r}; expected one of "
                f"{CACHE_RESIDENCIES}."
            )
        self._residency = residency
        self._budget = _as_budget(budget)
        self._writer = writer or _default_writer
        self._reader = reader or _default_reader
        self._on_spill = on_spill
        self._nbytes_fn = nbytes_fn or tensor_nbytes
        self._memory: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._disk: dict[Hashable, Path] = {}
        self._held = 0
        self._closed = False
        self._lock = threading.RLock()
        self._file_prefix = f"cache_{uuid.uuid4().hex[:8]}_"
        self._file_counter = itertools.count()
        self._spill_source = spill_dir
        self._owns_spill_dir = not isinstance(spill_dir, (str, Path))
        self._spill_dir: Path | None = None if self._owns_spill_dir else Path(spill_dir)
        self._spill_dir_ready = False
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ properties
    @property
    def residency(self) -> str:
        """``"memory"``, ``"disk"`` or ``"tiered"``."""
        return self._residency

    @property
    def nbytes(self) -> int:
        """Bytes of the entries held in memory (as sized by ``nbytes_fn``)."""
        return self._held

    @property
    def spill_dir(self) -> Path | None:
        """The spill directory (``None`` while a lazily created one does not exist yet)."""
        return self._spill_dir

    # ------------------------------------------------------------------ container protocol
    def __len__(self) -> int:
        """Number of entries (memory and disk)."""
        return len(self._memory) + len(self._disk)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has an entry (memory or disk)."""
        return key in self._memory or key in self._disk

    def keys(self) -> list[Hashable]:
        """All keys, in-memory entries first (oldest first), then on-disk ones."""
        with self._lock:
            return list(self._memory) + list(self._disk)

    def location(self, key: Hashable) -> Path | None:
        """Spill file of ``key``, or ``None`` when it is in memory or absent."""
        return self._disk.get(key)

    # ------------------------------------------------------------------ access
    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value stored under ``key`` (read back from disk if spilled), else ``default``."""
        with self._lock:
            if key in self._memory:
                return self._memory[key][0]
            path = self._disk.get(key)
        if path is None:
            return default
        return self._reader(path)

    def put(self, key: Hashable, value: Any) -> bool:
        """Store ``value`` under ``key``, replacing any existing entry.

        Returns ``False`` when a ``"memory"`` cache cannot fit the entry within
        its budget (the entry is then not cached and a previous entry under the
        same key is dropped); ``True`` otherwise. Raises `RuntimeError` after
        `close`; ``TypeError`` (nothing changed) when the default writer could
        not spill ``value`` (see the module docstring). When a spill write
        fails, the error propagates, the entry being evicted stays in memory
        and no entry is left under ``key`` (never a stale one).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"TensorCache.put({key!r}): the cache is closed; create a new TensorCache."
                )
            if self._residency != "memory" and self._writer is _default_writer:
                _check_spillable(key, value)
            self._drop(key)
            if self._residency == "disk":
                self._write(key, value)
                return True
            nbytes = int(self._nbytes_fn(value))
            if self._residency == "memory":
                if not self._fits(nbytes):
                    return False
            elif not self._make_room(nbytes):
                self._write(key, value)
                return True
            self._memory[key] = (value, nbytes)
            self._held += nbytes
            return True

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The cached value of ``key``, else ``compute()`` stored (if it fits) and returned."""
        with self._lock:
            if key in self:
                return self.get(key)
        value = compute()
        self.put(key, value)
        return value

    def discard(self, key: Hashable) -> None:
        """Drop ``key`` (deleting its spill file); absent keys are ignored."""
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        """Drop every entry and delete their spill files (the cache stays usable)."""
        with self._lock:
            for key in list(self._memory) + list(self._disk):
                self._drop(key)

    def close(self) -> None:
        """Release all entries and remove an owned spill directory (idempotent).

        A spill directory passed as a path is left in place with its files.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._memory.clear()
            self._held = 0
            self._disk.clear()
            if self._finalizer is not None:
                self._finalizer()

    def __enter__(self) -> TensorCache:
        """Return ``self``."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """`close` on exit."""
        self.close()

    def __repr__(self) -> str:
        """Residency, entry counts and held bytes."""
        return (
            f"TensorCache(residency={self._residency!r}, memory_entries={len(self._memory)}, "
            f"disk_entries={len(self._disk)}, nbytes={self._held}, budget={self._budget})"
        )

    # ------------------------------------------------------------------ internals
    def _fits(self, nbytes: int) -> bool:
        return self._budget is None or self._budget.fits(nbytes, self._held)

    def _make_room(self, nbytes: int) -> bool:
        """Spill oldest memory entries until ``nbytes`` fit; ``False`` if they never can.

        Each entry leaves memory only after its spill file is written: a failing
        writer leaves it resident and the error propagates.
        """
        if self._budget is None:
            return True
        if nbytes > self._budget.total():
            return False
        while self._memory and not self._fits(nbytes):
            old_key, (old_value, _) = next(iter(self._memory.items()))
            self._write(old_key, old_value)
        return self._fits(nbytes)

    def _drop(self, key: Hashable) -> None:
        entry = self._memory.pop(key, None)
        if entry is not None:
            self._held -= entry[1]
        path = self._disk.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def _write(self, key: Hashable, value: Any) -> None:
        """Write ``value`` to a fresh spill file, then move ``key`` from memory to disk.

        If the writer raises, whatever it left at the planned path is removed
        (never indexed, so never read), a memory entry under ``key`` stays, and
        the error propagates.
        """
        directory = self._ensure_spill_dir()
        path = directory / f"{self._file_prefix}{next(self._file_counter):08d}.pt"
        try:
            written = self._writer(path, value)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        path = Path(written) if written is not None else path
        entry = self._memory.pop(key, None)
        if entry is not None:
            self._held -= entry[1]
        self._disk[key] = path
        if self._on_spill is not None:
            self._on_spill(key, path)

    def _ensure_spill_dir(self) -> Path:
        if self._spill_dir_ready:
            return self._spill_dir
        if self._spill_dir is None:
            source = self._spill_source
            self._spill_dir = (
                Path(source()) if callable(source) else Path(tempfile.mkdtemp(prefix="dattri_llm_"))
            )
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        if self._owns_spill_dir:
            self._finalizer = weakref.finalize(
                self, shutil.rmtree, str(self._spill_dir), ignore_errors=True
            )
        self._spill_dir_ready = True
        return self._spill_dir

"""Store-wide settings and their JSON sidecars, each rewritten atomically only when changed.

``index_meta.json`` holds the format version, the identifier scheme
(``sample_id_key``), the accumulation window and a low-rank store's ``c``;
``projection.json`` the declared capture projection (`projection_record`).
A ``"disk"`` store writes them in its write directory before the first index
line; re-opening merges those of every directory (conflicts → `ValueError`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dattri_llm.gradient.ops.projector import DattriProjector
from dattri_llm.gradient.store.format import FORMAT_VERSION
from dattri_llm.utils.atomic import atomic_write

SIDECAR_FILE = "index_meta.json"
PROJECTION_FILE = "projection.json"
_DEFAULT_PROJECTION = {"style": "logra", "proj_seed": 0, "include_bias": True}
_DEFAULT_FACTORIES = (
    "dattri.func.projection.random_project",
    "dattri_llm.gradient.ops.projection.random_project",
)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``."""
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` as indented JSON to ``path`` atomically."""
    data = json.dumps(value, indent=1).encode("utf-8")
    atomic_write(path, lambda fh: fh.write(data))


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


# --------------------------------------------------------------------------- the settings


class StoreSettings:
    """A store's settings (identifier scheme, accumulation window, low-rank ``c``, projection).

    Declarations are checked against what the store already holds; once a
    write directory is attached (a ``"disk"`` store's first save) every change
    is written to its sidecars. ``None`` values are undeclared.
    """

    def __init__(self, save_dir: Path) -> None:
        self._save_dir = save_dir
        self.sample_id_key: str | int | None = None
        self.id_scheme_fixed = False
        self.accumulation_steps: int | None = None
        self.low_rank: int | None = None
        self.projection: dict[str, dict] | None = None
        self.write_dir: Path | None = None
        self._written_meta: dict[str, Any] | None = None
        self._written_projection: dict[str, dict] | None = None

    @property
    def gradient_accumulation_steps(self) -> int:
        """Declared accumulation window (1 when undeclared)."""
        return self.accumulation_steps or 1

    # ----------------------------------------------------------------- declarations
    def declare_gradient_accumulation_steps(self, n: int) -> None:
        """Record the accumulation window ``n`` (``n < 1`` or another ``n`` → `ValueError`)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an int >= 1, got {n!r} (store "
                f"{self._save_dir})."
            )
        if self.accumulation_steps is not None and self.accumulation_steps != n:
            raise ValueError(
                f"gradient store {self._save_dir} holds records with "
                f"gradient_accumulation_steps={self.accumulation_steps}; cannot declare {n}. "
                f"Use a fresh directory or the store's convention."
            )
        self.accumulation_steps = n
        self.write()

    def declare_low_rank(self, rank: int, has_groups: bool) -> None:
        """Make the store one of rank ``c``; another ``c`` or full-rank groups → `ValueError`.

        ``has_groups``: the store already holds groups.
        """
        if self.low_rank is not None and self.low_rank != rank:
            raise ValueError(
                f"gradient store {self._save_dir} holds low-rank records of rank c="
                f"{self.low_rank}; cannot add records of rank c={rank}. Stores of different c "
                f"cannot be mixed: use low_rank={self.low_rank} or a fresh directory."
            )
        if self.low_rank is None and has_groups:
            raise ValueError(
                f"gradient store {self._save_dir} already holds full-rank records; cannot make "
                f"it a low-rank store (c={rank}). Use a fresh directory for low_rank={rank}."
            )
        self.low_rank = rank
        self.write()

    def declare_projection(self, record: dict[str, dict]) -> None:
        """Record a resolved `projection_record` (another declared record → `ValueError`)."""
        if self.projection is not None and self.projection != record:
            raise ValueError(
                f"gradient store {self._save_dir} holds gradients captured with projection "
                f"{self.projection}; cannot declare {record}. Capture with the store's "
                f"projection_kwargs (and projector) or use a fresh directory."
            )
        self.projection = record
        self.write()

    def check_id_scheme(self, key: str | int | None) -> None:
        """`ValueError` when records identified by ``key`` may not join the store."""
        if self.id_scheme_fixed and key != self.sample_id_key:
            raise ValueError(
                f"gradient store {self._save_dir} identifies samples by sample_id_key="
                f"{self.sample_id_key!r} but the record has sample_id_key={key!r}; use one "
                f"scheme per store (or another directory)."
            )

    def fix_id_scheme(self, key: str | int | None) -> None:
        """Adopt ``key`` as the identifier scheme unless one is fixed already."""
        if not self.id_scheme_fixed:
            self.sample_id_key, self.id_scheme_fixed = key, True

    # ----------------------------------------------------------------- writing
    def attach(self, write_dir: Path, has_log: bool) -> None:
        """Write sidecars into ``write_dir`` from now on (the ones there count as written)."""
        self._written_meta = _read_sidecar(write_dir / SIDECAR_FILE, has_log)
        self._written_projection = _read_sidecar(write_dir / PROJECTION_FILE, has_log)
        self.write_dir = write_dir

    def _meta(self) -> dict[str, Any]:
        meta = {
            "format": FORMAT_VERSION,
            "sample_id_key": self.sample_id_key,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        if self.low_rank is not None:
            meta["low_rank"] = self.low_rank
        return meta

    def write(self) -> None:
        """Rewrite changed sidecars atomically (disk, once the identifier scheme is known)."""
        if self.write_dir is None or not self.id_scheme_fixed:
            return
        meta = self._meta()
        if meta != self._written_meta:
            write_json(self.write_dir / SIDECAR_FILE, meta)
            self._written_meta = meta
        if self.projection is not None and self.projection != self._written_projection:
            write_json(self.write_dir / PROJECTION_FILE, self.projection)
            self._written_projection = self.projection

    # ----------------------------------------------------------------- merging on open
    def merge_directory(self, directory: Path, has_groups: bool) -> None:
        """Merge the sidecars of a store directory (``has_groups``: groups seen before)."""
        sidecar = directory / SIDECAR_FILE
        self._merge_meta(read_json(sidecar), sidecar, has_groups)
        projection = directory / PROJECTION_FILE
        if projection.exists():
            self._merge_projection(read_json(projection), projection)

    def _merge_meta(self, meta: dict[str, Any], path: Path, has_groups: bool) -> None:
        if "sample_id_key" not in meta:
            raise ValueError(
                f"gradient store settings {path} lack the required key 'sample_id_key'; the "
                f"file is corrupt."
            )
        key = meta["sample_id_key"]
        if self.id_scheme_fixed and key != self.sample_id_key:
            raise ValueError(
                f"gradient store {self._save_dir}: {path} uses sample_id_key={key!r} but "
                f"another part of the store uses {self.sample_id_key!r}."
            )
        self.sample_id_key, self.id_scheme_fixed = key, True
        n = meta.get("gradient_accumulation_steps", 1)
        if self.accumulation_steps is not None and n != self.accumulation_steps:
            raise ValueError(
                f"gradient store {self._save_dir}: {path} declares gradient_accumulation_steps="
                f"{n} but another part of the store declares {self.accumulation_steps}."
            )
        self.accumulation_steps = n
        self._merge_low_rank(meta.get("low_rank"), path, has_groups)

    def _merge_low_rank(self, rank: int | None, path: Path, has_groups: bool) -> None:
        """Adopt the ``c`` recorded in ``path``; another ``c`` (or full rank) elsewhere → error."""
        if has_groups and rank != self.low_rank:
            ours = "full rank" if self.low_rank is None else f"c={self.low_rank}"
            raise ValueError(
                f"gradient store {self._save_dir}: {path} records low_rank={rank} but another "
                f"part of the store holds {ours}; stores of different c cannot be mixed."
            )
        self.low_rank = rank

    def _merge_projection(self, record: dict[str, dict], path: Path) -> None:
        if self.projection is not None and record != self.projection:
            raise ValueError(
                f"gradient store {self._save_dir}: {path} declares projection {record} but "
                f"another part of the store declares {self.projection}."
            )
        self.projection = record


def _read_sidecar(path: Path, has_log: bool) -> dict[str, Any] | None:
    return read_json(path) if has_log and path.exists() else None

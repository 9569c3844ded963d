"""An attribution index's files and the store state it was built from.

Two files in the index directory (by default ``<store>/attribution_index/``):

* ``index-<digest>.faiss``: the FAISS index as FAISS writes it
  (``faiss.serialize_index``), plain data that FAISS parses without running code,
  named by the first 16 hex digits of its SHA-256;
* ``index.json``: the sidecar, JSON only: the format version, the kind and its settings,
  ``normalize``, the vector layout, the training ids in index order, the name, size and
  SHA-256 of the index file, and the store state (:func:`store_state`).

Each is written crash-safely (temporary file, fsync, rename): the new index file under
its own name first, then the sidecar that points at it, then older index files are
removed. A run killed at any point leaves a sidecar and the complete index file it
names (the old pair or the new one). A load whose index file does not match the
sidecar's size and digest (truncated, replaced) is refused before FAISS reads it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.atomic import atomic_write

INDEX_DIR = "attribution_index"
FAISS_SUFFIX = ".faiss"
SIDECAR_FILE = "index.json"
FORMAT = 1
EXTRA_HINT = 'pip install "dattri_llm[index]"'


def require_faiss() -> Any:
    """The ``faiss`` module; ``ImportError`` naming the ``index`` extra when it is missing."""
    try:
        import faiss  # optional dependency: faiss
    except ImportError as err:
        raise ImportError(
            f"AttributionIndex needs FAISS, which is not installed; install it with {EXTRA_HINT} "
            "(the faiss-cpu package)."
        ) from err
    return faiss


def store_state(store: GradientStorageManager, steps: Iterable[int]) -> dict[str, Any]:
    """The store's indexed records at ``steps``: a digest, their count and their groups.

    ``digest`` is the SHA-256 of the sorted ``(step, id, group, record, row)``
    entries; ``groups`` maps each group to its number of such entries. A save
    adds a group (and may take rows from older ones), so a record added,
    replaced or dropped since changes the digest. ``store_steps`` lists every
    step the store holds.
    """
    wanted = {int(s) for s in steps}
    lines = []
    groups: dict[str, int] = {}
    for identifier, step, location, idx, sample_idx in store.index_rows(wanted):
        lines.append(f"{step}\t{identifier}\t{location}\t{idx}\t{sample_idx}")
        groups[location] = groups.get(location, 0) + 1
    lines.sort()
    digest = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()
    return {
        "digest": digest,
        "entries": len(lines),
        "groups": dict(sorted(groups.items())),
        "store_steps": store.available_steps(),
    }


def default_directory(store: GradientStorageManager) -> Path:
    """``<save_dir>/attribution_index`` of a disk store (``ValueError`` for a RAM store)."""
    if store.residency != "disk":
        raise ValueError(
            f"a {store.residency!r} store has no directory to keep an index beside; pass "
            "path= (a directory) or save=False."
        )
    return store.save_dir / INDEX_DIR


def index_file_name(digest: str) -> str:
    """``index-<first 16 hex digits of the SHA-256>.faiss``."""
    return f"index-{digest[:16]}{FAISS_SUFFIX}"


def write_index_files(directory: Path, index_bytes: bytes, sidecar: dict[str, Any]) -> Path:
    """Write the index file, then ``index.json`` pointing at it; remove older index files."""
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(index_bytes).hexdigest()
    name = index_file_name(digest)
    sidecar = dict(sidecar)
    sidecar["index_file"] = {"name": name, "bytes": len(index_bytes), "sha256": digest}
    text = json.dumps(sidecar, separators=(",", ":")).encode("utf-8")
    atomic_write(directory / name, lambda fh: fh.write(index_bytes))
    atomic_write(directory / SIDECAR_FILE, lambda fh: fh.write(text))
    for old in directory.glob(f"index-*{FAISS_SUFFIX}"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return directory


def read_index_files(directory: Path) -> tuple[bytes, dict[str, Any]]:
    """The index bytes and the sidecar of ``directory``, checked against each other.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: the sidecar is not this format's JSON, or the index file's size or
            digest differs from the sidecar's (a truncated or replaced file).
    """
    sidecar_path = directory / SIDECAR_FILE
    if not sidecar_path.is_file():
        raise FileNotFoundError(
            f"{sidecar_path} not found; build the index with AttributionIndex.build(store) first."
        )
    try:
        sidecar = json.loads(sidecar_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{sidecar_path} is not valid JSON ({err}); rebuild the index.") from err
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        found = sidecar.get("format") if isinstance(sidecar, dict) else type(sidecar).__name__
        raise ValueError(
            f"{sidecar_path} is not an attribution index sidecar of format {FORMAT} (found "
            f"{found!r}); rebuild the index."
        )
    expected = sidecar.get("index_file") if isinstance(sidecar.get("index_file"), dict) else {}
    name = expected.get("name")
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(FAISS_SUFFIX):
        raise ValueError(f"{sidecar_path} names no index file in {directory}; rebuild the index.")
    paths = [sidecar_path, directory / name]
    if not paths[1].is_file():
        raise FileNotFoundError(
            f"{paths[1]} (named by {sidecar_path}) not found; rebuild the index."
        )
    data = paths[1].read_bytes()
    if len(data) != expected.get("bytes") or hashlib.sha256(data).hexdigest() != expected.get(
        "sha256"
    ):
        raise ValueError(
            f"{paths[1]} ({len(data)} bytes) does not match its sidecar {paths[0]} (expected "
            f"{expected.get('bytes')} bytes with the recorded SHA-256): the file is truncated "
            "or was replaced; rebuild the index."
        )
    return data, sidecar

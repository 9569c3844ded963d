"""Crash-safe file writes: a temporary file beside the target, fsynced, then renamed.

A reader never sees a partly written file: a process killed mid-write leaves
either the previous file or none (plus, at worst, a stray ``.<name>.*.tmp``
that nothing reads). Every side file the library writes (scores, K-FAC fits,
covariances, store sidecars and groups) goes through :func:`atomic_write`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_torch_save", "atomic_write", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush ``directory``'s entries (a rename into it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Run ``write(fh)`` on a temporary binary file beside ``path``, fsync it, rename it.

    Args:
        path: the final file; its parent directory must exist.
        write: called once with the open temporary file.

    Returns:
        ``path`` as a `Path`. On any exception the temporary file is removed
        and the previous content of ``path`` (if any) is left untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` through :func:`atomic_write`."""
    return atomic_write(path, lambda fh: torch.save(obj, fh))

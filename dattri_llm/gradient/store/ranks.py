"""Rank directories of a store written under a process group, and their completeness.

Each rank writes into ``save_dir/rank_<r>/`` (resolved at its first save) and
records the run's world size in ``ranks.json``. Reading a store in which some
indexed rank directory declares world size ``n`` needs an indexed
``rank_0 .. rank_{n-1}``; a missing one makes every read raise `ValueError`
naming it (a partial score would be silent). Stores without ``ranks.json``
(the reference design's) are read as they are.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from dattri_llm.gradient.store.sidecars import read_json, write_json

RANKS_FILE = "ranks.json"


class ProcessRank(Protocol):
    """Where a store asks for this process's rank and world size (looked up at call time)."""

    def rank(self) -> int | None:
        """Global rank, ``None`` outside a process group."""

    def world_size(self) -> int:
        """Number of processes of the group."""


_RANK_DIR_RE = re.compile(r"^rank_(\d+)$")


def store_dirs(save_dir: Path) -> list[Path]:
    """The root, then every ``rank_*`` directory in sorted (lexicographic) order."""
    if not save_dir.is_dir():
        return []
    return [save_dir] + sorted(p for p in save_dir.glob("rank_*") if p.is_dir())


def rank_write_dir(save_dir: Path, process: ProcessRank) -> tuple[Path, str]:
    """This process's write directory (created) and its handle prefix ``"rank_<r>/"`` or ``""``.

    Under a process group (``process.rank()`` not ``None``) the directory is
    ``save_dir/rank_<r>`` and its ``ranks.json`` records ``{"rank", "world_size"}``
    of this run.
    """
    rank = process.rank()
    prefix = "" if rank is None else f"rank_{rank}/"
    write_dir = save_dir if rank is None else save_dir / f"rank_{rank}"
    write_dir.mkdir(parents=True, exist_ok=True)
    if rank is not None:
        _write_rank_file(write_dir, rank, process.world_size())
    return write_dir, prefix


def _write_rank_file(write_dir: Path, rank: int, world_size: int) -> None:
    """Record ``{"rank", "world_size"}`` of this run in ``write_dir/ranks.json``."""
    content = {"rank": rank, "world_size": world_size}
    path = write_dir / RANKS_FILE
    if not path.exists() or read_json(path) != content:
        write_json(path, content)


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
    world_size = read_json(path).get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"gradient store rank file {path} has world_size={world_size!r}, not a positive "
            f"int; the file is corrupt. Delete it to read that rank directory as it is."
        )
    return world_size


class RankShards:
    """The rank directories a store's ``ranks.json`` files need, and which of them are missing.

    Fed directory by directory while the store is opened; a save into a rank
    directory makes that rank present.
    """

    def __init__(self, save_dir: Path) -> None:
        self._save_dir = save_dir
        self.missing: list[int] = []  # rank directories a ranks.json needs, not indexed
        self._declared_world: tuple[Path, int] | None = None  # (ranks.json, its world size)
        self._indexed: set[int] = set()

    def note_directory(self, directory: Path, indexed: bool) -> None:
        """Note an opened store directory (``indexed``: its log describes a group)."""
        rank = None if directory == self._save_dir else _rank_of(directory)
        if rank is None:
            return
        if indexed:
            self._indexed.add(rank)
        declared = _declared_world_size(directory)
        if declared > (0 if self._declared_world is None else self._declared_world[1]):
            self._declared_world = (directory / RANKS_FILE, declared)

    def finish_opening(self) -> None:
        """Compute the missing ranks once every directory is noted."""
        world_size = 0 if self._declared_world is None else self._declared_world[1]
        self.missing = [r for r in range(world_size) if r not in self._indexed]

    def mark_written(self, prefix: str) -> None:
        """A group was indexed in the write directory of handle prefix ``prefix``."""
        self.missing = [r for r in self.missing if f"rank_{r}/" != prefix]

    def check_complete(self) -> None:
        """`ValueError` naming the rank directories the store needs but lacks (see `RANKS_FILE`)."""
        if not self.missing:
            return
        missing = ", ".join(f"rank_{r}/" for r in self.missing)
        path, world_size = self._declared_world
        raise ValueError(
            f"gradient store {self._save_dir} is missing the shard of rank(s) "
            f"{self.missing}: {path} records a run of {world_size} ranks, but "
            f"{missing} holds no indexed gradients, so scores would silently leave out that "
            f"rank's samples. Copy the missing rank directory (from the machine that ran it) "
            f"into {self._save_dir}, or re-run the capture into this store (re-saved samples "
            f"replace their earlier records). To score only the ranks present, delete the "
            f"{RANKS_FILE} files of its rank directories."
        )

"""``TrajectorySnapshots``: a directory store of per-step parameters, batches and optimizer moments.

Layout under ``root``::

    snapshots.json                 manifest (MANIFEST_FILE)
    parameters_<step>.pt           {name: tensor} of the requires_grad parameters (CPU, own dtype)
    batch_<step>.pt                the step's batch (CPU; plain dict / list / tuple containers)
    dynamics_<step>_<side>.pt      an OptimizerStateCallback entry, side "pre" or "post"

Crash safety follows the gradient store: every file is written to a temporary
name beside its target, fsynced and renamed (:func:`atomic_torch_save`), and
the manifest is rewritten the same way *after* the data file. A run killed at
any point leaves every snapshot the manifest lists complete and readable; a
data file the manifest does not list yet is ignored. Files are read with
``torch.load(weights_only=True)``: loading never runs code from the store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.state.dynamics import assemble_dynamics
from dattri_llm.utils.atomic import atomic_torch_save, atomic_write
from dattri_llm.utils.wrappers import unwrap_model

__all__ = ["MANIFEST_FILE", "LazyDynamics", "TrajectorySnapshots"]

MANIFEST_FILE = "snapshots.json"
_FORMAT_VERSION = 1
_SIDES = ("pre", "post")
_PLAIN_VALUES = (int, float, bool, str, bytes, type(None))


def _check_step(step: object, where: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"TrajectorySnapshots.{where}: step must be an int >= 0, got {step!r}.")
    return step


def _check_side(side: object, where: str) -> str:
    if side not in _SIDES:
        raise ValueError(
            f"TrajectorySnapshots.{where}: side must be 'pre' or 'post', got {side!r}."
        )
    return side


def _plain_cpu(batch: Any, path: str = "batch") -> Any:
    """``batch`` on CPU in containers ``weights_only`` loading accepts.

    Tensors are detached and moved to CPU; mappings become ``dict``, lists stay
    lists, tuples (named ones too) become ``tuple``; ints, floats, bools,
    strings, bytes and ``None`` pass through. Anything else → ``TypeError``.
    """
    if isinstance(batch, torch.Tensor):
        return batch.detach().to("cpu")
    if isinstance(batch, Mapping):
        return {key: _plain_cpu(value, f"{path}[{key!r}]") for key, value in batch.items()}
    if isinstance(batch, list):
        return [_plain_cpu(value, f"{path}[{i}]") for i, value in enumerate(batch)]
    if isinstance(batch, tuple):
        return tuple(_plain_cpu(value, f"{path}[{i}]") for i, value in enumerate(batch))
    if isinstance(batch, _PLAIN_VALUES):
        return batch
    raise TypeError(
        f"TrajectorySnapshots.save_batch: {path} is a {type(batch).__name__}; a stored batch may "
        "hold tensors, numbers, strings, None and mappings / lists / tuples of them (it is "
        "reloaded with torch.load(weights_only=True)). Convert it to tensors first."
    )


class TrajectorySnapshots:
    """Per-step parameters, batches and optimizer moments of a training trajectory.

    The directory (created if needed) holds the manifest ``snapshots.json``;
    an existing store is reopened. Each step may hold parameters (or a
    reference to an equal step, ``same_as``), a batch, and a ``"pre"`` /
    ``"post"`` dynamics entry. Saving a step again replaces that item.

    Args:
        root: the store directory.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._manifest = self._read_manifest()
        if not (self.root / MANIFEST_FILE).exists():
            self._write_manifest()

    # ---- manifest

    @staticmethod
    def is_snapshot_dir(path: str | Path) -> bool:
        """Whether ``path`` is a directory holding a snapshot manifest."""
        return (Path(path) / MANIFEST_FILE).is_file()

    def _read_manifest(self) -> dict[str, dict]:
        path = self.root / MANIFEST_FILE
        empty: dict[str, dict] = {"parameters": {}, "batches": {}, "dynamics": {}}
        if not path.exists():
            return empty
        manifest = json.loads(path.read_text())
        if manifest.get("format") != _FORMAT_VERSION:
            raise ValueError(
                f"TrajectorySnapshots: {path} has format {manifest.get('format')!r}; this "
                f"version reads format {_FORMAT_VERSION}."
            )
        return {key: manifest.get(key, {}) for key in empty}

    def _write_manifest(self) -> None:
        text = json.dumps({"format": _FORMAT_VERSION, **self._manifest}, indent=1, sort_keys=True)
        atomic_write(self.root / MANIFEST_FILE, lambda fh: fh.write(text.encode()))

    def _store(self, obj: Any, file: str, section: str, step: int, entry: Any) -> None:
        """Write ``obj`` to ``file`` (atomically), then list ``entry`` under ``section[step]``.

        For ``"dynamics"`` the entry is merged into the step's ``{side: file}`` dict.
        """
        atomic_torch_save(obj, self.root / file)
        if section == "dynamics":
            self._manifest[section].setdefault(str(step), {}).update(entry)
        else:
            self._manifest[section][str(step)] = entry
        self._write_manifest()

    def _load(self, file: str) -> Any:
        return torch.load(self.root / file, map_location="cpu", weights_only=True)

    # ---- parameters

    def save_parameters(self, step: int, model: nn.Module, *, same_as: int | None = None) -> None:
        """Store ``model``'s ``requires_grad`` parameters for ``step`` (CPU copies, own dtype).

        With ``same_as``, record that ``step`` has the parameters of the stored
        step ``same_as`` (no copy; ``KeyError`` if it has none). Names are those
        of the unwrapped model (``model.module`` of a DDP / DataParallel wrapper).
        """
        step = _check_step(step, "save_parameters")
        if same_as is not None:
            target = self._manifest["parameters"].get(str(_check_step(same_as, "save_parameters")))
            if target is None:
                raise KeyError(
                    f"TrajectorySnapshots.save_parameters: same_as={same_as} has no stored "
                    f"parameters in {self.root}; save that step first."
                )
            self._manifest["parameters"][str(step)] = {"file": target["file"], "same_as": same_as}
            self._write_manifest()
            return
        params = {
            name: p.detach().to("cpu", copy=True)
            for name, p in unwrap_model(model).named_parameters()
            if p.requires_grad
        }
        file = f"parameters_{step:08d}.pt"
        self._store(params, file, "parameters", step, {"file": file})

    def load_parameters(self, step: int, model: nn.Module) -> None:
        """Copy the parameters stored for ``step`` into ``model`` in place.

        Raises:
            KeyError: no parameters for ``step``, or a stored name is not a
                parameter of ``model``.
        """
        entry = self._entry("parameters", step, "load_parameters")
        stored = self._load(entry["file"])
        params = dict(unwrap_model(model).named_parameters())
        missing = sorted(set(stored) - set(params))
        if missing:
            raise KeyError(
                f"TrajectorySnapshots.load_parameters: step {step} stores parameters {missing} "
                f"that {type(unwrap_model(model)).__name__} does not have; load into the model "
                "the snapshot was taken from."
            )
        with torch.no_grad():
            for name, value in stored.items():
                params[name].copy_(value)

    def parameter_dict(self, step: int) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` stored for ``step`` (CPU, own dtype), without a model.

        Raises:
            KeyError: no parameters for ``step``.
        """
        return self._load(self._entry("parameters", step, "parameter_dict")["file"])

    # ---- batches

    def save_batch(self, step: int, batch: Any) -> None:
        """Store ``step``'s batch on CPU (tensors, numbers, strings in dict / list / tuple)."""
        step = _check_step(step, "save_batch")
        file = f"batch_{step:08d}.pt"
        self._store(_plain_cpu(batch), file, "batches", step, file)

    def load_batch(self, step: int) -> Any:
        """The batch stored for ``step`` (``KeyError`` if none)."""
        return self._load(self._entry("batches", step, "load_batch"))

    # ---- dynamics

    def save_dynamics(self, step: int, side: str, entry: dict) -> None:
        """Store an optimizer-moment entry (``OptimizerStateCallback``) of ``step``'s ``side``."""
        step = _check_step(step, "save_dynamics")
        side = _check_side(side, "save_dynamics")
        file = f"dynamics_{step:08d}_{side}.pt"
        self._store(entry, file, "dynamics", step, {side: file})

    def load_dynamics(self, step: int, side: str) -> dict | None:
        """The ``side`` entry stored for ``step``, ``None`` if there is none."""
        side = _check_side(side, "load_dynamics")
        file = self._manifest["dynamics"].get(str(step), {}).get(side)
        return None if file is None else self._load(file)

    def dynamics_steps(self) -> list[int]:
        """Ascending steps having both a ``"pre"`` and a ``"post"`` entry."""
        return sorted(
            int(step)
            for step, sides in self._manifest["dynamics"].items()
            if set(_SIDES) <= set(sides)
        )

    # ---- listing

    def steps(self) -> list[int]:
        """Ascending steps having both parameters and a batch."""
        both = set(self._manifest["parameters"]) & set(self._manifest["batches"])
        return sorted(int(step) for step in both)

    def _entry(self, section: str, step: int, where: str) -> Any:
        entry = self._manifest[section].get(str(step))
        if entry is None:
            raise KeyError(
                f"TrajectorySnapshots.{where}: no {section} stored for step {step} in "
                f"{self.root}; stored steps: {sorted(int(s) for s in self._manifest[section])}."
            )
        return entry

    def __repr__(self) -> str:
        """``TrajectorySnapshots('<root>', steps=<n>)``."""
        return f"TrajectorySnapshots('{self.root}', steps={len(self.steps())})"


class LazyDynamics(Mapping[int, dict]):
    """Read-only ``{step: dynamics entry}`` over a store's steps having both sides.

    Each entry is built on access with ``assemble_dynamics(pre, post)`` from
    the stored files (nothing is cached); iteration is in ascending step order.
    """

    def __init__(self, snapshots: TrajectorySnapshots) -> None:
        self.snapshots = snapshots

    def __getitem__(self, step: int) -> dict:
        """The assembled entry of ``step`` (``KeyError`` unless both sides are stored)."""
        pre = self.snapshots.load_dynamics(step, "pre")
        post = self.snapshots.load_dynamics(step, "post")
        if pre is None or post is None:
            raise KeyError(step)
        return assemble_dynamics(pre, post)

    def __iter__(self) -> Iterator[int]:
        """Ascending steps with both sides."""
        return iter(self.snapshots.dynamics_steps())

    def __len__(self) -> int:
        """Number of steps with both sides."""
        return len(self.snapshots.dynamics_steps())

    def __contains__(self, step: object) -> bool:
        """Whether ``step`` has both sides (without loading them)."""
        return step in self.snapshots.dynamics_steps()

    def __repr__(self) -> str:
        """``LazyDynamics(<store repr>, steps=[...])``."""
        return f"LazyDynamics({self.snapshots!r}, steps={self.snapshots.dynamics_steps()})"

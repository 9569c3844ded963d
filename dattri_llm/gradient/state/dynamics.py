"""The dynamics records of a training run: a step's moment entry and ``training_dynamics.json``.

:func:`assemble_dynamics` joins the ``"pre"`` and ``"post"`` side entries an
``OptimizerStateCallback`` records around one optimizer update (in memory or as
a ``TrajectorySnapshots`` store's dynamics files) into the entry
AdamW-influence consumes. :func:`save_training_dynamics` /
:func:`load_training_dynamics` write and read ``training_dynamics.json``, what
every update of the run applied (``TrainingDynamicsCallback``), beside a run's
store.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from dattri_llm.utils.atomic import atomic_write

__all__ = [
    "TRAINING_DYNAMICS_FILE",
    "assemble_dynamics",
    "load_training_dynamics",
    "save_training_dynamics",
]

TRAINING_DYNAMICS_FILE = "training_dynamics.json"
_FORMAT = 1


def assemble_dynamics(pre: dict, post: dict) -> dict:
    """One step's dynamics entry from its ``pre`` and ``post`` side entries.

    Returns:
        ``{"pre": {layer: (m, v)}, "post": {layer: (m, v)}, "step": post["step"],
        "lr", "betas", "eps", "weight_decay"}`` — ``step`` is the update count after
        the step's update; the hyperparameters come from the pre side — plus the
        post side's ``"update"`` and ``"layers"`` when it has them.
    """
    entry = {
        "pre": pre["moments"],
        "post": post["moments"],
        "step": post["step"],
        "lr": pre["lr"],
        "betas": pre["betas"],
        "eps": pre["eps"],
        "weight_decay": pre["weight_decay"],
    }
    for key in ("update", "layers"):
        if key in post:
            entry[key] = post[key]
    return entry


def save_training_dynamics(
    directory: str | Path,
    updates: Mapping[int, dict],
    layer_map: Mapping[str, dict],
    *,
    skipped_steps: Iterable[int] = (),
    parameter_groups: Mapping[str, int] | None = None,
) -> Path:
    """Write ``training_dynamics.json`` (format 1) in ``directory``; return its path.

    Layout: ``{"format": 1, "layers": {layer: {...}}, "updates": {step: {...}},
    "skipped_steps": [...], "parameter_groups": {parameter name: group index}}``
    (``parameter_groups`` only when given; files without it still load) — see
    :class:`~dattri_llm.gradient.callbacks.training_dynamics_callback.TrainingDynamicsCallback`.
    """
    path = Path(directory) / TRAINING_DYNAMICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": _FORMAT,
        "layers": dict(layer_map),
        "updates": {str(int(step)): dict(update) for step, update in sorted(updates.items())},
        "skipped_steps": sorted(int(step) for step in skipped_steps),
    }
    if parameter_groups:
        payload["parameter_groups"] = {str(k): int(v) for k, v in parameter_groups.items()}
    text = json.dumps(payload)
    return atomic_write(path, lambda fh: fh.write(text.encode("utf-8")))


def load_training_dynamics(directory: str | Path) -> dict | None:
    """``{"layers", "updates" (int keys), "skipped_steps"}`` read from ``directory``, plus
    ``"parameter_groups"`` when the file records them (older files do not).

    ``None`` when the directory holds no ``training_dynamics.json``.

    Raises:
        ValueError: a file of another format.
    """
    path = Path(directory) / TRAINING_DYNAMICS_FILE
    if not path.is_file():
        return None
    payload = json.loads(path.read_text(encoding="utf-8"))
    if payload.get("format") != _FORMAT:
        raise ValueError(
            f"{path} has format {payload.get('format')!r}; this version reads format {_FORMAT}"
        )
    loaded = {
        "layers": payload.get("layers", {}),
        "updates": {int(step): update for step, update in payload.get("updates", {}).items()},
        "skipped_steps": [int(step) for step in payload.get("skipped_steps", [])],
    }
    if "parameter_groups" in payload:
        loaded["parameter_groups"] = {
            str(name): int(group) for name, group in payload["parameter_groups"].items()
        }
    return loaded

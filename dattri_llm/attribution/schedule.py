"""The learning-rate schedule file of a recorded run: ``lr_schedule.json`` beside its store.

A trajectory's train store (or snapshot directory) keeps ``{step: lr}``, the
learning rate applied at each step, so methods that weigh steps by it (LESS,
trajectory TracIn, DVEmb) can read it back without the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from dattri_llm.utils.atomic import atomic_write

LR_SCHEDULE_FILE = "lr_schedule.json"


def write_lr_schedule(dir: str | Path, lrs: Mapping[int, float]) -> Path:  # noqa: A002
    """Write ``{step: lr}`` as ``lr_schedule.json`` in ``dir``; return the file path."""
    path = Path(dir) / LR_SCHEDULE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {str(int(step)): float(lr) for step, lr in sorted(lrs.items())}
    return atomic_write(path, lambda fh: fh.write(json.dumps(payload).encode("utf-8")))


def read_lr_schedule(dir: str | Path) -> dict[int, float] | None:  # noqa: A002
    """Read ``lr_schedule.json`` from ``dir`` (``None`` when absent)."""
    path = Path(dir) / LR_SCHEDULE_FILE
    if not path.is_file():
        return None
    payload = json.loads(path.read_text(encoding="utf-8"))
    return {int(step): float(lr) for step, lr in payload.items()}

"""How much a trajectory score rests on the optimizer's first update.

Adam's first update is ``m̂/(√v̂ + eps) = g/(|g| + eps)`` per coordinate:
nearly ``sign(g)``, a step function wherever the batch gradient ``g`` is near
zero. The derivative of the run in the weight of a sample of that update
(AdamW-influence's row, the exact metagradient's row) is therefore very large
and very nonlinear: removing the sample moves far past the steep part, so the
linear prediction of its removal is unreliable, and such rows can dominate a
subset sum. Later updates divide by a second moment that remembers earlier
gradients, so they are not sign-like in the same way.

:func:`first_update_steps` finds the store steps of the updates that are some
parameter group's first (Adam's update count ``k == 1`` in the recorded
dynamics); :func:`first_update_statistic` compares their rows with the
others; :func:`first_update_meta` records the result and warns when the
first update's rows stand out (:data:`FIRST_UPDATE_RATIO_THRESHOLD`).

The statistic: a row's magnitude is the mean of ``|score|`` over the queries
(one number per row, so one row with a large score on a few queries counts,
and the ratio does not depend on the number of queries);
``magnitude_ratio`` is the median magnitude of the first update's rows over
the median magnitude of the other rows (the mean of the two middle values for
an even count; ``None`` when every scored row is in the first update, ``inf``
when the others' median is 0); ``mass_share`` is the first update's rows'
share of ``Σ |score|`` over all rows and queries. The medians make the ratio
about the typical sample of the first update, not one outlier either side.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics, Window

# Warn when the first update's median row is more than this many times the others'. In the
# leave-one-out fidelity experiment (2-layer GPT-2, 16 AdamW updates of 4 samples), where the
# first batch's rows misled (its linear removal estimates missed by 3.5–11 times the true
# effect; they alone moved MAGIC's subset score from +0.76 to +0.60), this ratio reads 4.7–25.6
# (AdamW-influence / metagradient: 7.0 / 9.6 summed loss, 11.3 / 25.6 Trainer defaults,
# 4.9 / 4.7 with MKL's AVX2 kernels): 3 sits below all of them; a run whose first update is
# not sign-like gives about 1 (1.25 in the warm-up test of tests/attribution).
FIRST_UPDATE_RATIO_THRESHOLD = 3.0
FIRST_UPDATE_KEY = "first_update"


def is_first_update(run: RunDynamics, window: Window) -> bool:
    """Whether ``window`` is the first update of some parameter group (Adam's ``k == 1``).

    A recorded update gives each group's update count after it (``groups[i]["step"]``);
    an unrecorded AdamW-dynamics entry the one count of its step. A run without
    either (``False``) cannot be told.
    """
    if window.update is not None:
        return any(int(group.get("step", 0)) == 1 for group in window.update.get("groups", ()))
    legacy = run.legacy.get(window.key)
    return legacy is not None and int(legacy.get("step", 0)) == 1


def first_update_steps(run: RunDynamics, windows: Iterable[Window]) -> list[int]:
    """Store steps of the ``windows`` that are a group's first update, ascending."""
    return sorted(s for window in windows if is_first_update(run, window) for s in window.steps)


def first_update_statistic(
    scores: torch.Tensor, row_steps: Sequence[int], first_steps: Iterable[int]
) -> dict[str, Any] | None:
    """The first update's share of a score (see the module docstring).

    Args:
        scores: ``(rows, n_test)`` score matrix.
        row_steps: ``(rows,)`` store step of each row.
        first_steps: store steps of the first update(s).

    Returns:
        ``{"steps", "num_rows", "magnitude_ratio", "mass_share"}`` (``steps``:
        the first-update steps that have rows, ascending), or ``None`` when no
        row is in the first update.

    Raises:
        ValueError: ``row_steps`` of another length than the rows of ``scores``.
    """
    if scores.dim() != 2 or scores.shape[0] != len(row_steps):
        raise ValueError(
            f"scores must be (rows, n_test) with one step per row; got shape "
            f"{tuple(scores.shape)} and {len(row_steps)} row steps"
        )
    first = set(int(s) for s in first_steps)
    mask = torch.tensor([int(s) in first for s in row_steps], dtype=torch.bool)
    if not bool(mask.any()):
        return None
    magnitude = _row_magnitudes(scores.detach())
    total = float(magnitude.sum())
    others = magnitude[~mask]
    ratio: float | None = None
    if others.numel():
        top, bottom = _median(magnitude[mask]), _median(others)
        ratio = top / bottom if bottom > 0 else (math.inf if top > 0 else 1.0)
    return {
        "steps": sorted({int(s) for s, m in zip(row_steps, mask.tolist(), strict=True) if m}),
        "num_rows": int(mask.sum()),
        "magnitude_ratio": ratio,
        "mass_share": float(magnitude[mask].sum()) / total if total > 0 else 0.0,
    }


def _row_magnitudes(scores: torch.Tensor, block: int = 1 << 16) -> torch.Tensor:
    """``(rows,)`` float64 mean ``|score|`` over the queries, a block of rows at a time (no
    full-size copy of a large score)."""
    return torch.cat(
        [part.abs().mean(dim=1, dtype=torch.float64) for part in scores.split(block)]
        or [torch.zeros(0, dtype=torch.float64)]
    ).cpu()


def _median(values: torch.Tensor) -> float:
    """The median of a non-empty ``(n,)`` tensor, the mean of the two middle values for even
    ``n`` (``Tensor.median`` takes the lower one)."""
    ordered = values.sort().values
    n = ordered.numel()
    return float(ordered[n // 2]) if n % 2 else float(ordered[n // 2 - 1 : n // 2 + 1].mean())


def first_update_meta(
    scores: torch.Tensor,
    row_steps: Sequence[int],
    run: RunDynamics,
    windows: Iterable[Window],
    *,
    method: str,
    threshold: float = FIRST_UPDATE_RATIO_THRESHOLD,
) -> dict[str, dict[str, Any]]:
    """``{"first_update": statistic}`` of a score (``{}`` when the first update holds no
    scored row), with a ``UserWarning`` when its ``magnitude_ratio`` exceeds ``threshold``.

    ``scores`` ``(rows, n_test)`` and ``row_steps`` ``(rows,)`` are the score's;
    ``windows`` the updates the call swept; ``method`` names the attributor in the
    warning. The result is merged into the score's ``algorithm_meta``.
    """
    stats = first_update_statistic(scores, row_steps, first_update_steps(run, windows))
    if stats is None:
        return {}
    ratio = stats["magnitude_ratio"]
    if ratio is not None and ratio > threshold:
        warnings.warn(
            f"{method}: the {stats['num_rows']} rows of the optimizer's first update (steps "
            f"{stats['steps']}) are {ratio:.3g} times the other rows in median magnitude and "
            f"hold {stats['mass_share']:.0%} of the score's mass (threshold {threshold}). "
            "These samples' scores are derivatives through Adam's first, sign-like step "
            "g/(|g|+eps); the linear prediction of removing them is unreliable. Consider "
            "excluding them (selected_training_steps without the first update), warming the "
            "optimizer up (a first update with a tiny learning rate), or judging them "
            f"separately (algorithm_meta[{FIRST_UPDATE_KEY!r}] has the numbers)",
            UserWarning,
            stacklevel=4,  # the caller of the (keywords-wrapped) attribute_from_cache
        )
    return {FIRST_UPDATE_KEY: stats}


__all__ = [
    "FIRST_UPDATE_RATIO_THRESHOLD",
    "FIRST_UPDATE_KEY",
    "first_update_meta",
    "first_update_statistic",
    "first_update_steps",
    "is_first_update",
]

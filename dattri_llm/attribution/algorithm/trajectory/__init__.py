"""The trajectory methods' shared machinery: collection, recorded dynamics, the one sweep.

* :mod:`.base`: :class:`TrajectoryAttributor`, the base of every trajectory
  method (opening a run's sources, the shared scoring flow);
* :mod:`.recording`: recording a run (the training side's steps, then the
  queries at the final parameters);
* :mod:`.scope`: :class:`RunScope`, the steps one scoring call propagates and emits;
* :mod:`.run`: :class:`RunDynamics` / :class:`Window`, what each recorded
  optimizer update applied (windows, clip, loss scale, per-coordinate values);
* :mod:`.sweep`: :class:`TrajectorySweep`, the backward sweep over the
  updates, and the :class:`Fold` interface a method fills in;
* :mod:`.folds`: the folds of trajectory TracIn, DVEmb and AdamW-influence;
* :mod:`.second_order`: AdamW-influence's second-order error proxy (a forward sweep).
* :mod:`.first_update`: the share of a score held by Adam's first update (a warning);
* :mod:`.masks`: disjoint coordinate masks of the sweep (AdamW-influence's ``num_masks``).
"""

from dattri_llm.attribution.algorithm.trajectory.base import TrajectoryAttributor
from dattri_llm.attribution.algorithm.trajectory.recording import (
    TEST_GRADS_DIR,
    TRAIN_GRADS_DIR,
    TRAIN_SNAPSHOTS_DIR,
)
from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics, Window
from dattri_llm.attribution.algorithm.trajectory.scope import RunScope
from dattri_llm.attribution.algorithm.trajectory.second_order import (
    RELIABILITY_THRESHOLD,
    ErrorProxy,
)
from dattri_llm.attribution.algorithm.trajectory.sweep import (
    LOSS_REDUCTIONS,
    PROPAGATIONS,
    Fold,
    TrajectorySweep,
    WindowRows,
)

__all__ = [
    "LOSS_REDUCTIONS",
    "PROPAGATIONS",
    "RELIABILITY_THRESHOLD",
    "TEST_GRADS_DIR",
    "TRAIN_GRADS_DIR",
    "TRAIN_SNAPSHOTS_DIR",
    "ErrorProxy",
    "Fold",
    "RunDynamics",
    "RunScope",
    "TrajectoryAttributor",
    "TrajectorySweep",
    "Window",
    "WindowRows",
]

"""``ParameterSnapshotCallback``: store the parameters each step's gradients were taken at."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dattri_llm.gradient.callbacks.base import HookManagerCallback

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.gradient.model.container import GradientRecord
    from dattri_llm.gradient.state.snapshots import TrajectorySnapshots


class ParameterSnapshotCallback(HookManagerCallback):
    """Save ``model``'s parameters into ``snapshots`` at the end of every capture step.

    ``on_step_end`` fires at the end of the backward, before
    ``optimizer.step()``, so the stored parameters are those the step's
    gradients were taken at (``snapshots.save_parameters(record.step, model)``).
    The batch is not seen by callbacks: save it with
    ``snapshots.save_batch(step, batch)`` (``GradientStreamer`` does both).

    Args:
        model: the trained model.
        snapshots: the :class:`~dattri_llm.gradient.state.snapshots.TrajectorySnapshots` store.
    """

    def __init__(self, model: nn.Module, snapshots: TrajectorySnapshots) -> None:
        self.model = model
        self.snapshots = snapshots

    def on_step_end(self, record: GradientRecord) -> None:
        """``snapshots.save_parameters(record.step, model)``."""
        self.snapshots.save_parameters(record.step, self.model)

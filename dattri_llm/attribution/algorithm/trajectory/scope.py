"""What one trajectory scoring call sweeps: the steps it propagates and emits, and their updates.

:func:`resolve_steps` picks the propagated and output steps of a recorded
run; :func:`run_scope` reads the run's recorded dynamics and keeps the
updates the sweep must read; :class:`RunScope` carries them to the sweep.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics, Window
from dattri_llm.attribution.algorithm.trajectory.sweep import swept_windows
from dattri_llm.gradient.state.dynamics import load_training_dynamics


@dataclass
class RunScope:
    """What one scoring call sweeps.

    Attributes:
        run: the recorded dynamics.
        windows: the propagated updates (store steps before ``final_step``), ascending.
        swept: those the sweep reads: from the earliest holding an output step
            to the last (earlier ones change no score), ascending.
        output_steps: the store steps whose rows are emitted, latest first.
        final_step: the step the queries were taken at.
    """

    run: RunDynamics
    windows: list[Window]
    swept: list[Window]
    output_steps: list[int]
    final_step: int

    def recorded_rates(self) -> dict[int, float | str]:
        """``{update key: recorded lr}`` of the swept updates (``"per_group"`` if groups differ)."""
        rates = {}
        for window in self.swept:
            value = self.run.uniform(window, "lr")
            rates[window.key] = "per_group" if value is None else value
        return rates

    @property
    def swept_steps(self) -> list[int]:
        """Store steps of the swept updates, latest first."""
        return sorted((s for window in self.swept for s in window.steps), reverse=True)


def run_scope(
    attributor: Any,
    train_source: object,
    *,
    selected_training_steps: Iterable[int] | None,
    final_step: int | None,
    entries: Mapping[int, Mapping[str, Any]] | None,
) -> RunScope:
    """The :class:`RunScope` of a call (``TrajectoryAttributor.run_scope``).

    ``attributor`` is the ``TrajectoryAttributor`` (typed ``Any``: this
    module does not import ``base``, which imports it) whose
    ``resolve_steps``, ``available_steps`` and ``train_dir_of`` read the run.
    """
    prop_steps, output_steps, final_step = attributor.resolve_steps(
        attributor.available_steps(train_source), selected_training_steps, final_step
    )
    directory = attributor.train_dir_of(train_source)
    recorded = None if directory is None else load_training_dynamics(directory)
    run = RunDynamics.from_records(
        recorded, entries=entries, merged=attributor._merged_windows(train_source)
    )
    windows = run.windows(prop_steps)
    swept = swept_windows(windows, set(output_steps))
    if not swept:
        raise ValueError(
            f"none of the output steps {sorted(output_steps)} belongs to a recorded "
            "optimizer update; nothing to score"
        )
    return RunScope(run, windows, swept, output_steps, final_step)


def resolve_steps(
    available: Iterable[int],
    selected: Iterable[int] | None,
    final_step: int | None,
) -> tuple[list[int], list[int], int]:
    """``(prop_steps, output_steps, final_step)``, step lists latest first.

    ``final_step`` defaults to the last available step + 1; the propagated
    steps are the available ones before it; the output steps are those
    among them in ``selected`` (all when ``None``).

    Raises:
        ValueError: no available step before ``final_step``; a selection
            matching none of the propagated steps.
    """
    steps = sorted({int(s) for s in available})
    if final_step is None:
        final_step = steps[-1] + 1 if steps else 0
    propagated = [s for s in reversed(steps) if s < final_step]
    if not propagated:
        raise ValueError(
            f"no recorded step before final_step={final_step}; recorded steps: {steps}"
        )
    if selected is None:
        return propagated, list(propagated), final_step
    chosen = {int(s) for s in selected}
    output = [s for s in propagated if s in chosen]
    if not output:
        raise ValueError(
            f"selected_training_steps {sorted(chosen)} match none of the propagated steps "
            f"{sorted(propagated)}"
        )
    return propagated, output, final_step

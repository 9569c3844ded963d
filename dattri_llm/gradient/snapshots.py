"""``TrajectorySnapshots``: a trajectory's per-step parameters, batches and moments (public path).

Re-exports :mod:`dattri_llm.gradient.state.snapshots`, where the store lives.
"""

from dattri_llm.gradient.state.snapshots import MANIFEST_FILE, LazyDynamics, TrajectorySnapshots

__all__ = ["MANIFEST_FILE", "LazyDynamics", "TrajectorySnapshots"]

"""Gradient data model (spec path): ``Factorized``, ``Gradient``, ``GradientRecord``.

Defined in :mod:`dattri_llm.gradient.model` (``records``: ``Factorized`` and the payload
types; ``container``: ``Gradient`` and ``GradientRecord``); the classes report this module
as their own, the path stores pickle them by.
"""

from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.model.records import (
    Factorized,
    GradientData,
    GradientRepresentation,
    GradientShapeError,
    Indexing,
    base_layer_name,
)

# Old path of a private helper, still imported from here by ops/kronecker.py.
from dattri_llm.gradient.ops.materialize import (
    _materialized_width_estimate as _materialized_width_estimate,
)

__all__ = [
    "Factorized",
    "Gradient",
    "GradientData",
    "GradientRecord",
    "GradientRepresentation",
    "GradientShapeError",
    "Indexing",
    "base_layer_name",
]

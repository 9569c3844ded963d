"""Gradient data model (public path): ``Factorized``, ``Gradient``, ``GradientRecord``.

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

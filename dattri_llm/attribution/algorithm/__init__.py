"""One module per attribution method."""

from dattri_llm.attribution.algorithm.kronecker import (
    EKFACAttributor,
    KFACAttributor,
    KroneckerAttributor,
)
from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.algorithm.trajectory import TrajectoryAttributor

__all__ = [
    "EKFACAttributor",
    "KFACAttributor",
    "KroneckerAttributor",
    "LESSAttributor",
    "TracInAttributor",
    "TrajectoryAttributor",
]

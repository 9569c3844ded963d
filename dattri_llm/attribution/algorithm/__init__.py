"""One module per attribution method."""

from dattri_llm.attribution.algorithm.kronecker import (
    EKFACAttributor,
    KFACAttributor,
    KroneckerAttributor,
)
from dattri_llm.attribution.algorithm.tracin import TracInAttributor

__all__ = ["EKFACAttributor", "KFACAttributor", "KroneckerAttributor", "TracInAttributor"]

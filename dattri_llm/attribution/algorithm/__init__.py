"""One module per attribution method."""

from dattri_llm.attribution.algorithm.tracin import TracInAttributor

__all__ = ["TracInAttributor"]

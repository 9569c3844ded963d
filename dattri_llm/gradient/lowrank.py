"""Low-rank per-sample gradient records (LoRIF's storage format); public path.

Defined in :mod:`dattri_llm.gradient.model.lowrank`; ``LowRank`` reports this module as
its own, the path stores pickle it by.
"""

from dattri_llm.gradient.model.lowrank import (
    LowRank,
    check_low_rank,
    has_matrix_form,
    is_low_rank,
    low_rank_cross_dot,
    low_rank_factors,
    low_rank_gradient,
    low_rank_of,
    require_raw_factors,
)

__all__ = [
    "LowRank",
    "check_low_rank",
    "has_matrix_form",
    "is_low_rank",
    "low_rank_cross_dot",
    "low_rank_factors",
    "low_rank_gradient",
    "low_rank_of",
    "require_raw_factors",
]

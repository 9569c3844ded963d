"""Attribution quality measured on the user's own data: LOO, LDS, recall@k.

The user supplies ``train_fn(kept_indices, seed) -> model`` and
``eval_fn(model) -> (n_queries,) losses``; retrains are resumable through an
output directory (one atomic JSON file per finished retrain). Any attributor's
:class:`~dattri_llm.attribution.score.AttributionScore` (or a plain
``(n_train, n_test)`` tensor) can then be scored against the ground truth.
"""

from dattri_llm.evaluation.ground_truth import (
    LDSGroundTruth,
    LeaveOneOutResult,
    lds,
    lds_ground_truth,
    leave_one_out,
    loo_correlation,
)
from dattri_llm.evaluation.metrics import (
    Interval,
    align_scores,
    mean_ci,
    pearson,
    rank,
    recall_at_k,
    spearman,
)
from dattri_llm.evaluation.retrain import RetrainJob, RetrainRunner
from dattri_llm.evaluation.subsets import LDSConfig, sample_subsets, subset_size

__all__ = [
    "Interval",
    "LDSConfig",
    "LDSGroundTruth",
    "LeaveOneOutResult",
    "RetrainJob",
    "RetrainRunner",
    "align_scores",
    "lds",
    "lds_ground_truth",
    "leave_one_out",
    "loo_correlation",
    "mean_ci",
    "pearson",
    "rank",
    "recall_at_k",
    "sample_subsets",
    "spearman",
    "subset_size",
]

"""Retraining ground truth (leave-one-out, LDS) and the metrics that score attributions on it.

Sign conventions: *helpfulness* is ``polarity * score`` (larger = more
helpful). Leave-one-out ground truth is ``Δ_i = L(without i) − L(full)``, so a
helpful sample has ``Δ > 0``; the LOO metric correlates helpfulness with ``Δ``.
LDS correlates, across random subsets, the summed helpfulness of a subset's
members with ``−L(subset)`` (a helpful subset lowers the loss), so a perfect
attribution has LDS ``+1`` and random scores ``≈ 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.evaluation.metrics import Interval, align_scores, mean_ci, pearson, spearman
from dattri_llm.evaluation.retrain import EvalFn, RetrainJob, RetrainRunner, TrainFn
from dattri_llm.evaluation.subsets import LDSConfig, ids_digest, sample_subsets

__all__ = [
    "LDSGroundTruth",
    "LeaveOneOutResult",
    "lds",
    "lds_ground_truth",
    "leave_one_out",
    "loo_correlation",
]

_METRICS = {"spearman": spearman, "pearson": pearson}


def _check_ids(train_ids: Sequence[str]) -> list[str]:
    ids = [str(h) for h in train_ids]
    if len(set(ids)) != len(ids):
        raise ValueError("train_ids contains duplicates; each training row needs a distinct id")
    if len(ids) < 2:
        raise ValueError(f"need at least 2 training samples, got {len(ids)}")
    return ids


@dataclass(frozen=True)
class LeaveOneOutResult:
    """Leave-one-out ground truth.

    Attributes:
        train_ids: all training ids, in the order ``train_fn``'s indices refer to.
        removed: indices (into ``train_ids``) of the samples left out, ``(r,)``.
        full_loss: query losses of the full-data model, ``(n_queries,)``.
        delta: ``L(without i) − L(full)``, ``(r, n_queries)`` (positive = helpful).
    """

    train_ids: list[str]
    removed: list[int]
    full_loss: torch.Tensor
    delta: torch.Tensor


def leave_one_out(
    train_fn: TrainFn,
    eval_fn: EvalFn,
    train_ids: Sequence[str],
    *,
    removed: Sequence[int] | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> LeaveOneOutResult:
    """Retrain without each sample of ``removed`` and measure the change of query losses.

    Every retrain (the full one included) uses the same ``seed``, so training
    noise shared by the runs cancels in ``Δ``.

    Args:
        train_fn: ``train_fn(kept_indices, seed) -> model``; indices into ``train_ids``.
        eval_fn: ``eval_fn(model) -> (n_queries,)`` losses.
        train_ids: ids of the training samples, ``(n_train,)``.
        removed: which indices to leave out (default: all).
        seed: the training seed of every retrain.
        out_dir: directory for resumable per-retrain results (``None``: in memory).
        progress: show a tqdm bar.

    Returns:
        A :class:`LeaveOneOutResult`.
    """
    ids = _check_ids(train_ids)
    n = len(ids)
    chosen = list(range(n)) if removed is None else [int(i) for i in removed]
    bad = [i for i in chosen if not 0 <= i < n]
    if bad or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"removed must be distinct indices in [0, {n}); bad: {bad[:5] or 'duplicates'}"
        )
    design = {"kind": "leave_one_out", "train_ids_sha256": ids_digest(ids), "seed": int(seed)}
    runner = RetrainRunner(train_fn, eval_fn, out_dir=out_dir, design=design, progress=progress)
    everyone = tuple(range(n))
    jobs = [RetrainJob("full", everyone, int(seed))]
    jobs += [RetrainJob(f"loo-{i}", everyone[:i] + everyone[i + 1 :], int(seed)) for i in chosen]
    losses = runner.run(jobs, desc="leave-one-out")
    return LeaveOneOutResult(ids, chosen, losses[0], losses[1:] - losses[0])


def loo_correlation(
    scores: AttributionScore | torch.Tensor,
    result: LeaveOneOutResult,
    *,
    test_ids: Sequence[str] | None = None,
    metric: str = "spearman",
    polarity: int = 1,
    seed: int = 0,
) -> Interval:
    """Per-query correlation between helpfulness and the leave-one-out ``Δ``.

    Args:
        scores: an :class:`AttributionScore` (rows looked up by id) or a plain
            ``(n_train, n_test)`` tensor in ``result.train_ids`` order.
        result: from :func:`leave_one_out`.
        test_ids: the ids of ``eval_fn``'s queries in order (for an
            :class:`AttributionScore`; ``None``: its column order).
        metric: ``"spearman"`` or ``"pearson"``.
        polarity: sign of a plain tensor (``+1``: larger = more helpful).
        seed: seed of the bootstrap interval.

    Returns:
        An :class:`Interval` over queries (``+1``: perfect agreement).
    """
    func = _pick(metric)
    if isinstance(scores, AttributionScore):
        helpful = align_scores(scores, [result.train_ids[i] for i in result.removed], test_ids)
    else:
        helpful = align_scores(scores, result.train_ids, test_ids, polarity=polarity)[
            result.removed
        ]
    _check_queries(helpful, result.delta)
    return mean_ci(func(helpful, result.delta), seed=seed)


@dataclass(frozen=True)
class LDSGroundTruth:
    """Losses of models retrained on random subsets.

    Attributes:
        train_ids: all training ids, ``(n_train,)``.
        config: the :class:`LDSConfig` used.
        subsets: member indices of each subset, ``(num_subsets, k)`` long.
        losses: query losses of each retrain, ``(num_subsets, n_queries)`` float64.
    """

    train_ids: list[str]
    config: LDSConfig
    subsets: torch.Tensor
    losses: torch.Tensor


def lds_ground_truth(
    train_fn: TrainFn,
    eval_fn: EvalFn,
    train_ids: Sequence[str],
    config: LDSConfig | None = None,
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> LDSGroundTruth:
    """Retrain on ``config.num_subsets`` seeded random ``alpha``-subsets (resumable).

    Subset ``m`` trains with seed ``config.seed + 1 + m``. With ``out_dir``,
    each finished retrain is saved at once and skipped on a rerun; a directory
    made with another config or training set is refused.
    """
    config = LDSConfig() if config is None else config
    ids = _check_ids(train_ids)
    subsets = sample_subsets(len(ids), config.alpha, config.num_subsets, config.seed)
    design = {"kind": "lds", "train_ids_sha256": ids_digest(ids), **config.to_dict()}
    runner = RetrainRunner(train_fn, eval_fn, out_dir=out_dir, design=design, progress=progress)
    jobs = [
        RetrainJob(f"subset-{m}", tuple(row.tolist()), config.retrain_seed(m))
        for m, row in enumerate(subsets)
    ]
    return LDSGroundTruth(ids, config, subsets, runner.run(jobs, desc="LDS retrains"))


def lds(
    scores: AttributionScore | torch.Tensor,
    truth: LDSGroundTruth,
    *,
    test_ids: Sequence[str] | None = None,
    polarity: int = 1,
    seed: int = 0,
) -> Interval:
    """Linear datamodeling score: per-query Spearman of summed helpfulness vs ``−loss``.

    The correlation runs across the subsets of ``truth``.

    Args:
        scores: an :class:`AttributionScore` or a plain ``(n_train, n_test)``
            tensor in ``truth.train_ids`` order.
        truth: from :func:`lds_ground_truth`.
        test_ids: the ids of ``eval_fn``'s queries in order (``None``: the score's column order).
        polarity: sign of a plain tensor.
        seed: seed of the bootstrap interval.

    Returns:
        An :class:`Interval` over queries (``+1``: perfect, ``≈ 0``: random).
    """
    helpful = align_scores(scores, truth.train_ids, test_ids, polarity=polarity)
    _check_queries(helpful, truth.losses)
    predicted = helpful[truth.subsets].sum(dim=1)  # (num_subsets, n_queries)
    return mean_ci(spearman(predicted, -truth.losses), seed=seed)


def _pick(metric: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    try:
        return _METRICS[metric]
    except KeyError:
        raise ValueError(f"metric must be one of {sorted(_METRICS)}, got {metric!r}") from None


def _check_queries(helpful: torch.Tensor, truth: torch.Tensor) -> None:
    if helpful.shape[1] != truth.shape[1]:
        raise ValueError(
            f"the scores have {helpful.shape[1]} queries but eval_fn returned {truth.shape[1]}; "
            "pass test_ids in eval_fn's query order"
        )

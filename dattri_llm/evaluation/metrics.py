"""Correlation metrics, recall@k and score alignment for attribution evaluation.

Every metric works per query (column) and summarises the queries with a mean
and a seeded bootstrap confidence interval over queries (:func:`mean_ci`).
Scores enter through :func:`align_scores`, which returns *helpfulness*:
``polarity * score`` summed per training sample, so a larger value always means
"more helpful" (removing the sample raises the query's loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dattri_llm.attribution.score import AttributionScore, check_polarity

__all__ = [
    "Interval",
    "align_scores",
    "mean_ci",
    "pearson",
    "rank",
    "recall_at_k",
    "spearman",
]


@dataclass(frozen=True)
class Interval:
    """A per-query metric with its mean and a bootstrap confidence interval.

    Attributes:
        per_query: the metric of each query, ``(n_queries,)`` float64 (NaN where
            undefined, e.g. a constant column).
        mean: mean of the finite entries of ``per_query``.
        low: lower end of the interval.
        high: upper end of the interval.
        level: the interval's confidence level (e.g. ``0.95``).
        method: how the interval was made (``"bootstrap over queries"``).
    """

    per_query: torch.Tensor
    mean: float
    low: float
    high: float
    level: float
    method: str = "bootstrap over queries"

    def __str__(self) -> str:
        """``mean [low, high] (level CI)``."""
        return f"{self.mean:.4f} [{self.low:.4f}, {self.high:.4f}] ({self.level:.0%} CI)"


def mean_ci(
    values: torch.Tensor, *, level: float = 0.95, num_bootstrap: int = 2000, seed: int = 0
) -> Interval:
    """Mean of per-query values with a percentile bootstrap interval over queries.

    Args:
        values: ``(n_queries,)`` per-query metric; NaN entries are dropped.
        level: confidence level in ``(0, 1)``.
        num_bootstrap: bootstrap resamples (``>= 1``).
        seed: seed of the resampling (same seed, same interval).

    Returns:
        An :class:`Interval`; all NaN when no entry is finite. With a single
        finite query the interval collapses to that value.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95; got {level!r}")
    if num_bootstrap < 1:
        raise ValueError(f"num_bootstrap must be >= 1, got {num_bootstrap!r}")
    per_query = torch.as_tensor(values).detach().to("cpu", torch.float64).reshape(-1)
    finite = per_query[torch.isfinite(per_query)]
    if finite.numel() == 0:
        nan = float("nan")
        return Interval(per_query, nan, nan, nan, level)
    generator = torch.Generator().manual_seed(int(seed))
    picks = torch.randint(finite.numel(), (num_bootstrap, finite.numel()), generator=generator)
    means = finite[picks].mean(dim=1)
    tail = (1.0 - level) / 2.0
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64))
    return Interval(per_query, finite.mean().item(), low.item(), high.item(), level)


def rank(values: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean rank) along dim 0: ``(n, ...)`` -> same shape, float64."""
    x = torch.as_tensor(values, dtype=torch.float64)
    flat = x.reshape(x.shape[0], -1)
    out = torch.empty_like(flat)
    for j in range(flat.shape[1]):
        sorted_vals, order = torch.sort(flat[:, j], stable=True)
        _, inverse, counts = torch.unique_consecutive(
            sorted_vals, return_inverse=True, return_counts=True
        )
        ends = torch.cumsum(counts, 0).to(torch.float64)
        mean_rank = ends - (counts.to(torch.float64) - 1.0) / 2.0  # 1-based average rank
        out[order, j] = mean_rank[inverse]
    return out.reshape(x.shape)


def pearson(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each column: ``(n, q)`` and ``(n, q)`` -> ``(q,)`` float64.

    A 1-D pair ``(n,)`` gives a 0-d result. A constant column gives NaN.
    """
    a = torch.as_tensor(x, dtype=torch.float64)
    b = torch.as_tensor(y, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(
            f"x and y must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[0] < 2:
        raise ValueError(f"correlation needs at least 2 rows, got {a.shape[0]}")
    a = a - a.mean(dim=0)
    b = b - b.mean(dim=0)
    denom = (a.square().sum(dim=0) * b.square().sum(dim=0)).sqrt()
    result = (a * b).sum(dim=0) / denom
    return torch.where(denom > 0, result, torch.full_like(result, float("nan")))


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation of each column: ``(n, q)``, ``(n, q)`` -> ``(q,)`` float64.

    Pearson correlation of the average ranks (ties share a rank).
    """
    a = torch.as_tensor(x, dtype=torch.float64)
    b = torch.as_tensor(y, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(
            f"x and y must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return pearson(rank(a), rank(b))


def align_scores(
    scores: AttributionScore | torch.Tensor,
    train_ids: Sequence[str],
    test_ids: Sequence[str] | None = None,
    *,
    polarity: int = 1,
) -> torch.Tensor:
    """Helpfulness ``(len(train_ids), n_test)`` float64 in the given train/test order.

    For an :class:`AttributionScore`, each training sample's rows (one per
    step, or per step and token) are summed, rows are picked by ``train_ids``
    and columns by ``test_ids`` (``None``: the score's column order), and the
    result is multiplied by the score's polarity. A plain tensor
    ``(n_train, n_test)`` is taken to be in ``train_ids`` / query order already
    and is multiplied by ``polarity``.

    Raises:
        KeyError: a training or test id is not in the score (the error names it).
        ValueError: a plain tensor's row count differs from ``len(train_ids)``,
            or ``polarity`` is not ``+1``/``-1``.
    """
    ids = [str(h) for h in train_ids]
    if isinstance(scores, AttributionScore):
        missing = [h for h in ids if h not in scores.train_index]
        if missing:
            raise KeyError(
                f"{len(missing)} training id(s) have no score, e.g. {missing[:3]}; score every "
                "training sample you evaluate, or pass only the scored ids"
            )
        matrix = scores.query(ids, None if test_ids is None else [str(t) for t in test_ids])
        return matrix.detach().to("cpu", torch.float64) * scores.polarity
    sign = check_polarity(polarity)
    matrix = torch.as_tensor(scores).detach().to("cpu", torch.float64)
    if matrix.dim() != 2 or matrix.shape[0] != len(ids):
        raise ValueError(
            f"a plain score tensor must be (n_train={len(ids)}, n_test), got {tuple(matrix.shape)}"
        )
    if test_ids is not None and len(test_ids) != matrix.shape[1]:
        raise ValueError(
            f"test_ids has {len(test_ids)} entries but the score tensor has "
            f"{matrix.shape[1]} columns"
        )
    return matrix * sign


def recall_at_k(
    scores: AttributionScore | torch.Tensor,
    planted: torch.Tensor | Sequence[Sequence[int]],
    k: int,
    *,
    train_ids: Sequence[str] | None = None,
    test_ids: Sequence[str] | None = None,
    polarity: int = 1,
) -> Interval:
    """Fraction of each query's planted training samples found among its ``k`` most helpful.

    Args:
        scores: an :class:`AttributionScore` (then ``train_ids`` gives the row
            order, default its :attr:`~AttributionScore.train_ids`) or a plain
            ``(n_train, n_test)`` tensor (rows in training order).
        planted: a boolean mask ``(n_train, n_test)``, or one list of planted
            row indices per query.
        k: how many top samples to look at per query (``>= 1``).
        train_ids, test_ids, polarity: as in :func:`align_scores`.

    Returns:
        An :class:`Interval` of per-query recall ``|top-k ∩ planted| / |planted|``
        (NaN for a query with nothing planted).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if train_ids is None:
        if isinstance(scores, AttributionScore):
            train_ids = scores.train_ids
        else:
            train_ids = [str(i) for i in range(torch.as_tensor(scores).shape[0])]
    helpful = align_scores(scores, train_ids, test_ids, polarity=polarity)
    n_train, n_test = helpful.shape
    if isinstance(planted, torch.Tensor):
        mask = planted.to(torch.bool)
        if tuple(mask.shape) != (n_train, n_test):
            raise ValueError(
                f"planted mask must be (n_train, n_test) = {(n_train, n_test)}, "
                f"got {tuple(mask.shape)}"
            )
    else:
        if len(planted) != n_test:
            raise ValueError(f"planted has {len(planted)} lists but there are {n_test} queries")
        mask = torch.zeros(n_train, n_test, dtype=torch.bool)
        for j, rows in enumerate(planted):
            rows = [int(r) for r in rows]
            bad = [r for r in rows if not 0 <= r < n_train]
            if bad:
                raise ValueError(f"planted rows of query {j} must be in [0, {n_train}), got {bad}")
            mask[rows, j] = True
    top = torch.sort(-helpful, dim=0, stable=True).indices[: min(k, n_train)]
    hits = mask.gather(0, top).sum(dim=0).to(torch.float64)
    total = mask.sum(dim=0).to(torch.float64)
    recall = torch.where(total > 0, hits / total.clamp_min(1), torch.full_like(hits, float("nan")))
    return mean_ci(recall)

"""Complete scores from a sharded live run: every rank's rows, in training-set order.

Under a process group the live path shards the training set without padding
(`gradient.stream.inputs._UnpaddedShardBatches`): rank ``r`` of ``W`` streams
the samples at sampler positions ``r, r + W, r + 2W, ...`` (dataset positions
without shuffling), each sample on exactly one rank. :func:`gather_results`
all-gathers every rank's per-checkpoint rows and interleaves them back into
that order, so the rows equal the single-process run's: the same row order
(dataset order for the frozen probes), the same ids, steps and token
positions. Every rank returns the same complete result.

A row *group* is one sample's rows of one pass: one row at instance
granularity, ``T`` consecutive rows with token positions ``0 .. T-1`` at
token granularity (the scoring engine's layout). Rank ``r``'s ``j``-th group
sits at sampler position ``r + (j mod n_r) · W``, where ``n_r`` is the size of
its shard (the modulus restarts the count at each epoch of an updating run);
groups are sorted by ``(step, position, rank, j)``.
"""

from __future__ import annotations

import warnings

import torch

from dattri_llm.attribution.scoring import ScoreResult
from dattri_llm.utils.distributed import all_gather_objects, dist_rank, dist_world_size

__all__ = ["gather_results"]


def gather_results(
    results: list[ScoreResult],
    *,
    num_samples: int,
    world_size: int,
    rank: int,
    unique: bool = False,
) -> list[ScoreResult]:
    """Every rank's rows of each result, merged in training-set order (a collective).

    ``results`` are this rank's per-checkpoint results of a sharded live run
    over a training set of ``num_samples`` samples; ``world_size`` and
    ``rank`` are the ones its sampler used (``args.world_size``,
    ``args.process_index``). Nothing to do (``results`` returned) when
    ``world_size`` is 1. When every rank holds the same rows (each scored a
    shared store whole), they are returned unchanged: merging would count
    every row ``world_size`` times. ``unique`` (results scored from stores,
    which hold each ``(sample, step)`` once): a sample that two ranks hold at
    the same step keeps one group of rows, at its last place in training-set
    order, as one store written by a single process keeps its last save.

    A sampler sharded over ``world_size`` ranks without a process group of
    that size and this rank cannot be gathered: ``UserWarning`` (the result
    holds this rank's shard only) and ``results`` unchanged.

    Raises:
        ValueError: the ranks scored different numbers of checkpoints or
            different test samples (raised on every rank).
    """
    if world_size <= 1:
        return results
    if dist_world_size() != world_size or dist_rank() != rank:
        warnings.warn(
            f"the training set was sharded over world_size={world_size} ranks (WORLD_SIZE), "
            f"but this process is rank {dist_rank()} of a process group of "
            f"{dist_world_size()}; the score holds this rank's shard only. Call "
            "torch.distributed.init_process_group on every rank before attribute().",
            UserWarning,
            stacklevel=3,
        )
        return results
    gathered: list[list[ScoreResult]] = all_gather_objects(  # type: ignore[assignment]
        [_on_cpu(result) for result in results]
    )
    counts = [len(per_rank) for per_rank in gathered]
    if len(set(counts)) != 1:
        raise ValueError(f"the ranks scored different numbers of checkpoints: {counts}")
    merged = []
    for index in range(len(results)):
        per_rank = [ranks_results[index] for ranks_results in gathered]
        if all(_same_rows(other, per_rank[0]) for other in per_rank[1:]):
            merged.append(results[index])
        else:
            merged.append(_merge(per_rank, num_samples, unique))
    return merged


def _on_cpu(result: ScoreResult) -> ScoreResult:
    scores, *rest = result
    return (scores.detach().cpu(), *rest)  # type: ignore[return-value]


def _same_rows(a: ScoreResult, b: ScoreResult) -> bool:
    """Whether two results hold the same rows (ids, steps, token positions) and columns."""
    return a[1] == b[1] and a[2] == b[2] and a[4] == b[4] and a[3] == b[3]


def _groups(row_tokens: list[int] | None, num_rows: int) -> list[tuple[int, int]]:
    """``(first row, end row)`` of each sample's rows (token rows start at position 0)."""
    if row_tokens is None:
        return [(row, row + 1) for row in range(num_rows)]
    starts = [row for row, position in enumerate(row_tokens) if position == 0]
    return list(zip(starts, [*starts[1:], num_rows]))


def _aligned_scores(result: ScoreResult, test_ids: list[str], rank: int) -> torch.Tensor:
    """``result``'s scores with columns in ``test_ids`` order (``ValueError`` if they differ)."""
    scores, _, _, ids, _ = result
    if ids == test_ids:
        return scores
    if set(ids) != set(test_ids):
        raise ValueError(
            f"rank {rank} scored other test samples than rank 0 ({len(ids)} vs {len(test_ids)} "
            "columns); every rank must get the same test_dataset"
        )
    position = {h: i for i, h in enumerate(ids)}
    return scores[:, [position[h] for h in test_ids]]


def _merge(per_rank: list[ScoreResult], num_samples: int, unique: bool) -> ScoreResult:
    """The ranks' rows of one result in training-set order (see the module docstring)."""
    world = len(per_rank)
    test_ids = list(per_rank[0][3])
    token_level = per_rank[0][4] is not None
    keyed: list[tuple[tuple[int, int, int, int], int, int, int]] = []
    for rank, (scores, _, steps, _, tokens) in enumerate(per_rank):
        shard = max(len(range(rank, num_samples, world)), 1)
        for j, (start, end) in enumerate(_groups(tokens, scores.shape[0])):
            key = (steps[start], rank + (j % shard) * world, rank, j)
            keyed.append((key, rank, start, end))
    keyed.sort(key=lambda item: item[0])
    if unique:  # one group per (sample, step): the last one in training-set order
        last = {(per_rank[r][1][start], key[0]): i for i, (key, r, start, _) in enumerate(keyed)}
        keyed = [keyed[i] for i in sorted(last.values())]
    matrices = [_aligned_scores(result, test_ids, rank) for rank, result in enumerate(per_rank)]
    offsets = [0]
    for matrix in matrices:
        offsets.append(offsets[-1] + matrix.shape[0])
    picks = [(rank, row) for _, rank, start, end in keyed for row in range(start, end)]
    order = torch.tensor([offsets[rank] + row for rank, row in picks], dtype=torch.long)
    scores = torch.cat(matrices).index_select(0, order)
    row_ids = [per_rank[rank][1][row] for rank, row in picks]
    row_steps = [per_rank[rank][2][row] for rank, row in picks]
    row_tokens = [per_rank[rank][4][row] for rank, row in picks] if token_level else None
    return scores, row_ids, row_steps, test_ids, row_tokens

"""Exact streaming top-k: each query's ``k`` best training samples without the ``N × M`` matrix.

The scoring engine (:func:`~dattri_llm.attribution.scoring.stream_scores`)
hands each train batch's ``(rows, M)`` scores to a :class:`RunningTopK`, which
merges them into a running ``(k, M)`` top-k (values and row positions), a
slice of rows at a time, and drops them: peak memory is one batch plus
``k·M`` and one slice's sort (and 8 bytes per training row for the
repeated-id check). The order is exactly that of
:meth:`AttributionScore.top_k` on the full matrix: keys ``-sign · score``
(``sign = polarity``, negated for opponents) sorted ascending and stably, so
ties keep training-row order and NaN ranks last. A trajectory method's sweep
emits one row per (sample, step); :class:`SampleSums` adds a sample's rows
before the top-k ranks it.

:func:`top_k_live` and :func:`top_k_stores` run an attributor's own
``attribute`` / ``attribute_from_cache`` (its options, fits and keyword
checks) with the running top-k in place of the dense matrix
(``BaseInnerProductAttributor.top_k`` / ``top_k_from_cache``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.scoring import ScoredBatch, stream_pass
from dattri_llm.attribution.sources import (
    _require_records,
    normalize_layer_names,
    open_store_directory,
)

__all__ = [
    "RunningTopK",
    "SampleSums",
    "TopK",
    "TopKCalls",
    "check_k",
    "top_k_live",
    "top_k_stores",
]

# Scores merged per step of RunningTopK.add: its float64 keys, sort and row numbers then take a
# few MiB, not several times the batch's own (rows, M) float32 scores.
_MERGE_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class TopK:
    """Each query's ``k`` most helpful (or most harmful) training samples, best first.

    Attributes:
        test_ids: the queries, in score-column order (first appearance).
        train_ids: ``train_ids[j]`` lists query ``j``'s training ids, best first
            (``min(k, N)`` of them).
        scores: ``(len(test_ids), min(k, N))`` float64, the scores as the
            method defines them (not multiplied by ``polarity``);
            ``scores[j, r]`` belongs to ``train_ids[j][r]``.
        polarity: ``+1`` when a larger score is more helpful, ``-1`` when a
            more negative one is (as on :class:`AttributionScore`).
        proponents: ``True`` for the most helpful samples, ``False`` for the
            most harmful.
        algorithm, algorithm_meta, layer_name: as the method's
            :class:`AttributionScore` would record them.
    """

    test_ids: list[str]
    train_ids: list[list[str]]
    scores: torch.Tensor
    polarity: int
    proponents: bool
    algorithm: str = ""
    algorithm_meta: dict[str, Any] = field(default_factory=dict)
    layer_name: list[str] | None = None

    @property
    def k(self) -> int:
        """Samples per query in the result (``min(k, N)``)."""
        return self.scores.shape[1]

    def as_dict(self) -> dict[str, list[tuple[str, float]]]:
        """``{test_id: [(train_id, score), ...]}``, the form of :meth:`AttributionScore.top_k`."""
        return {
            name: list(zip(ids, self.scores[j].tolist()))
            for j, (name, ids) in enumerate(zip(self.test_ids, self.train_ids))
        }


def check_k(k: object) -> int:
    """``k`` as an ``int`` (``ValueError`` unless it is an ``int >= 1``)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return k


class RunningTopK:
    """A score sink keeping, per query, the ``k`` best rows seen so far (exact, stable).

    ``sign`` is ``polarity`` for proponents and ``-polarity`` for opponents;
    rows rank by ``-sign · score`` ascending. Each :meth:`add` sorts the
    running ``(k, M)`` candidates stacked over the batch's rows with a stable
    sort: the running rows come first and precede the batch's rows in
    training order, so ties keep training-row order as a sort of the whole
    column does. A training id seen in two rows (several steps or
    checkpoints, which :meth:`AttributionScore.top_k` would sum) raises
    ``NotImplementedError`` at :meth:`result`; token rows raise at once.
    """

    def __init__(self, k: int, sign: int) -> None:
        self.k = check_k(k)
        self.sign = int(sign)
        self.test_ids: list[str] = []
        self._values = torch.zeros(0, 0, dtype=torch.float64)
        self._rows = torch.zeros(0, 0, dtype=torch.long)
        self._ids: dict[int, str] = {}
        self._hashes: list[torch.Tensor] = []
        self._num_rows = 0

    def start(self, test_ids: list[str]) -> None:
        """Fix the columns; forget any earlier pass."""
        self.test_ids = list(test_ids)
        num_test = len(self.test_ids)
        self._values = torch.zeros(0, num_test, dtype=torch.float64)
        self._rows = torch.zeros(0, num_test, dtype=torch.long)
        self._ids, self._hashes, self._num_rows = {}, [], 0

    def add(self, batch: ScoredBatch, positions: torch.Tensor | None = None) -> None:
        """Merge one train batch's ``(rows, M)`` scores into the running top-k.

        ``positions`` (``(rows,)`` int64, distinct over the pass): each row's
        place in the training order when rows arrive out of it (summed samples
        released as they complete); ``None``: rows follow the earlier ones.
        The batch is merged a slice of rows at a time (``max(k, 2**18 // M)``
        rows): merging the slices one after the other ranks exactly as merging
        the batch at once (ties go by position), while the float64 keys and
        the sort hold one slice.
        """
        if batch.row_tokens is not None:
            raise NotImplementedError(
                "streaming top-k ranks training samples (attribution_granularity='instance'); "
                "for token rows use attribute(..., attribution_granularity='token') and "
                "AttributionScore.top_k"
            )
        count, num_test = batch.scores.shape
        if count == 0:
            return
        if positions is None:
            positions = torch.arange(self._num_rows, self._num_rows + count)
        self._num_rows += count
        self._hashes.append(torch.tensor([hash(h) for h in batch.row_ids], dtype=torch.int64))
        self._ids.update(zip(positions.tolist(), batch.row_ids))
        step = max(self.k, _MERGE_ELEMENTS // max(num_test, 1))
        for start in range(0, count, step):
            self._merge(batch.scores[start : start + step], positions[start : start + step])
        if len(self._ids) > 4 * self._rows.numel() + 1024:  # amortized: forget dropped rows
            kept = set(self._rows.unique().tolist())
            self._ids = {row: h for row, h in self._ids.items() if row in kept}

    def _merge(self, scores: torch.Tensor, positions: torch.Tensor) -> None:
        """Merge ``(rows, M)`` scores of the training rows at ``positions``."""
        count, num_test = scores.shape
        # "+ 0.0" as AttributionScore.agnostic_matrix's sum into zeros: -0.0 becomes 0.0
        values = torch.cat([self._values, scores.to(torch.float64) + 0.0])
        rows = torch.cat([self._rows, positions.unsqueeze(1).expand(count, num_test)])
        out_of_order = bool((positions[1:] < positions[:-1]).any()) or (
            self._rows.numel() > 0 and int(positions.min()) < int(self._rows.max())
        )
        if out_of_order:  # order by position first, so the stable sort below keeps it in ties
            by_row = torch.sort(rows, dim=0, stable=True).indices
            values, rows = values.gather(0, by_row), rows.gather(0, by_row)
        order = torch.sort(-self.sign * values + 0.0, dim=0, stable=True).indices[: self.k]
        self._values = values.gather(0, order)
        self._rows = rows.gather(0, order)

    def _check_distinct(self) -> None:
        """``NotImplementedError`` when a training id filled more than one row."""
        if not self._hashes:
            return
        hashes = torch.sort(torch.cat(self._hashes)).values
        if bool((hashes[1:] == hashes[:-1]).any()):
            raise NotImplementedError(
                "a training id appears in more than one row (several steps or checkpoints); "
                "ranking sums a sample's rows, which one streaming pass over rows cannot do "
                "exactly. Score one step per call (selected_training_steps=[step]) or use "
                "attribute_from_cache(...).top_k(k)"
            )

    def result(self, polarity: int, proponents: bool, score: AttributionScore | None) -> TopK:
        """The :class:`TopK` of the pass (``score``: the stand-in carrying the provenance)."""
        self._check_distinct()
        rows = self._rows.T.tolist()
        return TopK(
            test_ids=list(self.test_ids),
            train_ids=[[self._ids[r] for r in column] for column in rows],
            scores=self._values.T.contiguous(),
            polarity=polarity,
            proponents=proponents,
            algorithm=score.algorithm if score is not None else "",
            algorithm_meta=dict(score.algorithm_meta) if score is not None else {},
            layer_name=score.layer_name if score is not None else None,
        )


class SampleSums:
    """Sums each training id's rows (one per step) before a :class:`RunningTopK` ranks it.

    A trajectory method scores a sample once per step that holds it, and its
    full score (:meth:`AttributionScore.top_k`) ranks the sum of those rows.
    Each id's sum is built in float32 in arrival order (as
    ``agnostic_matrix`` adds its rows into zeros) and handed to the top-k when
    its last row has arrived, ranked at its first row's place (ties keep the
    full score's order). ``remaining`` (``{id: rows to come}`` of the ids with
    more than one row, from the store's index; an id missing from it has one)
    says when that is; with ``remaining=None`` (a replayed run, whose rows are
    known only as they are recomputed) every id is held until :meth:`finish`.
    Memory: one ``(M,)`` sum per id seen but not complete (none when every
    sample is in one step).
    """

    def __init__(self, sink: RunningTopK, remaining: dict[str, int] | None) -> None:
        self.sink = sink
        self.remaining = None if remaining is None else dict(remaining)
        self.test_ids: list[str] | None = None
        self._open: dict[str, tuple[int, torch.Tensor]] = {}
        self._next = 0

    def start(self, test_ids: list[str]) -> None:
        """Fix the columns (later calls, one per scoring pass, must name the same ones)."""
        if self.test_ids is None:
            self.test_ids = list(test_ids)
            self.sink.start(self.test_ids)
        elif list(test_ids) != self.test_ids:
            raise RuntimeError("the passes of one top-k call scored different queries")

    def add(self, batch: ScoredBatch) -> None:
        """Add one batch's rows to their samples' sums; rank the samples now complete."""
        if batch.row_tokens is not None:
            self.sink.add(batch)  # refuses token rows
        done: list[tuple[int, str, torch.Tensor]] = []
        for row, sample in enumerate(batch.row_ids):
            left = None if self.remaining is None else self.remaining.get(sample, 1)
            position, total = self._open.pop(sample, (None, None))
            if position is None:
                position, self._next = self._next, self._next + 1
                total = torch.zeros(batch.scores.shape[1], dtype=torch.float32)
            total += batch.scores[row]
            if left is not None:  # a count reaching 0 is dropped: the dict shrinks as ids end
                left -= 1
                if left > 0:
                    self.remaining[sample] = left
                else:
                    self.remaining.pop(sample, None)
            if left is not None and left <= 0:
                done.append((position, sample, total))
            else:
                self._open[sample] = (position, total)
        self._release(done)

    def finish(self) -> None:
        """Rank every sample still held (the pass is over, so each is complete)."""
        held = [(position, sample, total) for sample, (position, total) in self._open.items()]
        self._open = {}
        self._release(held)

    def _release(self, done: list[tuple[int, str, torch.Tensor]]) -> None:
        """Hand complete samples to the top-k at their first rows' places."""
        if not done:
            return
        positions = torch.tensor([position for position, _, _ in done], dtype=torch.long)
        scores = torch.stack([total for _, _, total in done])
        ids = [sample for _, sample, _ in done]
        self.sink.add(ScoredBatch(scores, ids, [0] * len(ids), None), positions)


class _CheckpointSum:
    """The rows of checkpoint 0's pass summed with the same rows of the other checkpoints.

    Each other checkpoint's pass (``open_passes()``, opened once checkpoint
    0's call has configured the attributor) is read in lockstep: its batch
    must hold the same training ids in the same order; its columns are
    aligned to checkpoint 0's. Rows add in checkpoint order in float32, as
    ``AttributionScore.agnostic_matrix`` sums the concatenated rows.
    """

    def __init__(self, sink: RunningTopK, open_passes: Callable[[], list[Any]]) -> None:
        self.sink = sink
        self.open_passes = open_passes
        self._passes: list[tuple[list[int], Iterator[ScoredBatch]]] = []

    def start(self, test_ids: list[str]) -> None:
        """Open the other checkpoints' passes; align their columns to ``test_ids``."""
        self._passes = []
        for index, (ids, batches) in enumerate(self.open_passes(), start=1):
            if set(ids) != set(test_ids):
                raise ValueError(
                    f"checkpoint {index}'s test store holds other queries than checkpoint 0's; "
                    "every checkpoint needs the same test samples"
                )
            position = {h: col for col, h in enumerate(ids)}
            self._passes.append(([position[h] for h in test_ids], batches))
        self.sink.start(test_ids)

    def add(self, batch: ScoredBatch) -> None:
        """Sum ``batch`` with the next batch of every other checkpoint; rank the sum."""
        total = batch.scores
        for index, (columns, batches) in enumerate(self._passes, start=1):
            other = next(batches, None)
            if other is None or other.row_ids != batch.row_ids:
                raise ValueError(
                    f"checkpoint {index}'s training store does not hold the same samples in the "
                    "same order and blocks as checkpoint 0's (as cache() writes them); "
                    "streaming top-k sums a sample's checkpoints row by row"
                )
            total = total + other.scores[:, columns]
        self.sink.add(ScoredBatch(total, batch.row_ids, batch.row_steps, batch.row_tokens))

    def finish(self) -> None:
        """``ValueError`` when another checkpoint holds more rows than checkpoint 0."""
        for index, (_, batches) in enumerate(self._passes, start=1):
            if next(batches, None) is not None:
                raise ValueError(
                    f"checkpoint {index}'s training store holds more samples than checkpoint "
                    "0's; every checkpoint needs the same training samples"
                )


@contextlib.contextmanager
def _sinking(attributor: Any, sink: RunningTopK | _CheckpointSum) -> Iterator[None]:
    """Route the attributor's scoring passes into ``sink`` (nothing is saved meanwhile)."""
    attributor._score_sink = sink
    try:
        yield
    finally:
        attributor._score_sink = None


def _check_call(attributor: Any, method: str, attribution_kwargs: dict[str, Any]) -> None:
    """Refuse methods and options the streaming top-k cannot rank exactly."""
    if not getattr(attributor, "streaming_top_k", False):
        raise NotImplementedError(
            f"{type(attributor).__name__}.{method} is not available: its scores are not a "
            "single pass of inner products over the training rows; use attribute_from_cache"
            "(...).top_k(k) (AttributionScore.top_k)"
        )
    granularity = attribution_kwargs.get("attribution_granularity", "instance")
    if granularity != "instance":
        raise ValueError(
            f"{method} ranks training samples: attribution_granularity must be 'instance', "
            f"got {granularity!r}; for token rows use attribute(..., attribution_granularity="
            "'token') and AttributionScore.top_k"
        )


def _run(
    attributor: Any,
    k: int,
    proponents: bool,
    call: Any,
    *args: Any,
    open_passes: Callable[[], list[Any]] | None = None,
    **kwargs: Any,
) -> TopK:
    """``call(*args, **kwargs)`` with a running top-k in place of the matrix; its result.

    ``open_passes`` (several checkpoints) opens the other checkpoints' passes,
    summed row by row into the first's (:class:`_CheckpointSum`).
    """
    check_k(k)
    if not isinstance(proponents, bool):
        raise TypeError(f"proponents must be True or False, got {proponents!r}")
    polarity = attributor.polarity
    sink = RunningTopK(k, polarity if proponents else -polarity)
    summed = None if open_passes is None else _CheckpointSum(sink, open_passes)
    with _sinking(attributor, sink if summed is None else summed):
        stand_in = call(*args, **kwargs)
        if summed is not None:
            summed.finish()
    return sink.result(polarity, proponents, stand_in)


def _as_list(source: object) -> list[object] | None:
    """``source`` as a list of per-checkpoint stores, or ``None`` for a single one."""
    return list(source) if isinstance(source, (list, tuple)) else None


def _other_checkpoints(
    attributor: Any,
    trains: list[object],
    tests: list[object],
    attribution_kwargs: dict[str, Any],
) -> Callable[[], list[Any]]:
    """Opens checkpoints 1.. passes over the sources ``attribute_from_cache`` would read."""
    if not getattr(attributor, "checkpoint_ensemble", False):
        raise ValueError(
            f"{type(attributor).__name__} scores one checkpoint; pass one train store and one "
            "test store (lists of stores are TracIn's checkpoint ensemble)"
        )
    if len(trains) != len(tests) or not trains:
        raise ValueError(
            "train_source and test_source must list one store per checkpoint, the same number "
            f"on both sides; got {len(trains)} train and {len(tests)} test stores"
        )
    steps = attribution_kwargs.get("selected_training_steps")
    steps = None if steps is None else sorted(set(steps))
    layers = normalize_layer_names(attribution_kwargs.get("layer_name"))
    for train, test in zip(trains[1:], tests[1:]):
        _require_records(attributor.resolve_store(train), "training")
        _require_records(attributor.resolve_store(test), "test")

    def open_passes() -> list[Any]:
        return [
            stream_pass(
                attributor,
                attributor.load_train_rep(train, steps=steps, layer_name=layers),
                attributor.load_test_rep(test, layer_name=layers),
                loop_over_test=bool(attribution_kwargs.get("loop_over_test", False)),
                transform_test=None,
                attribution_granularity="instance",
            )
            for train, test in zip(trains[1:], tests[1:])
        ]

    return open_passes


def top_k_stores(
    attributor: Any,
    train_source: object,
    test_source: object,
    k: int,
    *,
    proponents: bool,
    attribution_kwargs: dict[str, Any],
) -> TopK:
    """``attributor.attribute_from_cache(train_source, test_source, **kwargs)`` as a top-k.

    Lists of stores (one train and one test store per checkpoint, as
    ``cache()`` returns them) are TracIn's checkpoint ensemble: a sample's
    score is the sum of its rows over the checkpoints, read in lockstep.
    """
    _check_call(attributor, "top_k_from_cache", attribution_kwargs)
    trains, tests = _as_list(train_source), _as_list(test_source)
    if trains is None and tests is None:
        return _run(
            attributor,
            k,
            proponents,
            attributor.attribute_from_cache,
            train_source,
            test_source,
            **attribution_kwargs,
        )
    trains = [open_store_directory(s) for s in ([train_source] if trains is None else trains)]
    tests = [open_store_directory(s) for s in ([test_source] if tests is None else tests)]
    open_passes = _other_checkpoints(attributor, trains, tests, attribution_kwargs)
    result = _run(
        attributor,
        k,
        proponents,
        attributor.attribute_from_cache,
        trains[0],
        tests[0],
        open_passes=open_passes,
        **attribution_kwargs,
    )
    meta = {**result.algorithm_meta, "n_checkpoints": len(trains)}
    return dataclasses.replace(result, algorithm_meta=meta)


def top_k_live(
    attributor: Any,
    test_dataset: object,
    k: int,
    *,
    train_source: object,
    proponents: bool,
    attribution_kwargs: dict[str, Any],
) -> TopK:
    """``attributor.attribute(train_source, test_dataset, **kwargs)`` as a top-k (one checkpoint).

    Several checkpoints (TracIn's ensemble) sum a sample's rows across passes
    with the model reloaded between them, which one running top-k over rows
    cannot rank exactly: ``NotImplementedError``.
    """
    _check_call(attributor, "top_k", attribution_kwargs)
    if attributor.args.world_size > 1:
        raise NotImplementedError(
            f"top_k ranks one process's rows, and this run is sharded over "
            f"{attributor.args.world_size} ranks (WORLD_SIZE), so each rank would rank only its "
            "shard. Use attribute(...) (it gathers every rank's rows) and AttributionScore.top_k, "
            "or cache() the stores and call top_k_from_cache on the store root, which every rank "
            "reads whole"
        )
    with warnings.catch_warnings():  # the attribute call itself warns about ignored ones
        warnings.simplefilter("ignore")
        checkpoints = list(attributor.checkpoints())
    if len(checkpoints) > 1 and not attribution_kwargs.get("enable_update", False):
        raise NotImplementedError(
            f"top_k scores one checkpoint live; the task has {len(checkpoints)} and TracIn "
            "sums a sample's rows over them. Collect each checkpoint into stores (cache()) and "
            "call top_k_from_cache with the lists of train and test stores"
        )
    return _run(
        attributor,
        k,
        proponents,
        attributor.attribute,
        train_source,
        test_dataset,
        **attribution_kwargs,
    )


class TopKCalls:
    """The streaming top-k entry points of ``BaseInnerProductAttributor`` (a mixin).

    ``streaming_top_k``: whether the method's score can be ranked as its rows
    stream past (``False`` for LESS, which refuses; the trajectory methods
    rank over their sweep). ``checkpoint_ensemble``: whether a sample's rows
    over several checkpoints sum (TracIn), so ``top_k_from_cache`` takes lists
    of per-checkpoint stores.
    """

    streaming_top_k: ClassVar[bool] = True
    checkpoint_ensemble: ClassVar[bool] = False

    def top_k(
        self,
        test_dataset: object,
        k: int,
        *,
        train_source: object,
        proponents: bool = True,
        **attribution_kwargs: Any,
    ) -> TopK:
        """Each query's ``k`` best training samples, live, without the ``N × M`` matrix.

        Runs ``attribute(train_source, test_dataset, **attribution_kwargs)``
        (``train_source`` is the training dataset; the keywords are
        ``attribute``'s, checked the same way) with a running top-k in place
        of the matrix. Equals ``attribute(...).top_k(k, proponents=...)``,
        ties included; nothing is saved. One checkpoint, instance granularity.

        Raises:
            ValueError: ``k`` is not an ``int >= 1``; token granularity.
            NotImplementedError: several checkpoints (use
                :meth:`top_k_from_cache` over the stores of ``cache()``); a
                training set sharded over several ranks (``WORLD_SIZE > 1``); a
                training id in more than one row (not a trajectory method); LESS.
        """
        return top_k_live(
            self,
            test_dataset,
            k,
            train_source=train_source,
            proponents=proponents,
            attribution_kwargs=attribution_kwargs,
        )

    def top_k_from_cache(
        self,
        train_source: object,
        test_source: object,
        k: int,
        *,
        proponents: bool = True,
        **attribution_kwargs: Any,
    ) -> TopK:
        """Each query's ``k`` best training samples from stores, reading the train store once.

        Runs ``attribute_from_cache(train_source, test_source,
        **attribution_kwargs)`` (its keywords, checked the same way) with a
        running top-k per query in place of the matrix: peak memory one train
        batch plus ``k × num_test``. Equals ``attribute_from_cache(...).top_k(k,
        proponents=...)``, ties included; nothing is saved. For TracIn,
        ``train_source`` and ``test_source`` may be lists with one store per
        checkpoint (as ``cache()`` returns them): a sample's score is the sum
        over the checkpoints, as ``attribute()`` ranks it.

        Raises:
            ValueError: ``k`` is not an ``int >= 1``; token granularity; an
                empty training or test store; checkpoint stores that differ in
                samples, order or blocks.
            NotImplementedError: a training id in more than one row (several
                steps of one store; the trajectory methods sum them); LESS;
                ``loop_over_test`` for a trajectory method.
        """
        return top_k_stores(
            self,
            train_source,
            test_source,
            k,
            proponents=proponents,
            attribution_kwargs=attribution_kwargs,
        )

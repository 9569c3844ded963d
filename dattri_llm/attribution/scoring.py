"""The scoring engine: every train batch of one gradient source against every test block of another.

:func:`score_sources` is the block loop ``Σ_layers <T_train(g_i), T_test(q_j)>``
over two sources (iterables of ``(step, Gradient, ids)``) with caller-supplied
transforms and inner products. Scores are float32 on CPU, ``(num_train_rows,
num_test)``; columns are the distinct test identifiers in first-appearance
order. :func:`stream_scores` is the same loop handing out one
:class:`ScoredBatch` per train batch (which :func:`score_sources`
concatenates and a running top-k ranks without the full matrix).
:func:`score_pass` runs one pass for an attributor: its hooks
(``prepare_scoring``, the transforms, the inner products, the progress bar)
around the loop, with the checks of :mod:`dattri_llm.attribution.checks`;
:func:`stream_pass` is that pass batch by batch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from dattri_llm.attribution.checks import _ScoringChecks
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.gradient.stream.rebatch import rebatch_blocks
from dattri_llm.utils.cache import CacheBudget, TensorCache

if TYPE_CHECKING:
    from dattri_llm.gradient.stream.source import GradientSource

ATTRIBUTION_GRANULARITIES = ("instance", "token")

ScoreResult = tuple[torch.Tensor, list[str], list[int], list[str], "list[int] | None"]


# ---------------------------------------------------------------------------- scoring loop
def check_granularity(value: str, name: str = "attribution_granularity") -> None:
    """Raise ``ValueError`` unless ``value`` is in ``ATTRIBUTION_GRANULARITIES``."""
    if value not in ATTRIBUTION_GRANULARITIES:
        raise ValueError(f"{name} must be one of {ATTRIBUTION_GRANULARITIES}, got {value!r}")


def _require_reusable(test_source: object) -> None:
    """Raise ``ValueError`` unless ``test_source.reusable`` is truthy (``loop_over_test``)."""
    if not getattr(test_source, "reusable", False):
        raise ValueError(
            "loop_over_test re-streams the test source for every train block, but the test "
            f"source {type(test_source).__name__} is not reusable; pass a reusable source "
            "(a store, DiskGradientSource or GradientStreamer) or loop_over_test=False"
        )


def _identity(block: Gradient) -> Gradient:
    """The default transform."""
    return block


def _to_device(block: Gradient, device: torch.device) -> Gradient:
    """``block`` on ``device`` (unchanged when already there)."""
    return block if block.device == device else block.to(device=device)


class _Columns:
    """Score columns: the distinct test identifiers (``str``) in first-appearance order."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._index: dict[str, int] = {}

    def assign(self, ids: Iterable[object]) -> list[int]:
        """Column of each identifier, adding the ones not seen before."""
        ids = [str(h) for h in ids]
        for h in ids:
            if h not in self._index:
                self._index[h] = len(self.ids)
                self.ids.append(h)
        return self.lookup(ids)

    def lookup(self, ids: Iterable[object]) -> list[int]:
        """Column of each identifier; ``KeyError`` for one the first pass did not yield."""
        ids = [str(h) for h in ids]
        unseen = [h for h in ids if h not in self._index]
        if unseen:
            raise KeyError(
                f"test ids {unseen} were not yielded by the first pass over the test source; "
                "loop_over_test needs a test source that yields the same samples every pass"
            )
        return [self._index[h] for h in ids]


class _TestBlock(NamedTuple):
    """A transformed test block and the score column of each of its rows."""

    rep: Gradient
    cols: list[int]


def _first_test_pass(
    test_source: Iterable[tuple[int, Gradient, list[str]]],
    columns: _Columns,
    device: torch.device,
    transform_test: Callable[[Gradient], Gradient],
    *,
    hold: bool,
) -> list[_TestBlock]:
    """Assign the columns; with ``hold``, move and transform each block and keep it."""
    held = []
    for _step, block, ids in test_source:
        cols = columns.assign(ids)
        if hold:
            held.append(_TestBlock(transform_test(_to_device(block, device)), cols))
        del block
    return held


def _has_broadcast_layer(rep: Gradient) -> bool:
    """Whether a dense layer of ``rep`` holds one row shared by a block of several samples."""
    batches = [
        value.shape[0]
        for name, value in rep.data.items()
        if isinstance(value, torch.Tensor) and rep.layer_types[name] != PARAM_GRAD_TYPES
    ]
    return 1 in batches and max(batches) > 1


def _taken(blocks: list[_TestBlock]) -> Iterator[_TestBlock]:
    """The items of ``blocks`` in order, each removed from the list as it is handed out."""
    blocks.reverse()
    while blocks:
        yield blocks.pop()


def _merge_dense_blocks(blocks: list[_TestBlock], num_columns: int) -> list[_TestBlock]:
    """Concatenate each run of consecutive dense test blocks into one (``rebatch_blocks``).

    Re-batching to ``num_columns`` rows (as many as a run of distinct samples can
    hold) merges a run into one block with its column lists concatenated;
    factorized blocks break a run and stay separate. So does a block with a
    broadcast (batch-1) dense layer: concatenation would average that row with
    the other blocks' rows and change the scores. ``blocks`` is emptied as it
    is read, so a merged block's pieces are released once it is built and
    the test side is not held twice.
    """
    merged: list[_TestBlock] = []
    runs = itertools.groupby(_taken(blocks), key=lambda b: _has_broadcast_layer(b.rep))
    for broadcast, run in runs:
        if broadcast:
            merged.extend(run)
            continue
        batches = rebatch_blocks(((0, b.rep, b.cols) for b in run), max(num_columns, 1))
        merged.extend(_TestBlock(rep, list(cols)) for _steps, rep, cols in batches)
    return merged


def _restreamed_tests(
    test_source: Iterable[tuple[int, Gradient, list[str]]],
    columns: _Columns,
    device: torch.device,
    transform_test: Callable[[Gradient], Gradient],
) -> Iterator[_TestBlock]:
    """Each block of a new pass over ``test_source``, moved, transformed, with its columns."""
    for _step, block, ids in test_source:
        item = _TestBlock(transform_test(_to_device(block, device)), columns.lookup(ids))
        del block
        yield item
        del item


def _token_count(rep: Gradient) -> int:
    """``T``: the largest token axis of ``rep``'s ``batch_token`` layers (1 if none)."""
    return max((t for t in rep.token_dim.values() if t is not None), default=1)


def _write_columns(scores: torch.Tensor, values: torch.Tensor, cols: list[int]) -> None:
    """``scores[:, cols] = values`` as CPU float32; a repeated column keeps its last row.

    Consecutive columns (a merged test block) are copied in place, without the
    gathered copy of ``values`` that other column lists need.
    """
    if cols and cols == list(range(cols[0], cols[0] + len(cols))):
        scores[:, cols[0] : cols[0] + len(cols)] = values.detach()
        return
    last = {col: row for row, col in enumerate(cols)}
    rows = torch.tensor(list(last.values()), dtype=torch.long, device=values.device)
    scores[:, list(last)] = values.detach()[:, rows].to(device="cpu", dtype=torch.float32)


def _pair_scores(
    rep: Gradient,
    test: _TestBlock,
    samples: int,
    tokens: int,
    *,
    inner_product: Callable[..., torch.Tensor],
    inner_product_per_token: Callable[[Gradient, Gradient], torch.Tensor] | None,
    dense_cache: TensorCache | None,
) -> torch.Tensor:
    """``(samples·tokens, len(test.cols))`` scores of a train batch against one test block.

    Token level (``inner_product_per_token`` given): ``(samples, tokens, B_te)``
    reshaped; instance level: ``inner_product(..., dense_cache=dense_cache)``.
    A scorer returning another shape raises ``ValueError``.
    """
    if inner_product_per_token is None:
        name, shape = "inner_product", (samples, len(test.cols))
        values = inner_product(rep, test.rep, dense_cache=dense_cache)
    else:
        name, shape = "inner_product_per_token", (samples, tokens, len(test.cols))
        values = inner_product_per_token(rep, test.rep)
    if tuple(values.shape) != shape:
        raise ValueError(
            f"{name} returned a tensor of shape {tuple(values.shape)} for a train batch of "
            f"{samples} samples and a test block of {len(test.cols)}; expected {shape}"
        )
    return values.reshape(samples * tokens, len(test.cols))


def _batch_scores(
    rep: Gradient,
    tests: Iterable[_TestBlock],
    samples: int,
    tokens: int,
    num_test: int,
    dense_cache: TensorCache | None,
    score_pair: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``(samples·tokens, num_test)`` CPU float32 scores of a train batch against every test block.

    Columns no test block reaches stay 0; ``dense_cache`` is closed on return.
    """
    scores = torch.zeros(samples * tokens, num_test, dtype=torch.float32)
    with dense_cache if dense_cache is not None else contextlib.nullcontext():
        for test in tests:
            values = score_pair(rep, test, samples, tokens, dense_cache=dense_cache)
            _write_columns(scores, values, test.cols)
    return scores


def score_sources(
    train_source: Iterable[tuple[int, Gradient, list[str]]],
    test_source: Iterable[tuple[int, Gradient, list[str]]],
    device: torch.device | str,
    *,
    inner_product: Callable[..., torch.Tensor],
    transform_train: Callable[[Gradient], Gradient] | None = None,
    transform_test: Callable[[Gradient], Gradient] | None = None,
    batch_size: int = 1,
    loop_over_test: bool = False,
    cache_budget: CacheBudget | None = None,
    granularity: str = "instance",
    inner_product_per_token: Callable[[Gradient, Gradient], torch.Tensor] | None = None,
) -> ScoreResult:
    """Score every train batch of ``train_source`` against every test block of ``test_source``.

    Both sources yield ``(step, Gradient, ids)``. The test source is iterated
    first: columns are its distinct ids (as ``str``) in first-appearance order,
    and (unless ``loop_over_test``) each block is moved to ``device``,
    transformed and held; runs of consecutive dense held blocks are merged.
    Train blocks are re-batched with ``rebatch_blocks(train_source,
    batch_size)``, moved, transformed, and scored with
    ``inner_product(train_rep, test_rep, dense_cache=...)`` -> ``(B_tr, B_te)``.
    ``dense_cache`` is a fresh ``TensorCache("memory", budget=cache_budget)``
    per train batch (closed after it met every test block) when
    ``loop_over_test`` or more than one held block remains, at instance
    granularity; otherwise ``None``. ``loop_over_test`` re-streams and
    re-transforms the (``reusable``) test source for every train batch.
    Token granularity scores with ``inner_product_per_token(train_rep,
    test_rep)`` -> ``(B, T, B_te)``: each sample gives ``T`` consecutive rows
    (``T`` = the largest ``train_rep.token_dim``, 1 if none), token ids
    ``0..T-1``. A column id that repeats takes the last value written.

    Returns:
        ``(scores, row_train_ids, row_steps, test_ids, row_token_ids)``:
        ``scores`` CPU float32 ``(num_rows, num_test)``; ``row_token_ids`` is
        ``None`` at instance granularity. An empty train source gives
        ``(zeros(0, num_test), [], [], test_ids, None or [])``.

    Raises:
        ValueError: unknown ``granularity``; ``"token"`` without
            ``inner_product_per_token``; ``loop_over_test`` with a test source
            that is not ``reusable``; a scorer returning the wrong shape.
        KeyError: a later pass over the test source yields an id the first did not.
    """
    test_ids, batches = stream_scores(
        train_source,
        test_source,
        device,
        inner_product=inner_product,
        transform_train=transform_train,
        transform_test=transform_test,
        batch_size=batch_size,
        loop_over_test=loop_over_test,
        cache_budget=cache_budget,
        granularity=granularity,
        inner_product_per_token=inner_product_per_token,
    )
    matrices: list[torch.Tensor] = []
    row_ids: list[str] = []
    row_steps: list[int] = []
    row_tokens: list[int] | None = [] if granularity == "token" else None
    for batch in batches:
        matrices.append(batch.scores)
        row_ids.extend(batch.row_ids)
        row_steps.extend(batch.row_steps)
        if row_tokens is not None:
            row_tokens.extend(batch.row_tokens or [])
    return _stacked(matrices, len(test_ids)), row_ids, row_steps, test_ids, row_tokens


def _stacked(matrices: list[torch.Tensor], num_test: int) -> torch.Tensor:
    """The batches' ``(rows, num_test)`` scores as one matrix, each batch freed once copied.

    Equal to ``torch.cat(matrices)``, but the pages of the result are touched
    as the batches are released, so the peak is about one matrix plus one
    batch rather than two matrices. ``matrices`` is emptied.
    """
    if not matrices:
        return torch.zeros(0, num_test, dtype=torch.float32)
    dtype = functools.reduce(torch.promote_types, (m.dtype for m in matrices))
    rows_total = sum(m.shape[0] for m in matrices)
    out = torch.empty(rows_total, num_test, dtype=dtype, device=matrices[0].device)
    offset = 0
    for i in range(len(matrices)):
        rows = matrices[i].shape[0]
        out[offset : offset + rows] = matrices[i]
        matrices[i] = None  # type: ignore[call-overload]
        offset += rows
    matrices.clear()
    return out


class ScoreSink(Protocol):
    """A consumer of the engine's batches in place of the dense matrix (``score_pass(sink=)``)."""

    def start(self, test_ids: list[str]) -> None:
        """Called once with the score columns before the first batch."""

    def add(self, batch: ScoredBatch) -> None:
        """Take one train batch's scores (the engine keeps no reference to it)."""


class ScoredBatch(NamedTuple):
    """One train batch's scores: ``(rows, num_test)`` CPU float32 and each row's identity.

    ``row_tokens`` is ``None`` at instance granularity.
    """

    scores: torch.Tensor
    row_ids: list[str]
    row_steps: list[int]
    row_tokens: list[int] | None


def stream_scores(
    train_source: Iterable[tuple[int, Gradient, list[str]]],
    test_source: Iterable[tuple[int, Gradient, list[str]]],
    device: torch.device | str,
    *,
    inner_product: Callable[..., torch.Tensor],
    transform_train: Callable[[Gradient], Gradient] | None = None,
    transform_test: Callable[[Gradient], Gradient] | None = None,
    batch_size: int = 1,
    loop_over_test: bool = False,
    cache_budget: CacheBudget | None = None,
    granularity: str = "instance",
    inner_product_per_token: Callable[[Gradient, Gradient], torch.Tensor] | None = None,
) -> tuple[list[str], Iterator[ScoredBatch]]:
    """The loop of :func:`score_sources`, one :class:`ScoredBatch` per train batch.

    The test source's first pass runs now (the columns are fixed and, unless
    ``loop_over_test``, the test blocks held); the train source is read as the
    returned iterator advances, each batch's scores released with it. Returns
    ``(test_ids, batches)``. Arguments and errors as :func:`score_sources`,
    which concatenates the batches; a consumer that keeps less (a running
    top-k) never holds the full matrix.
    """
    check_granularity(granularity, "granularity")
    token_level = granularity == "token"
    if token_level and inner_product_per_token is None:
        raise ValueError("granularity='token' needs inner_product_per_token")
    if loop_over_test:
        _require_reusable(test_source)
    device = torch.device(device)
    transform_train = transform_train or _identity
    transform_test = transform_test or _identity
    budget = cache_budget if cache_budget is not None else CacheBudget(device)
    columns = _Columns()
    held = _first_test_pass(test_source, columns, device, transform_test, hold=not loop_over_test)
    held = _merge_dense_blocks(held, len(columns.ids))
    use_cache = not token_level and (loop_over_test or len(held) > 1)
    num_test = len(columns.ids)
    score_pair = functools.partial(
        _pair_scores,
        inner_product=inner_product,
        inner_product_per_token=inner_product_per_token if token_level else None,
    )

    def batches() -> Iterator[ScoredBatch]:
        for steps, block, ids in rebatch_blocks(train_source, batch_size):
            rep = transform_train(_to_device(block, device))
            del block  # release the raw captures before the test blocks are scored
            tokens = _token_count(rep) if token_level else 1
            tests = (
                _restreamed_tests(test_source, columns, device, transform_test)
                if loop_over_test
                else held
            )
            cache = TensorCache("memory", budget=budget) if use_cache else None
            scores = _batch_scores(rep, tests, len(ids), tokens, num_test, cache, score_pair)
            del rep  # release this batch before the train source produces the next one
            row_ids = [str(sample) for sample in ids for _ in range(tokens)]
            row_steps = [int(step) for step in steps for _ in range(tokens)]
            row_tokens = list(range(tokens)) * len(ids) if token_level else None
            yield ScoredBatch(scores, row_ids, row_steps, row_tokens)
            del scores

    return list(columns.ids), batches()


# ---------------------------------------------------------------------------- an attributor's pass
def score_pass(
    attributor: Any,
    train_source: GradientSource,
    test_source: GradientSource,
    *,
    loop_over_test: bool,
    transform_test: Callable[[Gradient], Gradient] | None,
    attribution_granularity: str,
    sink: ScoreSink | None = None,
) -> ScoreResult:
    """One pass of :func:`score_sources` for ``attributor`` (``BaseInnerProductAttributor``).

    Its ``prepare_scoring``, then the loop on ``args.device`` with its
    transforms (``transform_test`` defaults to its ``transform_test_rep``;
    each train block first goes through ``transform_train_step``), inner
    products and ``progress`` bar; train batches of
    ``args.per_device_train_batch_size`` rows. A :class:`_ScoringChecks`
    wraps the sources and transforms; the layers both sides shared become the
    attributor's ``scored_layers``. (``attributor`` is typed ``Any``: this
    module does not import ``base``, which imports it.)

    With a ``sink`` (e.g. a running top-k) each batch's :class:`ScoredBatch`
    goes to ``sink.add`` (after ``sink.start(test_ids)``) and is then dropped;
    the result is ``(zeros(0, num_test), [], [], test_ids, None)``.
    """
    check_granularity(attribution_granularity)
    if loop_over_test:
        _require_reusable(test_source)
    if sink is None:
        return _pass(
            attributor,
            train_source,
            test_source,
            loop_over_test,
            transform_test,
            attribution_granularity,
            dense=True,
        )
    test_ids, batches = stream_pass(
        attributor,
        train_source,
        test_source,
        loop_over_test=loop_over_test,
        transform_test=transform_test,
        attribution_granularity=attribution_granularity,
    )
    sink.start(test_ids)
    for batch in batches:
        sink.add(batch)
    return torch.zeros(0, len(test_ids)), [], [], test_ids, None


def stream_pass(
    attributor: Any,
    train_source: GradientSource,
    test_source: GradientSource,
    *,
    loop_over_test: bool,
    transform_test: Callable[[Gradient], Gradient] | None,
    attribution_granularity: str,
) -> tuple[list[str], Iterator[ScoredBatch]]:
    """:func:`score_pass` as ``(test_ids, batches)`` (:func:`stream_scores`).

    The attributor's ``prepare_scoring`` and the test side's first pass run
    now; the train source is read as ``batches`` advances, and its exhaustion
    runs the end-of-pass checks (an empty training set, the layer audit) and
    sets ``scored_layers``.
    """
    check_granularity(attribution_granularity)
    if loop_over_test:
        _require_reusable(test_source)
    return _pass(
        attributor,
        train_source,
        test_source,
        loop_over_test,
        transform_test,
        attribution_granularity,
        dense=False,
    )


def _pass(
    attributor: Any,
    train_source: GradientSource,
    test_source: GradientSource,
    loop_over_test: bool,
    transform_test: Callable[[Gradient], Gradient] | None,
    attribution_granularity: str,
    *,
    dense: bool,
) -> Any:
    """The pass of :func:`score_pass` (``dense``) or :func:`stream_pass`."""
    attributor.prepare_scoring(train_source, test_source)
    device = torch.device(attributor.args.device)
    checks = _ScoringChecks(train_source, test_source, device, hold_test=not loop_over_test)
    total = len(train_source) if hasattr(train_source, "__len__") else None
    engine = functools.partial(
        score_sources if dense else stream_scores,
        attributor.progress(
            _train_steps_transformed(attributor, checks.train_source(train_source)), total=total
        ),
        checks.test_source(test_source),
        device,
        inner_product=attributor.inner_product,
        transform_train=checks.transform_train(attributor.transform_train_rep),
        transform_test=checks.transform_test(transform_test or attributor.transform_test_rep),
        batch_size=attributor.args.per_device_train_batch_size,
        loop_over_test=loop_over_test,
        granularity=attribution_granularity,
        inner_product_per_token=attributor.inner_product_per_token,
    )
    if dense:
        result = engine()
        attributor.scored_layers = checks.finish()
        return result
    test_ids, batches = engine()

    def checked() -> Iterator[ScoredBatch]:
        yield from batches
        attributor.scored_layers = checks.finish()

    return test_ids, checked()


def _train_steps_transformed(
    attributor: Any, source: Iterable[tuple[int, Gradient, list[str]]]
) -> Iterator[tuple[int, Gradient, list[str]]]:
    """``source`` with the attributor's ``transform_train_step`` applied to each block."""
    for step, block, ids in source:
        item = (step, attributor.transform_train_step(step, block), ids)
        del block
        yield item
        del item

"""Shared machinery of the attributors: gradient collection and the scoring loop.

`collect_gradients` saves a streamer's blocks into a store; `score_sources`
pairs every training batch with every test block of two gradient sources
(iterables of ``(step, Gradient, ids)``) through caller-supplied transforms
and inner products. Scores are float32 on CPU, ``(num_train_rows,
num_test)``; columns are the distinct test identifiers in first-appearance
order. `_ScoringChecks` holds what an attributor adds around one scoring pass
(layer compatibility, the shared-layer audit, test-side preparation).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dattri_llm.gradient.async_writer import AsyncGradientWriter
from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.streaming import rebatch_blocks
from dattri_llm.utils.atomic import atomic_write
from dattri_llm.utils.cache import CacheBudget, TensorCache

if TYPE_CHECKING:
    from dattri_llm.gradient.streaming import GradientSource

ATTRIBUTION_GRANULARITIES = ("instance", "token")
LR_SCHEDULE_FILE = "lr_schedule.json"
PARAM_GRAD_TYPE = "param_grad_layers"
_COMPARED_PROJECTION_KEYS = (
    "style",
    "proj_dim",
    "proj_seed",
    "proj_type",
    "include_bias",
    "projector",
)

ScoreResult = tuple[torch.Tensor, list[str], list[int], list[str], "list[int] | None"]


def normalize_layer_names(x: str | Iterable[str] | None) -> list[str] | None:
    """``None`` → ``None``; a name → ``[name]``; an iterable → list of names (non-empty)."""
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    names = list(x)
    if not names:
        raise ValueError("layer_name is empty; pass None to keep every layer")
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise TypeError(f"layer names must be strings, got {bad}")
    return names


# ---------------------------------------------------------------------------- collection
def collect_gradients(
    streamer: Any,
    store: Any,
    *,
    offload_interval: int = 1,
    on_block: Callable[[int, Gradient, Any], None] | None = None,
    async_write: bool | None = None,
) -> Any:
    """Enter ``streamer``, save every block into ``store`` and return the store.

    Needs from the streamer only ``args.async_disk_write`` (read with
    ``getattr``, missing = ``False``, and only when ``async_write is None``),
    ``hook_manager.sample_id_key``, the context-manager protocol and iteration
    yielding ``(step, grad, hashes)``; from the store only ``save_bulk``. Each
    block becomes ``GradientRecord(step, hashes as yielded, grad,
    sample_id_key)`` after ``on_block(step, grad, hashes)`` saw it; every
    ``offload_interval`` records are saved as one group, the rest at the end.
    With ``async_write`` the groups go through an ``AsyncGradientWriter(store)``,
    closed before returning (every write drained, a write error re-raised).

    Raises:
        ValueError: ``offload_interval < 1`` (before anything else happens).
    """
    if offload_interval < 1:
        raise ValueError(f"offload_interval must be >= 1, got {offload_interval}")
    if async_write is None:
        async_write = getattr(getattr(streamer, "args", None), "async_disk_write", False)
    sample_id_key = streamer.hook_manager.sample_id_key
    writer = AsyncGradientWriter(store) if async_write else None
    write = writer.submit if writer is not None else store.save_bulk
    try:
        with streamer:
            staged: list[GradientRecord] = []
            for step, grad, hashes in streamer:
                if on_block is not None:
                    on_block(step, grad, hashes)
                staged.append(GradientRecord(step, hashes, grad, sample_id_key))
                if len(staged) >= offload_interval:
                    write(staged)
                    staged = []
            if staged:
                write(staged)
    finally:
        if writer is not None:
            writer.close()
    return store


def write_lr_schedule(dir: str | Path, lrs: Mapping[int, float]) -> Path:  # noqa: A002
    """Write ``{step: lr}`` as ``lr_schedule.json`` in ``dir``; return the file path."""
    path = Path(dir) / LR_SCHEDULE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {str(int(step)): float(lr) for step, lr in sorted(lrs.items())}
    return atomic_write(path, lambda fh: fh.write(json.dumps(payload).encode("utf-8")))


def read_lr_schedule(dir: str | Path) -> dict[int, float] | None:  # noqa: A002
    """Read ``lr_schedule.json`` from ``dir`` (``None`` when absent)."""
    path = Path(dir) / LR_SCHEDULE_FILE
    if not path.is_file():
        return None
    payload = json.loads(path.read_text(encoding="utf-8"))
    return {int(step): float(lr) for step, lr in payload.items()}


# ---------------------------------------------------------------------------- test-side layout
def _prefers_dense(value: Any, layer_type: str) -> bool:
    """Whether the cost rule prefers scoring a factorized test layer as a dense block."""
    from dattri_llm.gradient.ops.dot import effective_dims, maybe_use_materialized_gram
    from dattri_llm.gradient.ops.types import is_embedding, is_norm

    if is_embedding(layer_type) or is_norm(layer_type):
        return False
    batch, seq, k, d = effective_dims(value, layer_type)
    return maybe_use_materialized_gram(batch, batch, seq, k, d)


def finalize_factors(
    rep: Gradient, *, budget: CacheBudget | int | None = None, held: int = 0
) -> Gradient:
    """Materialize the factorized layers of a held test ``rep`` that score cheaper dense.

    A layer is materialized when the routing rule
    (``ops.maybe_use_materialized_gram`` with equal batch sizes on both sides)
    prefers the dense route and the dense block fits in ``budget`` (a
    ``CacheBudget``, a byte cap, or ``None`` = 35 % of the free memory of the
    rep's device) on top of ``held`` bytes already held. Other layers stay as
    they are.
    """
    from dattri_llm.gradient.ops.materialize import materialize
    from dattri_llm.utils.cache import CacheBudget

    if budget is None:
        budget = CacheBudget(rep.device)
    elif isinstance(budget, int):
        budget = CacheBudget(limit_bytes=budget)
    held = held + rep.nbytes

    def convert(name: str, value: Any, layer_type: str) -> Any:
        nonlocal held
        if rep.representation[name] != "factorized" or not _prefers_dense(value, layer_type):
            return value
        single = rep.select_layers([name])
        extra = single.materialized_nbytes
        if not budget.fits(extra, held):
            return value
        held += extra
        return materialize(value, layer_type)

    factorized = [n for n, kind in rep.representation.items() if kind == "factorized"]
    if not factorized:
        return rep
    return rep.map_layers(convert, layers=factorized)


def _preprocess_layers(rep: Gradient, *, conv: bool = True) -> Gradient:
    """Preprocess raw linear (and, with ``conv``, conv) factors once into final factors.

    Final factors carry the bias column (and the im2col patches), so kernels that see
    the layer several times do not redo (and re-allocate) the preprocessing each time.
    """
    from dattri_llm.gradient.ops.preprocess import preprocess_factorized
    from dattri_llm.gradient.ops.types import is_conv, is_linear

    names = [
        name
        for name, kind in rep.representation.items()
        if kind == "factorized"
        and rep.data[name].module_kwargs is not None
        and rep.layer_types[name] != "nn.Bilinear"
        and (is_linear(rep.layer_types[name]) or (conv and is_conv(rep.layer_types[name])))
    ]
    if not names:
        return rep

    def preprocess(_name: str, value: Any, layer_type: str) -> Any:
        a, g = preprocess_factorized(value, layer_type)
        return Factorized(a, g, module_kwargs=None)

    return rep.map_layers(preprocess, layers=names)


# ---------------------------------------------------------------------------- compatibility
def _layer_signature(rep: Gradient, name: str) -> tuple:
    """``(representation, final?, widths, dtype)`` of one layer, independent of B and T."""
    from dattri_llm.gradient.ops.dot import effective_dims
    from dattri_llm.gradient.ops.types import is_embedding

    value = rep.data[name]
    layer_type = rep.layer_types[name]
    if rep.representation[name] != "factorized":
        return ("materialized", None, (value.shape[-1],), value.dtype)
    final = value.module_kwargs is None
    if is_embedding(layer_type) and not final:
        widths = (value.module_kwargs.get("num_embeddings"), value.pre_activation_grad.shape[-1])
    else:
        _, _, k, d = effective_dims(value, layer_type)
        widths = (k, d)
    return ("factorized", final, widths, value.pre_activation_grad.dtype)


def _describe(signature: tuple) -> str:
    kind, final, widths, dtype = signature
    label = "final factors" if final else ("raw factors" if kind == "factorized" else "dense")
    return f"{label} widths {widths} dtype {dtype}"


def source_projection(source: object) -> dict[str, dict] | None:
    """Capture projection record of a gradient source (see ``storage_manager.projection_record``).

    A store-backed source (``file_manager``) gives its store's declaration, a
    live source (``hook_manager``) its manager's config; ``None`` = unknown.
    """
    from dattri_llm.gradient.storage_manager import projection_record

    store = getattr(source, "file_manager", None)
    if store is not None:
        return store.projection
    manager = getattr(source, "hook_manager", None)
    if manager is not None:
        return projection_record(manager.config.projection_kwargs, manager.config.projector)
    return None


def _layer_projection(record: Mapping[str, dict], name: str) -> dict | None:
    """Compared settings of layer ``name`` (``name@k`` → ``name``), else ``"__default__"``."""
    from dattri_llm.gradient.gradient import base_layer_name

    entry = record.get(base_layer_name(name), record.get("__default__"))
    if entry is None:
        return None
    return {key: entry[key] for key in _COMPARED_PROJECTION_KEYS if key in entry}


def _describe_projection(settings: dict | None) -> str:
    if settings is None:
        return "unprojected"
    return ", ".join(f"{key}={value!r}" for key, value in settings.items())


def _check_projection(
    name: str, train_projection: Mapping[str, dict], test_projection: Mapping[str, dict]
) -> None:
    """Raise ``ValueError`` when layer ``name`` was projected differently on the two sides."""
    on_train = _layer_projection(train_projection, name)
    on_test = _layer_projection(test_projection, name)
    if on_train == on_test:
        return
    raise ValueError(
        f"layer {name!r}: train gradients were captured with projection "
        f"({_describe_projection(on_train)}) but test gradients with projection "
        f"({_describe_projection(on_test)}); their inner products are meaningless. Capture both "
        "sides with the same projection_kwargs (style, proj_dim, proj_seed, proj_type, "
        "include_bias) and projector"
    )


def check_layer_compatibility(
    train: Gradient,
    test: Gradient,
    layers: Iterable[str],
    *,
    train_projection: Mapping[str, dict] | None = None,
    test_projection: Mapping[str, dict] | None = None,
) -> None:
    """Raise ``ValueError`` when a shared layer differs between the sides.

    Widths and dtypes are compared for layers stored in the same form (dense,
    raw factors or final factors); mixed forms (e.g. a preconditioned dense
    train side against raw test factors) are left to the kernels, which check
    materialized widths. When both projection records are known (see
    `source_projection`), each layer's settings (its own entry, else
    ``"__default__"``, else unprojected) must agree in ``style``,
    ``proj_dim``, ``proj_seed``, ``proj_type``, ``include_bias`` and
    ``projector``.
    """
    layers = list(layers)
    _check_signatures(
        _layer_signatures(train, layers),
        _layer_signatures(test, layers),
        layers,
        train_projection=train_projection,
        test_projection=test_projection,
    )


def _layer_signatures(block: Gradient, layers: Iterable[str] | None = None) -> dict[str, tuple]:
    """``{layer: _layer_signature}`` of ``layers`` (default: every layer) of ``block``."""
    names = block.layer_names if layers is None else layers
    return {name: _layer_signature(block, name) for name in names}


def _check_signatures(
    train: Mapping[str, tuple],
    test: Mapping[str, tuple],
    layers: Iterable[str],
    *,
    train_projection: Mapping[str, dict] | None,
    test_projection: Mapping[str, dict] | None,
) -> None:
    """:func:`check_layer_compatibility` on precomputed ``{layer: signature}`` tables."""
    for name in layers:
        sig_train = train[name]
        sig_test = test[name]
        if sig_train[:2] == sig_test[:2] and sig_train[2:] != sig_test[2:]:
            raise ValueError(
                f"layer {name!r}: train gradients ({_describe(sig_train)}) and test gradients "
                f"({_describe(sig_test)}) are incompatible; capture both sides from the same "
                "model with the same hook config, projection (proj_dim, proj_seed) and dtype"
            )
        if train_projection is not None and test_projection is not None:
            _check_projection(name, train_projection, test_projection)


def per_sample_layers(block: Gradient) -> list[str]:
    """Layers of ``block`` that carry per-sample gradients (not batch-level ``param_grad``)."""
    return sorted(n for n, t in block.layer_types.items() if t != PARAM_GRAD_TYPE)


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
        if isinstance(value, torch.Tensor) and rep.layer_types[name] != PARAM_GRAD_TYPE
    ]
    return 1 in batches and max(batches) > 1


def _merge_dense_blocks(blocks: list[_TestBlock], num_columns: int) -> list[_TestBlock]:
    """Concatenate each run of consecutive dense test blocks into one (``rebatch_blocks``).

    Re-batching to ``num_columns`` rows (as many as a run of distinct samples can
    hold) merges a run into one block with its column lists concatenated;
    factorized blocks break a run and stay separate. So does a block with a
    broadcast (batch-1) dense layer: concatenation would average that row with
    the other blocks' rows and change the scores.
    """
    merged: list[_TestBlock] = []
    for broadcast, run in itertools.groupby(blocks, key=lambda b: _has_broadcast_layer(b.rep)):
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
    """``scores[:, cols] = values`` as CPU float32; a repeated column keeps its last row."""
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
    matrices: list[torch.Tensor] = []
    row_ids: list[str] = []
    row_steps: list[int] = []
    row_tokens: list[int] | None = [] if token_level else None
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
        matrices.append(scores)
        for step, sample in zip(steps, ids):
            row_ids.extend([str(sample)] * tokens)
            row_steps.extend([int(step)] * tokens)
            if row_tokens is not None:
                row_tokens.extend(range(tokens))
    matrix = torch.cat(matrices) if matrices else torch.zeros(0, num_test, dtype=torch.float32)
    return matrix, row_ids, row_steps, list(columns.ids), row_tokens


# ---------------------------------------------------------------------------- attributor checks
class _LayerAudit:
    """Layers seen on each side, to reject disjoint caches and warn on partial overlap.

    Every train block meets every test block, so the layers scored by some pair
    are exactly those seen on both sides.
    """

    def __init__(self) -> None:
        self.train_seen: set[str] = set()
        self.test_seen: set[str] = set()

    def finish(self) -> list[str]:
        """The shared layers (sorted); ``ValueError`` if none, ``UserWarning`` for one-sided."""
        shared = self.train_seen & self.test_seen
        if not shared:
            raise ValueError(
                "train and test gradients share no layer: train layers "
                f"{sorted(self.train_seen)}, test layers {sorted(self.test_seen)}; capture both "
                "sides with the same hook config or pass layer_name"
            )
        unshared = self.train_seen ^ self.test_seen
        if unshared:
            warnings.warn(
                f"layers {sorted(unshared)} were captured on only one side and do not "
                "contribute to the scores",
                UserWarning,
                stacklevel=3,
            )
        return sorted(shared)


def _drop_param_grad(block: Gradient) -> Gradient:
    """Remove batch-level ``param_grad`` layers (no per-sample gradient) from ``block``."""
    keep = per_sample_layers(block)
    if len(keep) == len(block.layer_types):
        return block
    if not keep:
        raise ValueError(
            "a gradient block holds only param_grad (batch-level) layers, which carry no "
            "per-sample gradient; capture layers with the linear_io hook family"
        )
    warnings.warn(
        "param_grad layers are batch-level and were dropped from scoring: "
        f"{sorted(set(block.layer_types) - set(keep))}",
        UserWarning,
        stacklevel=4,
    )
    return block.select_layers(keep)


class _CheckedTestSource:
    """A test source whose raw blocks are recorded by ``checks`` (same re-iterability)."""

    def __init__(self, source: GradientSource, checks: _ScoringChecks) -> None:
        self.source = source
        self.checks = checks

    @property
    def reusable(self) -> bool:
        """Whether the wrapped source can be iterated again."""
        return bool(getattr(self.source, "reusable", False))

    def __iter__(self) -> Iterator[tuple[int, Gradient, list[str]]]:
        count = 0
        for step, block, ids in self.source:
            item = (step, self.checks.see_test_block(block), ids)
            del block
            count += 1
            yield item
            del item
        self.checks.test_blocks = count


class _ScoringChecks:
    """Attributor-level bookkeeping of one pass of :func:`score_sources`.

    Wraps the sources and transforms an attributor hands to :func:`score_sources`:
    batch-level ``param_grad`` layers are dropped from both sides; every raw
    train block's shared layers are checked against the raw test blocks
    (widths, dtypes, capture projection) before it is transformed; the layers
    seen on each side are audited (:meth:`finish`); held test representations
    get their dense-preferred layers materialized within a budget
    (:func:`finalize_factors`) and raw linear factors preprocessed once; a train
    representation that meets several test blocks has its raw factors
    preprocessed once.

    Args:
        train_source: the attributor's train source (its projection record is read).
        test_source: the attributor's test source (likewise).
        device: the scoring device (budget of the held test side).
        hold_test: whether test representations are held for the pass
            (``not loop_over_test``).
    """

    def __init__(
        self,
        train_source: GradientSource,
        test_source: GradientSource,
        device: torch.device,
        *,
        hold_test: bool,
    ) -> None:
        self.projections = {
            "train_projection": source_projection(train_source),
            "test_projection": source_projection(test_source),
        }
        self.hold_test = hold_test
        self.audit = _LayerAudit()
        self.test_tables: list[dict[str, tuple]] = []
        self.test_blocks = 0
        self.train_blocks = 0
        self._budget = CacheBudget(device)
        self._held = 0

    def see_test_block(self, block: Gradient) -> Gradient:
        """Record a raw test block's layers and signatures; return it without param_grad."""
        block = _drop_param_grad(block)
        self.audit.test_seen |= block.layer_names
        table = _layer_signatures(block)
        if table not in self.test_tables:
            self.test_tables.append(table)
        return block

    def see_train_block(self, block: Gradient) -> Gradient:
        """Check a raw train block against the test side; return it without param_grad."""
        block = _drop_param_grad(block)
        self.train_blocks += 1
        self.audit.train_seen |= block.layer_names
        shared = sorted(block.layer_names & self.audit.test_seen)
        signatures = _layer_signatures(block, shared)
        for table in self.test_tables:
            on_both = [name for name in shared if name in table]
            _check_signatures(signatures, table, on_both, **self.projections)
        return block

    def test_source(self, source: GradientSource) -> _CheckedTestSource:
        """``source`` with each raw block passed through :meth:`see_test_block`."""
        return _CheckedTestSource(source, self)

    def train_source(
        self, source: Iterable[tuple[int, Gradient, list[str]]]
    ) -> Iterator[tuple[int, Gradient, list[str]]]:
        """``source`` through :meth:`see_train_block`; ``ValueError`` first if no test block.

        The test source is iterated before the train source moves, so an empty
        test set is refused before any train block is produced.
        """
        if not self.test_blocks:
            raise ValueError("the test set is empty: the test source yielded no block")
        for step, block, ids in source:
            item = (step, self.see_train_block(block), ids)
            del block
            yield item
            del item

    def transform_test(self, transform: Callable[[Gradient], Gradient]) -> Callable:
        """``transform``, then (held test side) dense-preferred layers and final factors."""

        def prepared(block: Gradient) -> Gradient:
            rep = transform(block)
            if not self.hold_test:
                return rep
            rep = finalize_factors(rep, budget=self._budget, held=self._held)
            rep = _preprocess_layers(rep, conv=False)
            self._held += rep.nbytes
            return rep

        return prepared

    def transform_train(self, transform: Callable[[Gradient], Gradient]) -> Callable:
        """``transform``, then final factors when the train rep meets several test blocks."""

        def prepared(block: Gradient) -> Gradient:
            rep = transform(block)
            return _preprocess_layers(rep) if self.test_blocks > 1 else rep

        return prepared

    def finish(self) -> list[str]:
        """End of pass: ``ValueError`` for an empty training set, then the layer audit.

        Returns the layers both sides shared (sorted).
        """
        if not self.train_blocks:
            raise ValueError("the training set is empty: the train source yielded no block")
        return self.audit.finish()


def scale_rows(block: Gradient, factors: torch.Tensor) -> Gradient:
    """``block`` with sample ``i``'s gradient multiplied by ``factors[i]`` in every layer.

    Factorized layers scale their output-gradient factor (the gradient is
    linear in it); dense layers scale their rows. ``param_grad`` layers pass
    through.
    """
    data = dict(block.data)
    for name in per_sample_layers(block):
        value = block.data[name]
        if isinstance(value, Factorized):
            grad = value.pre_activation_grad
            shape = [1] * grad.dim()
            shape[value.batch_axis] = -1
            scaled = grad * factors.to(grad).reshape(shape)
            data[name] = Factorized(
                value.activation, scaled, value.module_kwargs, value.batch_first
            )
        else:
            data[name] = value * factors.to(value).reshape(-1, *([1] * (value.dim() - 1)))
    return Gradient(
        dict(block.representation),
        data,
        dict(block.layer_types),
        dict(block.indexing),
        validate_on_init=False,
    )

"""Shared machinery of the attributors: gradient collection and the scoring loop.

The scoring loop pairs every training block with every test block of two
:class:`~dattri_llm.gradient.streaming.GradientSource` objects and calls the
attributor's extension hooks (``transform_*_rep``, ``inner_product``,
``inner_product_per_token``). Scores are float32 on CPU, ``(num_train_rows,
num_test)``; columns are the distinct test identifiers in first-appearance
order.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dattri_llm.gradient.streaming import GradientStreamer, rebatch_blocks

if TYPE_CHECKING:
    from dattri_llm.attribution.base import BaseInnerProductAttributor
    from dattri_llm.gradient.gradient import Gradient
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.gradient.streaming import GradientSource
    from dattri_llm.utils.cache import CacheBudget, TensorCache

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
    store: GradientStorageManager,
    *,
    offload_interval: int = 1,
    on_block: Callable[[int, Gradient, list[str]], None] | None = None,
    async_write: bool | None = None,
) -> GradientStorageManager:
    """Enter ``streamer``, save every block into ``store`` and return the store.

    Each block becomes one per-batch ``GradientRecord(step=label, input_hash=ids)``
    stamped with the streamer's ``sample_id_key``; groups of
    ``offload_interval`` records are written together (through an
    ``AsyncGradientWriter`` when ``async_write``, default
    ``args.async_disk_write``). ``on_block(step, grad, ids)`` sees each block
    before it is saved. The streamer's capture projection is declared to the
    store first (a store declaring another projection → ``ValueError``).
    """
    from dattri_llm.gradient.async_writer import AsyncGradientWriter
    from dattri_llm.gradient.gradient import GradientRecord

    if offload_interval < 1:
        raise ValueError(f"offload_interval must be >= 1, got {offload_interval}")
    if async_write is None:
        async_write = bool(streamer.args.async_disk_write)
    sample_id_key = streamer.hook_manager.sample_id_key
    config = streamer.hook_manager.config
    store.declare_projection(config.projection_kwargs, config.projector)
    writer = AsyncGradientWriter(store) if async_write else None
    write = writer.submit if writer is not None else store.save_bulk
    staged: list[GradientRecord] = []
    try:
        with streamer:
            for step, grad, ids in streamer:
                if on_block is not None:
                    on_block(step, grad, ids)
                staged.append(GradientRecord(step, list(ids), grad, sample_id_key))
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
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    tmp.replace(path)
    return path


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
    from dattri_llm.gradient.gradient import Factorized
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
class _TestColumns:
    """Maps each test block's rows to score columns (first appearance wins)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._col: dict[str, int] = {}
        self._plans: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []

    def plan(self, position: int, ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kept rows, their columns)`` of the test block at ``position`` in the pass."""
        ids = [str(h) for h in ids]
        if position < len(self._plans):
            seen_ids, keep, cols = self._plans[position]
            if seen_ids != ids:
                raise ValueError(
                    f"test block {position} changed between passes (loop_over_test needs a "
                    "test source that yields the same samples in the same order every pass)"
                )
            return keep, cols
        keep, cols = [], []
        for row, h in enumerate(ids):
            if h in self._col:
                continue
            self._col[h] = len(self.ids)
            self.ids.append(h)
            keep.append(row)
            cols.append(self._col[h])
        plan = (ids, torch.tensor(keep, dtype=torch.long), torch.tensor(cols, dtype=torch.long))
        self._plans.append(plan)
        return plan[1], plan[2]


class _LayerAudit:
    """Tracks which layers were scored, to reject disjoint caches and warn on partial overlap."""

    def __init__(self) -> None:
        self.shared: set[str] = set()
        self.train_only: set[str] = set()
        self.test_only: set[str] = set()
        self.train_seen: set[str] = set()
        self.test_seen: set[str] = set()

    def record(self, train_layers: set[str], test_layers: set[str]) -> list[str]:
        shared = train_layers & test_layers
        self.shared |= shared
        self.train_seen |= train_layers
        self.test_seen |= test_layers
        return sorted(shared)

    def finish(self) -> None:
        if not self.shared:
            raise ValueError(
                "train and test gradients share no layer: train layers "
                f"{sorted(self.train_seen)}, test layers {sorted(self.test_seen)}; capture both "
                "sides with the same hook config or pass layer_name"
            )
        unshared = (self.train_seen ^ self.test_seen) - self.shared
        if unshared:
            warnings.warn(
                f"layers {sorted(unshared)} were captured on only one side and do not "
                "contribute to the scores",
                UserWarning,
                stacklevel=3,
            )


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


def _to_device(block: Gradient, device: torch.device) -> Gradient:
    """``block`` on ``device`` (unchanged when already there)."""
    return block if block.device == device else block.to(device=device)


class _HeldTest(NamedTuple):
    """A prepared test block: its raw layout (for checks) and its scoring representation.

    The raw captured block itself is not kept: only its layer names and signatures are
    needed after the transform, and holding it would double the test side's memory.
    """

    layers: set[str]
    signatures: dict[str, tuple]
    rep: Gradient
    keep: torch.Tensor
    cols: torch.Tensor


class _ScoringPass:
    """One pass of the scoring loop over a train and a test source."""

    def __init__(
        self,
        attributor: BaseInnerProductAttributor,
        train_source: GradientSource,
        test_source: GradientSource,
        *,
        loop_over_test: bool,
        transform_test: Callable[[Gradient], Gradient],
        token_level: bool,
    ) -> None:
        self.attributor = attributor
        self.test_source = test_source
        self.loop_over_test = loop_over_test
        self.transform_test = transform_test
        self.token_level = token_level
        self.device = torch.device(attributor.args.device)
        self.columns = _TestColumns()
        self.audit = _LayerAudit()
        self.held_tests: list[_HeldTest] | None = None
        self.projections = {
            "train_projection": source_projection(train_source),
            "test_projection": source_projection(test_source),
        }

    def _prepared_tests(self) -> Iterator[_HeldTest]:
        """Yield each test block prepared for scoring.

        Held (not ``loop_over_test``) representations have their dense-preferred
        layers materialized (:func:`finalize_factors`) and their raw linear factors
        preprocessed once, instead of once per train block.
        """
        from dattri_llm.utils.cache import CacheBudget

        budget = CacheBudget(self.device)
        held = 0
        for position, (_step, block, ids) in enumerate(self.test_source):
            block = _to_device(_drop_param_grad(block), self.device)
            keep, cols = self.columns.plan(position, ids)
            layers, signatures = set(block.layer_names), _layer_signatures(block)
            rep = self.transform_test(block)
            del block  # the raw captures are not needed once transformed
            if not self.loop_over_test:
                rep = _preprocess_layers(
                    finalize_factors(rep, budget=budget, held=held), conv=False
                )
                held += rep.nbytes
            yield _HeldTest(layers, signatures, rep, keep, cols)

    def tests(self) -> Iterable[_HeldTest]:
        """The test blocks for the next train block (held, or re-streamed)."""
        if self.loop_over_test:
            return self._prepared_tests()
        if self.held_tests is None:
            self.held_tests = list(self._prepared_tests())
            if not self.held_tests:
                raise ValueError("the test set is empty: the test source yielded no block")
        return self.held_tests

    def _several_test_blocks(self) -> bool:
        """Whether each train block meets more than one test block (unknown → ``True``)."""
        if self.held_tests is not None:
            return len(self.held_tests) > 1
        try:
            return len(self.test_source) != 1
        except TypeError:
            return True

    def score_block(self, block: Gradient) -> tuple[torch.Tensor, int]:
        """Scores of one raw train block against every test block: ``((rows, num_test), T)``.

        With several test blocks, the train block's raw factors are preprocessed once and
        its materialized layers cached across test blocks; against a single test block
        each layer is preprocessed or materialized only while it is scored, so the
        block's layers never hold a second copy all at once.
        """
        from dattri_llm.utils.cache import CacheBudget, TensorCache

        block = _to_device(_drop_param_grad(block), self.device)
        layers, signatures = set(block.layer_names), _layer_signatures(block)
        rep = self.attributor.transform_train_rep(block)
        del block
        tests = self.tests()
        reused = self._several_test_blocks()
        if reused:
            rep = _preprocess_layers(rep)
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        tokens = 1
        cache = TensorCache("memory", budget=CacheBudget(self.device)) if reused else None
        with cache if cache is not None else contextlib.nullcontext():
            for test in tests:
                shared = self.audit.record(layers, test.layers)
                _check_signatures(signatures, test.signatures, shared, **self.projections)
                values = self._pair_scores(rep, test.rep, cache)
                tokens = values.shape[1] if self.token_level else 1
                values = values.reshape(-1, values.shape[-1])
                pieces.append((values[:, test.keep.to(values.device)], test.cols))
        if not pieces:
            raise ValueError("the test set is empty: the test source yielded no block")
        rows = pieces[0][0].shape[0]
        scores = torch.zeros(rows, len(self.columns.ids), dtype=torch.float32)
        for values, cols in pieces:
            scores[:, cols] = values.detach().to(device="cpu", dtype=torch.float32)
        return scores, tokens

    def _pair_scores(
        self, rep: Gradient, test_rep: Gradient, dense_cache: TensorCache | None
    ) -> torch.Tensor:
        """``(B_tr, B_te)`` or, token-level, ``(B_tr, T, B_te)`` scores of one block pair."""
        if self.token_level:
            return self.attributor.inner_product_per_token(rep, test_rep)
        return self.attributor.inner_product(rep, test_rep, dense_cache=dense_cache)


def _train_blocks(
    source: GradientSource, batch_size: int
) -> Iterator[tuple[list[int], Gradient, list[str]]]:
    """``rebatch_blocks(source, batch_size)``; a live streamer of that batch size passes through.

    A ``GradientStreamer`` yields batches of its own batch size (only the last one is
    shorter), so re-batching it to the same size is the identity. Passing it through
    here drops each block as soon as the consumer is done with it, instead of holding
    its captures while the streamer runs the next batch's forward and backward.
    """
    if not isinstance(source, GradientStreamer) or source._batch_size != batch_size:
        yield from rebatch_blocks(source, batch_size)
        return
    for step, block, ids in source:
        item = ([step] * len(ids), block, list(ids))
        del block
        yield item
        del item


def score_sources(
    attributor: BaseInnerProductAttributor,
    train_source: GradientSource,
    test_source: GradientSource,
    *,
    loop_over_test: bool = False,
    transform_test: Callable[[Gradient], Gradient] | None = None,
    attribution_granularity: str = "instance",
) -> ScoreResult:
    """Score every train block of ``train_source`` against every test block.

    Returns ``(scores, row_train_ids, row_steps, test_ids, row_token_ids)``;
    ``scores`` is float32 CPU ``(num_rows, num_test)``. Dense train blocks are
    re-batched to ``args.per_device_train_batch_size`` rows; test blocks are
    transformed once and held unless ``loop_over_test`` (then the test source
    is re-streamed per train block and must be ``reusable``). Token
    granularity gives each train sample ``T`` consecutive rows (positions
    ``0..T-1``).
    """
    from dattri_llm.attribution.base import check_granularity

    check_granularity(attribution_granularity)
    if loop_over_test and not getattr(test_source, "reusable", False):
        raise ValueError(
            "loop_over_test re-streams the test source for every train block, but the test "
            f"source {type(test_source).__name__} is not reusable"
        )
    scoring = _ScoringPass(
        attributor,
        train_source,
        test_source,
        loop_over_test=loop_over_test,
        transform_test=transform_test or attributor.transform_test_rep,
        token_level=attribution_granularity == "token",
    )
    blocks: list[torch.Tensor] = []
    row_ids: list[str] = []
    row_steps: list[int] = []
    row_tokens: list[int] | None = [] if scoring.token_level else None
    if not loop_over_test:
        scoring.tests()  # queries are taken before the train source moves (θ_0 for trajectories)
    train_iter = _train_blocks(train_source, attributor.args.per_device_train_batch_size)
    for steps, block, ids in attributor.progress(train_iter, total=len(train_source)):
        scores, tokens = scoring.score_block(block)
        del block  # release this block's captures before the next one is produced
        blocks.append(scores)
        for step, sample in zip(steps, ids):
            row_ids.extend([str(sample)] * tokens)
            row_steps.extend([int(step)] * tokens)
            if row_tokens is not None:
                row_tokens.extend(range(tokens))
    if not blocks:
        raise ValueError("the training set is empty: the train source yielded no block")
    scoring.audit.finish()
    attributor.scored_layers = sorted(scoring.audit.shared)
    matrix = torch.cat(blocks, dim=0)
    return matrix, row_ids, row_steps, list(scoring.columns.ids), row_tokens

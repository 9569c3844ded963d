"""What an attributor checks and prepares around one pass of the scoring engine.

Layer compatibility of the two sides (widths, dtypes and capture projection of
every shared layer, :func:`check_layer_compatibility`), the audit of the layers
each side brought (disjoint sides refused, one-sided layers warned about), and
:class:`_ScoringChecks`, which wraps the sources and transforms an attributor
hands to :func:`~dattri_llm.attribution.scoring.score_sources`: batch-level
layers dropped, raw blocks checked, the held test side laid out for scoring.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from dattri_llm.attribution.blocks import _drop_param_grad, _preprocess_layers, finalize_factors
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.model.records import base_layer_name
from dattri_llm.gradient.ops.dot import effective_dims
from dattri_llm.gradient.ops.types import is_embedding
from dattri_llm.gradient.store.sidecars import projection_record
from dattri_llm.utils.cache import CacheBudget

if TYPE_CHECKING:
    from dattri_llm.gradient.stream.source import GradientSource

_COMPARED_PROJECTION_KEYS = (
    "style",
    "proj_dim",
    "proj_seed",
    "proj_type",
    "include_bias",
    "projector",
)


# ---------------------------------------------------------------------------- compatibility
def _layer_signature(rep: Gradient, name: str) -> tuple:
    """``(representation, final?, widths, dtype)`` of one layer, independent of B and T."""
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
    store = getattr(source, "file_manager", None)
    if store is not None:
        return store.projection
    manager = getattr(source, "hook_manager", None)
    if manager is not None:
        return projection_record(manager.config.projection_kwargs, manager.config.projector)
    return None


def _layer_projection(record: Mapping[str, dict], name: str) -> dict | None:
    """Compared settings of layer ``name`` (``name@k`` → ``name``), else ``"__default__"``."""
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


# ---------------------------------------------------------------------------- the pass's checks
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
                stacklevel=4,
            )
        return sorted(shared)


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

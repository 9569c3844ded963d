"""The one backward sweep the trajectory methods share.

A trajectory method scores the rows of every recorded update against queries
taken at the end of the run (``θ_T``). Each method carries a summary ``U`` of
how the state after an update moves the queries' loss, from the last update to
the first, and at each update:

1. emits the rows of the update's samples, ``Y = K·(C t)ᵀ``, where ``K`` is
   the method's sensitivity of ``U`` to the update's gradient, ``t`` a
   sample's share of it and ``C`` how the loop transformed the gradient (the
   clip ``c``, with its Jacobian ``c(I − ĝĝᵀ)`` for AdamW-influence);
2. folds the update into ``U`` (the method's own transition, plus the
   Gauss–Newton coupling ``Σ_b c_b Y_b t_bᵀ`` of the batch gradient through
   the parameters).

:class:`TrajectorySweep` does everything but the method's own algebra, once:
resolving which updates (windows of store steps) to sweep, reading each
update's rows as one dense ``(B, p)`` block (layers concatenated in sorted
order, token axes summed, factors materialized), the per-row curvature scale
``c_b``, the clip and loss scale of the update, each coordinate's
hyperparameters, the query-side (``U`` starts at the queries ``Q``) or
train-side (``U`` starts at ``I``; rows are embeddings scored against ``Q`` at
the end) propagation, disjoint coordinate groups, and the rows' metadata. A
:class:`Fold` supplies the algebra (:mod:`.folds`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics, Window
from dattri_llm.attribution.blocks import per_sample_layers
from dattri_llm.attribution.scoring import ScoredBatch, ScoreSink

if TYPE_CHECKING:
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource

LOSS_REDUCTIONS = ("mean", "sum")
PROPAGATIONS = ("train", "test")
SUMMARY_WARN_BYTES = 2 * 1024**3


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError`` naming the option."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


# ---------------------------------------------------------------------------- one update's rows
@dataclass
class WindowRows:
    """One update's rows, as every fold sees them.

    Attributes:
        window: the update.
        layout: ``{layer: width}`` in concatenation order.
        types: ``{layer: layer type}`` of the stored blocks.
        z: ``(B, p)`` stored rows, layers concatenated in layout order.
        ids: the rows' sample ids; ``steps``: their store steps.
        curvature: ``(B,)`` ``c_b`` of the Gauss–Newton term ``H = Σ_b c_b t_b t_bᵀ``.
        hat: ``(p,)`` the clipped gradient's unit direction ``ĝ`` on the captured
            coordinates (``None`` when the clip was inactive).
        hat_rows: ``(B,)`` ``z_b·ĝ`` over every captured coordinate (``None`` likewise).
        entry: the method's per-update record (AdamW moments), if any.
        values: ``key → (p,)`` per-coordinate hyperparameters (cached per key).
        cache: per-update values a fold computes once for all its coordinate groups.
    """

    window: Window
    layout: dict[str, int]
    types: dict[str, str]
    z: torch.Tensor
    ids: list[str]
    steps: list[int]
    curvature: torch.Tensor
    hat: torch.Tensor | None
    hat_rows: torch.Tensor | None
    entry: Mapping[str, Any] | None
    values: Callable[[str], torch.Tensor]
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """``c / ρ``: what the update applied per stored row."""
        return self.window.row_step_scale

    @property
    def rho(self) -> float:
        """``ρ``: the loss scale the stored rows carry."""
        return self.window.row_scale


class Fold(ABC):
    """A method's algebra in the sweep: its summary per coordinate group and one update's step.

    ``combine`` is how the coordinate groups' rows add up: ``"sum"`` (blocks
    of one summary) or ``"mean"`` (independent estimates averaged).
    """

    combine: str = "sum"
    #: Whether the fold changes its summary (``False``: rows only, no propagation).
    propagates: bool = True

    @abstractmethod
    def start(self, initial: torch.Tensor) -> Any:
        """The summary of one coordinate group from ``initial`` (``Q`` or ``I``, ``(R, p_g)``)."""

    @abstractmethod
    def step(
        self,
        summary: Any,
        rows: WindowRows,
        columns: Columns,
        *,
        emit: bool,
        fold: bool,
    ) -> torch.Tensor | None:
        """Emit ``(B, R)`` rows when ``emit``; fold the update into ``summary`` when ``fold``.

        ``columns`` selects the group's coordinates (``None``: all).
        """

    def summary_bytes(self, rows: int, width: int, itemsize: int) -> int:
        """Bytes of one group's summary of ``rows × width`` entries."""
        return rows * width * itemsize

    def check_run(self, run: RunDynamics, windows: list[Window]) -> None:  # noqa: B027
        """Refuse what the fold cannot model in ``run`` (before any pass); no-op."""


Columns = torch.Tensor | slice | None


def select(values: torch.Tensor, columns: Columns) -> torch.Tensor:
    """``values[..., columns]``: all when ``None``, a view for a ``slice``, a copy for indices."""
    return values if columns is None else values[..., columns]


def group_width(columns: Columns, width: int) -> int:
    """Coordinates a group selects out of ``width``."""
    if columns is None:
        return width
    if isinstance(columns, slice):
        return len(range(*columns.indices(width)))
    return columns.numel()


# ---------------------------------------------------------------------------- reading rows
def dense_rows(
    block: Gradient, layers: Iterable[str], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{layer: (B, d_l)}`` of a block.

    Token axes are summed and factors materialized (``[W | b]`` layout).

    Raises:
        ValueError: a layer holding one row for a block of several samples (a
            batch-summed, broadcast layer: its gradient is not per sample).
    """
    layers = list(layers)
    dense = block.select_layers(layers).aggregate().materialize()
    rows = {}
    for name in layers:
        value = dense.data[name].to(device=device, dtype=dtype)
        value = value.reshape(value.shape[0], -1)
        if value.shape[0] != block.batch_size:
            raise ValueError(
                f"layer {name!r} holds {value.shape[0]} row(s) for a block of "
                f"{block.batch_size} samples: its gradient is summed over the batch (a "
                "broadcast layer such as a positional embedding), so no sample's own gradient "
                "is known. Leave it out: layer_name=[...] without it, or exclude it from the "
                "HookManagerConfig"
            )
        rows[name] = value
    return rows


def block_layers(block: Gradient, wanted: list[str] | None) -> list[str]:
    """The block's per-sample layers (sorted), restricted to ``wanted``."""
    layers = per_sample_layers(block)
    if wanted is not None:
        layers = [name for name in layers if name in wanted]
    if not layers:
        raise ValueError(
            "a training block holds no per-sample layer to sweep (only batch-level param_grad "
            "layers, or none of layer_name); capture layers with the linear_io hook family"
        )
    return sorted(layers)


# ---------------------------------------------------------------------------- the sweep
@dataclass
class SweepResult:
    """Rows of the emitted updates, latest first; ``layers``: those shared with the queries."""

    scores: torch.Tensor
    row_ids: list[str]
    row_steps: list[int]
    layers: list[str] = field(default_factory=list)


@dataclass
class Emission:
    """One swept update's emitted rows: ``out`` is ``(B_emitted, R)``; ``keep`` the emitted rows'
    positions in ``rows``."""

    rows: WindowRows
    out: torch.Tensor
    keep: list[int]


class TrajectorySweep:
    """Sweep a run's updates latest first with one :class:`Fold` (see the module docstring).

    Args:
        fold: the method's algebra.
        run: the recorded dynamics.
        device, dtype: where and in what the sweep computes.
        loss_reduction: ``"mean"`` (a sample's share is its loss's gradient over
            its micro-batch's rows and the loss divisor) or ``"sum"``.
        learning_rates: ``{window key: η}`` overriding the recorded rates
            (``None``: each coordinate's recorded group rate).
        groups: ``layout → [column index or None, ...]`` coordinate groups
            (default: one group of every coordinate).
        progress: wraps the window iterator (a progress bar), or ``None``.
    """

    def __init__(
        self,
        fold: Fold,
        run: RunDynamics,
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        loss_reduction: str = "mean",
        learning_rates: Mapping[int, float] | None = None,
        groups: Callable[[dict[str, int]], list[Columns]] | None = None,
        progress: Callable[[list[Window]], Iterable[Window]] | None = None,
    ) -> None:
        check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        self.fold, self.run = fold, run
        self.device, self.dtype = device, dtype
        self.loss_reduction = loss_reduction
        self.learning_rates = learning_rates
        self.groups = groups or (lambda layout: [None])
        self.progress = progress or (lambda windows: windows)
        self.layers_used: list[str] = []

    # ------------------------------------------------------------------ entry points
    def sweep(
        self,
        source: GradientSource,
        windows: list[Window],
        emitted: set[int],
        queries: Mapping[str, torch.Tensor],
        *,
        propagation: str = "test",
        layers: list[str] | None = None,
        entries: Mapping[int, Mapping[str, Any]] | None = None,
        on_emission: Callable[[Emission], None] | None = None,
        sink: ScoreSink | None = None,
    ) -> SweepResult:
        """Rows of the ``emitted`` store steps against ``queries`` (``{layer: (n, d)}``).

        ``windows`` are the propagated updates (ascending); the sweep runs from
        the last one down to the earliest holding an emitted step.
        ``on_emission`` sees every :class:`Emission` first (train side: the
        embeddings, before the queries). With a ``sink`` (already started on
        the query columns) each update's rows go to ``sink.add`` and are
        dropped: the result then holds no rows.

        Raises:
            ValueError: no layer shared with the queries, a width mismatch.
        """
        n_test = next(iter(queries.values())).shape[0]
        blocks, row_ids, row_steps = [], [], []
        for emission in self.emissions(
            source,
            windows,
            emitted,
            queries,
            propagation=propagation,
            layers=layers,
            entries=entries,
        ):
            if on_emission is not None:
                on_emission(emission)
            out = emission.out
            if propagation == "train":
                out = out @ self._queries.T
            ids = [emission.rows.ids[i] for i in emission.keep]
            steps = [emission.rows.steps[i] for i in emission.keep]
            if sink is not None:
                sink.add(ScoredBatch(out.to("cpu", torch.float32), ids, steps, None))
                continue
            blocks.append(out.to("cpu", torch.float32))
            row_ids.extend(ids)
            row_steps.extend(steps)
        scores = torch.cat(blocks) if blocks else torch.zeros(0, n_test)
        return SweepResult(scores, row_ids, row_steps, list(self.layers_used))

    def emissions(
        self,
        source: GradientSource,
        windows: list[Window],
        emitted: set[int],
        queries: Mapping[str, torch.Tensor] | None,
        *,
        propagation: str = "test",
        layers: list[str] | None = None,
        entries: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> Iterator[Emission]:
        """The swept updates' emitted rows, latest first.

        Query side: ``(B, n_test)`` rows. Train side: ``(B, p)`` embeddings (the
        rows before the queries; ``queries`` may then be ``None``).
        """
        check_choice("propagation", propagation, PROPAGATIONS)
        if queries is None and propagation == "test":
            raise ValueError("the query-side sweep needs queries")
        swept = swept_windows(windows, emitted)
        self.fold.check_run(self.run, swept)
        state: _State | None = None
        for position, window in enumerate(self.progress(list(reversed(swept)))):
            read = self._read(source, window, layers, entries)
            if state is None:
                state = self._start(read.layout, queries, propagation)
            rows = self._rows(read)
            keep = [i for i, step in enumerate(rows.steps) if step in emitted]
            fold = position < len(swept) - 1 and self.fold.propagates
            out = self._step(state, rows, emit=bool(keep), fold=fold)
            if keep:
                yield Emission(rows, out if len(keep) == len(rows.ids) else out[keep], keep)
            del read, rows, out

    def forward_rows(
        self,
        source: GradientSource,
        windows: list[Window],
        *,
        layers: list[str] | None = None,
        entries: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> Iterator[WindowRows]:
        """Each of ``windows``' rows, earliest first (for sweeps that run forward in time).

        Raises:
            ValueError: windows whose blocks disagree on layers.
        """
        layout: dict[str, int] | None = None
        for window in self.progress(list(windows)):
            rows = self._rows(self._read(source, window, layers, entries))
            if layout is not None and rows.layout != layout:
                raise ValueError(
                    f"training blocks disagree on layers: update {window.key} has "
                    f"{dict(rows.layout)}, earlier updates {layout}; record the whole run with "
                    "the same hook config"
                )
            layout = rows.layout
            yield rows

    def query_matrix(
        self, layout: Mapping[str, int], queries: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[str]]:
        """The queries ``{layer: (n_test, d)}`` as one ``(n_test, p)`` matrix in ``layout``.

        Layers only the training side holds are zero. Returns the matrix and the
        layers both sides hold.

        Raises:
            ValueError: no layer shared with the queries, a width mismatch.
        """
        shared = _check_queries(layout, queries)
        n_test = next(iter(queries.values())).shape[0]
        q = torch.zeros(n_test, sum(layout.values()), dtype=self.dtype, device=self.device)
        offset = 0
        for name, size in layout.items():
            if name in queries:
                q[:, offset : offset + size] = queries[name].to(self.device, self.dtype)
            offset += size
        return q, shared

    # ------------------------------------------------------------------ summaries
    def _start(
        self,
        layout: dict[str, int],
        queries: Mapping[str, torch.Tensor] | None,
        propagation: str,
    ) -> _State:
        width = sum(layout.values())
        q = None
        self.layers_used = list(layout)
        if queries is not None:
            q, self.layers_used = self.query_matrix(layout, queries)
        self._queries = q
        groups = self.groups(layout)
        if propagation == "train":
            self._warn_if_large(groups, width)
        summaries = []
        for columns in groups:
            if propagation == "train":
                size = group_width(columns, width)
                initial = torch.eye(size, dtype=self.dtype, device=self.device)
            else:  # q is this sweep's own: one group may take it as it is
                initial = q if columns is None else select(q, columns).clone()
            summaries.append(self.fold.start(initial))
        columns = [c.to(self.device) if isinstance(c, torch.Tensor) else c for c in groups]
        return _State(layout, columns, summaries, propagation)

    def _warn_if_large(self, groups: list[Columns], width: int) -> None:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        sizes = [group_width(c, width) for c in groups]
        total = sum(self.fold.summary_bytes(n, n, itemsize) for n in sizes)
        if total > SUMMARY_WARN_BYTES:
            warnings.warn(
                f"the train-side summary holds {total / 1024**3:.1f} GiB ({len(sizes)} "
                f"group(s), largest block ({max(sizes)}, {max(sizes)})); use propagation='test' "
                "(memory ∝ queries × coordinates), fewer coordinates (a mask), or fewer layers",
                UserWarning,
                stacklevel=5,
            )

    def _step(
        self, state: _State, rows: WindowRows, *, emit: bool, fold: bool
    ) -> torch.Tensor | None:
        outputs = [
            self.fold.step(summary, rows, columns, emit=emit, fold=fold)
            for columns, summary in zip(state.columns, state.summaries, strict=True)
        ]
        if not emit:
            return None
        weight = 1.0 / len(outputs) if self.fold.combine == "mean" else 1.0
        if state.propagation == "test" or state.columns == [None]:
            total = outputs[0]
            for out in outputs[1:]:
                total = total + out
            return total * weight if weight != 1.0 else total
        embeddings = torch.zeros_like(rows.z)
        for columns, out in zip(state.columns, outputs, strict=True):
            embeddings[:, columns] += out * weight
        return embeddings

    # ------------------------------------------------------------------ rows
    def _read(
        self,
        source: GradientSource,
        window: Window,
        layers: list[str] | None,
        entries: Mapping[int, Mapping[str, Any]] | None,
    ) -> _Read:
        """The window's blocks as one ``(B, p)`` matrix, latest store step first."""
        by_step: dict[int, list[tuple[Gradient, list[str]]]] = {}
        for step, block, block_ids in source.for_steps(list(window.steps)):
            by_step.setdefault(int(step), []).append((block, [str(i) for i in block_ids]))
        parts: list[torch.Tensor] = []
        ids: list[str] = []
        steps: list[int] = []
        micro: list[int] = []
        layout: dict[str, int] | None = None
        types: dict[str, str] = {}
        for step in sorted(by_step, reverse=True):
            for block, block_ids in by_step.pop(step):
                names = block_layers(block, layers)
                if layout is not None and names != list(layout):
                    raise ValueError(
                        f"training blocks disagree on layers: step {step} has {names}, earlier "
                        f"blocks {list(layout)}; record the whole run with the same hook config"
                    )
                rows = dense_rows(block, names, self.dtype, self.device)
                layout = layout or {name: value.shape[1] for name, value in rows.items()}
                types = types or {name: block.layer_types[name] for name in layout}
                parts.append(torch.cat([rows[name] for name in layout], dim=1))
                ids.extend(block_ids)
                steps.extend([step] * len(block_ids))
                micro.append(len(block_ids))
                del block, rows
        if layout is None:
            raise ValueError(f"the train source yielded no block for steps {list(window.steps)}")
        z = torch.cat(parts) if len(parts) > 1 else parts[0]
        entry = None if entries is None else entries.get(window.record_key)
        return _Read(window, layout, types, z, ids, steps, micro, entry)

    def _rows(self, read: _Read) -> WindowRows:
        window, z = read.window, read.z
        hat = hat_rows = None
        if window.clipped:
            hat, hat_rows = self._clip_direction(window, z)
        cache: dict[str, torch.Tensor] = {}

        def values(key: str) -> torch.Tensor:
            if key not in cache:
                if key == "lr" and self.learning_rates is not None:
                    rate = self.learning_rates[window.key]
                    cache[key] = torch.full(
                        (z.shape[1],), rate, dtype=self.dtype, device=self.device
                    )
                else:
                    value = self.run.values(window, read.layout, key, dtype=self.dtype)
                    cache[key] = value.to(self.device)
            return cache[key]

        return WindowRows(
            window,
            read.layout,
            read.types,
            z,
            read.ids,
            read.steps,
            self._curvature(read),
            hat,
            hat_rows,
            read.entry,
            values,
        )

    def _curvature(self, read: _Read) -> torch.Tensor:
        """``c_b`` per row: the inverse of the row's share factor in the loss."""
        window = read.window
        divisor = float(window.loss_divisor)
        rows = read.z.shape[0]
        if self.loss_reduction == "sum":
            return torch.full((rows,), divisor, dtype=self.dtype, device=self.device)
        micro = list(window.micro_rows or ())
        if sum(micro) != rows:
            micro = read.micro
        sizes = torch.cat([torch.full((n,), float(n)) for n in micro])
        return sizes.to(self.device, self.dtype) * divisor

    def _clip_direction(self, window: Window, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ĝ = u/‖u‖`` on the captured coordinates (``u = (c/ρ)·Σ_b z_b``) and ``Z ĝ``."""
        applied = z.sum(0) * window.row_step_scale
        captured = float(applied.norm())
        norm = window.grad_norm or captured
        if captured < (1.0 - 1e-3) * norm:
            self.run.warn_once(
                "partial-clip",
                f"the clip Jacobian c(I − ĝĝᵀ) is approximated: the captured coordinates hold "
                f"{(captured / norm) ** 2:.1%} of the clipped gradient's squared norm, so ĝ·t "
                "misses the uncaptured parameters' part. Capture every trainable parameter (all "
                "coordinates) for exact scores",
            )
        elif captured > (1.0 + 1e-3) * norm:
            self.run.warn_once(
                "clip-mismatch",
                f"the captured rows sum to a gradient of norm {captured:.4g} but the recorded "
                f"update applied one of norm {norm:.4g}; the store and the recorded dynamics "
                "may come from different runs",
            )
        hat = applied / norm
        return hat, z @ hat


@dataclass
class _Read:
    window: Window
    layout: dict[str, int]
    types: dict[str, str]
    z: torch.Tensor
    ids: list[str]
    steps: list[int]
    micro: list[int]
    entry: Mapping[str, Any] | None


@dataclass
class _State:
    layout: dict[str, int]
    columns: list[Columns]
    summaries: list[Any]
    propagation: str


def swept_windows(windows: list[Window], emitted: set[int]) -> list[Window]:
    """The windows from the earliest one holding an emitted step to the last (ascending)."""
    first = next(
        (i for i, window in enumerate(windows) if any(s in emitted for s in window.steps)), None
    )
    return [] if first is None else windows[first:]


def _check_queries(layout: Mapping[str, int], queries: Mapping[str, torch.Tensor]) -> list[str]:
    """Layers both sides hold (sorted); ``ValueError`` if none or widths differ."""
    shared = sorted(set(layout) & set(queries))
    if not shared:
        raise ValueError(
            f"train and test gradients share no layer: train layers {sorted(layout)}, test "
            f"layers {sorted(queries)}; capture both sides with the same hook config or pass "
            "layer_name"
        )
    for name in shared:
        if queries[name].shape[1] != layout[name]:
            raise ValueError(
                f"layer {name!r}: train gradients have width {layout[name]} but test gradients "
                f"{queries[name].shape[1]}; capture both sides from the same model with the "
                "same projection"
            )
    one_sided = sorted(set(layout) ^ set(queries))
    if one_sided:
        warnings.warn(
            f"layers {one_sided} were captured on only one side and do not contribute to the "
            "scores (train-only layers still enter the propagation)",
            UserWarning,
            stacklevel=7,
        )
    return shared

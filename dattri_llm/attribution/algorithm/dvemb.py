"""DVEmb: data value embeddings (Wang et al., 2025b), a trajectory method.

``I(z*, s; z') = η_s ∇ℓ(θ_T, z')ᵀ [Π_{k=s+1}^{T-1}(I − η_k H_k)] ĝ(θ_s, z*)`` with
``H_k = c Σ_{z∈B_k} ĝ_z ĝ_zᵀ`` (``c = |B_k|`` for a mean loss, 1 for a sum):
training sample ``z*`` seen at step ``s`` moves the parameters by ``η_s ĝ``,
and every later step ``k`` damps that move by ``I − η_k H_k`` before it reaches
the queries at the final parameters ``θ_T``. ``hessian_mode="full"`` couples
every layer in ``H``; ``"diagonal"`` keeps its per-layer blocks only. With
``H = 0`` a row is ``η_s`` times its TracIn row.

Two sweeps over the steps, latest first, give identical scores:

* ``propagation="train"``: each sample's *embedding* ``e = η_s(ĝ − Mĝ)``, then
  ``M ← M + η_s c Σ_b (ĝ_b − Mĝ_b) ĝ_bᵀ``; the score is ``<e, ∇ℓ(θ_T, z')>``.
  Embeddings do not depend on the queries: ``cache_dvemb`` stores them so
  ``TracInAttributor.attribute_from_cache(dvemb_dir, test_dir)`` gives the
  DVEmb score. ``M`` is ``(d, d)`` (per layer when diagonal).
* ``propagation="test"``: rows ``η_s <ĝ, w>``, then
  ``w ← w − η_s c Σ_b <ĝ_b, w> ĝ_b``, ``w`` starting at the query gradient;
  memory ∝ queries × d. ``loop_over_test`` sweeps once per query block.

Curvature runs over the training side's layers; scores over the layers both
sides share.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution import utils as attribution_utils
from dattri_llm.attribution.algorithm import _dvemb_sweep as sweep
from dattri_llm.attribution.algorithm.trajectory import LOSS_REDUCTIONS, TrajectoryAttributor
from dattri_llm.attribution.base import _check_dataset, _require_records, fresh_store
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.gradient.storage_manager import GradientStorageManager

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.streaming import GradientSource, StreamBatch

HESSIAN_MODES = sweep.HESSIAN_MODES
DVEMB_DIR = "dvemb_grads"

LearningRate = float | Mapping[int, float] | None


class DVEmbAttributor(TrajectoryAttributor):
    """Data value embeddings (``algorithm="DVEmb"``) over one recorded training run."""

    algorithm: ClassVar[str] = "DVEmb"

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)

    # ------------------------------------------------------------------ entry points
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        gradient_cache_residency: str = "disk",
        propagation: str = "train",
        dvemb_dir: str | None = None,
        hessian_mode: str = "full",
        selected_training_steps: Iterable[int] | None = None,
        loss_reduction: str = "mean",
        learning_rate: LearningRate = 1.0,
    ) -> AttributionScore:
        """Train from checkpoint 0 recording the run, then score it (:meth:`attribute_from_cache`).

        ``"disk"`` records into ``args.output_dir`` through :meth:`cache`;
        ``"memory"``/``"tiered"`` into temporary stores of that residency (the
        run's learning rates passed on as ``recorded_lr``).

        Raises:
            ValueError: a residency not in ``CACHE_RESIDENCIES``; any option
                :meth:`attribute_from_cache` refuses (checked before training).
        """
        from dattri_llm.utils.cache import CACHE_RESIDENCIES

        if gradient_cache_residency not in CACHE_RESIDENCIES:
            raise ValueError(
                f"gradient_cache_residency must be one of {list(CACHE_RESIDENCIES)}, got "
                f"{gradient_cache_residency!r}"
            )
        _check_options(propagation, loop_over_test, hessian_mode, loss_reduction, dvemb_dir)
        self.require_task("attribute")
        _check_dataset(train_dataset, "training")
        _check_dataset(test_dataset, "test")
        options = {
            "selected_training_steps": selected_training_steps,
            "verbose": verbose,
            "loop_over_test": loop_over_test,
            "propagation": propagation,
            "dvemb_dir": dvemb_dir,
            "hessian_mode": hessian_mode,
            "loss_reduction": loss_reduction,
            "learning_rate": learning_rate,
            "hook_config": hook_config,
        }
        if gradient_cache_residency == "disk":
            ((train_dir, test_dir),) = self.cache(
                train_dataset, test_dataset, hook_config=hook_config
            )
            return self.attribute_from_cache(train_dir, test_dir, **options)
        with tempfile.TemporaryDirectory(prefix="dattri_llm_dvemb_") as tmp, ExitStack() as stack:
            test_store = stack.enter_context(
                GradientStorageManager(f"{tmp}/test", residency=gradient_cache_residency)
            )
            if self.recompute:
                train: TrajectorySnapshots | GradientStorageManager = TrajectorySnapshots(
                    f"{tmp}/snapshots"
                )
            else:
                train = stack.enter_context(
                    GradientStorageManager(f"{tmp}/train", residency=gradient_cache_residency)
                )
            self.load_checkpoint(self.checkpoints()[0])
            lrs = self.collect_trajectory(
                train, test_store, train_dataset, test_dataset, hook_config=hook_config
            )
            return self.attribute_from_cache(train, test_store, recorded_lr=lrs, **options)

    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        algorithm_meta: dict[str, Any] | None = None,
        propagation: str = "train",
        dvemb_dir: str | None = None,
        hessian_mode: str = "full",
        final_step: int | None = None,
        loss_reduction: str = "mean",
        learning_rate: LearningRate = 1.0,
        recorded_lr: Mapping[int, float] | None = None,
        hook_config: HookManagerConfig | None = None,
        block_dtype: torch.dtype = torch.float32,
    ) -> AttributionScore:
        """DVEmb scores of a recorded run (gradient store or snapshots) against cached queries.

        Steps before ``final_step`` (default: last recorded + 1) are propagated;
        ``selected_training_steps`` keeps only those steps' rows (latest first).
        ``learning_rate``: a float ≥ 0, ``{step: lr}`` covering every
        propagated step, or ``None`` for the recorded schedule (``recorded_lr``,
        else ``lr_schedule.json`` beside the train source); a configured value
        that differs from the recorded schedule warns and is used.
        ``dvemb_dir`` (train propagation) also stores the embeddings there.
        The sweep runs in ``block_dtype`` on ``args.device``.

        Raises:
            ValueError: bad ``propagation``/``hessian_mode``/``loss_reduction``;
                ``loop_over_test`` or ``dvemb_dir`` without
                ``propagation="test"``/``"train"``; a propagated step without a
                learning rate; an empty test source; no layer shared by the
                two sides.
        """
        _check_options(propagation, loop_over_test, hessian_mode, loss_reduction, dvemb_dir)
        self.scored_layers = []
        layers = attribution_utils.normalize_layer_names(layer_name)
        test_store = self.resolve_store(test_source)
        _require_records(test_store, "test")
        prop_steps, output_steps, final_step = self.resolve_steps(
            self.available_steps(train_source), selected_training_steps, final_step
        )
        swept = _swept_steps(prop_steps, output_steps)
        recorded = recorded_lr if recorded_lr is not None else self.recorded_lr_of(train_source)
        lrs = sweep.resolve_learning_rates(learning_rate, swept, recorded)
        source_meta = self.source_meta(train_source, test_store)
        settings = _Settings(lrs, loss_reduction, hessian_mode, block_dtype)
        train = self.open_train_source(
            train_source, steps=swept, layer_name=layers, hook_config=hook_config
        )
        test = self.load_test_rep(test_source, layer_name=layers)
        self._verbose = verbose
        try:
            if propagation == "train":
                result = self._score_embeddings(
                    train, test, swept, output_steps, settings, dvemb_dir, source_meta
                )
            elif loop_over_test:
                result = self._score_query_blocks(train, test, swept, output_steps, settings)
            else:
                result = self._score_queries(train, test, swept, output_steps, settings)
        finally:
            self._verbose = False
            self.close_source(train)
        scores, row_ids, row_steps, test_ids = result
        meta = {
            "final_step": final_step,
            "selected_training_steps": (
                None if selected_training_steps is None else sorted(output_steps)
            ),
            "propagated_steps": swept,
            "learning_rate": lrs,
            "loss_reduction": loss_reduction,
            "propagation": propagation,
            "loop_over_test": loop_over_test,
            "block_dtype": str(block_dtype),
            "dvemb_dir": None if dvemb_dir is None else str(dvemb_dir),
            "hessian_mode": hessian_mode,
            **source_meta,
            **(algorithm_meta or {}),
        }
        return self.build_score(
            scores,
            row_ids,
            row_steps,
            test_ids,
            algorithm_meta=meta,
            layer_name=list(self.scored_layers),
        )

    def cache_dvemb(
        self,
        train_gradients_dir: object,
        dvemb_dir: str | None = None,
        *,
        selected_training_steps: Iterable[int] | None = None,
        hessian_mode: str = "full",
        final_step: int | None = None,
        loss_reduction: str = "mean",
        verbose: bool = False,
        layer_name: str | list[str] | None = None,
        learning_rate: LearningRate = 1.0,
    ) -> str:
        """Store the embeddings of a recorded run; return the store's directory.

        ``dvemb_dir`` defaults to ``<output_dir>/dvemb_grads``. Scoring it with
        ``TracInAttributor.attribute_from_cache(dvemb_dir, test_dir)`` gives
        the DVEmb score (train propagation) of the same options.

        Raises:
            ValueError: bad ``hessian_mode``/``loss_reduction``; a propagated
                step without a learning rate; ``dvemb_dir`` already holding records.
        """
        _check_options("train", False, hessian_mode, loss_reduction, None)
        layers = attribution_utils.normalize_layer_names(layer_name)
        prop_steps, output_steps, _final = self.resolve_steps(
            self.available_steps(train_gradients_dir), selected_training_steps, final_step
        )
        swept = _swept_steps(prop_steps, output_steps)
        lrs = sweep.resolve_learning_rates(
            learning_rate, swept, self.recorded_lr_of(train_gradients_dir)
        )
        target = Path(dvemb_dir or Path(self.args.output_dir) / DVEMB_DIR).expanduser()
        store = fresh_store(target)
        train = self.open_train_source(train_gradients_dir, steps=swept, layer_name=layers)
        sample_id_key = _train_sample_id_key(self, train)
        try:
            embeddings = self.embed_trajectory(
                train,
                swept,
                output_steps,
                learning_rate=lrs,
                loss_reduction=loss_reduction,
                hessian_mode=hessian_mode,
                verbose=verbose,
            )
            for _item in _persisted(embeddings, store, train, sample_id_key):
                pass
        finally:
            self.close_source(train)
        return str(target)

    # ------------------------------------------------------------------ the sweeps
    def embed_trajectory(
        self,
        train_source: object,
        prop_steps: list[int],
        output_steps: list[int],
        *,
        learning_rate: float | Mapping[int, float],
        loss_reduction: str = "mean",
        hessian_mode: str = "full",
        verbose: bool = False,
    ) -> Iterator[StreamBatch]:
        """Embedding blocks ``(step, Gradient, ids)`` of the ``output_steps``, latest first.

        Sweeps ``prop_steps`` latest first (stopping after the earliest output
        step); each block holds ``η_s(ĝ − Mĝ)`` per training layer, dense
        ``(B, d_l)`` in ``float32`` on ``args.device``. ``train_source`` is
        anything :meth:`open_train_source` accepts.

        Raises:
            ValueError: bad ``hessian_mode``/``loss_reduction``; a step without
                a learning rate.
        """
        _check_options("train", False, hessian_mode, loss_reduction, None)
        lrs = sweep.resolve_learning_rates(learning_rate, prop_steps, None)
        settings = _Settings(lrs, loss_reduction, hessian_mode, torch.float32)
        source = self.open_train_source(train_source)
        try:
            yield from self._embeddings(source, prop_steps, output_steps, settings, verbose=verbose)
        finally:
            if source is not train_source:
                self.close_source(source)

    def _embeddings(
        self,
        source: GradientSource,
        prop_steps: list[int],
        output_steps: list[int],
        settings: _Settings,
        *,
        verbose: bool = False,
    ) -> Iterator[StreamBatch]:
        """The train-side sweep behind :meth:`embed_trajectory` (blocks in ``settings.dtype``)."""
        operator: sweep.TrainOperator | None = None
        steps = self._steps_latest_first(source, prop_steps, output_steps, settings, verbose)
        for step, blocks in steps:
            count = 0
            for rows, types, ids in blocks:
                if operator is None:
                    operator = sweep.TrainOperator(
                        sweep.layer_groups(sorted(rows), settings.hessian_mode),
                        settings.dtype,
                        self._device,
                    )
                    operator.warn_if_large(rows)
                residuals = operator.residuals(rows)
                if step in output_steps:
                    yield step, _embedding_block(residuals, types, settings.lrs[step]), ids
                operator.accumulate(residuals, rows)
                count += len(ids)
            operator.step(settings.scale(step, count))

    def _steps_latest_first(
        self,
        source: GradientSource,
        prop_steps: list[int],
        output_steps: list[int],
        settings: _Settings,
        verbose: bool,
    ) -> Iterator[tuple[int, list[tuple[sweep.Rows, dict[str, str], list[str]]]]]:
        """``(step, [(rows, layer_types, ids), ...])`` per step, latest first.

        Rows are dense ``(B, d_l)`` in ``settings.dtype`` on ``args.device``.
        Stops after the earliest output step (earlier steps change no row); a
        progress bar when this call or the current entry point is verbose.
        """
        verbose_before, self._verbose = self._verbose, verbose or self._verbose
        steps = self.steps_bar(_swept_steps(prop_steps, output_steps))
        self._verbose = verbose_before
        layers: list[str] | None = None
        for step in steps:
            blocks = []
            for _step, block, ids in source.for_steps(step):
                rows = sweep.dense_rows(block, settings.dtype, self._device)
                layers = layers or sorted(rows)
                sweep.check_same_layers(rows, layers, step)
                blocks.append((rows, dict(block.layer_types), [str(i) for i in ids]))
                del block
            yield step, blocks

    @property
    def _device(self) -> torch.device:
        """The device the sweep runs on (``args.device``)."""
        return torch.device(self.args.device)

    # ------------------------------------------------------------------ scoring
    def _score_embeddings(
        self,
        train: GradientSource,
        test: GradientSource,
        swept: list[int],
        output_steps: list[int],
        settings: _Settings,
        dvemb_dir: str | None,
        source_meta: dict[str, Any],
    ) -> tuple[torch.Tensor, list[str], list[int], list[str]]:
        """Train propagation: ``<e, q>`` over shared layers; embeddings kept in ``dvemb_dir``."""
        test_ids, queries = self.collect_test_matrix(test, dtype=settings.dtype)
        embeddings = self._embeddings(train, swept, output_steps, settings)
        if dvemb_dir is not None:
            store = fresh_store(Path(dvemb_dir).expanduser())
            key = source_meta["sample_id_key"]["train"]
            embeddings = _persisted(embeddings, store, train, key)
        blocks, row_ids, row_steps = [], [], []
        shared: list[str] | None = None
        for step, block, ids in embeddings:
            shared = shared or self._shared_layers(block.data, queries)
            blocks.append(sum(block.data[n] @ queries[n].T for n in shared).float().cpu())
            row_ids.extend(ids)
            row_steps.extend([step] * len(ids))
        return torch.cat(blocks), row_ids, row_steps, test_ids

    def _score_queries(
        self,
        train: GradientSource,
        test: GradientSource,
        swept: list[int],
        output_steps: list[int],
        settings: _Settings,
    ) -> tuple[torch.Tensor, list[str], list[int], list[str]]:
        """Test propagation over every query at once."""
        test_ids, queries = self.collect_test_matrix(test, dtype=settings.dtype)
        scores, row_ids, row_steps = self._sweep_queries(
            train, swept, output_steps, settings, queries
        )
        return scores, row_ids, row_steps, test_ids

    def _score_query_blocks(
        self,
        train: GradientSource,
        test: GradientSource,
        swept: list[int],
        output_steps: list[int],
        settings: _Settings,
    ) -> tuple[torch.Tensor, list[str], list[int], list[str]]:
        """Test propagation once per query block (``loop_over_test``); columns in first-appearance
        order, a repeated query keeping its last block's column."""
        columns: dict[str, torch.Tensor] = {}
        row_ids: list[str] = []
        row_steps: list[int] = []
        for item in test:
            ids, queries = self.collect_test_matrix([item], dtype=settings.dtype)
            scores, row_ids, row_steps = self._sweep_queries(
                train, swept, output_steps, settings, queries
            )
            for position, sample in enumerate(ids):
                columns[sample] = scores[:, position]
        if not columns:
            raise ValueError("the test set is empty: the test source yielded no block")
        return torch.stack(list(columns.values()), dim=1), row_ids, row_steps, list(columns)

    def _sweep_queries(
        self,
        train: GradientSource,
        swept: list[int],
        output_steps: list[int],
        settings: _Settings,
        queries: sweep.Rows,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """Rows ``η_s <ĝ, w>`` of the output steps, carrying ``w`` from the queries backwards."""
        operator: sweep.QueryOperator | None = None
        blocks, row_ids, row_steps = [], [], []
        for step, items in self._steps_latest_first(train, swept, output_steps, settings, False):
            count = 0
            for rows, _types, ids in items:
                if operator is None:
                    self._shared_layers(rows, queries)
                    operator = sweep.QueryOperator(
                        sweep.layer_groups(sorted(rows), settings.hessian_mode),
                        _queries_for(rows, queries),
                    )
                alignments = operator.alignments(rows)
                if step in output_steps:
                    blocks.append((settings.lrs[step] * sum(alignments)).float().cpu())
                    row_ids.extend(ids)
                    row_steps.extend([step] * len(ids))
                operator.accumulate(alignments, rows)
                count += len(ids)
            operator.step(settings.scale(step, count))
        return torch.cat(blocks), row_ids, row_steps

    def _shared_layers(self, train: Mapping[str, Any], queries: sweep.Rows) -> list[str]:
        """Layers on both sides (recorded as :attr:`scored_layers`); ``ValueError`` if none or
        if a shared layer's widths differ."""
        shared = sorted(set(train) & set(queries))
        if not shared:
            raise ValueError(
                f"train and test gradients share no layer: train layers {sorted(train)}, test "
                f"layers {sorted(queries)}; capture both sides with the same hook config or "
                "pass layer_name"
            )
        for name in shared:
            if train[name].shape[-1] != queries[name].shape[-1]:
                raise ValueError(
                    f"layer {name!r}: train gradients have width {train[name].shape[-1]} but "
                    f"test gradients {queries[name].shape[-1]}; capture both sides from the "
                    "same model with the same projection"
                )
        _warn_one_sided(set(train), set(queries))
        self.scored_layers = shared
        return shared


class _Settings:
    """Per-call sweep settings: learning rates, curvature scale, mode and dtype."""

    def __init__(
        self, lrs: dict[int, float], loss_reduction: str, hessian_mode: str, dtype: torch.dtype
    ) -> None:
        self.lrs = lrs
        self.loss_reduction = loss_reduction
        self.hessian_mode = hessian_mode
        self.dtype = dtype

    def scale(self, step: int, batch: int) -> float:
        """``η_s · c`` of the step's update."""
        return self.lrs[step] * sweep.curvature_scale(self.loss_reduction, batch)


def _check_options(
    propagation: str,
    loop_over_test: bool,
    hessian_mode: str,
    loss_reduction: str,
    dvemb_dir: object,
) -> None:
    """``ValueError`` for any option DVEmb refuses."""
    TrajectoryAttributor.validate_propagation(propagation, loop_over_test)
    sweep.check_choice("hessian_mode", hessian_mode, HESSIAN_MODES)
    sweep.check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
    if dvemb_dir is not None and propagation != "train":
        raise ValueError(
            "dvemb_dir stores the train-side embeddings, which only propagation='train' "
            "computes; use propagation='train' or drop dvemb_dir"
        )


def _swept_steps(prop_steps: list[int], output_steps: list[int]) -> list[int]:
    """The propagated steps a sweep reads, latest first: none before the earliest output."""
    earliest = min(output_steps)
    return sorted((step for step in prop_steps if step >= earliest), reverse=True)


def _embedding_block(residuals: sweep.Rows, types: dict[str, str], lr: float) -> Gradient:
    """Dense embedding block ``η_s(ĝ − Mĝ)`` ``{layer: (B, d_l)}`` with the source's layer types."""
    data = {name: lr * value for name, value in residuals.items()}
    return Gradient(
        dict.fromkeys(data, "materialized"),
        data,
        {name: types[name] for name in data},
        dict.fromkeys(data, "batch"),
        validate_on_init=False,
    )


def _queries_for(rows: sweep.Rows, queries: sweep.Rows) -> sweep.Rows:
    """Query rows for every training layer (zeros where the queries lack the layer)."""
    count = next(iter(queries.values())).shape[0]
    return {
        name: queries[name] if name in queries else value.new_zeros((count, value.shape[1]))
        for name, value in rows.items()
    }


def _warn_one_sided(train: set[str], test: set[str]) -> None:
    """``UserWarning`` naming layers captured on one side only."""
    if train ^ test:
        warnings.warn(
            f"layers {sorted(train ^ test)} were captured on only one side and do not "
            "contribute to the scores (train-only layers still enter the curvature H)",
            UserWarning,
            stacklevel=5,
        )


def _persisted(
    embeddings: Iterator[StreamBatch],
    store: GradientStorageManager,
    source: object,
    sample_id_key: str | int | None,
) -> Iterator[StreamBatch]:
    """``embeddings`` unchanged, each block also saved to ``store`` as one record (CPU, float32).

    The train source's capture projection, when known, is declared to ``store``.
    """
    projection = attribution_utils.source_projection(source)
    if projection is not None:
        store.declare_projection(projection)
    for step, block, ids in embeddings:
        record = block.to(device="cpu", dtype=torch.float32)
        store.save_bulk([GradientRecord(step, list(ids), record, sample_id_key)])
        yield step, block, ids


def _train_sample_id_key(attributor: DVEmbAttributor, source: object) -> str | int | None:
    """Sample-id field of an opened train source's store (``None`` for a replay)."""
    if hasattr(source, "snapshots"):
        return None
    return attributor.resolve_store(source).sample_id_key

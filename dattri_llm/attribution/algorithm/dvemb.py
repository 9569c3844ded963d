"""DVEmb: data value embeddings (Wang et al., 2025b), a trajectory method.

``I(z*, s; z') = ∇ℓ(θ_T, z')ᵀ [Π_{k=s+1}^{T-1}(I − η_k c_k H_k)] η_s c_s ĝ(θ_s, z*)``
with ``H_k = Σ_{z∈B_k} c_z ĝ_z ĝ_zᵀ`` over the update's samples (``c_z`` the
inverse of a sample's share factor in the loss: its micro-batch's rows times
the loss divisor for a mean loss, the loss divisor for a sum): training sample
``z*`` of update ``s`` moves the parameters by ``η_s c_s ĝ`` (``c_s`` the clip
coefficient the loop applied; per-coordinate ``η`` from each parameter
group), and every later update ``k`` damps that move by
``I − η_k c_k H_k`` before it reaches the queries at ``θ_T``.
``hessian_mode="full"`` couples every layer in ``H``; ``"diagonal"`` keeps its
per-layer blocks only. With ``H = 0`` a row is its trajectory-TracIn row. An
accumulation window is one update: its micro-batches do not damp each other
and ``H`` counts the whole window.

Two propagations give identical scores (:mod:`.trajectory.sweep`):

* ``propagation="train"``: each sample's *embedding* ``Π(...)·η_s c_s ĝ``,
  scored ``<e, ∇ℓ(θ_T, z')>``. Embeddings do not depend on the queries:
  ``cache_dvemb`` stores them so ``TracInAttributor.attribute_from_cache(dvemb_dir,
  test_dir)`` gives the DVEmb score. The operator is ``(d, d)`` (per layer
  when diagonal).
* ``propagation="test"``: the queries are carried back instead (memory ∝
  queries × d). ``loop_over_test`` sweeps once per query block.

Curvature runs over the training side's layers; scores over the layers both
sides share.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.trajectory.base import TrajectoryAttributor
from dattri_llm.attribution.algorithm.trajectory.folds import DVEmbFold
from dattri_llm.attribution.algorithm.trajectory.sweep import (
    LOSS_REDUCTIONS,
    Emission,
    TrajectorySweep,
    check_choice,
)
from dattri_llm.attribution.sources import _check_dataset, fresh_store, normalize_layer_names
from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.cache import CACHE_RESIDENCIES
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.algorithm.trajectory.scope import RunScope
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.stream.source import StreamBatch

HESSIAN_MODES = ("full", "diagonal")
DVEMB_DIR = "dvemb_grads"

LearningRate = float | Mapping[int, float] | None


def layer_groups(hessian_mode: str):
    """The curvature blocks of ``hessian_mode`` as the sweep's coordinate groups.

    ``"full"``: one block of every coordinate; ``"diagonal"``: one per layer.
    """
    if hessian_mode == "full":
        return lambda layout: [None]

    def per_layer(layout: dict[str, int]) -> list[slice]:
        bounds, offset = [], 0
        for width in layout.values():
            bounds.append(slice(offset, offset + width))
            offset += width
        return bounds

    return per_layer


class DVEmbAttributor(TrajectoryAttributor):
    """Data value embeddings (``algorithm="DVEmb"``) over one recorded training run."""

    algorithm: ClassVar[str] = "DVEmb"

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)

    # ------------------------------------------------------------------ entry points
    @keywords()
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
        run's dynamics in a temporary directory beside them).

        Raises:
            ValueError: a residency not in ``CACHE_RESIDENCIES``; any option
                :meth:`attribute_from_cache` refuses (checked before training).
        """
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
            self.collect_trajectory(
                train, test_store, train_dataset, test_dataset, hook_config=hook_config
            )
            return self.attribute_from_cache(train, test_store, **options)

    @keywords()
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
        propagated step, or ``None`` for the recorded rates (each parameter
        group's, from ``training_dynamics.json``; else ``recorded_lr``, else
        ``lr_schedule.json`` beside the train source); a configured value that
        differs from the recorded one warns and is used. The clip coefficient
        and loss scale each update applied, when recorded, are used whatever
        the learning rate. ``dvemb_dir`` (train propagation) also stores the
        embeddings there. The sweep runs in ``block_dtype`` on ``args.device``.

        Raises:
            ValueError: bad ``propagation``/``hessian_mode``/``loss_reduction``;
                ``loop_over_test`` or ``dvemb_dir`` without
                ``propagation="test"``/``"train"``; a propagated step without a
                learning rate; an empty test source; no layer shared by the
                two sides.
        """
        _check_options(propagation, loop_over_test, hessian_mode, loss_reduction, dvemb_dir)
        self.scored_layers = []
        test_store = self.require_test_records(test_source)
        scope = self.run_scope(
            train_source, selected_training_steps=selected_training_steps, final_step=final_step
        )
        rates = self._rates(scope, learning_rate, recorded_lr, train_source)
        persist = None
        if dvemb_dir is not None:
            store = fresh_store(Path(dvemb_dir).expanduser())
            persist = self._persist(store, train_source)
        self._verbose = verbose
        try:
            result, test_ids = self.score_run(
                train_source,
                test_store,
                DVEmbFold(),
                scope,
                layer_name=layer_name,
                hook_config=hook_config,
                loss_reduction=loss_reduction,
                propagation=propagation,
                loop_over_test=loop_over_test,
                block_dtype=block_dtype,
                learning_rates=rates,
                groups=layer_groups(hessian_mode),
                on_emission=persist,
                verbose=verbose,
            )
        finally:
            self._verbose = False
        return self.build_run_score(
            result,
            test_ids,
            train_source,
            test_store,
            scope,
            selected_training_steps=selected_training_steps,
            options={
                "loss_reduction": loss_reduction,
                "propagation": propagation,
                "loop_over_test": loop_over_test,
                "block_dtype": block_dtype,
            },
            extra={
                "learning_rate": scope.recorded_rates() if rates is None else rates,
                "dvemb_dir": None if dvemb_dir is None else str(dvemb_dir),
                "hessian_mode": hessian_mode,
                **(algorithm_meta or {}),
            },
        )

    def _rates(
        self,
        scope: RunScope,
        learning_rate: LearningRate,
        recorded_lr: Mapping[int, float] | None,
        train_source: object,
    ) -> dict[int, float] | None:
        """Learning rates overriding the recorded ones (``None``: each group's recorded rate).

        An explicit ``recorded_lr`` is the run's schedule: with
        ``learning_rate=None`` it replaces the recorded per-group rates.
        """
        if learning_rate is None and recorded_lr is not None:
            return scope.run.learning_rates(
                scope.swept, recorded_lr, None, where="recorded_lr", warn=False
            )
        recorded = recorded_lr if recorded_lr is not None else self.recorded_lr_of(train_source)
        return scope.run.learning_rates(scope.swept, learning_rate, recorded)

    @keywords(aliases={"train_gradients_dir": "train_source"})
    def cache_dvemb(
        self,
        train_source: object,
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
        scope = self.run_scope(
            train_source,
            selected_training_steps=selected_training_steps,
            final_step=final_step,
        )
        rates = self._rates(scope, learning_rate, None, train_source)
        target = Path(dvemb_dir or Path(self.args.output_dir) / DVEMB_DIR).expanduser()
        persist = self._persist(fresh_store(target), train_source)
        for emission in self._emissions(
            train_source, scope, rates, loss_reduction, hessian_mode, layer_name, verbose
        ):
            persist(emission)
        return str(target)

    # ------------------------------------------------------------------ the sweeps
    @keywords()
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
        step); each block holds a store step's embeddings per training layer,
        dense ``(B, d_l)`` float32 on ``args.device``. ``train_source`` is
        anything :meth:`open_train_source` accepts.

        Raises:
            ValueError: bad ``hessian_mode``/``loss_reduction``; a step without
                a learning rate.
        """
        _check_options("train", False, hessian_mode, loss_reduction, None)
        scope = self.run_scope(
            train_source,
            selected_training_steps=output_steps,
            final_step=max(prop_steps) + 1 if prop_steps else None,
        )
        rates = self._rates(scope, learning_rate, None, train_source)
        for emission in self._emissions(
            train_source, scope, rates, loss_reduction, hessian_mode, None, verbose
        ):
            yield from _embedding_blocks(emission)

    def _emissions(
        self,
        train_source: object,
        scope: RunScope,
        rates: dict[int, float] | None,
        loss_reduction: str,
        hessian_mode: str,
        layer_name: str | list[str] | None,
        verbose: bool,
    ) -> Iterator[Emission]:
        """The train-side embeddings of ``scope`` (no queries)."""
        engine = TrajectorySweep(
            DVEmbFold(),
            scope.run,
            device=torch.device(self.args.device),
            loss_reduction=loss_reduction,
            learning_rates=rates,
            groups=layer_groups(hessian_mode),
            progress=self._progress(verbose),
        )
        source = self.open_train_source(
            train_source,
            steps=scope.swept_steps,
            layer_name=normalize_layer_names(layer_name),
        )
        try:
            yield from engine.emissions(
                source, scope.swept, set(scope.output_steps), None, propagation="train"
            )
        finally:
            if source is not train_source:
                self.close_source(source)

    def _persist(self, store: GradientStorageManager, source: object) -> _Persist:
        """Embedding persistence into ``store`` with the train store's id key and projection."""
        if self.is_replay(source):
            return _Persist(store, None, None)
        train = self.resolve_store(source)
        return _Persist(store, train.sample_id_key, train.projection)


def _check_options(
    propagation: str,
    loop_over_test: bool,
    hessian_mode: str,
    loss_reduction: str,
    dvemb_dir: object,
) -> None:
    """``ValueError`` for any option DVEmb refuses."""
    TrajectoryAttributor.validate_propagation(propagation, loop_over_test)
    check_choice("hessian_mode", hessian_mode, HESSIAN_MODES)
    check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
    if dvemb_dir is not None and propagation != "train":
        raise ValueError(
            "dvemb_dir stores the train-side embeddings, which only propagation='train' "
            "computes; use propagation='train' or drop dvemb_dir"
        )


def _embedding_blocks(emission: Emission) -> Iterator[StreamBatch]:
    """One dense embedding block ``{layer: (B, d_l)}`` per store step of an emission."""
    rows = emission.rows
    steps = [rows.steps[i] for i in emission.keep]
    ids = [rows.ids[i] for i in emission.keep]
    widths = list(rows.layout.values())
    for step in dict.fromkeys(steps):
        picked = [i for i, s in enumerate(steps) if s == step]
        parts = torch.split(emission.out[picked].to(torch.float32), widths, dim=1)
        data = dict(zip(rows.layout, parts, strict=True))
        block = Gradient(
            dict.fromkeys(data, "materialized"),
            data,
            {name: rows.types[name] for name in data},
            dict.fromkeys(data, "batch"),
            validate_on_init=False,
        )
        yield step, block, [ids[i] for i in picked]


class _Persist:
    """Save each emission's embedding blocks to a store (CPU, float32, one record per step)."""

    def __init__(
        self,
        store: GradientStorageManager,
        sample_id_key: str | int | None,
        projection: dict[str, dict] | None,
    ) -> None:
        if projection is not None:
            store.declare_projection(projection)
        self.store, self.sample_id_key = store, sample_id_key

    def __call__(self, emission: Emission) -> None:
        for step, block, ids in _embedding_blocks(emission):
            record = block.to(device="cpu", dtype=torch.float32)
            self.store.save_bulk([GradientRecord(step, list(ids), record, self.sample_id_key)])

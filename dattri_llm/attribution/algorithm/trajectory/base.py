"""Shared base of the trajectory methods (trajectory TracIn, DVEmb, AdamW-influence).

A trajectory method trains once from checkpoint 0 and scores every training
step ``t`` of that run against queries taken at the final parameters ``θ_T``.
:class:`TrajectoryAttributor` collects the run (per-step gradients into a
store, or, with ``args.recompute_gradients``, per-step parameter snapshots
from which a ``ReplayGradientSource`` recomputes them) together with what
each update applied (``training_dynamics.json``: accumulation windows, clip
coefficients, loss scales, every parameter group's hyperparameters) and its
learning-rate schedule (``lr_schedule.json``), and runs the one backward
sweep the methods share (:meth:`score_run`, :mod:`.sweep`): a method supplies
only its :class:`~.sweep.Fold`. Rows are emitted latest step first.

The class holds the public flow and the subclass hooks; recording a run lives
in :mod:`.recording`, what a scoring call sweeps (:class:`RunScope`,
``resolve_steps``) in :mod:`.scope`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.trajectory.recording import (
    fresh_targets,
    record_run,
)
from dattri_llm.attribution.algorithm.trajectory.run import Window
from dattri_llm.attribution.algorithm.trajectory.scope import RunScope
from dattri_llm.attribution.algorithm.trajectory.scope import resolve_steps as _resolve_steps
from dattri_llm.attribution.algorithm.trajectory.scope import run_scope as _run_scope
from dattri_llm.attribution.algorithm.trajectory.sweep import (
    PROPAGATIONS,
    Emission,
    Fold,
    SweepResult,
    TrajectorySweep,
)
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.blocks import per_sample_layers
from dattri_llm.attribution.schedule import read_lr_schedule, write_lr_schedule
from dattri_llm.attribution.sources import (
    _check_dataset,
    _require_records,
    normalize_layer_names,
    resolve_store,
)
from dattri_llm.attribution.topk import SampleSums
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.stream.readers import DiskGradientSource
from dattri_llm.gradient.stream.replay import ReplayGradientSource
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.callbacks.base import HookManagerCallback
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.stream.source import GradientSource
    from dattri_llm.gradient.stream.streamer import GradientStreamer

__all__ = ["ADAMW_OPTIMS", "TrajectoryAttributor"]

# ``args.optim`` values that train with torch.optim.AdamW (what AdamW-influence and the
# exact metagradient model).
ADAMW_OPTIMS = ("adamw_torch", "adamw")


class TrajectoryAttributor(BaseInnerProductAttributor):
    """Base of the trajectory methods (``algorithm="Trajectory"``); one checkpoint.

    Subclass hooks: :meth:`trajectory_callbacks` (extra capture callbacks for
    the training run), :meth:`on_trajectory_block` (after each block's
    update) and :meth:`finish_trajectory` (after the run).
    """

    algorithm: ClassVar[str] = "Trajectory"
    streaming_top_k: ClassVar[bool] = True  # over the sweep, each sample's steps summed

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)

    def checkpoints(self) -> list[int]:
        """``[0]``: the run starts at the first checkpoint (``UserWarning`` if there are more)."""
        return self._first_checkpoint_only()

    @property
    def recompute(self) -> bool:
        """Whether the run stores parameter snapshots instead of gradients."""
        return bool(self.args.recompute_gradients)

    # ------------------------------------------------------------------ collection
    @keywords()
    def cache(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        cache_dir: str | None = None,
        hook_config: HookManagerConfig | None = None,
        offload_interval: int = 1,
    ) -> list[tuple[str, str]]:
        """Train from checkpoint 0, recording the run; then collect the queries at ``θ_T``.

        The run goes to ``<cache_dir>/train_grads`` (``train_snapshots`` when
        :attr:`recompute`) with ``lr_schedule.json`` beside it; the queries to
        ``<cache_dir>/test_grads`` (``cache_dir`` default ``args.output_dir``).

        Raises:
            ValueError: an empty dataset; a target directory already holding
                records or snapshots.
        """
        _check_dataset(train_dataset, "training")
        _check_dataset(test_dataset, "test")
        root = Path(cache_dir if cache_dir is not None else self.args.output_dir).expanduser()
        train_dir, train_target, test_dir, test_store = fresh_targets(root, self.recompute)
        self.load_checkpoint(self.checkpoints()[0])
        lrs = self.collect_trajectory(
            train_target,
            test_store,
            train_dataset,
            test_dataset,
            hook_config=hook_config,
            offload_interval=offload_interval,
        )
        if self.args.should_log:
            write_lr_schedule(train_dir, lrs)
        return [(str(train_dir), str(test_dir))]

    def collect_trajectory(
        self,
        train_target: GradientStorageManager | TrajectorySnapshots,
        test_store: GradientStorageManager,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        offload_interval: int = 1,
    ) -> dict[int, float]:
        """Record the run into ``train_target``, then the queries at ``θ_T`` into ``test_store``.

        A store receives every step's gradients (in groups of
        ``offload_interval`` records); ``TrajectorySnapshots`` receive each
        step's parameters and batch instead. The queries are labelled with the
        final step ``T`` (last step + 1). Returns ``{step: lr}``, the learning
        rate applied at each step.
        """
        return record_run(
            self,
            train_target,
            test_store,
            train_dataset,
            test_dataset,
            hook_config=hook_config,
            offload_interval=offload_interval,
        )

    def require_adamw_training(self, method: str, alternative: str = "") -> None:
        """``ValueError`` (before training) unless ``args.optim`` trains with torch's AdamW.

        ``method`` names what models AdamW runs; ``alternative`` is appended to the fix.
        """
        if self.args.optim not in ADAMW_OPTIMS:
            raise ValueError(
                f"{method} torch.optim.AdamW (and Adam) runs; args.optim={self.args.optim!r} "
                f"trains with another optimizer. Use optim='adamw_torch'{alternative}"
            )

    # ------------------------------------------------------------------ subclass hooks
    def trajectory_callbacks(
        self,
        model: nn.Module,
        streamer: GradientStreamer,
        snapshots: TrajectorySnapshots | None,
    ) -> list[HookManagerCallback]:
        """Callbacks added to the run's hook manager (none)."""
        return []

    def on_trajectory_block(self) -> None:
        """Called after each training block's update (no-op)."""

    def finish_trajectory(self, train_target: GradientStorageManager | TrajectorySnapshots) -> None:
        """Called once the run is recorded into ``train_target`` (no-op)."""

    # ------------------------------------------------------------------ sources
    def open_train_source(
        self,
        train_source: object,
        *,
        steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
    ) -> GradientSource:
        """The per-step training gradients of a recorded run.

        A gradient store (directory, open store, ``DiskGradientSource``) gives a
        ``DiskGradientSource``; a snapshot directory or ``TrajectorySnapshots``
        a ``ReplayGradientSource`` recomputing each step on the task model with
        the train loss (``hook_config`` its capture config). An open
        ``ReplayGradientSource`` is restricted to ``steps``.

        Raises:
            ValueError: snapshots without a task.
        """
        desc = f"{self.algorithm} train" if verbose else None
        if isinstance(train_source, ReplayGradientSource):
            return train_source if steps is None else train_source.for_steps(steps)
        snapshots = _as_snapshots(train_source)
        if snapshots is None:
            return self.load_train_rep(
                train_source, steps=steps, layer_name=layer_name, verbose=verbose, desc=desc
            )
        task = self.require_task("open_train_source")
        return ReplayGradientSource(
            task.model,
            self.args,
            snapshots,
            loss_fn=self.train_loss_fn(),
            config=hook_config,
            steps=steps,
            layer_name=layer_name,
            desc=desc,
            verbose=verbose,
        )

    @staticmethod
    def train_dir_of(train_source: object) -> Path | None:
        """Directory holding a run's records (and its ``lr_schedule.json``); ``None`` if unknown."""
        if isinstance(train_source, (str, Path)):
            return Path(train_source).expanduser()
        if isinstance(train_source, TrajectorySnapshots):
            return train_source.root
        if isinstance(train_source, GradientStorageManager):
            return train_source.save_dir
        if isinstance(train_source, DiskGradientSource):
            return train_source.file_manager.save_dir
        snapshots = getattr(train_source, "snapshots", None)
        if isinstance(snapshots, TrajectorySnapshots):
            return snapshots.root
        return None

    @staticmethod
    def available_steps(train_source: object) -> list[int]:
        """Ascending steps a run records (its source's steps, a store's or the snapshots')."""
        snapshots = _as_snapshots(train_source)
        if snapshots is not None:
            return snapshots.steps()
        steps = getattr(train_source, "steps", None)
        if isinstance(steps, list):
            return sorted(steps)
        return resolve_store(train_source).available_steps()

    @classmethod
    def recorded_lr_of(cls, train_source: object) -> dict[int, float] | None:
        """The ``lr_schedule.json`` recorded beside a run (``None`` if there is none)."""
        directory = cls.train_dir_of(train_source)
        return None if directory is None else read_lr_schedule(directory)

    @staticmethod
    def close_source(source: object) -> None:
        """Release what an opened train source holds (a replay's hooks and parameters)."""
        if isinstance(source, (GradientStorageManager, DiskGradientSource)):
            return
        close = getattr(source, "close", None)
        if callable(close):
            close()

    def source_meta(
        self, train_source: object, test_store: GradientStorageManager
    ) -> dict[str, Any]:
        """``{"train_source": "gradients" | "snapshots", "sample_id_key": {train, test}}``."""
        replay = self.is_replay(train_source)
        train_key = None if replay else self.resolve_store(train_source).sample_id_key
        return {
            "train_source": "snapshots" if replay else "gradients",
            "sample_id_key": {"train": train_key, "test": test_store.sample_id_key},
        }

    def steps_bar(self, steps: Iterable[int], desc: str | None = None) -> Iterable[int]:
        """``steps`` in a tqdm bar when the current call is verbose on rank 0."""
        return self._bar(steps, desc=desc or f"{self.algorithm} steps", unit="step")

    # ------------------------------------------------------------------ the shared sweep
    def run_scope(
        self,
        train_source: object,
        *,
        selected_training_steps: Iterable[int] | None = None,
        final_step: int | None = None,
        entries: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> RunScope:
        """The updates a scoring call sweeps, from the run's records (see :class:`RunScope`).

        ``entries``: per-update records a method keeps itself (AdamW moments),
        read for their update records when no ``training_dynamics.json`` lies
        beside the run.

        Raises:
            ValueError: see :meth:`resolve_steps`; no update holds an output step.
        """
        return _run_scope(
            self,
            train_source,
            selected_training_steps=selected_training_steps,
            final_step=final_step,
            entries=entries,
        )

    @staticmethod
    def snapshots_of(train_source: object) -> TrajectorySnapshots | None:
        """The snapshot store of a train source (the store, its directory, or a replay)."""
        snapshots = _as_snapshots(train_source)
        if snapshots is None:
            snapshots = getattr(train_source, "snapshots", None)
        return snapshots if isinstance(snapshots, TrajectorySnapshots) else None

    @staticmethod
    def is_replay(train_source: object) -> bool:
        """Whether ``train_source`` is a snapshot store (or its directory, or a replay)."""
        return TrajectoryAttributor.snapshots_of(train_source) is not None

    def _merged_windows(self, train_source: object) -> bool:
        """Whether a gradient store holds one merged record per optimizer update."""
        if self.is_replay(train_source):
            return False
        return self.resolve_store(train_source).gradient_accumulation_steps > 1

    def score_run(
        self,
        train_source: object,
        test_source: object,
        fold: Fold,
        scope: RunScope,
        *,
        layer_name: str | list[str] | None = None,
        hook_config: HookManagerConfig | None = None,
        loss_reduction: str = "mean",
        propagation: str = "test",
        loop_over_test: bool = False,
        block_dtype: torch.dtype = torch.float32,
        learning_rates: Mapping[int, float] | None = None,
        groups: Callable[[dict[str, int]], list[torch.Tensor | None]] | None = None,
        entries: Mapping[int, Mapping[str, Any]] | None = None,
        on_emission: Callable[[Emission], None] | None = None,
        verbose: bool = False,
    ) -> tuple[SweepResult, list[str]]:
        """Sweep ``scope`` with ``fold`` against the queries; ``(result, test_ids)``.

        ``loop_over_test`` sweeps once per query block (query side only); a
        query repeated across blocks keeps its last block's column.

        Raises:
            ValueError: an empty test source; see :class:`TrajectorySweep`.
        """
        self.validate_propagation(propagation, loop_over_test)
        layers = normalize_layer_names(layer_name)
        if self._score_sink is not None and loop_over_test:
            raise NotImplementedError(
                f"{self.algorithm} top-k sweeps every query at once: drop loop_over_test=True "
                "(or use attribute_from_cache(..., loop_over_test=True).top_k(k))"
            )
        sweep = TrajectorySweep(
            fold,
            scope.run,
            device=torch.device(self.args.device),
            dtype=block_dtype,
            loss_reduction=loss_reduction,
            learning_rates=learning_rates,
            groups=groups,
            progress=self._progress(verbose),
        )
        with self.summed_rows(train_source, scope) as summed:
            source = self.open_train_source(
                train_source, steps=scope.swept_steps, layer_name=layers, hook_config=hook_config
            )
            emitted = set(scope.output_steps)
            try:
                test = self.load_test_rep(test_source, layer_name=layers)
                if not loop_over_test:
                    test_ids, queries = self.collect_test_matrix(test, dtype=block_dtype)
                    if summed is not None:
                        summed.start(test_ids)
                    result = sweep.sweep(
                        source,
                        scope.swept,
                        emitted,
                        queries,
                        propagation=propagation,
                        entries=entries,
                        on_emission=on_emission,
                        sink=summed,
                    )
                    return result, test_ids
                columns: dict[str, torch.Tensor] = {}
                result = None
                for item in test:
                    ids, queries = self.collect_test_matrix([item], dtype=block_dtype)
                    result = sweep.sweep(
                        source,
                        scope.swept,
                        emitted,
                        queries,
                        propagation=propagation,
                        entries=entries,
                    )
                    for position, sample in enumerate(ids):
                        columns[sample] = result.scores[:, position]
                if result is None:
                    raise ValueError("the test set is empty: the test source yielded no block")
                result.scores = torch.stack(list(columns.values()), dim=1)
                return result, list(columns)
            finally:
                self.close_source(source)

    @contextlib.contextmanager
    def summed_rows(self, train_source: object, scope: RunScope) -> Iterator[SampleSums | None]:
        """Within a top-k call, sum each sample's rows over its steps before ranking them.

        Replaces the running top-k of ``top_k`` / ``top_k_from_cache`` by a
        :class:`SampleSums` in front of it for the scoring passes of the block
        (yielded; ``None`` outside a top-k call), releasing each sample once
        its last emitted step is scored (the count comes from the store's
        index; a replayed run holds every sum to the end), and ranks what is
        left when the block ends without error.
        """
        sink = self._score_sink
        if sink is None:
            yield None
            return
        summed = SampleSums(sink, self._rows_per_sample(train_source, scope.output_steps))
        self._score_sink = summed
        try:
            yield summed
        finally:
            self._score_sink = sink
        summed.finish()

    def _rows_per_sample(self, train_source: object, steps: Iterable[int]) -> dict[str, int] | None:
        """``{id: rows at steps}`` of a gradient store's ids with more than one row there.

        ``None`` for a replayed run (its rows are known only as they are recomputed).
        """
        if self.is_replay(train_source):
            return None
        rows = self.resolve_store(train_source).index_rows(steps)  # identifier by identifier
        counts = ((sample, sum(1 for _ in group)) for sample, group in groupby(rows, itemgetter(0)))
        return {sample: count for sample, count in counts if count > 1}

    def build_run_score(
        self,
        result: SweepResult,
        test_ids: list[str],
        train_source: object,
        test_source: object,
        scope: RunScope,
        *,
        selected_training_steps: Iterable[int] | None,
        options: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
    ) -> AttributionScore:
        """The :class:`AttributionScore` of a sweep, with the metadata every trajectory
        method records: the run's (steps, dynamics, clip coefficients, sources), the
        call's ``options`` (dtypes as strings), then the method's ``extra``."""
        clipped = {w.key: w.clip_coef for w in scope.swept if w.clipped}
        meta = {
            "final_step": scope.final_step,
            "selected_training_steps": (
                None if selected_training_steps is None else sorted(scope.output_steps)
            ),
            "propagated_steps": scope.swept_steps,
            **{k: str(v) if isinstance(v, torch.dtype) else v for k, v in options.items()},
            "dynamics": "recorded" if scope.run.recorded else "unrecorded",
            "clip_coefficients": clipped,
            **self.source_meta(train_source, self.resolve_store(test_source)),
            **(extra or {}),
        }
        self.scored_layers = list(result.layers)
        return self.build_score(
            result.scores,
            result.row_ids,
            result.row_steps,
            test_ids,
            algorithm_meta=meta,
            layer_name=list(result.layers),
        )

    def _progress(self, verbose: bool) -> Callable[[list[Window]], Iterable[Window]]:
        """The sweep's progress bar over its updates (:meth:`steps_bar` of a ``verbose`` call)."""

        def bar(windows: list[Window]) -> Iterable[Window]:
            previous, self._verbose = self._verbose, verbose
            try:
                return self.steps_bar(windows, desc=f"{self.algorithm} updates")
            finally:
                self._verbose = previous

        return bar

    @staticmethod
    def require_test_records(test_source: object) -> GradientStorageManager:
        """The test store; ``ValueError`` when it holds no records."""
        store = resolve_store(test_source)
        _require_records(store, "test")
        return store

    # ------------------------------------------------------------------ queries
    @staticmethod
    def test_column_order(test_source: Iterable[tuple[int, Any, list[str]]]) -> list[str]:
        """Distinct test identifiers (as ``str``) in first-appearance order."""
        return list(dict.fromkeys(str(i) for _step, _block, ids in test_source for i in ids))

    def collect_test_matrix(
        self,
        test_source: GradientSource,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Dense query gradients ``{layer: (num_test, d)}`` on ``args.device``.

        Columns are the distinct test identifiers in first-appearance order (a
        repeated identifier keeps its last row); layers are the sorted
        per-sample layers of the test blocks (``param_grad`` layers dropped).

        Raises:
            ValueError: the test source yields no block, or blocks disagree on layers.
        """
        device = torch.device(self.args.device)
        rows: dict[str, list[torch.Tensor]] = {}
        ids: list[str] = []
        for _step, block, block_ids in test_source:
            layers = per_sample_layers(block)
            dense = block.select_layers(layers).aggregate().materialize()  # tokens summed
            if rows and set(layers) != set(rows):
                raise ValueError(
                    f"test blocks disagree on layers: {sorted(rows)} vs {sorted(layers)}; "
                    "capture every query with the same hook config"
                )
            for name in layers:
                value = dense.data[name].to(device=device, dtype=dtype)
                rows.setdefault(name, []).append(value.reshape(value.shape[0], -1))
            ids.extend(str(i) for i in block_ids)
        if not ids:
            raise ValueError("the test set is empty: the test source yielded no block")
        last = {sample: position for position, sample in enumerate(ids)}
        order = list(dict.fromkeys(ids))
        index = torch.tensor([last[sample] for sample in order], device=device)
        return order, {name: torch.cat(rows[name])[index] for name in sorted(rows)}

    # ------------------------------------------------------------------ static checks
    @staticmethod
    def validate_propagation(propagation: str, loop_over_test: bool) -> None:
        """``ValueError`` for a propagation not in ``("train", "test")``, or ``"train"`` with
        ``loop_over_test`` (looping over query blocks needs the query-side sweep)."""
        if propagation not in PROPAGATIONS:
            raise ValueError(
                f"propagation must be one of {list(PROPAGATIONS)}, got {propagation!r}"
            )
        if propagation == "train" and loop_over_test:
            raise ValueError(
                "loop_over_test sweeps once per query block, which needs propagation='test'; "
                "use propagation='test' or loop_over_test=False"
            )

    # static: the steps a call propagates and emits (scope.resolve_steps)
    resolve_steps = staticmethod(_resolve_steps)


def _as_snapshots(train_source: object) -> TrajectorySnapshots | None:
    """``train_source`` as ``TrajectorySnapshots`` when it is one or a snapshot directory."""
    if isinstance(train_source, TrajectorySnapshots):
        return train_source
    if isinstance(train_source, (str, Path)) and TrajectorySnapshots.is_snapshot_dir(
        Path(train_source).expanduser()
    ):
        return TrajectorySnapshots(Path(train_source).expanduser())
    return None

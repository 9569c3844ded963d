"""AdamW-influence: the first-order effect of a training sample through AdamW's real dynamics.

An update ``t`` maps the optimizer state ``(θ, m, v)`` (plus the running
maximum ``u`` of ``v`` under ``amsgrad``) to the next one, from the gradient
the step applied, ``g = C(G_t)``: the accumulated batch gradient ``G_t``
after the loop's clip ``C`` (``c_t = min(1, M/(‖G_t‖+1e-6))`` over every
parameter), plus ``wd·θ`` for ``torch.optim.Adam``'s coupled L2 decay. Each
coordinate uses its own parameter group's ``lr``, ``betas``, ``eps`` and
``weight_decay``. Up-weighting a training sample ``z`` of update ``t`` moves
``G_t`` by its share ``t_z``, hence ``g`` by ``C'·t_z`` with the clip's
Jacobian ``C' = c_t(I − ĝĝᵀ)`` (``I`` when the clip is inactive).

A summary ``W = [W_θ | W_m | W_v (| W_u)]``, the derivative of the queries'
loss at ``θ_T`` in the state after the current update, is carried from the
last update to the first (:class:`~.trajectory.folds.AdamWFold`). At an
emitted update a sample scores ``W·∂state/∂g·C'·t_z``, the first-order change
of the query loss when the sample is up-weighted: **a helpful sample scores
negative** (``polarity = -1``; :meth:`AttributionScore.top_k` ranks by it).
Then the update is folded into ``W`` through the AdamW state Jacobian, the
batch gradient linearised by the Gauss–Newton coupling ``C'·Σ_b c_b t_b t_bᵀ``
(``c_b`` the inverse of a row's share factor in the loss: its micro-batch's
rows times the loss divisor for a mean loss, the loss divisor for a sum).
Every captured coordinate enters the coupling (layers concatenated).

The run's moments come from :class:`OptimizerStateCallback` (``pre`` before and
``post`` after every update, recorded automatically at ``optimizer.step()``),
its updates (accumulation windows, clip coefficients, loss scales, parameter
groups) from the :class:`TrainingDynamicsCallback` it extends. The rows are
exact (to float rounding) when every trainable parameter is captured on all
its coordinates; otherwise ``ĝ·t_z`` of the clip's Jacobian sees only the
captured part (a warning says how much of the gradient that holds), and the
coupling only the captured coordinates.

``propagation="test"`` carries ``U = Q·W`` (``(n_test, ·)``),
``propagation="train"`` ``W`` itself (``(p, ·)``); both give the same scores.
``num_masks > 1`` splits each layer's captured coordinates into that many
disjoint random groups, sweeps each on its own and averages the scores.

The scores are first order: :meth:`AdamWInfluenceAttributor.error_proxy`
computes the second-order term ``½a''(0)`` of removing each sample by a
forward sweep along the same run (:mod:`.trajectory.second_order`), and
flags the scores as unreliable when it is large against them
(``attribute_from_cache(..., error_proxy=True)`` does so in probe mode).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.trajectory.base import TrajectoryAttributor
from dattri_llm.attribution.algorithm.trajectory.first_update import first_update_meta
from dattri_llm.attribution.algorithm.trajectory.folds import ADAMW_OPTIMIZERS, AdamWFold
from dattri_llm.attribution.algorithm.trajectory.masks import (
    check_num_masks,
    coordinate_groups,
    mask_groups,
)
from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics
from dattri_llm.attribution.algorithm.trajectory.scope import RunScope
from dattri_llm.attribution.algorithm.trajectory.second_order import (
    RELIABILITY_THRESHOLD,
    ErrorProxy,
    check_counts,
    check_query_hessian,
    error_proxy,
)
from dattri_llm.attribution.algorithm.trajectory.sweep import (
    LOSS_REDUCTIONS,
    TrajectorySweep,
    check_choice,
    swept_windows,
)
from dattri_llm.attribution.sources import normalize_layer_names
from dattri_llm.gradient.callbacks.optimizer_state_callback import OptimizerStateCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.state.dynamics import load_training_dynamics
from dattri_llm.gradient.state.snapshots import LazyDynamics, TrajectorySnapshots
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.atomic import atomic_torch_save
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.callbacks.training_dynamics_callback import (
        TrainingDynamicsCallback,
    )
    from dattri_llm.gradient.stream.source import GradientSource
    from dattri_llm.gradient.stream.streamer import GradientStreamer

ADAMW_DYNAMICS_FILE = "adamw_dynamics.pt"
# Seed of the disjoint coordinate groups of ``num_masks > 1``.
# ``args.optim`` values whose optimizer AdamW-influence models.

Queries = dict[str, torch.Tensor]
# Keywords of ``attribute_from_cache`` that ``attribute`` passes on.
_FROM_CACHE = (
    "dynamics", "selected_training_steps", "layer_name", "loss_reduction", "propagation",
    "loop_over_test", "final_step", "block_dtype", "num_masks", "algorithm_meta", "error_proxy",
)  # fmt: skip


class AdamWInfluenceAttributor(TrajectoryAttributor):
    """AdamW-influence (``algorithm="AdamWInfluence"``): influence through AdamW's dynamics.

    Args:
        args: the run settings (``args.optim`` must name AdamW to collect a run).
        task: the :class:`AttributionTask` (``None`` for cache-only use).
        projection_kwargs: per-layer ``"mask"`` configs (``"__default__"``
            fallback) of the captured coordinates, whose optimizer moments are
            recorded; ``None``: those of ``cache``'s ``hook_config`` (all
            coordinates without one).
    """

    algorithm: ClassVar[str] = "AdamWInfluence"
    # Rows are the first-order change of the query loss when the sample is up-weighted:
    # a helpful sample scores NEGATIVE (AttributionScore.top_k ranks by polarity * score).
    polarity: ClassVar[int] = -1

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        projection_kwargs: dict[str, dict] | None = None,
    ) -> None:
        super().__init__(args, task=task)
        self.projection_kwargs = projection_kwargs
        self._state_callback: OptimizerStateCallback | None = None

    # ------------------------------------------------------------------ collection
    def capture_config(self, hook_config: HookManagerConfig | None) -> HookManagerConfig | None:
        """The capture (and replay) config: ``hook_config``, projected by ``projection_kwargs``.

        Without ``projection_kwargs`` it is ``hook_config`` as given; without
        ``hook_config`` a ``linear_io=REGISTER_ALL`` config with those masks.

        Raises:
            ValueError: ``hook_config`` projects differently from ``projection_kwargs``.
        """
        if self.projection_kwargs is None:
            return hook_config
        if hook_config is None:
            return HookManagerConfig(
                linear_io=REGISTER_ALL, projection_kwargs=self.projection_kwargs
            )
        if hook_config.projection_kwargs != self.projection_kwargs:
            raise ValueError(
                "hook_config.projection_kwargs differs from the attributor's projection_kwargs "
                f"({hook_config.projection_kwargs!r} vs {self.projection_kwargs!r}); the "
                "gradients and the optimizer moments must sit on the same coordinates: pass "
                "one of them, or the same masks to both"
            )
        return hook_config

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
        """Record the run with its AdamW moments, then the queries at ``θ_T`` (base ``cache``).

        The dynamics go to ``adamw_dynamics.pt`` inside the gradient store
        (snapshot stores keep them per step).

        Raises:
            ValueError: ``args.optim`` is not AdamW (checked before training).
        """
        self.require_adamw_training(
            "AdamW-influence models", ", or DVEmb / TracIn for other optimizers"
        )
        return super().cache(
            train_dataset,
            test_dataset,
            cache_dir=cache_dir,
            hook_config=self.capture_config(hook_config),
            offload_interval=offload_interval,
        )

    def dynamics_recorder(
        self, streamer: GradientStreamer, snapshots: object | None = None
    ) -> TrainingDynamicsCallback:
        """An ``OptimizerStateCallback`` on the captured coordinates (into ``snapshots`` if any)."""
        projection = self.projection_kwargs
        if projection is None:
            projection = streamer.hook_manager.config.projection_kwargs
        self._state_callback = OptimizerStateCallback(
            streamer.model,
            lambda: streamer.optimizer,
            projection_kwargs=projection,
            snapshots=snapshots,
            grad_scaler=lambda: streamer.grad_scaler,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
        )
        return self._state_callback

    def finish_trajectory(self, train_target: GradientStorageManager | TrajectorySnapshots) -> None:
        """Save the dynamics as ``adamw_dynamics.pt`` inside a gradient store (rank 0)."""
        callback, self._state_callback = self._state_callback, None
        if isinstance(train_target, GradientStorageManager) and callback is not None:
            if self.args.should_log:
                path = Path(train_target.save_dir) / ADAMW_DYNAMICS_FILE
                atomic_torch_save(dict(callback.dynamics()), path)

    # ------------------------------------------------------------------ dynamics
    @staticmethod
    def load_dynamics(train: object, dynamics: object) -> Mapping[int, dict]:
        """``{step: entry}`` (``assemble_dynamics`` entries) for a recorded run.

        ``dynamics``: a mapping (``OptimizerStateCallback.dynamics()``) is
        returned as is; a file path (or a directory holding
        ``adamw_dynamics.pt``) is loaded with ``weights_only=True``; ``None``
        reads the snapshot store's entries, or ``adamw_dynamics.pt`` inside the
        train gradient store.

        Raises:
            FileNotFoundError: a ``dynamics`` path that does not exist.
            ValueError: ``None`` and nothing recorded beside the run.
        """
        if isinstance(dynamics, Mapping):
            return dynamics
        if dynamics is not None:
            path = Path(dynamics).expanduser()
            if path.is_dir():
                path = path / ADAMW_DYNAMICS_FILE
            if not path.is_file():
                raise FileNotFoundError(
                    f"AdamW dynamics file {str(path)!r} does not exist; pass "
                    "OptimizerStateCallback.dynamics(), or the adamw_dynamics.pt written by "
                    "AdamWInfluenceAttributor.cache"
                )
            return torch.load(path, map_location="cpu", weights_only=True)
        snapshots = TrajectoryAttributor.snapshots_of(train)
        if snapshots is not None:
            return LazyDynamics(snapshots)
        directory = TrajectoryAttributor.train_dir_of(train)
        if directory is not None and (directory / ADAMW_DYNAMICS_FILE).is_file():
            return torch.load(
                directory / ADAMW_DYNAMICS_FILE, map_location="cpu", weights_only=True
            )
        raise ValueError(
            f"no AdamW dynamics recorded beside the train source {directory}; pass "
            "dynamics=OptimizerStateCallback.dynamics(), a file path, or keep "
            f"{ADAMW_DYNAMICS_FILE} in the gradient store"
        )

    # ------------------------------------------------------------------ sweeps
    def sweep(
        self,
        train_source: GradientSource,
        queries: Queries,
        dynamics: Mapping[int, dict],
        prop_steps: list[int],
        output_steps: list[int],
        *,
        loss_reduction: str = "mean",
        num_masks: int = 1,
        block_dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """Train-side sweep carrying ``W`` (``(p, ·)`` per coordinate group).

        Args:
            train_source: the run's per-step gradients (``open_train_source``).
            queries: ``{layer: (n_test, p_layer)}`` query gradients at ``θ_T``
                on the captured coordinates.
            dynamics: ``{step: entry}`` covering every propagated update.
            prop_steps: store steps to propagate through, latest first.
            output_steps: steps whose rows are emitted (a subset of ``prop_steps``).
            loss_reduction: ``"mean"`` or ``"sum"`` (see the module docstring).
            num_masks: disjoint coordinate groups swept separately and averaged.
            block_dtype: dtype the sweep computes in.

        Returns:
            ``(scores (rows, n_test) float32 CPU, row_train_ids, row_steps)``,
            rows latest step first.
        """
        return self._sweep_source(
            train_source,
            queries,
            dynamics,
            prop_steps,
            output_steps,
            loss_reduction,
            num_masks,
            block_dtype,
            "train",
        )

    def sweep_queries(
        self,
        train_source: GradientSource,
        queries: Queries,
        dynamics: Mapping[int, dict],
        prop_steps: list[int],
        output_steps: list[int],
        *,
        loss_reduction: str = "mean",
        num_masks: int = 1,
        block_dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """Query-side sweep carrying ``U = Q·W`` (``(n_test, ·)``); same arguments and scores
        as :meth:`sweep`."""
        return self._sweep_source(
            train_source,
            queries,
            dynamics,
            prop_steps,
            output_steps,
            loss_reduction,
            num_masks,
            block_dtype,
            "test",
        )

    def _sweep_source(
        self,
        train_source: GradientSource,
        queries: Queries,
        dynamics: Mapping[int, dict],
        prop_steps: list[int],
        output_steps: list[int],
        loss_reduction: str,
        num_masks: int,
        block_dtype: torch.dtype,
        propagation: str,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """One sweep of an opened source (behind :meth:`sweep` and :meth:`sweep_queries`)."""
        directory = self.train_dir_of(train_source)
        recorded = None if directory is None else load_training_dynamics(directory)
        run = RunDynamics.from_records(recorded, entries=dynamics)
        windows = run.windows(prop_steps)
        _check_entries(dynamics, swept_windows(windows, set(output_steps)))
        engine = TrajectorySweep(
            self._fold(run),
            run,
            device=torch.device(self.args.device),
            dtype=block_dtype,
            loss_reduction=loss_reduction,
            groups=mask_groups(check_num_masks(num_masks)),
        )
        result = engine.sweep(
            train_source,
            windows,
            set(output_steps),
            queries,
            propagation=propagation,
            entries=dynamics,
        )
        return result.scores, result.row_ids, result.row_steps

    @staticmethod
    def _fold(run: RunDynamics) -> AdamWFold:
        return AdamWFold(amsgrad=run.recorded and 1.0 in run.group_settings("amsgrad"))

    def _recorded_run(
        self,
        train_source: object,
        test_source: object,
        dynamics: object,
        selected_training_steps: Iterable[int] | None,
        final_step: int | None,
    ) -> tuple[GradientStorageManager, Mapping[int, dict], RunScope, AdamWFold]:
        """``(test store, dynamics entries, run scope, checked fold)`` of a scoring call.

        Raises:
            ValueError: an empty test source, a swept update without dynamics,
                or a recorded run the fold cannot model.
        """
        test_store = self.require_test_records(test_source)
        entries = self.load_dynamics(train_source, dynamics)
        scope = self.run_scope(
            train_source,
            selected_training_steps=selected_training_steps,
            final_step=final_step,
            entries=entries,
        )
        _check_entries(entries, scope.swept)
        fold = self._fold(scope.run)
        fold.check_run(scope.run, scope.swept)
        return test_store, entries, scope, fold

    # ------------------------------------------------------------------ entry points
    @keywords(extra=("cache_dir", "offload_interval", *_FROM_CACHE))
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> AttributionScore:
        """:meth:`cache`, then :meth:`attribute_from_cache` on the written stores.

        ``kwargs`` ``cache_dir`` (default ``args.output_dir``) and
        ``offload_interval`` go to :meth:`cache`, the others to
        :meth:`attribute_from_cache` (checked before training).
        """
        cache_options = {k: kwargs.pop(k) for k in ("cache_dir", "offload_interval") if k in kwargs}
        _check_options(kwargs)
        ((train_dir, test_dir),) = self.cache(
            train_dataset, test_dataset, hook_config=hook_config, **cache_options
        )
        return self.attribute_from_cache(
            train_dir, test_dir, hook_config=hook_config, verbose=verbose, **kwargs
        )

    @keywords(extra=("num_masks", "algorithm_meta", "error_proxy"))
    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        dynamics: object = None,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        loss_reduction: str = "mean",
        propagation: str = "train",
        loop_over_test: bool = False,
        final_step: int | None = None,
        hook_config: HookManagerConfig | None = None,
        block_dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> AttributionScore:
        """AdamW-influence scores of a recorded run against queries taken at ``θ_T``.

        ``train_source``: a gradient store (dir, open store, ``DiskGradientSource``)
        or snapshots (replayed on the task model with ``hook_config``, by
        default the attributor's masks); ``dynamics``: see :meth:`load_dynamics`.
        Rows: the propagated steps (recorded steps before ``final_step``) in
        ``selected_training_steps``, latest first. ``loop_over_test`` sweeps
        once per query block (``propagation="test"`` only). ``kwargs``: an int
        ``num_masks`` (default 1) averages that many disjoint coordinate groups
        of every layer; ``algorithm_meta`` (a dict) is merged into the score's;
        ``error_proxy=True`` also runs :meth:`error_proxy` in probe mode (16
        probes, about the cost of one more query-side sweep) and records its
        :meth:`ErrorProxy.to_meta` under ``algorithm_meta["error_proxy"]``,
        with a ``UserWarning`` when the linear scores are flagged unreliable;
        any other keyword raises ``TypeError``. A scored first update records
        ``algorithm_meta["first_update"]`` (:mod:`.trajectory.first_update`).

        Raises:
            ValueError: bad ``loss_reduction`` / ``propagation`` / ``num_masks``;
                a propagated step without dynamics; an optimizer other than
                Adam/AdamW or ``maximize=True`` in the recorded run; an empty
                test source.
        """
        _check_options({"loss_reduction": loss_reduction, **kwargs})
        self.validate_propagation(propagation, loop_over_test)
        num_masks = check_num_masks(kwargs.pop("num_masks", 1))
        extra_meta = kwargs.pop("algorithm_meta", None) or {}
        with_proxy = bool(kwargs.pop("error_proxy", False))
        test_store, entries, scope, fold = self._recorded_run(
            train_source, test_source, dynamics, selected_training_steps, final_step
        )
        self._verbose = verbose
        try:
            result, test_ids = self.score_run(
                train_source,
                test_store,
                fold,
                scope,
                layer_name=layer_name,
                hook_config=self.capture_config(hook_config),
                loss_reduction=loss_reduction,
                propagation=propagation,
                loop_over_test=loop_over_test,
                block_dtype=block_dtype,
                groups=mask_groups(num_masks),
                entries=entries,
                verbose=verbose,
            )
        finally:
            self._verbose = False
        extra_meta = {**extra_meta, **first_update_meta(
            result.scores, result.row_steps, scope.run, scope.swept, method=self.algorithm
        )}  # fmt: skip
        if with_proxy:
            proxy = self.error_proxy(
                train_source,
                test_source,
                dynamics=entries,
                selected_training_steps=selected_training_steps,
                final_step=final_step,
                layer_name=layer_name,
                loss_reduction=loss_reduction,
                hook_config=hook_config,
                per_sample=False,
                verbose=verbose,
            )
            extra_meta = {**extra_meta, "error_proxy": proxy.to_meta()}
            _warn_if_unreliable(proxy)
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
                "num_masks": num_masks,
                "projection_kwargs": self.projection_kwargs,
                **extra_meta,
            },
        )

    def error_proxy(
        self,
        train_source: object,
        test_source: object,
        *,
        dynamics: object = None,
        selected_training_steps: Iterable[int] | None = None,
        final_step: int | None = None,
        layer_name: str | list[str] | None = None,
        loss_reduction: str = "mean",
        hook_config: HookManagerConfig | None = None,
        per_sample: bool = True,
        sample_block: int = 256,
        num_probes: int = 16,
        seed: int = 0,
        query_hessian: torch.Tensor | None = None,
        block_dtype: torch.dtype = torch.float64,
        verbose: bool = False,
    ) -> ErrorProxy:
        """The second-order term ``E = ½a''(0)`` of removing each training sample.

        ``a(ε)`` is the query loss at ``θ_T`` with the sample's loss weighted
        ``1 + ε``; removal is ``ε = −1``, with linear estimate ``−a'(0)``
        (``a'(0)``: the sample's :meth:`attribute_from_cache` rows summed over
        its steps). ``E`` comes from a forward sweep of first and second
        tangents along the recorded run (:mod:`.trajectory.second_order`):
        large ``|E|`` against the linear estimate flags a trajectory too long,
        a learning rate too large, or samples too large a share of their
        batches for first-order scores.

        Sources, ``dynamics``, ``final_step``, ``layer_name``,
        ``loss_reduction`` and ``hook_config`` are as in
        :meth:`attribute_from_cache`; ``selected_training_steps`` restricts
        which occurrences are perturbed (a sample's rows at other steps keep
        their weight).

        Args:
            per_sample: one-hot directions, ``sample_block`` samples per forward
                sweep (``ceil(N/sample_block)`` sweeps, each holding
                ``6 × sample_block × p`` values); ``False``: ``num_probes``
                Rademacher directions over all samples in one sweep (seeded
                by ``seed``), estimating the mean ``E`` and the RMS of the
                linear estimate per query.
            query_hessian: ``(p, p)`` curvature ``H_q`` of the query loss over
                the concatenated captured coordinates (layers in sorted order);
                ``None``: the mean per-sample Gauss–Newton of the last update,
                a query-independent stand-in.
            block_dtype: the sweep's dtype (results on the CPU in it). Float64 by
                default: ``∂²θ'/∂v'²`` grows like ``v̂^(-3/2)`` where a coordinate's
                second moment is tiny, which overflows float32.

        Raises:
            NotImplementedError: a run with ``amsgrad``.
            ValueError: bad ``loss_reduction``, ``sample_block``,
                ``num_probes`` or ``query_hessian``; see :meth:`attribute_from_cache`.
        """
        check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        check_counts(sample_block=sample_block, num_probes=num_probes)
        check_query_hessian(query_hessian)
        test_store, entries, scope, fold = self._recorded_run(
            train_source, test_source, dynamics, selected_training_steps, final_step
        )
        if fold.amsgrad:
            raise NotImplementedError(
                "error_proxy does not model amsgrad (the running maximum of v has no second "
                "derivative); use the first-order scores of attribute_from_cache alone"
            )
        layers = normalize_layer_names(layer_name)
        engine = TrajectorySweep(
            fold,
            scope.run,
            device=torch.device(self.args.device),
            dtype=block_dtype,
            loss_reduction=loss_reduction,
            progress=self._progress(verbose),
        )
        source = self.open_train_source(
            train_source,
            steps=scope.swept_steps,
            layer_name=layers,
            hook_config=self.capture_config(hook_config),
        )
        try:
            test = self.load_test_rep(test_store, layer_name=layers)
            test_ids, queries = self.collect_test_matrix(test, dtype=block_dtype)
            return error_proxy(
                engine,
                source,
                scope.swept,
                set(scope.output_steps),
                queries,
                test_ids,
                per_sample=per_sample,
                sample_block=sample_block,
                num_probes=num_probes,
                seed=seed,
                query_hessian=query_hessian,
                layers=layers,
                entries=entries,
            )
        finally:
            self.close_source(source)


def _warn_if_unreliable(proxy: ErrorProxy) -> None:
    """``UserWarning`` when the proxy flags the linear scores as unreliable."""
    if not proxy.reliable:
        warnings.warn(
            f"AdamW-influence's linear scores may be unreliable: the second-order term of "
            f"removing a sample is {proxy.median_relative_error:.3g} of the linear estimate's "
            f"RMS (median over the queries; threshold {proxy.threshold}). If a few samples of the "
            "run's first update(s) carry it (error_proxy(per_sample=True) shows; Adam's first "
            "step is nearly sign(g) per coordinate), score from a later step "
            "(selected_training_steps); otherwise score a shorter trajectory window "
            "(selected_training_steps / final_step) or a run with a smaller learning rate",
            UserWarning,
            stacklevel=3,
        )


def _check_entries(entries: Mapping[int, dict], windows: list) -> None:
    """``ValueError`` naming the swept updates ``entries`` lack."""
    missing = sorted(w.key for w in windows if w.record_key not in entries)
    if missing:
        raise ValueError(
            f"the AdamW dynamics lack propagated step(s) {missing} (they cover "
            f"{sorted(entries)}); record every step with OptimizerStateCallback, or pass "
            "final_step / a train source ending where they end"
        )


def _check_options(options: Mapping[str, Any]) -> None:
    """``ValueError`` for a bad ``loss_reduction`` or ``num_masks`` (before any work)."""
    check_choice("loss_reduction", options.get("loss_reduction", "mean"), LOSS_REDUCTIONS)
    if "num_masks" in options:
        check_num_masks(options["num_masks"])


__all__ = [
    "ADAMW_DYNAMICS_FILE",
    "ADAMW_OPTIMIZERS",
    "RELIABILITY_THRESHOLD",
    "AdamWInfluenceAttributor",
    "ErrorProxy",
    "coordinate_groups",
]

"""Trajectory TracIn: each recorded update's samples against the final queries, lr-weighted.

A training sample ``z`` of update ``t`` scores ``<η_t ⊙ c_t t_z, ∇ℓ(θ_T, z')>``:
its share ``t_z`` of the update's gradient (the stored row over the loss scale
the row carries), times the clip coefficient ``c_t`` the loop applied and each
coordinate's learning rate ``η_t`` (its parameter group's) — the first-order
effect of the update's step on the query loss at the end of the run, as if
nothing after it changed the parameters. It is DVEmb without curvature
(``H = 0``) and the lr-weighted counterpart of ``TracInAttributor``'s unit
weights; ``AttributionScore.agnostic_matrix()`` sums a sample's updates.

When every coordinate of an update shares one learning rate, the update's
weight ``η_t c_t / ρ`` scales its rows and the inner products are Grad-Dot's
(factored or dense, whichever is cheaper): the cost of Grad-Dot on the same
store. Parameter groups with different rates go through the shared sweep
(:class:`~.trajectory.folds.TracInFold`), which scales each coordinate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.trajectory.base import TrajectoryAttributor
from dattri_llm.attribution.algorithm.trajectory.folds import TracInFold
from dattri_llm.attribution.algorithm.trajectory.sweep import SweepResult
from dattri_llm.attribution.blocks import scale_rows
from dattri_llm.attribution.sources import normalize_layer_names
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.algorithm.trajectory.scope import RunScope
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.model.container import Gradient

LearningRate = float | Mapping[int, float] | None
# Keywords of ``attribute_from_cache`` that ``attribute`` passes on.
_FROM_CACHE = (
    "selected_training_steps", "layer_name", "loop_over_test", "algorithm_meta", "final_step",
    "learning_rate", "block_dtype",
)  # fmt: skip


class TrajectoryTracInAttributor(TrajectoryAttributor):
    """Learning-rate-weighted TracIn over one recorded run (``algorithm="TrajectoryTracIn"``)."""

    algorithm: ClassVar[str] = "TrajectoryTracIn"

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)
        self._step_weights: dict[int, float] | None = None

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

        ``kwargs`` ``cache_dir`` and ``offload_interval`` go to :meth:`cache`,
        the others to :meth:`attribute_from_cache`.
        """
        cache_options = {k: kwargs.pop(k) for k in ("cache_dir", "offload_interval") if k in kwargs}
        ((train_dir, test_dir),) = self.cache(
            train_dataset, test_dataset, hook_config=hook_config, **cache_options
        )
        return self.attribute_from_cache(
            train_dir, test_dir, hook_config=hook_config, verbose=verbose, **kwargs
        )

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
        final_step: int | None = None,
        learning_rate: LearningRate = None,
        hook_config: HookManagerConfig | None = None,
        block_dtype: torch.dtype = torch.float32,
    ) -> AttributionScore:
        """Trajectory-TracIn scores of a recorded run against queries taken at ``θ_T``.

        ``learning_rate``: ``None`` (default) for the recorded rates (each
        parameter group's, else ``lr_schedule.json``), a float, or
        ``{step: lr}``. Rows: the steps before ``final_step`` in
        ``selected_training_steps``, latest first.

        Raises:
            ValueError: a step without a learning rate; an empty test source;
                no layer shared by the two sides.
        """
        test_store = self.require_test_records(test_source)
        scope = self.run_scope(
            train_source, selected_training_steps=selected_training_steps, final_step=final_step
        )
        rates = scope.run.learning_rates(
            scope.swept, learning_rate, self.recorded_lr_of(train_source)
        )
        weights = _uniform_weights(scope, rates)
        self._verbose = verbose
        try:
            if weights is None:
                result, test_ids = self.score_run(
                    train_source,
                    test_store,
                    TracInFold(),
                    scope,
                    layer_name=layer_name,
                    hook_config=hook_config,
                    propagation="test",
                    loop_over_test=loop_over_test,
                    block_dtype=block_dtype,
                    learning_rates=rates,
                    verbose=verbose,
                )
            else:
                result, test_ids = self._weighted_dot(
                    train_source,
                    test_store,
                    scope,
                    weights,
                    layer_name,
                    hook_config,
                    loop_over_test,
                )
        finally:
            self._verbose = False
            self._step_weights = None
        return self.build_run_score(
            result,
            test_ids,
            train_source,
            test_store,
            scope,
            selected_training_steps=selected_training_steps,
            options={"loop_over_test": loop_over_test, "block_dtype": block_dtype},
            extra={
                "learning_rate": scope.recorded_rates() if rates is None else rates,
                **(algorithm_meta or {}),
            },
        )

    def _weighted_dot(
        self,
        train_source: object,
        test_store: object,
        scope: RunScope,
        weights: dict[int, float],
        layer_name: str | list[str] | None,
        hook_config: HookManagerConfig | None,
        loop_over_test: bool,
    ) -> tuple[SweepResult, list[str]]:
        """Grad-Dot of the emitted steps with each step's rows scaled by its weight."""
        layers = normalize_layer_names(layer_name)
        steps = sorted(set(scope.swept_steps) & set(scope.output_steps))
        self._step_weights = weights
        with self.summed_rows(train_source, scope) as summed:
            # a top-k pass reads the steps latest first, the order of the score's rows
            passes = [steps] if summed is None else [[step] for step in reversed(steps)]
            for pass_steps in passes:
                source = self.open_train_source(
                    train_source, steps=pass_steps, layer_name=layers, hook_config=hook_config
                )
                try:
                    test = self.load_test_rep(test_store, layer_name=layers)
                    scores, row_ids, row_steps, test_ids, _ = self.score_sources(
                        source, test, loop_over_test=loop_over_test
                    )
                finally:
                    self.close_source(source)
        order = sorted(range(len(row_steps)), key=lambda row: -row_steps[row])  # latest first
        result = SweepResult(
            scores[order],
            [row_ids[i] for i in order],
            [row_steps[i] for i in order],
            list(self.scored_layers),
        )
        return result, test_ids

    def transform_train_step(self, step: int, block: Gradient) -> Gradient:
        """The step's rows times its update's weight ``η_t c_t / ρ`` (identity outside a call)."""
        if self._step_weights is None:
            return block
        factors = torch.full((block.batch_size,), self._step_weights[step])
        return scale_rows(block, factors)


def _uniform_weights(scope: RunScope, rates: Mapping[int, float] | None) -> dict[int, float] | None:
    """``{store step: η_t c_t / ρ}`` when every swept update has one rate for all coordinates."""
    weights = {}
    for window in scope.swept:
        rate = rates[window.key] if rates is not None else scope.run.uniform(window, "lr")
        if rate is None:
            return None
        for step in window.steps:
            weights[step] = rate * window.row_step_scale
    return weights

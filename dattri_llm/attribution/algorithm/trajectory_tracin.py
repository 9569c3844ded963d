"""Trajectory TracIn: each recorded update's samples against the final queries, lr-weighted.

A training sample ``z`` of update ``t`` scores ``<η_t ⊙ c_t t_z, ∇ℓ(θ_T, z')>``:
its share ``t_z`` of the update's gradient (the stored row over the loss scale
the row carries), times the clip coefficient ``c_t`` the loop applied and each
coordinate's learning rate ``η_t`` (its parameter group's) — the first-order
effect of the update's step on the query loss at the end of the run, as if
nothing after it changed the parameters. It is DVEmb without curvature
(``H = 0``) and the lr-weighted counterpart of ``TracInAttributor``'s unit
weights; ``AttributionScore.agnostic_matrix()`` sums a sample's updates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.trajectory import TrajectoryAttributor
from dattri_llm.attribution.algorithm.trajectory.folds import TracInFold

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig

LearningRate = float | Mapping[int, float] | None


class TrajectoryTracInAttributor(TrajectoryAttributor):
    """Learning-rate-weighted TracIn over one recorded run (``algorithm="TrajectoryTracIn"``)."""

    algorithm: ClassVar[str] = "TrajectoryTracIn"

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)

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
        self._verbose = verbose
        try:
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
        finally:
            self._verbose = False
        meta = {
            **self.run_meta(
                train_source,
                test_store,
                scope,
                selected_training_steps=selected_training_steps,
                loss_reduction="mean",
                propagation="test",
                loop_over_test=loop_over_test,
                block_dtype=block_dtype,
            ),
            "learning_rate": scope.recorded_rates() if rates is None else rates,
            **(algorithm_meta or {}),
        }
        for unused in ("loss_reduction", "propagation"):
            meta.pop(unused)
        self.scored_layers = result.layers
        return self.build_score(
            result.scores,
            result.row_ids,
            result.row_steps,
            test_ids,
            algorithm_meta=meta,
            layer_name=list(result.layers),
        )

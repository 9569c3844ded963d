"""AdamW-influence: the first-order effect of a training sample through AdamW's real dynamics.

A training step ``t`` maps the optimizer state ``(θ, m, v)`` to the next one.
Over the ``p`` captured coordinates (all of them, or per-layer masks) the
recorded moments give, per step, the batch gradient ``g_t = (m_post −
β1·m_pre)/(1−β1)`` and the diagonal Adam Jacobian ``(D_t, S_t) =
adam_preconditioner(m_post/(1−β1ⁿ), v_post/(1−β2ⁿ), eps)`` (``n`` = the update
count after the step). A summary ``W = [W_θ | W_m | W_v]`` — the derivative of
``θ_T`` in the state after the current step, ``[I | 0 | 0]`` at the end — is
carried from the latest step to the earliest. At an emitted step a training
sample ``z`` of the batch scores ``−qᵀ W·push(g_z)`` against each query
gradient ``q`` (taken at ``θ_T``), ``push = ops.adamw_influence_push``; then
the step is folded into ``W``: ``V = coupling(W, g_z)``, ``W ←
transition(W)`` (with the step's weight decay) and ``W_θ += c·Vᵀ g_z``, the
Gauss–Newton coupling of the batch (``c = |B|`` for a mean loss, 1 for a sum).
Layers are concatenated: the coupling spans every captured coordinate.

``propagation="train"`` carries ``W`` itself (``(p, 3p)``);
``propagation="test"`` carries ``U = Q·W`` (``(n_test, 3p)``) instead, which
gives the same scores at a cost linear in the number of queries.
``num_masks > 1`` splits each layer's captured coordinates into that many
disjoint random groups, sweeps each group on its own and averages the scores.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution import utils as attribution_utils
from dattri_llm.attribution.algorithm._adamw_sweep import (
    Summary,
    check_dynamics_cover,
    check_loss_reduction,
    coordinate_groups,
    identity_summary,
    layer_widths,
    select_columns,
    step_dynamics,
)
from dattri_llm.attribution.algorithm.trajectory import TrajectoryAttributor
from dattri_llm.gradient.callbacks.optimizer_state_callback import OptimizerStateCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.ops.optimizer import adamw_influence_push
from dattri_llm.gradient.snapshots import LazyDynamics, TrajectorySnapshots
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.atomic import atomic_torch_save

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.callbacks import HookManagerCallback
    from dattri_llm.gradient.gradient import GradientRecord
    from dattri_llm.gradient.streaming import GradientSource, GradientStreamer

ADAMW_DYNAMICS_FILE = "adamw_dynamics.pt"

Queries = dict[str, torch.Tensor]


class _StepTrackingStateCallback(OptimizerStateCallback):
    """``OptimizerStateCallback`` remembering the step of the last pre-update read."""

    last_step: int | None = None

    def on_step_end(self, record: GradientRecord) -> None:
        """Read the pre-update moments and remember ``record.step``."""
        super().on_step_end(record)
        self.last_step = record.step


class AdamWInfluenceAttributor(TrajectoryAttributor):
    """AdamW-influence (``algorithm="AdamWInfluence"``): influence through AdamW's dynamics.

    Args:
        args: the run settings (``args.gradient_accumulation_steps`` must be 1
            to collect a run).
        task: the :class:`AttributionTask` (``None`` for cache-only use).
        projection_kwargs: per-layer ``"mask"`` configs (``"__default__"``
            fallback) of the captured coordinates, whose optimizer moments are
            recorded; ``None``: those of ``cache``'s ``hook_config`` (all
            coordinates without one).
    """

    algorithm: ClassVar[str] = "AdamWInfluence"

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        projection_kwargs: dict[str, dict] | None = None,
    ) -> None:
        super().__init__(args, task=task)
        self.projection_kwargs = projection_kwargs
        self._state_callback: _StepTrackingStateCallback | None = None

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
        """
        return super().cache(
            train_dataset,
            test_dataset,
            cache_dir=cache_dir,
            hook_config=self.capture_config(hook_config),
            offload_interval=offload_interval,
        )

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
        """The base collection, refusing gradient accumulation first.

        Raises:
            NotImplementedError: ``args.gradient_accumulation_steps > 1``.
        """
        if self.args.gradient_accumulation_steps > 1:
            raise NotImplementedError(
                f"AdamW-influence needs one optimizer update per captured batch; "
                f"args.gradient_accumulation_steps={self.args.gradient_accumulation_steps} "
                "accumulates several batches into one update. Use gradient_accumulation_steps=1 "
                "(raise per_device_train_batch_size instead)"
            )
        return super().collect_trajectory(
            train_target,
            test_store,
            train_dataset,
            test_dataset,
            hook_config=hook_config,
            offload_interval=offload_interval,
        )

    def trajectory_callbacks(
        self,
        model: nn.Module,
        streamer: GradientStreamer,
        snapshots: TrajectorySnapshots | None,
    ) -> list[HookManagerCallback]:
        """An ``OptimizerStateCallback`` on the captured coordinates (into ``snapshots`` if any)."""
        projection = self.projection_kwargs
        if projection is None:
            projection = streamer.hook_manager.config.projection_kwargs
        self._state_callback = _StepTrackingStateCallback(
            model, lambda: streamer.optimizer, projection_kwargs=projection, snapshots=snapshots
        )
        return [self._state_callback]

    def on_trajectory_block(self) -> None:
        """Read the post-update moments of the step just taken."""
        callback = self._state_callback
        if callback is not None and callback.last_step is not None:
            callback.record_post(callback.last_step)

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
        snapshots = _snapshots_of(train)
        if snapshots is not None:
            return LazyDynamics(snapshots)
        directory = TrajectoryAttributor.train_dir_of(train)
        if directory is not None and (directory / ADAMW_DYNAMICS_FILE).is_file():
            return torch.load(
                directory / ADAMW_DYNAMICS_FILE, map_location="cpu", weights_only=True
            )
        raise ValueError(
            f"no AdamW dynamics recorded beside the train source {directory}; pass "
            "dynamics=OptimizerStateCallback.dynamics() (with record_post(step) after every "
            f"optimizer.step()), a file path, or keep {ADAMW_DYNAMICS_FILE} in the gradient store"
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
        """Train-side sweep carrying ``W`` (``(p, 3p)`` per coordinate group).

        Args:
            train_source: the run's per-step gradients (``open_train_source``).
            queries: ``{layer: (n_test, p_layer)}`` query gradients at ``θ_T``
                on the captured coordinates; their sorted layers are scored.
            dynamics: ``{step: entry}`` covering every propagated step.
            prop_steps: steps to propagate through, latest first.
            output_steps: steps whose rows are emitted (a subset of ``prop_steps``).
            loss_reduction: ``"mean"`` (``c = |B|``) or ``"sum"`` (``c = 1``).
            num_masks: disjoint coordinate groups swept separately and averaged.
            block_dtype: dtype the training gradients are read in.

        Returns:
            ``(scores (rows, n_test) float32 CPU, row_train_ids, row_steps)``,
            rows latest step first.
        """
        return self._sweep(
            train_source, queries, dynamics, prop_steps, output_steps,
            loss_reduction, num_masks, block_dtype, query_side=False,
        )  # fmt: skip

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
        """Query-side sweep carrying ``U = Q·W`` (``(n_test, 3p)``); same arguments and
        scores as :meth:`sweep`."""
        return self._sweep(
            train_source, queries, dynamics, prop_steps, output_steps,
            loss_reduction, num_masks, block_dtype, query_side=True,
        )  # fmt: skip

    def _sweep(
        self,
        train_source: GradientSource,
        queries: Queries,
        dynamics: Mapping[int, dict],
        prop_steps: list[int],
        output_steps: list[int],
        loss_reduction: str,
        num_masks: int,
        block_dtype: torch.dtype,
        *,
        query_side: bool,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """The backward recurrence shared by both propagations (see the module docstring)."""
        check_loss_reduction(loss_reduction)
        layers = sorted(queries)
        device = torch.device(self.args.device)
        q = torch.cat([queries[name] for name in layers], dim=1).to(device, torch.float32)
        check_dynamics_cover(dynamics, prop_steps)
        widths = layer_widths(dynamics[prop_steps[0]], layers)
        for name in layers:
            if queries[name].shape[1] != widths[name]:
                raise ValueError(
                    f"layer {name!r}: the queries have {queries[name].shape[1]} coordinates but "
                    f"the AdamW dynamics {widths[name]}; capture the queries with the same "
                    "projection_kwargs (masks) as the run"
                )
        groups = coordinate_groups(widths, num_masks)
        summaries = [
            Summary(
                select_columns(q, index)
                if query_side
                else identity_summary(index, q.shape[1], device)
            )
            for index in groups
        ]
        emitted = set(output_steps)
        rows: list[torch.Tensor] = []
        row_ids: list[str] = []
        row_steps: list[int] = []
        for step in self.steps_bar(prop_steps):
            g_z, ids = self._step_gradients(train_source, step, layers, widths, block_dtype)
            dyn = step_dynamics(dynamics[step], layers, step, device)
            c = float(g_z.shape[0]) if loss_reduction == "mean" else 1.0
            total = torch.zeros(g_z.shape[0], q.shape[0], device=device)
            for index, summary in zip(groups, summaries, strict=True):
                g_group, dyn_group = select_columns(g_z, index), dyn.subset(index)
                if step in emitted:
                    push = adamw_influence_push(
                        g_group,
                        dyn_group.g_t,
                        dyn_group.d,
                        dyn_group.s,
                        **dyn_group.kernel_kwargs(),
                    )
                    moved = summary.apply(push)
                    total -= moved if query_side else moved @ select_columns(q, index).T
                summary.fold(g_group, dyn_group, c)
            if step in emitted:
                rows.append((total / len(groups)).cpu())
                row_ids.extend(ids)
                row_steps.extend([step] * len(ids))
        scores = torch.cat(rows) if rows else torch.zeros(0, q.shape[0])
        return scores, row_ids, row_steps

    def _step_gradients(
        self,
        train_source: GradientSource,
        step: int,
        layers: list[str],
        widths: Mapping[str, int],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, list[str]]:
        """``(g_z (B, p) on args.device, ids)``: the step's per-sample rows, layers concatenated.

        Raises:
            ValueError: the step yields no block, lacks a layer, or a layer's
                width differs from the dynamics'.
        """
        device = torch.device(self.args.device)
        columns: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
        ids: list[str] = []
        for _step, block, block_ids in self.open_train_source(train_source, steps=[step]):
            missing = sorted(set(layers) - set(block.layer_names))
            if missing:
                raise ValueError(
                    f"training step {step} holds no gradients for query layers {missing}; "
                    "capture the run and the queries on the same layers"
                )
            dense = block.select_layers(layers).materialize()
            for name in layers:
                value = dense.data[name].to(device=device, dtype=dtype)
                columns[name].append(value.reshape(value.shape[0], -1))
            ids.extend(str(i) for i in block_ids)
        if not ids:
            raise ValueError(f"the train source yielded no block for step {step}")
        parts = []
        for name in layers:
            value = torch.cat(columns[name])
            if value.shape[1] != widths[name]:
                raise ValueError(
                    f"layer {name!r}: step {step} gradients have {value.shape[1]} coordinates "
                    f"but the AdamW dynamics {widths[name]}; capture the gradients and record "
                    "the moments with the same projection_kwargs (masks)"
                )
            parts.append(value)
        return torch.cat(parts, dim=1), ids

    # ------------------------------------------------------------------ entry points
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
        :meth:`attribute_from_cache`.
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
        of every layer; all of them are recorded in ``algorithm_meta``.

        Raises:
            ValueError: bad ``loss_reduction`` / ``propagation`` / ``num_masks``;
                a propagated step without dynamics; an empty test source.
        """
        check_loss_reduction(loss_reduction)
        self.validate_propagation(propagation, loop_over_test)
        num_masks = kwargs.pop("num_masks", 1)
        if isinstance(num_masks, bool) or not isinstance(num_masks, int) or num_masks < 1:
            raise ValueError(f"num_masks must be an int >= 1, got {num_masks!r}")
        layers = attribution_utils.normalize_layer_names(layer_name)
        test_store = self.resolve_store(test_source)
        if not test_store.index:
            raise ValueError(
                f"the test gradient store {str(test_store.save_dir)!r} holds no records; "
                "capture the queries at the final parameters into it first"
            )
        loaded = self.load_dynamics(train_source, dynamics)
        prop_steps, output_steps, final_step = self.resolve_steps(
            self.available_steps(train_source), selected_training_steps, final_step
        )
        check_dynamics_cover(loaded, prop_steps)
        sweep = self.sweep_queries if propagation == "test" else self.sweep
        options = {
            "loss_reduction": loss_reduction,
            "num_masks": num_masks,
            "block_dtype": block_dtype,
        }
        self._verbose = verbose
        source = self.open_train_source(
            train_source,
            steps=prop_steps,
            layer_name=layers,
            hook_config=self.capture_config(hook_config),
        )
        try:
            test = self.load_test_rep(test_source, layer_name=layers)
            query_blocks = [[item] for item in test] if loop_over_test else [test]
            results, test_ids, scored = [], [], []
            for block in query_blocks:
                ids, queries = self.collect_test_matrix(block)
                results.append(sweep(source, queries, loaded, prop_steps, output_steps, **options))
                test_ids.extend(ids)
                scored = sorted(queries)
        finally:
            self.close_source(source)
            self._verbose = False
        scores = torch.cat([result[0] for result in results], dim=1)
        _, row_ids, row_steps = results[0]
        meta = {
            "final_step": final_step,
            "selected_training_steps": output_steps if selected_training_steps else None,
            "propagated_steps": prop_steps,
            "loss_reduction": loss_reduction,
            "propagation": propagation,
            "loop_over_test": loop_over_test,
            "num_masks": num_masks,
            "block_dtype": str(block_dtype),
            "projection_kwargs": self.projection_kwargs,
            **self.source_meta(train_source, test_store),
            **kwargs,
        }
        self.scored_layers = scored
        return self.build_score(
            scores, row_ids, row_steps, test_ids, algorithm_meta=meta, layer_name=scored
        )


def _snapshots_of(train: object) -> TrajectorySnapshots | None:
    """The snapshot store of a train source (store, its directory, or a replay), else ``None``."""
    if isinstance(train, TrajectorySnapshots):
        return train
    if isinstance(train, (str, Path)) and TrajectorySnapshots.is_snapshot_dir(
        Path(train).expanduser()
    ):
        return TrajectorySnapshots(Path(train).expanduser())
    snapshots = getattr(train, "snapshots", None)
    return snapshots if isinstance(snapshots, TrajectorySnapshots) else None

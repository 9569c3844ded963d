"""LESS: cosine between a query gradient and a sample's optimizer update direction.

``Inf(z, z') = Σ_t w_t · cos(Γ(z; θ_t), ∇ℓ(z'; θ_t))`` (Xia et al., 2024). The
train side is captured preconditioned (``Γ`` = ``ops.precondition`` with the
optimizer state before the step, through ``HookManager(optimizer=...)``;
projection ``"mask"`` or ``"dense"`` only), the queries raw. ``Γ`` is the
update direction of the sample's *own* gradient: with ``loss_reduction="mean"``
(the default) the map sees ``B·share`` (times the loss divisor of gradient
accumulation), not the share the hook captured
(``HookManager.set_loss_convention``). Each train row is scaled to norm
``w_t`` and each test row to norm 1 (norms over the row's per-sample layers),
then the plain inner product of the base class is taken;
``AttributionScore.agnostic_matrix()`` sums the weighted rows over steps.

Two forms:
* trajectory (``enable_update=True``): one training run from checkpoint 0,
  ``w_t = η_t·c_t``, the learning rate applied at step ``t`` (the first
  parameter group's, ``lr_schedule.json``) times the clip coefficient the
  update applied (``training_dynamics.json`` beside a cached trajectory
  store). Where parameter groups have other learning rates, each
  coordinate of ``Γ`` is first scaled by its group's rate over ``η_t`` (the
  direction the parameters really moved);
* frozen (``enable_update=False``): one frozen pass per task checkpoint ``k``
  preconditioned with ``optimizers[k]``, ``w_k = checkpoint_weights[k]``
  (default 1).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.tracin import COSINE_EPS
from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics, Window
from dattri_llm.attribution.algorithm.trajectory.sweep import LOSS_REDUCTIONS, check_choice
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.blocks import per_sample_layers, scale_rows
from dattri_llm.attribution.schedule import LR_SCHEDULE_FILE, read_lr_schedule
from dattri_llm.attribution.sources import open_store_directory
from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.dot import grad_norm_sq
from dattri_llm.gradient.state.dynamics import load_training_dynamics
from dattri_llm.gradient.stream.streamer import GradientStreamer
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.storage_manager import GradientStorageManager

StepWeight = Callable[[int], float]
# Keywords ``attribute_from_cache`` passes to the base method.
_BASE_FROM_CACHE = (
    "selected_training_steps", "layer_name", "verbose", "loop_over_test",
    "attribution_granularity",
)  # fmt: skip


# ---------------------------------------------------------------------------- row scaling
def row_norms(block: Gradient) -> torch.Tensor:
    """Per-sample gradient norms ``(B,)`` over the block's per-sample layers.

    A dense per-token payload is summed over tokens first (the sample's
    gradient); ``param_grad`` layers carry no sample axis and are left out.
    """
    total = None
    for name in per_sample_layers(block):
        value = block.data[name]
        if isinstance(value, torch.Tensor) and block.indexing[name] == "batch_token":
            value = value.sum(dim=1)
        sq = grad_norm_sq(value, block.layer_types[name]).reshape(-1).float()
        if sq.numel() != block.batch_size:
            raise ValueError(
                f"layer {name!r} holds {sq.numel()} sample(s) in a block of {block.batch_size}; "
                "LESS normalizes each sample's whole gradient and cannot scale a layer "
                "captured batch-summed (broadcast)"
            )
        total = sq if total is None else total + sq.to(total.device)
    return total.sqrt()


def scale_to_norm(block: Gradient, norm: float) -> Gradient:
    """``block`` with every sample's gradient rescaled to norm ``norm`` (zero rows stay 0)."""
    norms = row_norms(block)
    return scale_rows(block, norm / (norms + COSINE_EPS))


# ---------------------------------------------------------------------------- step weights
def _steps_table(source_name: str, table: Mapping[int, float]) -> StepWeight:
    """Lookup ``step → weight`` raising ``ValueError`` for a step the table lacks."""
    weights = {int(step): float(lr) for step, lr in table.items()}

    def weight(step: int) -> float:
        if step not in weights:
            raise ValueError(
                f"no learning rate for training step {step}: {source_name} covers steps "
                f"{sorted(weights)}; pass learning_rate={{step: lr}} covering every stored "
                "step (or a single float)"
            )
        return weights[step]

    return weight


def _constant(value: float) -> StepWeight:
    """The same weight at every step."""
    weight = float(value)
    return lambda step: weight


class LESSAttributor(BaseInnerProductAttributor):
    """LESS (``algorithm="LESS"``): learning-rate-weighted cosine of update directions.

    Args:
        args: the run settings.
        task: the :class:`AttributionTask` (``None`` for cache-only use).
        optimizers: the frozen form's optimizers, one per task checkpoint, each
            holding the optimizer state at that checkpoint (over the task
            model's parameters).
        checkpoint_weights: the frozen form's weight ``w_k`` per checkpoint
            (``None`` or empty: 1 each).

    Raises:
        ValueError: non-empty ``checkpoint_weights`` whose length differs from
            ``len(optimizers)``.
    """

    algorithm: ClassVar[str] = "LESS"
    streaming_top_k: ClassVar[bool] = False  # rows rescaled after the pass (build_score)

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        checkpoint_weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__(args, task=task)
        self.optimizers = list(optimizers) if optimizers is not None else None
        self.checkpoint_weights = [float(w) for w in checkpoint_weights or ()] or None
        if (
            self.checkpoint_weights is not None
            and self.optimizers is not None
            and len(self.checkpoint_weights) != len(self.optimizers)
        ):
            raise ValueError(
                f"checkpoint_weights has {len(self.checkpoint_weights)} entries but "
                f"optimizers has {len(self.optimizers)}; pass one weight per optimizer "
                "(checkpoint), or none for unit weights"
            )
        self._step_weight: StepWeight | None = None
        self._coordinate_rates: _CoordinateRates | None = None
        self._loss_reduction = "mean"
        self._live_recorder: TrainingDynamicsCallback | None = None
        self._capture_meta: dict[str, Any] = {}

    # ------------------------------------------------------------------ frozen form
    def checkpoint_weight(self, k: int) -> float:
        """Weight ``w_k`` of checkpoint ``k`` in the frozen form (1 without weights)."""
        return 1.0 if self.checkpoint_weights is None else self.checkpoint_weights[k]

    def _check_frozen_form(self) -> None:
        """One optimizer per task checkpoint (weights match the optimizers), else ``ValueError``."""
        count = self.num_checkpoints()
        if self.optimizers is None:
            raise _missing_optimizers_error()
        if len(self.optimizers) != count:
            raise ValueError(
                f"LESSAttributor got {len(self.optimizers)} optimizers for {count} task "
                "checkpoints; the frozen form (enable_update=False) needs one optimizer per "
                "checkpoint, optimizers[k] holding the optimizer state at checkpoint k"
            )

    def _frozen_optimizer(self, k: int) -> torch.optim.Optimizer:
        """``optimizers[k]``; ``ValueError`` saying what to pass when there is none."""
        if self.optimizers is None:
            raise _missing_optimizers_error()
        if not 0 <= k < len(self.optimizers):
            raise ValueError(
                f"no optimizer for checkpoint {k}: optimizers has {len(self.optimizers)} "
                "entries; pass one optimizer per task checkpoint"
            )
        return self.optimizers[k]

    # ------------------------------------------------------------------ sources
    def generate_train_rep(
        self,
        train_dataset: object,
        *,
        checkpoint_step: int = 0,
        enable_update: bool = False,
        hook_config: HookManagerConfig | None = None,
    ) -> GradientStreamer:
        """Preconditioned train-side streamer (``GradientStreamer(precondition=True)``).

        Trajectory (``enable_update=True``): the streamer trains with the
        optimizer it builds from ``args`` and captures each step's update
        direction with the pre-step state; a ``TrainingDynamicsCallback``
        records what each update applied. Frozen: a probe at checkpoint
        ``checkpoint_step`` preconditioned with ``optimizers[checkpoint_step]``.
        Either way the map sees each sample's own gradient under the call's
        ``loss_reduction`` (``HookManager.set_loss_convention``).
        """
        if enable_update:
            if self.optimizers is not None:
                warnings.warn(
                    "optimizers= serves LESS's frozen form only; the trajectory "
                    "(enable_update=True) trains with an optimizer built from args",
                    UserWarning,
                    stacklevel=2,
                )
            optimizer = None
        else:
            optimizer = self._frozen_optimizer(checkpoint_step)
        streamer = self._train_streamer(
            train_dataset,
            "generate_train_rep",
            checkpoint_step=checkpoint_step,
            enable_update=enable_update,
            config=hook_config,
            optimizer=optimizer,
            precondition=True,
        )
        divisor = self.args.gradient_accumulation_steps if enable_update else 1
        streamer.hook_manager.set_loss_convention(self._loss_reduction, divisor)
        if enable_update:
            self.attach_dynamics_recorder(streamer)
        return streamer

    # ------------------------------------------------------------------ transforms
    def prepare_scoring(self, train_source: object, test_source: object) -> None:
        """A live train streamer sets the step weights: its learning rates, or ``w_k``.

        A live trajectory's clip coefficients are known only after each update:
        its rows are scaled by them when the score is built.
        """
        if isinstance(train_source, GradientStreamer):
            if train_source.enable_update:
                self._step_weight = lambda step: train_source.learning_rates[step]
                self._live_recorder = self.attach_dynamics_recorder(train_source)
            else:
                self._step_weight = self.checkpoint_weight

    def transform_train_step(self, step: int, block: Gradient) -> Gradient:
        """Each train row (coordinates scaled by their group's rate) rescaled to norm ``w_step``."""
        weight = 1.0 if self._step_weight is None else self._step_weight(step)
        if self._coordinate_rates is not None:
            block = self._coordinate_rates.scale(step, block)
        return scale_to_norm(block, weight)

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """Each test row rescaled to norm 1."""
        return scale_to_norm(block, 1.0)

    def build_score(
        self,
        scores: torch.Tensor,
        row_train_ids: list[str],
        row_steps: list[int],
        test_ids: list[str],
        **kwargs: Any,
    ) -> AttributionScore:
        """The base score; a live trajectory's rows times their update's clip coefficient.

        A call of :meth:`attribute` also records its capture's ``loss_reduction``.
        """
        if self._capture_meta:
            kwargs["algorithm_meta"] = {
                **(kwargs.get("algorithm_meta") or {}),
                **self._capture_meta,
            }
        recorder, self._live_recorder = self._live_recorder, None
        if recorder is not None:
            clip = {
                step: float(update["clip_coef"])
                for update in recorder.updates.values()
                for step in update["steps"]
            }
            factors = torch.tensor([clip.get(step, 1.0) for step in row_steps])
            scores = scores * factors.to(scores)[:, None]
        return super().build_score(scores, row_train_ids, row_steps, test_ids, **kwargs)

    # ------------------------------------------------------------------ entry points
    @keywords(extra=("cache_dir", "hook_config", "on_train_block"))
    def cache(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        enable_update: bool = False,
        loss_reduction: str = "mean",
        **kwargs: Any,
    ) -> list[tuple[str, str]]:
        """Collect raw test and preconditioned train gradients (see the base ``cache``).

        A trajectory store gets ``lr_schedule.json`` and ``training_dynamics.json``
        beside it; the frozen form writes one store pair per checkpoint (score
        each with ``attribute_from_cache(..., checkpoint_weight=w_k)``).
        ``loss_reduction``: how the train loss reduces over a batch (``"mean"``
        or ``"sum"``), so the map sees each sample's own gradient.
        """
        self._loss_reduction = check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        if not enable_update:
            self._check_frozen_form()
        return super().cache(train_dataset, test_dataset, enable_update=enable_update, **kwargs)

    @keywords()
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        enable_update: bool = False,
        gradient_cache_residency: str | None = None,
        attribution_granularity: str = "instance",
        loss_reduction: str = "mean",
    ) -> AttributionScore:
        """Live LESS scores: trajectory (``enable_update=True``) or frozen form.

        Rows are stamped with the optimizer step (trajectory) or the checkpoint
        index (frozen); ``algorithm_meta["learning_rates"]`` holds the frozen
        form's ``{k: w_k}``. ``loss_reduction`` as in :meth:`cache`.
        """
        self._loss_reduction = check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        self._capture_meta = {"loss_reduction": loss_reduction}
        extra: dict[str, Any] = {}
        if not enable_update:
            self.require_task("attribute")
            self._check_frozen_form()
            extra["learning_rates"] = {k: self.checkpoint_weight(k) for k in self.checkpoints()}
        try:
            return super().attribute(
                train_dataset,
                test_dataset,
                hook_config=hook_config,
                verbose=verbose,
                loop_over_test=loop_over_test,
                enable_update=enable_update,
                gradient_cache_residency=gradient_cache_residency,
                attribution_granularity=attribution_granularity,
                **extra,
            )
        finally:
            self._step_weight = None
            self._live_recorder = None
            self._capture_meta = {}

    @keywords(
        aliases={"learning_rates": "learning_rate"},
        extra=_BASE_FROM_CACHE,
    )
    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        checkpoint_weight: float | None = None,
        learning_rate: float | Mapping[int, float] | None = None,
        algorithm_meta: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AttributionScore:
        """LESS scores from a preconditioned train store and a raw test store.

        Weights: ``learning_rate`` (a float, or ``{step: lr}``; alias
        ``learning_rates``), else
        ``checkpoint_weight``, else the recorded run (``training_dynamics.json``:
        each update's first-group rate and per-group rates), else
        ``lr_schedule.json`` beside the train store, else 1. A recorded run's
        clip coefficients multiply every weight but ``checkpoint_weight``.
        ``kwargs`` go to the base method.

        Raises:
            ValueError: a scored step has no weight in ``learning_rate`` or
                the schedule file.
        """
        train_source = open_store_directory(train_source)  # one store (and index) per call
        train_store = self.resolve_store(train_source)
        run = _recorded_run(train_store)
        weight, origin = self._stored_weights(train_store, checkpoint_weight, learning_rate, run)
        steps = kwargs.get("selected_training_steps")
        for step in _scored_steps(train_store, steps):
            weight(step)  # refuse a step without weight before any scoring work
        meta = {"weights_from": origin, **(algorithm_meta or {})}
        self._step_weight = weight
        if run is not None and checkpoint_weight is None:
            self._coordinate_rates = _CoordinateRates(run, train_store.available_steps())
        try:
            return super().attribute_from_cache(
                train_source,
                test_source,
                algorithm_meta=meta,
                checkpoint_weight=checkpoint_weight,
                learning_rate=learning_rate,
                **kwargs,
            )
        finally:
            self._step_weight = None
            self._coordinate_rates = None

    @staticmethod
    def _stored_weights(
        train_store: GradientStorageManager,
        checkpoint_weight: float | None,
        learning_rate: float | Mapping[int, float] | None,
        run: RunDynamics | None = None,
    ) -> tuple[StepWeight, str]:
        """The step-weight lookup of a cached scoring call and where it came from."""
        clip = _clip_of(run, train_store.available_steps())
        if learning_rate is not None:
            if isinstance(learning_rate, Mapping):
                rates = _steps_table("learning_rate", learning_rate)
            else:
                rates = _constant(learning_rate)
            return _times(rates, clip), "learning_rate"
        if checkpoint_weight is not None:
            return _constant(checkpoint_weight), "checkpoint_weight"
        if run is not None:
            windows = _window_of(run, train_store.available_steps())
            recorded = {step: run.reference_lr(window) for step, window in windows.items()}
            table = _steps_table("the recorded run (training_dynamics.json)", recorded)
            return _times(table, clip), "training_dynamics"
        schedule = read_lr_schedule(train_store.save_dir)
        if schedule is not None:
            path = train_store.save_dir / LR_SCHEDULE_FILE
            return _steps_table(f"the schedule {str(path)!r}", schedule), "lr_schedule"
        return _constant(1.0), "unit"


def _recorded_run(store: GradientStorageManager) -> RunDynamics | None:
    """The run recorded beside a trajectory store (``None`` without ``training_dynamics.json``)."""
    recorded = load_training_dynamics(store.save_dir)
    if recorded is None:
        return None
    return RunDynamics.from_records(recorded, merged=store.gradient_accumulation_steps > 1)


def _window_of(run: RunDynamics, steps: list[int]) -> dict[int, Window]:
    """``{store step: its update}``."""
    return {step: window for window in run.windows(steps) for step in window.steps}


def _clip_of(run: RunDynamics | None, steps: list[int]) -> StepWeight:
    """``step → c`` of the recorded run (1 without one)."""
    if run is None:
        return _constant(1.0)
    windows = _window_of(run, steps)
    return lambda step: windows[step].clip_coef if step in windows else 1.0


def _times(first: StepWeight, second: StepWeight) -> StepWeight:
    return lambda step: first(step) * second(step)


class _CoordinateRates:
    """Scales each coordinate of a step's rows by its group's rate over the reference rate."""

    def __init__(self, run: RunDynamics, steps: list[int]) -> None:
        self.run = run
        self.windows = _window_of(run, steps)
        self._ratios: dict[tuple[int, str, int], torch.Tensor] = {}

    def scale(self, step: int, block: Gradient) -> Gradient:
        window = self.windows.get(step)
        if window is None or self.run.uniform(window, "lr") is not None:
            return block
        data = dict(block.data)
        for name in per_sample_layers(block):
            value = block.data[name]
            if isinstance(value, Factorized):
                self.run.warn_once(
                    f"factorized:{name}",
                    f"layer {name!r} is stored factorized, so its coordinates cannot take their "
                    "groups' own learning rates; LESS uses the reference rate for it",
                )
                continue
            ratio = self._ratio(window, name, value.shape[-1])
            data[name] = value * ratio.to(value)
        return Gradient(
            dict(block.representation),
            data,
            dict(block.layer_types),
            dict(block.indexing),
            validate_on_init=False,
        )

    def _ratio(self, window: Window, name: str, width: int) -> torch.Tensor:
        """``(width,)`` each coordinate's rate over the reference rate (1 where that is 0: the
        step's weight ``w_t`` is then 0, so its rows are zero whatever their direction)."""
        key = (window.key, name, width)
        if key not in self._ratios:
            rates = self.run.values(window, {name: width}, "lr", dtype=torch.float64)
            reference = self.run.reference_lr(window)
            ratio = rates / reference if reference else torch.ones_like(rates)
            self._ratios[key] = ratio.float()
        return self._ratios[key]


def _scored_steps(store: GradientStorageManager, selected: Iterable[int] | None) -> list[int]:
    """Stored steps a cached call scores (all, or those in ``selected``)."""
    available = store.available_steps()
    if selected is None:
        return available
    chosen = {int(s) for s in selected}
    return [step for step in available if step in chosen]


def _missing_optimizers_error() -> ValueError:
    """The error for the frozen form without optimizer states."""
    return ValueError(
        "LESS's frozen form (enable_update=False) maps train gradients through the optimizer "
        "state at each checkpoint; pass optimizers=[one torch.optim optimizer per task "
        "checkpoint, holding that checkpoint's state], or use enable_update=True to train a "
        "trajectory"
    )

"""LESS: cosine between a query gradient and a sample's optimizer update direction.

``Inf(z, z') = Σ_t w_t · cos(Γ(z; θ_t), ∇ℓ(z'; θ_t))`` (Xia et al., 2024). The
train side is captured preconditioned (``Γ`` = ``ops.precondition`` with the
optimizer state before the step, through ``HookManager(optimizer=...)``;
projection ``"mask"`` or ``"dense"`` only), the queries raw. Each train row is
scaled to norm ``w_t`` and each test row to norm 1 (norms over the row's
per-sample layers), then the plain inner product of the base class is taken;
``AttributionScore.agnostic_matrix()`` sums the weighted rows over steps.

Two forms:
* trajectory (``enable_update=True``): one training run from checkpoint 0,
  ``w_t`` = the learning rate applied at step ``t`` (``lr_schedule.json``
  beside a cached trajectory store);
* frozen (``enable_update=False``): one frozen pass per task checkpoint ``k``
  preconditioned with ``optimizers[k]``, ``w_k = checkpoint_weights[k]``
  (default 1).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution import utils as attribution_utils
from dattri_llm.attribution.algorithm.tracin import COSINE_EPS
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops.dot import grad_norm_sq
from dattri_llm.gradient.streaming import GradientStreamer

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.storage_manager import GradientStorageManager

StepWeight = Callable[[int], float]


# ---------------------------------------------------------------------------- row scaling
def row_norms(block: Gradient) -> torch.Tensor:
    """Per-sample gradient norms ``(B,)`` over the block's per-sample layers.

    A dense per-token payload is summed over tokens first (the sample's
    gradient); ``param_grad`` layers carry no sample axis and are left out.
    """
    total = None
    for name in attribution_utils.per_sample_layers(block):
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


def scale_rows(block: Gradient, factors: torch.Tensor) -> Gradient:
    """``block`` with sample ``i``'s gradient multiplied by ``factors[i]`` in every layer.

    Factorized layers scale their output-gradient factor (the gradient is
    linear in it); dense layers scale their rows. ``param_grad`` layers pass
    through.
    """
    data = dict(block.data)
    for name in attribution_utils.per_sample_layers(block):
        value = block.data[name]
        if isinstance(value, Factorized):
            grad = value.pre_activation_grad
            shape = [1] * grad.dim()
            shape[value.batch_axis] = -1
            scaled = grad * factors.to(grad).reshape(shape)
            data[name] = Factorized(
                value.activation, scaled, value.module_kwargs, value.batch_first
            )
        else:
            data[name] = value * factors.to(value).reshape(-1, *([1] * (value.dim() - 1)))
    return Gradient(
        dict(block.representation),
        data,
        dict(block.layer_types),
        dict(block.indexing),
        validate_on_init=False,
    )


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
                f"{sorted(weights)}; pass learning_rates={{step: lr}} covering every stored "
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
        direction with the pre-step state. Frozen: a probe at checkpoint
        ``checkpoint_step`` preconditioned with ``optimizers[checkpoint_step]``.
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
        return self._train_streamer(
            train_dataset,
            "generate_train_rep",
            checkpoint_step=checkpoint_step,
            enable_update=enable_update,
            config=hook_config,
            optimizer=optimizer,
            precondition=True,
        )

    # ------------------------------------------------------------------ transforms
    def prepare_scoring(self, train_source: object, test_source: object) -> None:
        """A live train streamer sets the step weights: its learning rates, or ``w_k``."""
        if isinstance(train_source, GradientStreamer):
            if train_source.enable_update:
                self._step_weight = lambda step: train_source.learning_rates[step]
            else:
                self._step_weight = self.checkpoint_weight

    def transform_train_step(self, step: int, block: Gradient) -> Gradient:
        """Each train row rescaled to norm ``w_step``."""
        weight = 1.0 if self._step_weight is None else self._step_weight(step)
        return scale_to_norm(block, weight)

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """Each test row rescaled to norm 1."""
        return scale_to_norm(block, 1.0)

    # ------------------------------------------------------------------ entry points
    def cache(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        enable_update: bool = False,
        **kwargs: Any,
    ) -> list[tuple[str, str]]:
        """Collect raw test and preconditioned train gradients (see the base ``cache``).

        A trajectory store gets ``lr_schedule.json`` beside it; the frozen form
        writes one store pair per checkpoint (score each with
        ``attribute_from_cache(..., checkpoint_weight=w_k)``).
        """
        if not enable_update:
            self._check_frozen_form()
        return super().cache(train_dataset, test_dataset, enable_update=enable_update, **kwargs)

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
    ) -> AttributionScore:
        """Live LESS scores: trajectory (``enable_update=True``) or frozen form.

        Rows are stamped with the optimizer step (trajectory) or the checkpoint
        index (frozen); ``algorithm_meta["learning_rates"]`` holds the frozen
        form's ``{k: w_k}``.
        """
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

    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        checkpoint_weight: float | None = None,
        learning_rates: float | Mapping[int, float] | None = None,
        algorithm_meta: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AttributionScore:
        """LESS scores from a preconditioned train store and a raw test store.

        Weights: ``learning_rates`` (a float, or ``{step: lr}``), else
        ``checkpoint_weight``, else ``lr_schedule.json`` beside the train
        store, else 1. ``kwargs`` go to the base method.

        Raises:
            ValueError: a scored step has no weight in ``learning_rates`` or
                the schedule file.
        """
        train_store = self.resolve_store(train_source)
        weight, origin = self._stored_weights(train_store, checkpoint_weight, learning_rates)
        steps = kwargs.get("selected_training_steps")
        for step in _scored_steps(train_store, steps):
            weight(step)  # refuse a step without weight before any scoring work
        meta = {"weights_from": origin, **(algorithm_meta or {})}
        self._step_weight = weight
        try:
            return super().attribute_from_cache(
                train_source,
                test_source,
                algorithm_meta=meta,
                checkpoint_weight=checkpoint_weight,
                learning_rates=learning_rates,
                **kwargs,
            )
        finally:
            self._step_weight = None

    @staticmethod
    def _stored_weights(
        train_store: GradientStorageManager,
        checkpoint_weight: float | None,
        learning_rates: float | Mapping[int, float] | None,
    ) -> tuple[StepWeight, str]:
        """The step-weight lookup of a cached scoring call and where it came from."""
        if learning_rates is not None:
            if isinstance(learning_rates, Mapping):
                return _steps_table("learning_rates", learning_rates), "learning_rates"
            return _constant(learning_rates), "learning_rates"
        if checkpoint_weight is not None:
            return _constant(checkpoint_weight), "checkpoint_weight"
        schedule = attribution_utils.read_lr_schedule(train_store.save_dir)
        if schedule is not None:
            path = train_store.save_dir / attribution_utils.LR_SCHEDULE_FILE
            return _steps_table(f"the schedule {str(path)!r}", schedule), "lr_schedule"
        return _constant(1.0), "unit"


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

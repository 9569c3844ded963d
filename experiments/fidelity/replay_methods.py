"""The registry's replay-based rows: the exact metagradient (MAGIC), TrackStar and SOURCE.

* MAGIC replays the recorded run (``Captured.snapshots``) and differentiates the query losses
  in every sample's loss weight through every update, in float64 with a float64 loss;
* TrackStar scores live at ``θ_T`` with the run's AdamW state after its last update
  (``Captured.optimizer_state``);
* SOURCE fits EK-FAC at the end of each segment of the run, the checkpoints read back from
  the snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import setting as setting_module
import torch
from capture import FROZEN_BATCH, Captured, backward_over, offloading
from method_base import (
    PROJECTION_K,
    aligned,
    arguments,
    attributor_class,
    final_model,
    projected_hooks,
)
from setting import (
    Setting,
    adamw_for,
    batch_loss,
    finetuned_parameters,
    lr_schedule,
    sequence_losses,
)

from dattri_llm import AttributionTask
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots

MAGIC = "MetagradientAttributor"
TRACKSTAR = "TrackStarAttributor"
SOURCE = "SourceAttributor"


# ---------------------------------------------------------------------------- MAGIC
@contextmanager
def float64_cross_entropy() -> Iterator[None]:
    """``setting.sequence_losses`` keeps a float64 model's cross-entropy in float64 inside.

    The setting computes the loss in float32 whatever the model's dtype (``FLOAT64_LOSS``
    False, what the reference run and every replay use); a float64 metagradient through
    that loss would carry float32 rounding at the logits.
    """
    previous = setting_module.FLOAT64_LOSS
    setting_module.FLOAT64_LOSS = True
    try:
        yield
    finally:
        setting_module.FLOAT64_LOSS = previous


def exact_sequence_losses(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """``(B,)`` per-sentence losses, in float64 for a float64 model (float32 models: unchanged)."""
    with float64_cross_entropy():
        return sequence_losses(model, batch)


def exact_summed_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Sum of :func:`exact_sequence_losses` (a query's target: one sentence per call)."""
    return exact_sequence_losses(model, batch).sum()


def loop_loss(setting: Setting) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    """The training loop's batch loss (``setting.batch_loss``: the sum, or the mean over the
    batch), float64 for a float64 model."""

    def loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        losses = exact_sequence_losses(model, batch)
        return batch_loss(losses, len(losses), setting)

    return loss


def metagradient(captured: Captured, block_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """MAGIC: the exact ``∂L_j(θ_T)/∂w_i`` through the recorded run, replayed in ``block_dtype``.

    Replays ``captured.snapshots`` (``θ_t`` and the batch of every update) with the
    dynamics the capture recorded (clip coefficients, parameter groups), the setting's
    reduction and clip threshold (``arguments()`` would default to 1.0); the loss in float64
    (:func:`exact_sequence_losses`), so the derivative carries no float32 rounding of the
    cross-entropy. Polarity ``-1`` (``dL/dw``): :func:`aligned` turns it to "helps", the
    first-order estimate of ``Δ`` (removing ``i`` is ``w_i: 1 → 0``).
    """
    setting = captured.setting
    model, data = final_model(captured)  # θ_T; the frozen layers never moved
    finetuned_parameters(model, setting)
    attributor = attributor_class(MAGIC)(
        arguments(captured),
        task=AttributionTask(loop_loss(setting), model, target_func=exact_summed_loss),
        sample_loss_func=exact_sequence_losses,
        sample_target_func=exact_sequence_losses,
    )
    score = attributor.attribute_from_cache(
        captured.snapshots,
        data.queries,
        dynamics=captured.trajectory,
        loss_reduction=setting.loss_reduction,
        max_grad_norm=setting.max_grad_norm,
        block_dtype=block_dtype,
    )
    return aligned(score, captured)


# ---------------------------------------------------------------------------- TrackStar
# TrackStar divides each gradient by the optimizer's sqrt(v) + eps before projecting, so the
# factor-wise (LoGRA) projection of TRAK's row cannot be used; a random mask keeps the same
# count of numbers per layer, k² = 32² (a dense Gaussian projection of the materialized
# gradients cost 6-14× the time and ~1 GB in the method tour).
TRACKSTAR_PROJECTION = {"style": "mask", "proj_dim": PROJECTION_K**2}


def trained_optimizer(captured: Captured, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The run's AdamW over ``model``'s trained parameters, in its state after the last update
    (rebuilt as ``setting.adamw_for`` built it, so the saved indices map in order)."""
    optimizer = adamw_for(captured.setting)(finetuned_parameters(model, captured.setting))
    optimizer.load_state_dict(torch.load(captured.optimizer_state, weights_only=True))
    return optimizer


def trackstar(captured: Captured) -> torch.Tensor:
    """TrackStar at ``θ_T``, live: ``cos(R^{-1/2} P(g ⊘ d))`` with ``d = √v + eps`` of the
    trained AdamW, ``P`` :data:`TRACKSTAR_PROJECTION`, ``R`` mixing training rows and queries
    (default ``λ = 0.9``, relative damping). Its captures are inside the call (charged)."""
    setting = captured.setting
    model, data = final_model(captured)
    optimizer = trained_optimizer(captured, model)
    attributor = attributor_class(TRACKSTAR)(
        arguments(captured),
        task=AttributionTask(loop_loss(setting), model),
        optimizer=optimizer,
        loss_reduction=setting.loss_reduction,
    )
    hooks = projected_hooks(model, setting, TRACKSTAR_PROJECTION)
    return aligned(attributor.attribute(data.finetune, data.queries, hook_config=hooks), captured)


# ---------------------------------------------------------------------------- SOURCE
def segment_ends(num_steps: int, segments: int) -> list[int]:
    """Ends of ``segments`` near-equal spans of ``num_steps`` updates (the last is ``T``)."""
    if not 1 <= segments <= num_steps:
        raise ValueError(f"segments must be between 1 and {num_steps} (updates), got {segments}")
    return [round(num_steps * (k + 1) / segments) for k in range(segments)]


def segment_rates(setting: Setting, ends: list[int]) -> list[float]:
    """``η̄_ℓ``: the sum of the schedule's learning rates over each segment's updates."""
    lrs = lr_schedule(setting)
    return [sum(lrs[start:end]) for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def segment_stores(captured: Captured, ends: list[int]) -> list[Path]:
    """Training gradients at each segment end: a frozen pass at ``θ_end`` (loaded from the
    snapshots) per earlier segment; the last segment ends at ``θ_T``: ``final_train``."""
    model, data = final_model(captured)
    finetuned_parameters(model, captured.setting)
    snapshots = TrajectorySnapshots(captured.snapshots)
    stores = []
    for end in ends[:-1]:
        directory = captured.root / "source" / f"step_{end}"
        if not directory.is_dir():
            snapshots.load_parameters(end, model)
            with offloading(model, directory, captured.setting).collect(deregister_on_exit=True):
                backward_over(model, data.finetune, FROZEN_BATCH)
        stores.append(directory)
    return [*stores, captured.final_train]


def source(segments: int) -> Callable[[Captured], torch.Tensor]:
    """SOURCE over ``segments`` near-equal spans of the run: EK-FAC fitted at each segment's
    end (damping 0.1 × mean eigenvalue, as the EK-FAC row), ``η̄_ℓ`` the segment's summed
    AdamW rates taken as SGD step sizes, queries at ``θ_T``."""

    def score(captured: Captured) -> torch.Tensor:
        ends = segment_ends(captured.setting.num_steps, segments)
        attributor = attributor_class(SOURCE)(
            arguments(captured),
            segment_learning_rates=segment_rates(captured.setting, ends),
            damping=0.1,
            relative_damping=True,
        )
        result = attributor.attribute_from_cache(
            segment_stores(captured, ends), captured.queries_final
        )
        return aligned(result, captured)

    return score

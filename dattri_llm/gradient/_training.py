"""Training-step pieces of `GradientStreamer`: loss check, optimizer, RNG state.

Private to :mod:`dattri_llm.gradient.streaming`; the optimizer construction
mirrors the Hugging Face ``Trainer`` (no weight decay on biases and 1-D
parameters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments


def check_loss(loss: object, batch_index: int, role: str = "training") -> torch.Tensor:
    """Return ``loss`` if it is a finite 0-d tensor, else raise ``ValueError``.

    The message names the batch as ``"<role> batch <batch_index>"`` (``role``
    is ``"training"`` or ``"query"``). A non-scalar loss is not reduced for the
    caller: the reduction sets the scale of every score.
    """
    where = f"{role} batch {batch_index}"
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn returned {shape} for {where}; it must return a scalar tensor. Reduce the "
            "per-sample losses with .sum() so that each sample's gradient is its own loss's "
            "gradient; a .mean() over a batch of B samples makes every per-sample gradient, "
            "and every score, B times smaller"
        )
    if not bool(torch.isfinite(loss.detach())):
        raise ValueError(
            f"loss_fn returned a non-finite loss ({loss.item()}) for {where}; "
            "check the batch and the model's numerical stability"
        )
    return loss


def decay_parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable parameters into a decayed group and a no-decay group.

    Parameters with ``ndim < 2`` or whose names end with ``.bias`` get weight
    decay 0; the others ``weight_decay``. Empty groups are omitted.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.endswith(".bias") or name == "bias":
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    groups: list[dict[str, Any]], args: AttributionArguments
) -> torch.optim.Optimizer:
    """The optimizer ``args`` describes over the parameter ``groups``.

    ``groups`` come from :func:`decay_parameter_groups`, taken before any FSDP
    wrapping (which flattens parameters to 1-D shards).
    ``optim`` ``"adamw_torch"``/``"adamw"`` → ``AdamW(lr, betas, eps)``;
    ``"sgd"`` → ``SGD(lr)``; anything else → ``ValueError``.
    """
    if not groups:
        raise ValueError(
            "enable_update=True but the model has no trainable parameter "
            "(every parameter has requires_grad=False)"
        )
    if args.optim in ("adamw_torch", "adamw"):
        return torch.optim.AdamW(
            groups,
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        )
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    raise ValueError(
        f"unsupported optim {args.optim!r}; use 'adamw_torch', 'adamw' or 'sgd', or pass an "
        "optimizer= to GradientStreamer"
    )


def rng_state() -> dict[str, object]:
    """The global CPU (and, once initialised, CUDA) RNG states."""
    state: dict[str, object] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    """Restore states saved by :func:`rng_state`."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])

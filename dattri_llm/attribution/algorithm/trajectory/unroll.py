"""A recorded Adam / AdamW run written as a differentiable function of the sample weights.

The exact metagradient (:mod:`dattri_llm.attribution.algorithm.metagradient`)
replays every update of a recorded run as the loop computed it and
differentiates through it. One update maps the optimizer state
``(θ, m, v)`` and the weights ``w`` of its window's samples to the next state:

* the window's loss ``Σ_micro Σ_b w_b ℓ_b · a`` (``a = 1/N`` for a summed
  micro-batch loss, ``1/(B_mb·N)`` for a mean, ``N`` the loss divisor), its
  gradient ``G`` in the parameters (kept differentiable: the reverse sweep
  needs the second derivatives);
* the loop's clip ``c = min(1, M/(‖G‖ + 1e-6))`` over every parameter the
  optimizer holds (``clip_grad_norm_``), ``g = c·G``;
* torch's Adam / AdamW step per parameter with its group's values:
  ``g += wd·θ`` (``Adam``'s coupled L2 decay) or ``θ ← θ(1 − lr·wd)``
  (decoupled), ``m' = β1 m + (1−β1) g``, ``v' = β2 v + (1−β2) g²``,
  ``θ' = θ − lr/(1−β1^k) · m' / (√v'/√(1−β2^k) + eps)``.

:func:`bound_parameters` runs the task's own loss function on graph tensors
(the model's parameters swapped for them inside the block), so any
``loss_fn(model, batch)`` works unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ADAM_TYPES",
    "GroupValues",
    "adam_update",
    "bound_parameters",
    "cast_batch",
    "per_sample_losses",
    "sample_slices",
    "window_loss",
]

ADAM_TYPES = ("Adam", "AdamW")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
SampleLossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class GroupValues:
    """One parameter group's Adam values at one update (``step``: its count after it)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    decoupled: bool

    @classmethod
    def from_record(cls, group: Mapping[str, Any]) -> GroupValues:
        """From a recorded group (``TrainingDynamicsCallback``'s ``groups`` entries).

        Raises:
            ValueError: ``amsgrad`` or ``maximize`` set.
        """
        if group.get("amsgrad"):
            raise ValueError(
                "the exact metagradient replays Adam / AdamW without amsgrad (the running "
                "maximum of v is not differentiable where it switches); the recorded run set "
                "amsgrad=True. Use AdamWInfluenceAttributor, which models it"
            )
        if group.get("maximize"):
            raise ValueError(
                "the recorded optimizer has maximize=True (it ascends the loss); the exact "
                "metagradient supports maximize=False only"
            )
        betas = group.get("betas", (0.9, 0.999))
        return cls(
            lr=float(group["lr"]),
            beta1=float(betas[0]),
            beta2=float(betas[1]),
            eps=float(group.get("eps", 1e-8)),
            weight_decay=float(group.get("weight_decay", 0.0)),
            step=int(group["step"]),
            decoupled=bool(group.get("decoupled_weight_decay", False)),
        )


# ---------------------------------------------------------------------------- the model
@contextlib.contextmanager
def bound_parameters(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``model``'s parameters named in ``tensors`` are those tensors.

    Names are ``model.named_parameters()`` names; a parameter shared by several
    modules (tied weights) is replaced everywhere. The original parameters are
    put back however the block ends.

    Raises:
        KeyError: a name that is not a parameter of ``model``.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    canonical = dict(model.named_parameters())
    swapped: list[tuple[nn.Module, str, Any]] = []
    try:
        for name, tensor in tensors.items():
            if name not in canonical:
                raise KeyError(
                    f"{name!r} is not a parameter of {type(model).__name__}; the snapshots were "
                    "taken from another model"
                )
            for module, attr in owners[id(canonical[name])]:
                swapped.append((module, attr, module._parameters[attr]))
                module._parameters[attr] = tensor
        yield
    finally:
        for module, attr, original in reversed(swapped):
            module._parameters[attr] = original


def cast_batch(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``batch`` on ``device``, floating tensors cast to ``dtype`` (``None``: kept)."""
    if isinstance(batch, torch.Tensor):
        cast = dtype if dtype is not None and batch.is_floating_point() else None
        return batch.to(device=device, dtype=cast)
    if isinstance(batch, Mapping):
        return {key: cast_batch(value, device, dtype) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(cast_batch(value, device, dtype) for value in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """The leading size of the first tensor with a batch axis in ``batch``.

    Raises:
        ValueError: no tensor with a leading axis.
    """
    found = _first_tensor(batch)
    if found is None:
        raise ValueError(
            "the batch holds no tensor with a batch axis; the exact metagradient needs "
            "tensors to slice the batch into samples"
        )
    return int(found.shape[0])


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch if batch.ndim > 0 else None
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(batch, (Mapping, list, tuple)):
        for value in values:
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def sample_slices(batch: Any, size: int) -> list[Any]:
    """The one-sample batches of ``batch``: every tensor (and list) of leading size ``size``
    sliced ``[b:b+1]``, anything else kept as is."""

    def take(value: Any, b: int) -> Any:
        if isinstance(value, torch.Tensor):
            return value[b : b + 1] if value.ndim > 0 and value.shape[0] == size else value
        if isinstance(value, Mapping):
            return {key: take(item, b) for key, item in value.items()}
        if isinstance(value, list) and len(value) == size:
            return value[b : b + 1]
        if isinstance(value, (list, tuple)):
            return type(value)(take(item, b) for item in value)
        return value

    return [take(batch, b) for b in range(size)]


def per_sample_losses(
    model: nn.Module,
    batch: Any,
    loss_fn: SampleLossFn,
    sample_loss_fn: SampleLossFn | None = None,
) -> torch.Tensor:
    """``(B,)`` losses ``ℓ_b``: ``sample_loss_fn(model, batch)`` in one forward, else
    ``loss_fn`` on each one-sample slice of the batch (one forward per sample).

    Raises:
        ValueError: ``sample_loss_fn`` returns another shape than ``(B,)``.
    """
    size = batch_size_of(batch)
    if sample_loss_fn is not None:
        losses = sample_loss_fn(model, batch)
        if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (size,):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses)
            raise ValueError(
                f"sample_loss_func returned {shape} for a batch of {size} samples; it must "
                f"return the ({size},) per-sample losses"
            )
        return losses
    return torch.stack([loss_fn(model, one).reshape(()) for one in sample_slices(batch, size)])


def window_loss(
    model: nn.Module,
    micro_batches: Sequence[Any],
    weights: Sequence[torch.Tensor],
    loss_fn: SampleLossFn,
    *,
    reduction: str,
    divisor: int,
    sample_loss_fn: SampleLossFn | None = None,
) -> torch.Tensor:
    """``Σ_micro Σ_b w_b ℓ_b · a`` of one window (see the module docstring for ``a``).

    ``weights[k]``: ``(B_k,)`` weights of micro-batch ``k``'s samples.
    """
    total = None
    for batch, w in zip(micro_batches, weights, strict=True):
        losses = per_sample_losses(model, batch, loss_fn, sample_loss_fn)
        share = 1.0 / divisor if reduction == "sum" else 1.0 / (losses.shape[0] * divisor)
        term = (w * losses).sum() * share
        total = term if total is None else total + term
    if total is None:
        raise ValueError("an optimizer update without micro-batches")
    return total


# ---------------------------------------------------------------------------- the optimizer
def _safe_sqrt(v: torch.Tensor) -> torch.Tensor:
    """``√v`` whose derivative is 0 where ``v == 0`` (a coordinate never given a gradient)."""
    positive = v > 0
    root = torch.sqrt(torch.where(positive, v, torch.ones_like(v)))
    return torch.where(positive, root, torch.zeros_like(root))


def adam_update(
    theta: Sequence[torch.Tensor],
    m: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    values: Sequence[GroupValues],
    *,
    max_grad_norm: float | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One clipped Adam / AdamW update of every parameter, differentiably.

    Args:
        theta, m, v: the state before the update, one tensor per parameter.
        grads: the window's gradient ``G`` per parameter (before the clip).
        values: each parameter's group values at this update.
        max_grad_norm: the loop's clip threshold ``M`` (``None`` or ``<= 0``: no clip).

    Returns:
        ``(θ', m', v', c)``, ``c`` the clip coefficient (a 0-d tensor, 1 unclipped).
    """
    one = grads[0].new_ones(())
    coef = one
    if max_grad_norm is not None and max_grad_norm > 0:
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        coef = torch.clamp(max_grad_norm / (norm + CLIP_EPS), max=1.0)
    new_theta, new_m, new_v = [], [], []
    for p, m_p, v_p, g, h in zip(theta, m, v, grads, values, strict=True):
        g = g * coef
        if h.weight_decay != 0.0 and not h.decoupled:
            g = g + h.weight_decay * p
        if h.weight_decay != 0.0 and h.decoupled:
            p = p * (1.0 - h.lr * h.weight_decay)
        m_next = h.beta1 * m_p + (1.0 - h.beta1) * g
        v_next = h.beta2 * v_p + (1.0 - h.beta2) * g * g
        bias1 = 1.0 - h.beta1**h.step
        bias2 = math.sqrt(1.0 - h.beta2**h.step)
        denom = _safe_sqrt(v_next) / bias2 + h.eps
        new_theta.append(p - (h.lr / bias1) * m_next / denom)
        new_m.append(m_next)
        new_v.append(v_next)
    return new_theta, new_m, new_v, coef

"""The AdamW-influence recurrence: per-step dynamics, coordinate groups and the summary ``W``.

Private helpers of :mod:`dattri_llm.attribution.algorithm.adamw_influence`
(see its docstring for the math).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dattri_llm.attribution.algorithm.trajectory import LOSS_REDUCTIONS
from dattri_llm.gradient.ops.optimizer import (
    adam_preconditioner,
    adamw_influence_coupling,
    adamw_influence_transition,
)

# Seed of the disjoint coordinate groups of ``num_masks > 1``.
_GROUP_SEED = 0


@dataclass
class StepDynamics:
    """One step's AdamW quantities on the ``p`` concatenated coordinates.

    Attributes:
        g_t: ``(p,)`` the batch gradient the step consumed.
        d, s: ``(p,)`` from ``adam_preconditioner``.
        lr, step, beta1, beta2, weight_decay: the step's hyperparameters
            (``step`` = update count after the step).
    """

    g_t: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    lr: float
    step: int
    beta1: float
    beta2: float
    weight_decay: float

    def subset(self, index: torch.Tensor | None) -> StepDynamics:
        """The same step restricted to coordinates ``index`` (``None`` = all)."""
        if index is None:
            return self
        return StepDynamics(
            self.g_t[index], self.d[index], self.s[index], self.lr, self.step,
            self.beta1, self.beta2, self.weight_decay,
        )  # fmt: skip

    def kernel_kwargs(self) -> dict[str, float]:
        """``lr``, ``step``, ``beta1``, ``beta2`` as the ops kernels take them."""
        return {"lr": self.lr, "step": self.step, "beta1": self.beta1, "beta2": self.beta2}


def step_dynamics(
    entry: Mapping[str, Any], layers: list[str], step: int, device: torch.device
) -> StepDynamics:
    """:class:`StepDynamics` of one dynamics entry (``assemble_dynamics``), layers concatenated.

    Raises:
        ValueError: a layer has no moments in the entry.
    """
    beta1, beta2 = (float(b) for b in entry["betas"])
    n = int(entry["step"])
    pieces: dict[str, list[torch.Tensor]] = {"m_pre": [], "m_post": [], "v_post": []}
    for name in layers:
        if name not in entry["pre"] or name not in entry["post"]:
            raise ValueError(
                f"the AdamW dynamics of step {step} hold no moments for layer {name!r} (they "
                f"cover {sorted(entry['post'])}); record them with OptimizerStateCallback on "
                "the same layers as the gradients"
            )
        pieces["m_pre"].append(entry["pre"][name][0])
        pieces["m_post"].append(entry["post"][name][0])
        pieces["v_post"].append(entry["post"][name][1])
    m_pre, m_post, v_post = (
        torch.cat(pieces[key]).to(device=device, dtype=torch.float32)
        for key in ("m_pre", "m_post", "v_post")
    )
    g_t = (m_post - beta1 * m_pre) / (1.0 - beta1)
    d, s = adam_preconditioner(
        m_post / (1.0 - beta1**n), v_post / (1.0 - beta2**n), eps=float(entry["eps"])
    )
    return StepDynamics(
        g_t, d, s, float(entry["lr"]), n, beta1, beta2, float(entry["weight_decay"])
    )


def layer_widths(entry: Mapping[str, Any], layers: list[str]) -> dict[str, int]:
    """Captured coordinates per layer in a dynamics entry (``0`` where the layer is absent)."""
    post = entry["post"]
    return {name: int(post[name][0].numel()) if name in post else 0 for name in layers}


def coordinate_groups(widths: Mapping[str, int], num_masks: int) -> list[torch.Tensor | None]:
    """``num_masks`` disjoint index sets over the concatenated coordinates (``[None]`` for 1).

    Each layer's coordinates are permuted (seeded by ``_GROUP_SEED`` and the
    width) and split into ``num_masks`` near-equal parts; group ``j`` takes
    part ``j`` of every layer, sorted.

    Raises:
        ValueError: a layer with fewer coordinates than ``num_masks``.
    """
    if num_masks == 1:
        return [None]
    groups: list[list[torch.Tensor]] = [[] for _ in range(num_masks)]
    offset = 0
    for name, width in widths.items():
        if width < num_masks:
            raise ValueError(
                f"num_masks={num_masks} exceeds the {width} captured coordinates of layer "
                f"{name!r}; use fewer masks or capture more coordinates"
            )
        gen = torch.Generator().manual_seed(_GROUP_SEED * 1_000_003 + width)
        parts = torch.tensor_split(torch.randperm(width, generator=gen), num_masks)
        for group, part in zip(groups, parts, strict=True):
            group.append(part.sort().values + offset)
        offset += width
    return [torch.cat(group) for group in groups]


class Summary:
    """``W = [W_θ | W_m | W_v]``, each ``(r, p)``, carried back through the steps.

    ``r = p`` with ``W_θ = I`` at the end of training (train-side), or ``r =
    n_test`` with ``W_θ = Q`` (query-side, ``U = Q·W``).
    """

    def __init__(self, theta: torch.Tensor) -> None:
        self.theta = theta
        self.m = torch.zeros_like(theta)
        self.v = torch.zeros_like(theta)

    def apply(self, push: torch.Tensor) -> torch.Tensor:
        """``push @ Wᵀ`` for ``push : (B, 3p)`` → ``(B, r)``."""
        p = self.theta.shape[1]
        return (
            push[:, :p] @ self.theta.T + push[:, p : 2 * p] @ self.m.T + push[:, 2 * p :] @ self.v.T
        )

    def fold(self, g_z: torch.Tensor, dyn: StepDynamics, c: float) -> None:
        """Carry ``W`` back through the step: coupling, transition, ``W_θ += c·Vᵀ g_z``."""
        kw = dyn.kernel_kwargs()
        coupling = adamw_influence_coupling(
            self.theta, self.m, self.v, g_z, dyn.g_t, dyn.d, dyn.s, **kw
        )
        theta, self.m, self.v = adamw_influence_transition(
            self.theta, self.m, self.v, dyn.d, dyn.s, weight_decay=dyn.weight_decay, **kw
        )
        self.theta = theta + c * (coupling.T @ g_z)


# ---------------------------------------------------------------------------- helpers
def check_loss_reduction(loss_reduction: str) -> None:
    """``ValueError`` unless ``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"loss_reduction must be one of {list(LOSS_REDUCTIONS)}, got {loss_reduction!r}"
        )


def check_dynamics_cover(dynamics: Mapping[int, dict], steps: Iterable[int]) -> None:
    """``ValueError`` naming the propagated steps ``dynamics`` lacks."""
    missing = [step for step in steps if step not in dynamics]
    if missing:
        raise ValueError(
            f"the AdamW dynamics lack propagated step(s) {sorted(missing)} (they cover "
            f"{sorted(dynamics)}); record every step with OptimizerStateCallback and "
            "record_post(step), or pass final_step / a train source ending where they end"
        )


def select_columns(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Columns ``index`` of ``x`` (all when ``None``)."""
    return x if index is None else x[:, index.to(x.device)]


def identity_summary(index: torch.Tensor | None, p: int, device: torch.device) -> torch.Tensor:
    """``I`` of the group's size (``p`` when ``index`` is ``None``)."""
    size = p if index is None else index.numel()
    return torch.eye(size, device=device)

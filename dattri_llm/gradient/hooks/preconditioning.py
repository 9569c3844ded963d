"""The optimizer side of a :class:`HookManager`'s preconditioned capture.

A :class:`Preconditioning` holds the optimizer-state reader
(``optimizer_state.OptimizerSnapshot``) of a manager built with
``optimizer=``, the per-capture map built from it, the per-pass switch and the
loss convention, and refuses the layers and projections the map cannot serve.
"""

from __future__ import annotations

import torch
from torch import nn

from dattri_llm.gradient.hooks.linear_io import check_preconditionable_projection
from dattri_llm.gradient.ops.projector import DattriProjector
from dattri_llm.gradient.state.names import optimizer_type
from dattri_llm.gradient.state.optimizer_snapshot import OptimizerLike, OptimizerSnapshot
from dattri_llm.gradient.state.preconditioner import PRECONDITION_RULES, GradientPreconditioner

__all__ = ["Preconditioning"]


class Preconditioning:
    """Preconditioned capture of one manager; inert without an optimizer.

    ``snapshot`` is ``None`` without optimizer; ``preconditioner`` (the map
    each linear_io capture goes through) is ``None`` until :meth:`build`.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerLike | None) -> None:
        self.snapshot = _optimizer_snapshot(model, optimizer)
        # Built with the projector in register(), so masks and matrices are the capture's own.
        self.preconditioner: GradientPreconditioner | None = None

    def build(self, projector: DattriProjector) -> None:
        """Build the map with the capture's ``projector`` (once; a no-op without optimizer)."""
        if self.snapshot is not None and self.preconditioner is None:
            self.preconditioner = GradientPreconditioner(self.snapshot, projector)

    @property
    def enabled(self) -> bool:
        """Whether captures are mapped through the optimizer now."""
        return self.preconditioner is not None and self.preconditioner.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if self.preconditioner is None:
            if value:
                raise ValueError(
                    "precondition=True needs a HookManager built with optimizer=... "
                    "(preconditioned capture); this one has no optimizer."
                )
            return
        self.preconditioner.enabled = bool(value)

    @property
    def rule(self) -> str:
        """The map's rule (``"update"`` or ``"second_moment"``; ``"update"`` without optimizer)."""
        return "update" if self.preconditioner is None else self.preconditioner.rule

    @rule.setter
    def rule(self, value: str) -> None:
        if value not in PRECONDITION_RULES:
            raise ValueError(
                f"precondition_rule must be one of {list(PRECONDITION_RULES)}, got {value!r}."
            )
        if self.preconditioner is None:
            raise ValueError(
                f"precondition_rule={value!r} needs a HookManager built with optimizer=... "
                "(preconditioned capture); this one has no optimizer."
            )
        self.preconditioner.rule = value

    def set_loss_convention(
        self, loss_reduction: str | None, gradient_accumulation_steps: int
    ) -> None:
        """Validate and set the loss convention (see ``HookManager.set_loss_convention``)."""
        if loss_reduction not in (None, "mean", "sum"):
            raise ValueError(
                f"loss_reduction must be one of [None, 'mean', 'sum'], got {loss_reduction!r}"
            )
        if (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1
        ):
            raise ValueError(
                "gradient_accumulation_steps must be an int >= 1, got "
                f"{gradient_accumulation_steps!r}"
            )
        if self.preconditioner is None:
            raise ValueError(
                "set_loss_convention applies to preconditioned capture; build the HookManager "
                "with optimizer=..."
            )
        self.preconditioner.loss_reduction = loss_reduction
        self.preconditioner.loss_divisor = gradient_accumulation_steps

    def check_capturable(
        self, param_layers: list[str], projection_kwargs: dict[str, dict] | None
    ) -> None:
        """``ValueError`` for ``param_grad`` layers or ``"logra"`` projections (preconditioning)."""
        if param_layers:
            raise ValueError(
                f"HookManager(optimizer=...) preconditions per-sample gradients, but layers "
                f"{sorted(param_layers)} are assigned 'param_grad', which captures batch-level "
                "gradients only. Capture only linear_io layers with an optimizer: "
                "HookManagerConfig(linear_io=REGISTER_ALL) or hook_types={name: 'linear_io'}."
            )
        for entry, proj in (projection_kwargs or {}).items():
            check_preconditionable_projection(proj, entry, "HookManager(optimizer=...)")


def _optimizer_snapshot(
    model: nn.Module, optimizer: OptimizerLike | None
) -> OptimizerSnapshot | None:
    """The optimizer-state reader of preconditioned capture (``None`` without optimizer).

    A given optimizer instance is checked now (``NotImplementedError`` for an
    unsupported type); a callable is resolved on first use.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer_type(optimizer)
    elif not callable(optimizer):
        raise TypeError(
            "HookManager optimizer must be a torch.optim.Optimizer or a zero-argument callable "
            f"returning one, got {type(optimizer).__name__}."
        )
    return OptimizerSnapshot(model, optimizer)

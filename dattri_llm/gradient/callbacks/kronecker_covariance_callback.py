"""K-FAC covariances fitted during capture from the factors the hooks emit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.ops.kronecker import LayerKroneckerAccumulator
from dattri_llm.gradient.ops.types import is_kfac_eligible

if TYPE_CHECKING:
    import torch


class KroneckerCovarianceCallback(HookManagerCallback):
    """Accumulate per-layer K-FAC covariances ``(A, G)`` while gradients are captured.

    For K-FAC-eligible layer types only (linear, conv, conv-transpose): the
    forward hook pushes the emitted activation on a per-layer stack, the
    backward hook pops it (LIFO: re-entrant/checkpointed forwards pair with
    their backward; a backward without a pending activation is skipped) and
    feeds ``LayerKroneckerAccumulator.update``. Under capture-time ``"logra"``
    projection the emitted factors are the projected ones, so the covariances
    live in the projected space. :meth:`result` equals the covariances of a fit
    pass over the captured store (same row rules as ``ops.kfac_factors``).

    Args:
        include_bias: fold the layer bias into ``A`` (ones column), as the
            attributors do.
    """

    def __init__(self, *, include_bias: bool = True) -> None:
        """Start with no accumulated layer."""
        self.include_bias = include_bias
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._accumulators: dict[str, LayerKroneckerAccumulator] = {}

    def on_layer_forward(
        self,
        layer_name: str,
        activation: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Push the activation ``(B, *, D_in)`` of a K-FAC-eligible layer."""
        if is_kfac_eligible(layer_type):
            self._pending.setdefault(layer_name, []).append(activation)

    def on_layer_backward(
        self,
        layer_name: str,
        grad_output: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Pop the matching activation and add the token rows to the layer's covariances."""
        stack = self._pending.get(layer_name)
        if not stack:
            return
        activation = stack.pop()
        acc = self._accumulators.setdefault(layer_name, LayerKroneckerAccumulator())
        acc.update(
            activation, grad_output, layer_type, module_kwargs, include_bias=self.include_bias
        )

    def all_reduce(self) -> None:
        """Sum every layer's covariances across ranks (sorted order; every rank must call it)."""
        for name in sorted(self._accumulators):
            self._accumulators[name].all_reduce()

    def result(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer: (A, G)}`` normalised and undamped; layers without kept rows omitted."""
        return {
            name: acc.result() for name, acc in self._accumulators.items() if acc.a_sum is not None
        }

    def reset(self) -> None:
        """Drop every accumulated covariance and pending activation."""
        self._pending.clear()
        self._accumulators.clear()

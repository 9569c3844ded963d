"""K-FAC covariances fitted during capture from the factors the hooks emit."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.hooks.layer_capture import current_forward_token
from dattri_llm.gradient.ops.kronecker_accumulators import LayerKroneckerAccumulator
from dattri_llm.gradient.ops.layer_sums import all_reduce_layer_accumulators
from dattri_llm.gradient.ops.types import is_kfac_eligible

if TYPE_CHECKING:
    import torch

    from dattri_llm.gradient.model.container import GradientRecord


class KroneckerCovarianceCallback(HookManagerCallback):
    """Accumulate per-layer K-FAC covariances ``(A, G)`` while gradients are captured.

    For K-FAC-eligible layer types only (linear, conv, conv-transpose): the
    forward hook keeps the emitted activation, the backward hook takes the
    activation of exactly the forward it belongs to (the hooks' pairing,
    :func:`~dattri_llm.gradient.hooks.hooks.current_forward_token`) and feeds
    ``LayerKroneckerAccumulator.update``. A backward without a kept activation
    is skipped. A forward whose output is never backpropagated (a validation
    forward with grad enabled, a checkpoint recompute) is dropped when its
    output is freed, and at the latest at the end of the step, as the
    manager's capture drops it. Events dispatched directly (not by the hooks)
    pair last-in-first-out per layer. Under capture-time ``"logra"``
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
        # forward token -> activation; an entry goes with its forward's output
        self._pending: weakref.WeakKeyDictionary[object, torch.Tensor] = weakref.WeakKeyDictionary()
        self._direct: dict[str, list[torch.Tensor]] = {}  # direct calls: LIFO per layer
        self._accumulators: dict[str, LayerKroneckerAccumulator] = {}

    def on_layer_forward(
        self,
        layer_name: str,
        activation: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Keep the activation ``(B, *, D_in)`` of a K-FAC-eligible layer for its backward."""
        if not is_kfac_eligible(layer_type):
            return
        token = current_forward_token()
        if token is None:
            self._direct.setdefault(layer_name, []).append(activation)
        else:
            self._pending[token] = activation

    def on_layer_backward(
        self,
        layer_name: str,
        grad_output: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Take this backward's forward activation and add the token rows to the covariances."""
        token = current_forward_token()
        if token is None:
            stack = self._direct.get(layer_name)
            activation = stack.pop() if stack else None
        else:
            activation = self._pending.pop(token, None)
        if activation is None:
            return
        acc = self._accumulators.setdefault(layer_name, LayerKroneckerAccumulator())
        acc.update(
            activation, grad_output, layer_type, module_kwargs, include_bias=self.include_bias
        )

    def on_step_end(self, record: GradientRecord) -> None:
        """Drop the activations of forwards this step never backpropagated."""
        self._pending.clear()
        self._direct.clear()

    def all_reduce(self) -> None:
        """Sum every layer's covariances across ranks (every rank must call it).

        Ranks may have seen different layers or row counts: the union of the
        ranks' layers is reduced (``ops.kronecker.all_reduce_layer_accumulators``),
        a rank without a layer contributing zeros; afterwards every rank holds
        every layer with the global sums and row count.
        """
        all_reduce_layer_accumulators(self._accumulators, LayerKroneckerAccumulator)

    @property
    def layer_names(self) -> frozenset[str]:
        """Layers this callback accumulates covariances for (a backward of each was seen)."""
        return frozenset(self._accumulators)

    def result(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer: (A, G)}`` normalised and undamped; layers without kept rows omitted."""
        return {
            name: acc.result() for name, acc in self._accumulators.items() if acc.a_sum is not None
        }

    def reset(self) -> None:
        """Drop every accumulated covariance and pending activation."""
        self._pending.clear()
        self._direct.clear()
        self._accumulators.clear()

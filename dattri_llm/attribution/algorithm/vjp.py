"""Vector-Jacobian products of a retained graph for a block of cotangents at once.

:func:`batched_vjp` runs one backward over the leading axis of the
cotangents (``torch.autograd.grad(..., is_grads_batched=True)``, which vmaps
the backward); it returns ``None`` when an operation of the graph has no
batching rule, and :func:`looped_vjp` then takes one backward per row. The
exact metagradient's reverse sweep and the influence functions'
Hessian-vector products both use them, inside :func:`math_attention` (the
fused attention kernels have no double backward).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["batched_vjp", "looped_vjp", "math_attention"]


def math_attention() -> contextlib.AbstractContextManager[None]:
    """Scaled-dot-product attention on its math kernel inside the block: the fused (flash,
    memory-efficient) kernels have no double backward, which a graph differentiated twice
    (the metagradient's reverse sweep, a Hessian-vector product) takes."""
    return sdpa_kernel([SDPBackend.MATH])


def batched_vjp(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
    *,
    retain_graph: bool,
) -> tuple[torch.Tensor | None, ...] | None:
    """``(K, *input.shape)`` per input (``None``: unused): the rows of ``cotangents``
    (``(K, *output.shape)`` each) times the Jacobian of ``outputs`` in ``inputs``, one
    batched backward; ``None`` when the graph cannot be batched (it is then left intact)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vmap's slow-fallback notices
            return torch.autograd.grad(
                outputs, inputs, grad_outputs=cotangents,
                retain_graph=retain_graph, allow_unused=True, is_grads_batched=True,
            )  # fmt: skip
    except RuntimeError:
        return None


def looped_vjp(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
    *,
    retain_graph: bool,
) -> list[torch.Tensor]:
    """What :func:`batched_vjp` returns, one backward per row (unused inputs give zeros);
    the graph is freed after the last row unless ``retain_graph``."""
    count = cotangents[0].shape[0]
    result = [torch.zeros(count, *x.shape, device=x.device, dtype=x.dtype) for x in inputs]
    for k in range(count):
        single = torch.autograd.grad(
            outputs, inputs, grad_outputs=[c[k] for c in cotangents],
            retain_graph=retain_graph or k < count - 1, allow_unused=True,
        )  # fmt: skip
        for target, value in zip(result, single, strict=True):
            if value is not None:
                target[k] = value
    return result

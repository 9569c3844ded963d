"""Independent ground truth for tests: per-sample gradients from ``torch.func``.

Nothing here imports ``dattri_llm``: these helpers are the reference the
library is checked against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def per_sample_param_grads(
    module: nn.Module,
    loss_of_sample: Callable[[nn.Module, dict[str, torch.Tensor], tuple], torch.Tensor],
    batch: tuple,
    param_names: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{param_name: (B, *param.shape)}`` via ``vmap(grad(...))``.

    ``loss_of_sample(module, params, sample)`` must compute one sample's scalar
    loss with ``functional_call(module, params, ...)``; ``sample`` is the tuple
    of the batch's tensors indexed at one row (the batch axis is kept with size
    1 so modules see batched inputs).
    """
    params = {k: v.detach() for k, v in module.named_parameters()}
    names = param_names or list(params)

    def one(sel: dict[str, torch.Tensor], *sample: torch.Tensor) -> torch.Tensor:
        full = dict(params)
        full.update(sel)
        return loss_of_sample(module, full, tuple(x.unsqueeze(0) for x in sample))

    sel = {k: params[k] for k in names}
    return vmap(grad(one), in_dims=(None,) + (0,) * len(batch))(sel, *batch)


def call(module: nn.Module, params: dict[str, torch.Tensor], *args, **kwargs):
    """``functional_call`` shorthand for use inside ``loss_of_sample``."""
    return functional_call(module, params, args, kwargs)


def per_sample_loop_grads(
    module: nn.Module,
    loss_of_batch: Callable[[nn.Module, tuple], torch.Tensor],
    batch: tuple,
) -> dict[str, torch.Tensor]:
    """Per-sample gradients by a loop of single-sample backward passes."""
    out: dict[str, list[torch.Tensor]] = {}
    n = batch[0].shape[0]
    for i in range(n):
        module.zero_grad(set_to_none=True)
        loss_of_batch(module, tuple(x[i : i + 1] for x in batch)).backward()
        for name, p in module.named_parameters():
            if p.grad is not None:
                out.setdefault(name, []).append(p.grad.detach().clone())
    module.zero_grad(set_to_none=True)
    return {k: torch.stack(v) for k, v in out.items()}

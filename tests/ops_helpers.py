"""Ground-truth helpers for the ops tests: capture (a, g) and reference per-sample grads.

The reference never uses dattri_llm: per-sample parameter gradients come from
``tests/reference.py`` (torch.func or a backward loop) and are laid out here
in the normative ``materialize`` layout of gradient-model.md.
"""

from __future__ import annotations

import copy

import torch
from reference import call, per_sample_loop_grads, per_sample_param_grads
from torch import nn


def capture_io(module: nn.Module, inputs: tuple, seed: int = 0):
    """Run ``module(*inputs)``; return ``(a, g, R)`` for the loss ``(y * R).sum()``.

    ``a`` is the layer input (``input[0]`` seen by a forward hook), ``g`` the
    autograd gradient of the loss w.r.t. the layer output.
    """
    seen = {}
    handle = module.register_forward_hook(lambda m, i, o: seen.update(a=i[0], y=o))
    try:
        out = module(*inputs)
    finally:
        handle.remove()
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    (g,) = torch.autograd.grad((seen["y"] * r).sum(), seen["y"])
    return seen["a"].detach(), g.detach(), r


def reference_grads(module: nn.Module, inputs: tuple, r: torch.Tensor, loop: bool = False):
    """Per-sample ``{param: (B, *shape)}`` of ``(module(*x_i) * r_i).sum()``."""
    if loop:
        return per_sample_loop_grads(
            module, lambda mod, batch: (mod(*batch[:-1]) * batch[-1]).sum(), (*inputs, r)
        )

    def loss_of_sample(mod, params, sample):
        *xs, r_i = sample
        return (call(mod, params, *xs) * r_i).sum()

    return per_sample_param_grads(module, loss_of_sample, (*inputs, r))


def expected_layout(layer_type: str, grads: dict, include_bias: bool = True) -> torch.Tensor:
    """Flatten reference grads in the normative layout (gradient-model.md)."""
    w = grads["weight"]
    b = grads.get("bias") if include_bias else None
    n = w.shape[0]
    if layer_type.startswith("nn.ConvTranspose"):
        w = w.reshape(n, w.shape[1], -1)  # (B, C_in, C_out/G·Πk)
        if b is None:
            return w.reshape(n, -1)
        c_in, width = w.shape[1:]
        top = torch.cat([w, w.new_zeros(n, c_in, b.shape[1])], dim=2)
        bottom = torch.cat([w.new_zeros(n, 1, width), b[:, None, :]], dim=2)
        return torch.cat([top, bottom], dim=1).reshape(n, -1)
    if layer_type.startswith("nn.Conv") or layer_type.endswith("Linear"):
        w = w.reshape(n, w.shape[1], -1)
    elif layer_type == "transformers.pytorch_utils.Conv1D":
        w = w.transpose(1, 2)  # HF Conv1D weight is (in, out); the layout is (out, in)
    else:  # norms and embeddings: [dγ, dβ] / (vocab, E), flattened
        parts = [w.reshape(n, -1)] + ([] if b is None else [b.reshape(n, -1)])
        return torch.cat(parts, dim=1)
    if b is not None:
        w = torch.cat([w, b[:, :, None]], dim=2)
    return w.reshape(n, -1)


def cast_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    """Cast the floating inputs to ``dtype`` (integer ids untouched)."""
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def bf16_and_fp32_copies(module: nn.Module, inputs: tuple):
    """bf16 module/inputs and an fp32 copy holding exactly the same (rounded) values."""
    low = copy.deepcopy(module).to(torch.bfloat16)
    low_inputs = cast_inputs(inputs, torch.bfloat16)
    high = copy.deepcopy(low).float()
    return low, low_inputs, high, cast_inputs(low_inputs, torch.float32)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ``‖got - expected‖ / ‖expected‖`` in float64."""
    got, expected = got.double(), expected.double()
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))

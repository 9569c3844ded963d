"""Layer cases for the inner-product tests: captured factors plus torch.func ground truth.

Each case builds a small float64 layer and three batches: side 1 ``(B1=3)``, side 2
``(B2=2)`` with a different token/spatial length, and side 3 (``B1`` samples, another
length) for aligned dots. For every side it captures the raw ``(a, g)`` of the loss
``(y * R).sum()`` and the reference per-sample gradients (``tests/reference.py``) flattened
in the normative ``materialize`` layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from ops_helpers import capture_io, expected_layout, reference_grads
from torch import nn

from dattri_llm.gradient.ops.preprocess import extract_module_kwargs


@dataclass
class Side:
    """One batch of a layer: raw factors and the reference dense gradients ``(B, d)``."""

    a: torch.Tensor
    g: torch.Tensor
    dense: torch.Tensor
    dense_weight_only: torch.Tensor
    per_token_dense: torch.Tensor | None  # (B, T, d) for token-independent 3-D layers


@dataclass
class LayerCase:
    """A layer with its type, module kwargs and three captured sides (float64)."""

    name: str
    layer_type: str
    module_kwargs: dict
    sides: tuple[Side, Side, Side]
    token_independent: bool


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids in ``[0, 11)`` with repeats and padding id 0."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (batch, length), generator=gen)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _hf_conv1d(bias: bool) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(4, 5)  # always has a bias


# name -> (module factory(bias), input factory(batch, length, seed), has with/without-bias
#          variants, tokens on axis 1 independent of each other)
_CASES = {
    "linear2d": (
        lambda b: nn.Linear(5, 4, bias=b),
        lambda n, t, s: _randn(n, 5, seed=s),
        True,
        False,
    ),
    "linear3d": (
        lambda b: nn.Linear(5, 4, bias=b),
        lambda n, t, s: _randn(n, t, 5, seed=s),
        True,
        True,
    ),
    "hf_conv1d": (_hf_conv1d, lambda n, t, s: _randn(n, t, 5, seed=s), False, True),
    "conv1d": (
        lambda b: nn.Conv1d(3, 4, 3, stride=2, padding=1, bias=b),
        lambda n, t, s: _randn(n, 3, t + 3, seed=s),
        True,
        False,
    ),
    "conv2d_grouped_dilated": (
        lambda b: nn.Conv2d(4, 6, (2, 3), padding=1, dilation=(1, 2), groups=2, bias=b),
        lambda n, t, s: _randn(n, 4, t + 1, 5, seed=s),
        True,
        False,
    ),
    "conv_transpose1d": (
        lambda b: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1, bias=b),
        lambda n, t, s: _randn(n, 3, t, seed=s),
        True,
        False,
    ),
    "conv_transpose2d_grouped": (
        lambda b: nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2, bias=b),
        lambda n, t, s: _randn(n, 4, t, 2, seed=s),
        True,
        False,
    ),
    "embedding": (
        lambda b: nn.Embedding(11, 5, padding_idx=0),
        lambda n, t, s: _ids(n, t, s),
        False,
        True,
    ),
    "embedding_bag_mean": (
        lambda b: nn.EmbeddingBag(11, 5, mode="mean", padding_idx=0),
        lambda n, t, s: _ids(n, t, s),
        False,
        False,
    ),
    "layer_norm": (
        lambda b: nn.LayerNorm(6, bias=b),
        lambda n, t, s: _randn(n, t, 6, seed=s),
        True,
        True,
    ),
    "rms_norm": (lambda b: nn.RMSNorm(6), lambda n, t, s: _randn(n, t, 6, seed=s), False, True),
    "group_norm": (
        lambda b: nn.GroupNorm(2, 4),
        lambda n, t, s: _randn(n, 4, t, 2, seed=s),
        False,
        False,
    ),
    "instance_norm1d": (
        lambda b: nn.InstanceNorm1d(4, affine=True),
        lambda n, t, s: _randn(n, 4, t + 1, seed=s),
        False,
        False,
    ),
    "instance_norm2d": (
        lambda b: nn.InstanceNorm2d(3, affine=True),
        lambda n, t, s: _randn(n, 3, t, 2, seed=s),
        False,
        False,
    ),
    "instance_norm3d": (
        lambda b: nn.InstanceNorm3d(2, affine=True),
        lambda n, t, s: _randn(n, 2, t, 2, 2, seed=s),
        False,
        False,
    ),
}

CASE_IDS = [
    variant
    for name, (_, _, has_bias_variants, _) in _CASES.items()
    for variant in ((f"{name}-bias", f"{name}-nobias") if has_bias_variants else (name,))
]


def _per_token_dense(module, layer_type, x, r) -> torch.Tensor:
    """Reference gradient of each token's loss term: every token run as its own sample."""
    batch, length = x.shape[:2]
    x_tok = x.reshape(batch * length, 1, *x.shape[2:])
    r_tok = r.reshape(batch * length, 1, *r.shape[2:])
    grads = reference_grads(module, (x_tok,), r_tok)
    return expected_layout(layer_type, grads).reshape(batch, length, -1)


def _side(module, layer_type: str, x: torch.Tensor, seed: int, token_independent: bool) -> Side:
    a, g, r = capture_io(module, (x,), seed=seed)
    grads = reference_grads(module, (x,), r)
    per_token = _per_token_dense(module, layer_type, x, r) if token_independent else None
    return Side(
        a=a,
        g=g,
        dense=expected_layout(layer_type, grads, include_bias=True),
        dense_weight_only=expected_layout(layer_type, grads, include_bias=False),
        per_token_dense=per_token,
    )


@functools.cache
def layer_case(case_id: str) -> LayerCase:
    """Build (once) the float64 case ``"<name>"``, ``"<name>-bias"`` or ``"<name>-nobias"``."""
    from dattri_llm.gradient.ops.types import canonical_class_name

    name, _, variant = case_id.partition("-")
    make_module, make_input, _, token_independent = _CASES[name]
    torch.manual_seed(sum(map(ord, case_id)))
    module = make_module(variant != "nobias").double()
    with torch.no_grad():
        for p in module.parameters():  # non-trivial affine parameters for the norms
            p.add_(0.3 * torch.randn_like(p))
    layer_type = canonical_class_name(module)
    sides = (
        _side(module, layer_type, make_input(3, 4, 1), 11, token_independent),
        _side(module, layer_type, make_input(2, 3, 2), 12, False),
        _side(module, layer_type, make_input(3, 2, 3), 13, False),
    )
    kwargs = extract_module_kwargs(module, layer_type)
    return LayerCase(name, layer_type, kwargs, sides, token_independent)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast floating tensors to ``dtype`` (ids untouched)."""
    return x.to(dtype) if x.is_floating_point() else x


# Tolerances against the float64 reference, relative to the largest reference entry.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` equals the float64 ``expected`` within the dtype's tolerance.

    fp64/fp32: elementwise ``|got - expected| <= tol·(|expected| + max|expected|)``;
    bf16: relative Frobenius error ``< 3e-2``.
    """
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.dtype == dtype, (got.dtype, dtype)
    got, expected = got.double(), expected.double()
    tol = TOLERANCE[dtype]
    scale = expected.abs().max().clamp_min(1e-12)
    if dtype == torch.bfloat16:
        err = (got - expected).norm() / expected.norm().clamp_min(1e-12)
        assert err < tol, f"relative Frobenius error {float(err):.3g} >= {tol}"
        return
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * float(scale))

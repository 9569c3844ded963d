"""Rotating kept EK-FAC blocks into the eigenbasis (``kronecker.ekfac``).

Against per-sample weight gradients ``dW`` from torch.func: in mode ``"both"`` a kept
layer materializes to ``U_Gᵀ·dW·U_A`` (as the smaller of rotated factors and
eigen-coordinates for per-sample scores, as factors for token scores), in mode
``"gradient"`` to ``U_Gᵀ·dW`` with the activation untouched; the squared
coordinates are reported either way; the query side pairs with each mode; the
mode is chosen by the rotated sizes against the budget.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm.attribution.algorithm.kronecker.ekfac import (
    BOTH,
    GRADIENT,
    eigenbasis_mode,
    precondition_in_eigenbasis,
    rotated_block,
)
from dattri_llm.attribution.algorithm.kronecker.plan import KeptPasses
from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops import extract_module_kwargs

K, D = 4, 5  # K + 1 with the bias column


def _per_sample_dw(layer: torch.nn.Linear, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[dW | db]`` ``(B, D, K+1)`` of ``Σ_t g_t·layer(a_t)`` per sample (torch.func)."""
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p, x, r):
        return (torch.func.functional_call(layer, p, (x,)) * r).sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, a, g)
    return torch.cat([grads["weight"], grads["bias"][..., None]], dim=-1)


def _block(tokens: int, gen: torch.Generator) -> tuple[Gradient, torch.Tensor]:
    """A 2-sample linear block with a bias, and its per-sample dW ``(2, D, K+1)``."""
    layer = torch.nn.Linear(K, D).double()
    kwargs = extract_module_kwargs(layer, "nn.Linear")
    a = torch.randn(2, tokens, K, generator=gen, dtype=torch.float64)
    g = torch.randn(2, tokens, D, generator=gen, dtype=torch.float64)
    block = Gradient({"w": "factorized"}, {"w": Factorized(a, g, kwargs)}, {"w": "nn.Linear"})
    return block, _per_sample_dw(layer, a, g)


def _bases(gen):
    u_a = torch.linalg.qr(torch.randn(K + 1, K + 1, generator=gen, dtype=torch.float64))[0]
    u_g = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))[0]
    return {"w": (u_a, u_g)}


def _materialized(value):
    if isinstance(value, torch.Tensor):
        return value
    a = value.activation
    if value.module_kwargs is not None:  # as captured: append the bias column
        a = torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype)], -1)
    return torch.einsum("bsd,bsk->bdk", value.pre_activation_grad, a).reshape(2, -1)


@pytest.mark.parametrize(
    ("mode", "tokens", "per_sample", "kept_dense"),
    [
        (BOTH, 3, True, True),  # 3·(5+5) > 5·5 > 1·(5+5)
        (BOTH, 1, True, False),
        (BOTH, 3, False, False),
        (GRADIENT, 3, True, False),
    ],
)
def test_rotated_layer_equals_explicit_rotations(mode, tokens, per_sample, kept_dense):
    gen = torch.Generator().manual_seed(tokens)
    block, dw = _block(tokens, gen)
    original = block.data["w"]
    bases = _bases(gen)
    u_a, u_g = bases["w"]
    coords = (u_g.T @ dw @ u_a).reshape(2, -1)
    squares = {}
    out = rotated_block(
        block, bases, lambda name, sq, n: squares.setdefault(name, (sq, n)), mode, per_sample
    )
    value = out.data["w"]
    assert isinstance(value, torch.Tensor) == kept_dense
    expected = coords if mode == BOTH else (u_g.T @ dw).reshape(2, -1)
    torch.testing.assert_close(_materialized(value), expected)
    if mode == GRADIENT:
        assert value.activation is original.activation
    torch.testing.assert_close(squares["w"][0], (coords**2).sum(0))
    assert squares["w"][1] == 2


@pytest.mark.parametrize("mode", [BOTH, GRADIENT])
def test_dense_layer_rotation_equals_explicit_rotations(mode):
    gen = torch.Generator().manual_seed(7)
    _, dw = _block(3, gen)
    block = Gradient({"w": "materialized"}, {"w": dw.reshape(2, -1)}, {"w": "nn.Linear"})
    bases = _bases(gen)
    u_a, u_g = bases["w"]
    coords = (u_g.T @ dw @ u_a).reshape(2, -1)
    squares = {}
    out = rotated_block(
        block, bases, lambda name, sq, n: squares.setdefault(name, (sq, n)), mode, True
    )
    expected = coords if mode == BOTH else (u_g.T @ dw).reshape(2, -1)
    torch.testing.assert_close(out.data["w"], expected)
    torch.testing.assert_close(squares["w"][0], (coords**2).sum(0))


@pytest.mark.parametrize("mode", [BOTH, GRADIENT])
def test_query_side_pairs_with_each_mode(mode):
    gen = torch.Generator().manual_seed(5)
    train, dw = _block(2, gen)
    query, dq = _block(2, gen)
    bases = _bases(gen)
    u_a, u_g = bases["w"]
    lam = torch.rand((K + 1) * D, generator=gen, dtype=torch.float64) + 0.5
    preconditioned = u_g @ ((u_g.T @ dq @ u_a) / lam.reshape(D, K + 1)) @ u_a.T
    expected = dw.reshape(2, -1) @ preconditioned.reshape(2, -1).T
    kept = rotated_block(train, bases, lambda *_: None, mode, per_sample=False).data["w"]
    test = precondition_in_eigenbasis((u_g.T @ dq @ u_a).reshape(2, -1), u_a, lam, mode)
    torch.testing.assert_close(_materialized(kept) @ test.T, expected)


class _Source:
    reusable = True

    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __iter__(self):
        for i, block in enumerate(self.blocks):
            yield i, block, [str(i)]


def _kept(block, budget):
    plan = KeptPasses(_Source([block]), budget)
    list(plan)  # the first pass keeps what fits
    return plan


def test_mode_follows_the_rotated_sizes():
    gen = torch.Generator().manual_seed(0)
    block, _ = _block(3, gen)
    bases = _bases(gen)
    assert block.nbytes == 2 * 3 * (K + D) * 8  # 432
    factors = 2 * 3 * (K + 1 + D) * 8  # 480: the bias column makes the rotation larger
    coords = 2 * (K + 1) * D * 8  # 400
    assert eigenbasis_mode(_kept(block, factors), bases, per_sample=False) == BOTH
    assert eigenbasis_mode(_kept(block, factors - 1), bases, per_sample=False) == GRADIENT
    assert coords < block.nbytes
    assert eigenbasis_mode(_kept(block, block.nbytes), bases, per_sample=True) == BOTH
    assert eigenbasis_mode(_kept(block, 0), bases, per_sample=True) is None  # nothing kept


def test_sixteen_bit_factors_are_not_rotated_in_place():
    gen = torch.Generator().manual_seed(1)
    block, _ = _block(3, gen)
    half = Gradient(
        {"w": "factorized"}, {"w": block.data["w"].to(torch.bfloat16)}, {"w": "nn.Linear"}
    )
    assert eigenbasis_mode(_kept(half, 1 << 20), _bases(gen), per_sample=True) is None

"""Rotating kept EK-FAC blocks into the eigenbasis (``_ekfac_eigenbasis``).

A rotated layer must materialize to ``ops.ekfac_materialize`` of the original
(against an explicit ``U_Gᵀ·dW·U_A`` of per-sample weight gradients), be kept as
the smaller of rotated factors and eigen-coordinates for per-sample scores and
as factors for token scores, and be sized by ``rotates_kept_blocks`` as stored.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm.attribution.algorithm._ekfac_eigenbasis import rotated_block, rotates_kept_blocks
from dattri_llm.attribution.algorithm._kfac_plan import KeptPasses
from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops import extract_module_kwargs

K, D = 4, 5  # K + 1 with the bias column


def _block(tokens: int, gen: torch.Generator) -> tuple[Gradient, torch.Tensor]:
    """A 2-sample linear block with a bias, and its per-sample dW ``(2, D, K+1)``."""
    kwargs = extract_module_kwargs(torch.nn.Linear(K, D), "nn.Linear")
    a = torch.randn(2, tokens, K, generator=gen, dtype=torch.float64)
    g = torch.randn(2, tokens, D, generator=gen, dtype=torch.float64)
    dw = torch.einsum("bsd,bsk->bdk", g, torch.cat([a, torch.ones(2, tokens, 1).double()], -1))
    block = Gradient({"w": "factorized"}, {"w": Factorized(a, g, kwargs)}, {"w": "nn.Linear"})
    return block, dw


def _bases(gen):
    u_a = torch.linalg.qr(torch.randn(K + 1, K + 1, generator=gen, dtype=torch.float64))[0]
    u_g = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))[0]
    return {"w": (u_a, u_g)}


@pytest.mark.parametrize(
    ("tokens", "per_sample", "kept_dense"),
    [(3, True, True), (1, True, False), (3, False, False)],  # 3·(5+5) > 5·5 > 1·(5+5)
)
def test_rotated_layer_equals_explicit_eigen_coordinates(tokens, per_sample, kept_dense):
    gen = torch.Generator().manual_seed(tokens)
    block, dw = _block(tokens, gen)
    bases = _bases(gen)
    u_a, u_g = bases["w"]
    expected = (u_g.T @ dw @ u_a).reshape(2, -1)
    squares = {}
    out = rotated_block(
        block, bases, lambda name, sq, n: squares.setdefault(name, (sq, n)), per_sample
    )
    value = out.data["w"]
    assert isinstance(value, torch.Tensor) == kept_dense
    got = value if kept_dense else torch.einsum(
        "bsd,bsk->bdk", value.pre_activation_grad, value.activation
    ).reshape(2, -1)  # fmt: skip
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(squares["w"][0], (expected**2).sum(0))
    assert squares["w"][1] == 2


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


def test_budget_check_counts_the_rotated_sizes():
    gen = torch.Generator().manual_seed(0)
    block, _ = _block(3, gen)
    bases = _bases(gen)
    assert block.nbytes == 2 * 3 * (K + D) * 8  # 432
    factors = 2 * 3 * (K + 1 + D) * 8  # 480: the bias column makes the rotation larger
    coords = 2 * (K + 1) * D * 8  # 400
    assert rotates_kept_blocks(_kept(block, factors), bases, per_sample=False)
    assert not rotates_kept_blocks(_kept(block, factors - 1), bases, per_sample=False)
    assert coords < block.nbytes
    assert rotates_kept_blocks(_kept(block, block.nbytes), bases, per_sample=True)
    assert not rotates_kept_blocks(_kept(block, 0), bases, per_sample=True)  # nothing kept


def test_sixteen_bit_factors_are_not_rotated_in_place():
    gen = torch.Generator().manual_seed(1)
    block, _ = _block(3, gen)
    half = Gradient(
        {"w": "factorized"}, {"w": block.data["w"].to(torch.bfloat16)}, {"w": "nn.Linear"}
    )
    assert not rotates_kept_blocks(_kept(half, 1 << 20), _bases(gen), per_sample=True)

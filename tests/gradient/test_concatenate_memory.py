"""Concatenating many blocks copies each row once, with the result of pairwise concatenation.

Blocks of one structure with a row per sample on every layer are joined with
one ``torch.cat`` per payload (a pairwise tree copies every row once per level);
token axes are padded as the pairwise rule pads them (integer activations with
their layer's ``padding_idx``). Broadcast and ``param_grad`` layers, and blocks
that differ, still go pairwise (and are refused as before).
"""

from __future__ import annotations

import functools

import pytest
import torch
from store_helpers import assert_gradients_equal, make_gradient

from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.model import layout
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.gradient.stream import readers
from dattri_llm.gradient.stream.readers import concatenate_gradients


def _pairwise(blocks: list[Gradient]) -> Gradient:
    return functools.reduce(lambda a, b: a.concatenate(b, dim="batch"), blocks)


def _with_padding_idx(block: Gradient, padding_idx: int) -> Gradient:
    emb = block.data["emb"]
    kwargs = {**emb.module_kwargs, "padding_idx": padding_idx}
    data = {**block.data, "emb": Factorized(emb.activation, emb.pre_activation_grad, kwargs)}
    return Gradient(block.representation, data, block.layer_types, block.indexing)


def _bits_equal(got: Gradient, want: Gradient) -> None:
    assert_gradients_equal(got, want)
    for name, value in want.data.items():
        pairs = (
            [(got.data[name].activation, value.activation)]
            + [(got.data[name].pre_activation_grad, value.pre_activation_grad)]
            if isinstance(value, Factorized)
            else [(got.data[name], value)]
        )
        for a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["factorized", "dense", "mixed"])
def test_one_copy_equals_pairwise_with_token_padding(kind):
    blocks = [make_gradient(kind, seed, batch, tokens) for seed, (batch, tokens) in
              enumerate([(2, 3), (1, 5), (3, 2), (2, 4), (1, 1)])]  # fmt: skip
    if kind != "dense":
        blocks = [_with_padding_idx(b, 7) for b in blocks]
    joined = layout.concatenate_batches(blocks)
    assert joined is not None
    _bits_equal(joined, _pairwise(blocks))
    _bits_equal(concatenate_gradients(blocks), _pairwise(blocks))


def test_mixed_dtypes_promote_as_pairwise():
    blocks = [make_gradient("dense", seed, 2) for seed in range(4)]
    blocks[2] = blocks[2].to(dtype=torch.float16)
    blocks[3] = blocks[3].to(dtype=torch.bfloat16)
    _bits_equal(layout.concatenate_batches(blocks), _pairwise(blocks))


def _broadcast(block: Gradient) -> Gradient:
    data = {**block.data, "dense": block.data["dense"][:1]}
    return Gradient(block.representation, data, block.layer_types, block.indexing)


def test_broadcast_param_grad_and_differing_blocks_go_pairwise():
    plain = [make_gradient("dense", seed, 3) for seed in range(3)]
    broadcast = [_broadcast(b) for b in plain]
    assert layout.concatenate_batches(broadcast) is None
    _bits_equal(concatenate_gradients(broadcast), _pairwise(broadcast))
    param = [
        Gradient(
            {**b.representation, "p": "materialized"},
            {**b.data, "p": torch.full((2, 2), float(i))},
            {**b.layer_types, "p": PARAM_GRAD_TYPES},
            {**b.indexing, "p": "batch"},
        )
        for i, b in enumerate(plain)
    ]
    assert layout.concatenate_batches(param) is None
    _bits_equal(concatenate_gradients(param), _pairwise(param))
    other = plain[:2] + [make_gradient("factorized", 9, 2)]
    assert layout.concatenate_batches(other) is None
    with pytest.raises(ValueError, match="layer sets differ"):
        concatenate_gradients(other)


def test_many_blocks_are_copied_once(monkeypatch):
    """Each payload is one torch.cat over every piece (no pairwise levels)."""
    blocks = [make_gradient("dense", seed, 2) for seed in range(8)]
    calls = []
    real = torch.cat

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting)
    joined = readers.concatenate_gradients(blocks)
    monkeypatch.setattr(torch, "cat", real)
    assert calls == [8] * len(joined.data)
    _bits_equal(joined, _pairwise(blocks))

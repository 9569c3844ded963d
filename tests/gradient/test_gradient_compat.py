"""compat.md §6: ``Gradient.slice`` / ``similarity`` / ``concatenate`` edge behaviours.

Expectations are built explicitly: stacked rows by hand, Gram matrices as
``X @ Yᵀ`` of dense rows, factor rows stacked with ``torch.cat``.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, GradientShapeError

KW = {"has_bias": False}


def _dense(layers: dict[str, torch.Tensor], types: dict[str, str] | None = None, **indexing):
    """Materialized block; ``types`` overrides the default ``"nn.Linear"`` per layer."""
    types = types or {}
    return Gradient(
        {n: "materialized" for n in layers},
        dict(layers),
        {n: types.get(n, "nn.Linear") for n in layers},
        dict(indexing),
    )


def _rows(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# -------------------------------------------------------------------------------- slice


@pytest.mark.parametrize(
    "index", [[2, 0, 2], (1, 1), torch.tensor([0, 2, 1, 1]), torch.tensor(1), slice(0, 2)]
)
def test_slice_repeats_a_broadcast_row_once_per_index(gen, index):
    x, pos, w = _rows(gen, 3, 4), _rows(gen, 1, 5), _rows(gen, 2, 2)
    block = _dense({"x": x, "pos": pos, "w": w}, {"w": "param_grad_layers"})
    picked = (
        list(range(3))[index] if isinstance(index, slice) else torch.as_tensor(index).reshape(-1)
    )
    n = len(picked)
    sliced = block.slice("batch", index)
    torch.testing.assert_close(sliced.data["x"], torch.stack([x[int(i)] for i in picked]))
    torch.testing.assert_close(sliced.data["pos"], torch.stack([pos[0]] * n))
    assert sliced.data["w"] is w
    assert sliced.batch_size == n


def test_slice_int_index_keeps_the_broadcast_row(gen):
    x, pos = _rows(gen, 3, 4), _rows(gen, 1, 5)
    sliced = _dense({"x": x, "pos": pos}).slice("batch", 2)
    torch.testing.assert_close(sliced.data["x"], x[2:3])
    torch.testing.assert_close(sliced.data["pos"], pos)


def test_slice_batch_one_block_repeats_and_range_checks(gen):
    only = _rows(gen, 1, 4)
    block = _dense({"pos": only})
    torch.testing.assert_close(block.slice("batch", [0, -1, 0]).data["pos"], only.repeat(3, 1))
    with pytest.raises(IndexError, match=r"\[5\].*batch size 1"):
        block.slice("batch", [0, 0, 5])


def test_slice_range_checks_against_the_block_batch_on_broadcast_layers(gen):
    block = _dense({"x": _rows(gen, 3, 4), "pos": _rows(gen, 1, 5)})
    for bad in ([0, 3], [-4], 3, torch.tensor([1, 7])):
        with pytest.raises(IndexError, match="batch size 3"):
            block.slice("batch", bad)


def test_slice_empty_sequence_gives_zero_rows_everywhere(gen):
    f = Factorized(_rows(gen, 1, 3, 4), _rows(gen, 1, 3, 2), KW)
    block = Gradient(
        {"x": "materialized", "f": "factorized"},
        {"x": _rows(gen, 3, 4), "f": f},
        {"x": "nn.Linear", "f": "nn.Linear"},
        {"f": "batch_token"},
    )
    sliced = block.slice("batch", [])
    assert sliced.data["x"].shape == (0, 4)
    assert sliced.data["f"].activation.shape == (0, 3, 4)
    assert sliced.data["f"].pre_activation_grad.shape == (0, 3, 2)


def test_slice_factorized_broadcast_layers_repeat_both_factors(gen):
    per_sample = Factorized(_rows(gen, 3, 2, 4), _rows(gen, 3, 2, 2), KW)
    a, g = _rows(gen, 2, 1, 4), _rows(gen, 2, 1, 2)  # sequence-first (T=2, B=1)
    seq_first = Factorized(a, g, KW, batch_first=False)
    block = Gradient(
        {"p": "factorized", "s": "factorized"},
        {"p": per_sample, "s": seq_first},
        {"p": "nn.Linear", "s": "nn.Linear"},
        {"p": "batch_token", "s": "batch_token"},
    )
    sliced = block.slice("batch", [2, 0])
    p, s = sliced.data["p"], sliced.data["s"]
    torch.testing.assert_close(
        p.activation, torch.stack([per_sample.activation[2], per_sample.activation[0]])
    )
    torch.testing.assert_close(s.activation, torch.cat([a, a], dim=1))
    torch.testing.assert_close(s.pre_activation_grad, torch.cat([g, g], dim=1))
    assert s.batch_first is False


def test_slice_token_dim_uses_ordinary_indexing(gen):
    x, pos = _rows(gen, 3, 5, 4), _rows(gen, 1, 5, 4)
    block = _dense({"x": x, "pos": pos}, x="batch_token", pos="batch_token")
    sliced = block.slice("token", [4, 0])
    torch.testing.assert_close(sliced.data["pos"], torch.stack([pos[:, 4], pos[:, 0]], dim=1))
    assert sliced.data["x"].shape == (3, 2, 4)
    mixed = _dense({"x": x, "flat": _rows(gen, 3, 4)}, x="batch_token")
    with pytest.raises(ValueError, match="'flat'.*not 'batch_token'"):
        mixed.slice("token", 0)
    with pytest.raises(ValueError, match=r"dim must be one of \('batch', 'token'\)"):
        block.slice("rows", 0)


# --------------------------------------------------------------------------- similarity


def test_similarity_keeps_each_layers_own_batch_sizes(gen):
    x1, x2 = _rows(gen, 3, 4), _rows(gen, 2, 4)
    p1, p2 = _rows(gen, 1, 5), _rows(gen, 2, 5)
    q1, q2 = _rows(gen, 3, 6), _rows(gen, 1, 6)
    b1, b2 = _rows(gen, 1, 2), _rows(gen, 1, 2)
    self_block = _dense({"x": x1, "p": p1, "q": q1, "b": b1, "only_self": _rows(gen, 3, 1)})
    other = _dense({"b": b2, "q": q2, "p": p2, "x": x2})
    grams = self_block.similarity(other)
    assert list(grams) == ["x", "p", "q", "b"]  # self's order, shared layers only
    expected = {"x": x1 @ x2.T, "p": p1 @ p2.T, "q": q1 @ q2.T, "b": b1 @ b2.T}
    assert {n: tuple(k.shape) for n, k in grams.items()} == {
        "x": (3, 2),
        "p": (1, 2),
        "q": (3, 1),
        "b": (1, 1),
    }
    for name, gram in grams.items():
        torch.testing.assert_close(gram, expected[name])

    cosine = self_block.similarity(other, metric="cosine", eps=0.0)
    for name, (s, o) in {"x": (x1, x2), "p": (p1, p2), "q": (q1, q2), "b": (b1, b2)}.items():
        norms = torch.outer(s.norm(dim=1), o.norm(dim=1))
        torch.testing.assert_close(cosine[name], expected[name] / norms)

    total = self_block.similarity(other, reduce="all")
    summed = sum(k.expand(3, 2) for k in expected.values())
    torch.testing.assert_close(total, summed)


def test_similarity_all_expands_to_the_block_batch_sizes(gen):
    pos1, pos2 = _rows(gen, 1, 5), _rows(gen, 1, 5)
    self_block = _dense({"pos": pos1, "x": _rows(gen, 3, 4)})
    other = _dense({"pos": pos2, "y": _rows(gen, 2, 4)})
    total = self_block.similarity(other, reduce="all")
    torch.testing.assert_close(total, (pos1 @ pos2.T).expand(3, 2))
    with pytest.raises(ValueError, match="no shared layer"):
        self_block.similarity(_dense({"z": _rows(gen, 2, 4)}), reduce="all")


# -------------------------------------------------------------------------- concatenate


def test_gradient_shape_error_is_both_value_and_runtime_error():
    assert issubclass(GradientShapeError, ValueError)
    assert issubclass(GradientShapeError, RuntimeError)


def _assert_shape_error(block1: Gradient, block2: Gradient, name: str, dim: str = "batch"):
    """``concatenate`` raises one error that both except clauses catch, naming layer and shapes."""
    for caught in (ValueError, RuntimeError):
        with pytest.raises(caught) as info:
            block1.concatenate(block2, dim=dim)
        assert type(info.value) is GradientShapeError
        assert repr(name) in str(info.value)
    return str(info.value)


def test_concatenate_dense_width_mismatch(gen):
    message = _assert_shape_error(
        _dense({"d": _rows(gen, 2, 4)}), _dense({"d": _rows(gen, 3, 5)}), "d"
    )
    assert "(2, 4)" in message and "(3, 5)" in message


def test_concatenate_batch_token_width_mismatch_on_batch_and_token_dims(gen):
    t1 = _dense({"t": _rows(gen, 2, 3, 4)}, t="batch_token")
    t2 = _dense({"t": _rows(gen, 2, 5, 6)}, t="batch_token")
    message = _assert_shape_error(t1, t2, "t")
    assert "4)" in message and "6)" in message
    message = _assert_shape_error(t1, t2, "t", dim="token")
    assert "(2, 3, 4)" in message and "(2, 5, 6)" in message


@pytest.mark.parametrize("dim", ["batch", "token"])
@pytest.mark.parametrize("factor", ["activation", "pre_activation_grad"])
def test_concatenate_factorized_width_mismatch(gen, dim, factor):
    widths = {"activation": (4, 2), "pre_activation_grad": (4, 3)}[factor]
    f1 = Factorized(_rows(gen, 2, 3, 4), _rows(gen, 2, 3, 2), KW)
    f2 = Factorized(_rows(gen, 2, 3, widths[0] + (factor == "activation")),
                    _rows(gen, 2, 3, widths[1]), KW)  # fmt: skip
    blocks = [
        Gradient({"f": "factorized"}, {"f": f}, {"f": "nn.Linear"}, {"f": "batch_token"})
        for f in (f1, f2)
    ]
    message = _assert_shape_error(*blocks, "f", dim=dim)
    assert factor in message


def test_concatenate_broadcast_width_one_against_wider_is_refused(gen):
    narrow = _dense({"x": _rows(gen, 3, 4), "pos": _rows(gen, 1, 1)})
    wide = _dense({"x": _rows(gen, 2, 4), "pos": _rows(gen, 1, 6)})
    message = _assert_shape_error(narrow, wide, "pos")
    assert "(1, 1)" in message and "(1, 6)" in message
    _assert_shape_error(wide, narrow, "pos")


def test_concatenate_param_grad_shape_mismatch(gen):
    types = {"w": "param_grad_layers"}
    b1 = _dense({"x": _rows(gen, 2, 4), "w": _rows(gen, 3, 1)}, types)
    b2 = _dense({"x": _rows(gen, 2, 4), "w": _rows(gen, 3, 4)}, types)
    message = _assert_shape_error(b1, b2, "w")
    assert "(3, 1)" in message and "(3, 4)" in message


def test_concatenate_invalid_dim_lists_the_choices(gen):
    block = _dense({"x": _rows(gen, 2, 4)})
    with pytest.raises(ValueError, match=r"dim must be one of \('batch', 'token'\), got 'rows'"):
        block.concatenate(block, dim="rows")


# ---------------------------------------------------------------- invalid-choice messages


def test_validation_choice_errors_say_must_be_one_of(gen):
    with pytest.raises(ValueError, match=r"'dense'; it must be one of \('materialized'"):
        Gradient({"x": "dense"}, {"x": _rows(gen, 2, 4)}, {"x": "nn.Linear"})
    with pytest.raises(ValueError, match=r"'tokens'; it must be one of \('batch', 'batch_token'"):
        Gradient({"x": "materialized"}, {"x": _rows(gen, 2, 4)}, {"x": "nn.Linear"},
                 {"x": "tokens"})  # fmt: skip
    f = Factorized(_rows(gen, 2, 4), _rows(gen, 2, 3), KW)
    with pytest.raises(ValueError, match=r"'linear'.*must be one of \[.*'nn\.Linear'"):
        Gradient({"f": "factorized"}, {"f": f}, {"f": "linear"})
    with pytest.raises(NotImplementedError, match=r"dim must be one of \('token',\)"):
        _dense({"x": _rows(gen, 2, 4)}).aggregate("batch")

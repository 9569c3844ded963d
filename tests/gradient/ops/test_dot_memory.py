"""The layer-summed cross-Gram holds one layer's matrix at a time, bit for bit as before.

``layerwise_cross_dot`` adds each layer's ``(B_train, B_test)`` matrix into the
running sum as soon as it is computed (the peak of a scored block is the sum
plus one layer's matrix, not one matrix per layer); the sum equals the sum of
the per-layer matrices in layer order, also when a broadcast first layer or
mixed dtypes make it start over.
"""

from __future__ import annotations

import importlib
import weakref

import pytest
import torch

from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.ops.dot import layerwise_cross_dot
from dattri_llm.gradient.ops.dot_blocks import _sum_broadcast

dot = importlib.import_module("dattri_llm.gradient.ops.dot")  # the module (ops.dot is a function)
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def _block(rows: dict[str, torch.Tensor], factorized: tuple[str, ...] = ()) -> Gradient:
    data: dict = {}
    for name, value in rows.items():
        if name in factorized:
            data[name] = Factorized(value[:, None, :3], value[:, None, 3:6], None)
        else:
            data[name] = value
    representation = {n: "factorized" if n in factorized else "materialized" for n in data}
    return Gradient(representation, data, {n: "nn.Linear" for n in data})


def _rows(batch: int, layers: int, seed: int, dtypes=None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"l{i}": torch.randn(batch, 9, generator=gen).to((dtypes or {}).get(i, torch.float32))
        for i in range(layers)
    }


def _reference(train: Gradient, test: Gradient) -> torch.Tensor:
    return _sum_broadcast(layerwise_cross_dot(train, test, reduce="none"), "reference")


@pytest.mark.parametrize(
    "case",
    ["dense", "factorized", "broadcast first", "broadcast later", "mixed dtypes", "lower later"],
)
def test_the_running_sum_equals_the_sum_of_every_layer(case):
    train_rows, test_rows = _rows(7, 5, 0), _rows(4, 5, 1)
    factorized: tuple[str, ...] = ()
    if case == "factorized":
        factorized = ("l1", "l3")
    if case == "broadcast first":
        train_rows["l0"] = train_rows["l0"][:1]
    if case == "broadcast later":
        train_rows["l3"] = train_rows["l3"][:1]
    if case == "mixed dtypes":
        train_rows["l2"] = train_rows["l2"].double()
        test_rows["l2"] = test_rows["l2"].double()
    if case == "lower later":
        train_rows["l2"] = train_rows["l2"].bfloat16()
        test_rows["l2"] = test_rows["l2"].bfloat16()
    train, test = _block(train_rows, factorized), _block(test_rows, factorized)
    got, want = layerwise_cross_dot(train, test), _reference(train, test)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(_BITS[got.dtype]), want.view(_BITS[want.dtype]))  # bit for bit


def test_each_layer_matrix_is_released_once_added(monkeypatch):
    train, test = _block(_rows(6, 4, 0)), _block(_rows(3, 4, 1))
    refs: list[weakref.ref] = []
    alive_at_call: list[int] = []
    real = dot._layer_cross_dot

    def recording(*args):
        alive_at_call.append(sum(ref() is not None for ref in refs))
        result = real(*args)
        refs.append(weakref.ref(result))
        return result

    monkeypatch.setattr(dot, "_layer_cross_dot", recording)
    summed = layerwise_cross_dot(train, test)
    assert alive_at_call == [0, 0, 0, 0]
    monkeypatch.setattr(dot, "_layer_cross_dot", real)
    assert torch.equal(summed, _reference(train, test))

"""Reading helpers that reference-design code imports (streaming.md, last section).

``GradientFileMultiStepDataset`` / ``make_gradient_multistep_dataloader`` in
``gradient/datasets.py`` and ``_is_linear_io_capable`` in ``gradient/hooks/hooks.py``.
Expected blocks are the stored records' gradients concatenated in stored order.
"""

from __future__ import annotations

import types

import pytest
import torch
from store_helpers import assert_gradients_equal, build_gradient, make_gradient, make_records
from torch import nn

from dattri_llm.gradient.datasets import (
    GradientFileMultiStepDataset,
    make_gradient_multistep_dataloader,
)
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.hooks.config import HookManagerConfig, resolve_hook_assignments
from dattri_llm.gradient.hooks.layers import is_linear_io_capable as _is_linear_io_capable
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.store import residency as store_residency


def make_args(workers=0, pin=False, persistent=False, prefetch=None):
    return types.SimpleNamespace(
        dataloader_num_workers=workers,
        dataloader_pin_memory=pin,
        dataloader_persistent_workers=persistent,
        dataloader_prefetch_factor=prefetch,
    )


def filled_store(path, residency="disk"):
    """Three group files; group ``k`` holds steps ``2k`` and ``2k+1`` (per-sample records)."""
    store = GradientStorageManager(path, residency=residency)
    groups = make_records("mixed", per_sample=True)
    for group in groups:
        store.save_bulk(group)
    return store, groups


def expected_item(group, steps, layer_name=None):
    """``{step: (gradient, hashes)}`` of one group: its records of each step, in order."""
    out = {}
    for step in sorted({r.step for r in group} & set(steps)):
        chosen = [r for r in group if r.step == step]
        grads = [r.gradient for r in chosen]
        if layer_name is not None:
            grads = [g.select_layers(layer_name, include_derived=True) for g in grads]
        block = grads[0]
        for g in grads[1:]:
            block = block.concatenate(g, dim="batch")
        out[step] = (block, [r.input_hash for r in chosen])
    return out


def assert_items_equal(got, want):
    assert list(got) == list(want)  # same steps, ascending
    for step, (block, hashes) in want.items():
        assert got[step][1] == hashes
        assert_gradients_equal(got[step][0], block)


@pytest.mark.parametrize("residency", ["disk", "memory"])
def test_one_item_per_group_file_holding_a_requested_step(tmp_path, residency):
    store, groups = filled_store(tmp_path / "s", residency)
    steps = [4, 0, 1, 3, 42]
    dataset = GradientFileMultiStepDataset(store, steps)
    assert isinstance(dataset, torch.utils.data.Dataset)
    assert len(dataset) == 3
    for i, group in enumerate(groups):
        assert_items_equal(dataset[i], expected_item(group, steps))
    assert list(dataset[0]) == [0, 1] and list(dataset[1]) == [3] and list(dataset[2]) == [4]
    assert len(GradientFileMultiStepDataset(store, [5])) == 1
    assert len(GradientFileMultiStepDataset(store, [42])) == 0


def test_an_item_reads_its_file_once(tmp_path, monkeypatch):
    store, _ = filled_store(tmp_path / "s")
    dataset = GradientFileMultiStepDataset(store, range(6))
    calls = []
    real = store_residency.load_group_file
    monkeypatch.setattr(store_residency, "load_group_file", lambda p: calls.append(p) or real(p))
    item = dataset[1]
    assert list(item) == [2, 3] and len(calls) == 1


def test_token_axes_are_zero_padded_to_the_longest(tmp_path):
    short = torch.arange(1.0, 7.0).reshape(1, 2, 3)
    long = torch.arange(10.0, 34.0).reshape(2, 4, 3)

    def record(ids, tokens):
        layer = ("materialized", "nn.Linear", "batch_token", tokens)
        return GradientRecord(7, ids, build_gradient({"tok": layer}))

    store = GradientStorageManager(tmp_path / "s")
    store.save_bulk([record(["a"], short), record(["b", "c"], long)])
    [item] = list(GradientFileMultiStepDataset(store, [7]))
    block, hashes = item[7]
    expected = torch.zeros(3, 4, 3)
    expected[0, :2] = short[0]
    expected[1:] = long
    assert hashes == ["a", "b", "c"]
    assert torch.equal(block.data["tok"], expected)


def test_layer_filter_keeps_use_site_layers_and_param_grad_layers_stay(tmp_path):
    def gradient(seed):
        gen = torch.Generator().manual_seed(seed)
        return build_gradient(
            {
                "lin": ("materialized", "nn.Linear", "batch", torch.randn(2, 3, generator=gen)),
                "lin@2": ("materialized", "nn.Linear", "batch", torch.randn(2, 3, generator=gen)),
                "other": ("materialized", "nn.Linear", "batch", torch.randn(2, 5, generator=gen)),
                "bias": (
                    "materialized",
                    "param_grad_layers",
                    "batch",
                    torch.randn(4, generator=gen),
                ),
            }
        )

    store = GradientStorageManager(tmp_path / "s")
    first, second = gradient(0), gradient(1)
    store.save_bulk([GradientRecord(0, ["a", "b"], first), GradientRecord(0, ["c", "d"], second)])
    [item] = list(GradientFileMultiStepDataset(store, 0, layer_name="lin"))
    assert item[0][0].layer_names == {"lin", "lin@2"}
    [item] = list(GradientFileMultiStepDataset(store, [0]))
    block = item[0][0]
    assert block.layer_names == {"lin", "lin@2", "other", "bias"}
    assert torch.equal(block.data["bias"], first.data["bias"] + second.data["bias"])
    assert torch.equal(block.data["other"], torch.cat([first.data["other"], second.data["other"]]))


def test_resaved_sample_is_read_from_its_newest_record(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    old = make_gradient("dense", seed=0, batch=3)
    new = make_gradient("dense", seed=1, batch=1)
    store.save_bulk([GradientRecord(0, ["a", "b", "c"], old)])
    store.save_bulk([GradientRecord(0, ["b"], new)])
    items = list(GradientFileMultiStepDataset(GradientStorageManager(tmp_path / "s"), [0]))
    blocks = {tuple(item[0][1]): item[0][0] for item in items}
    assert sorted(blocks) == [("a", "c"), ("b",)]  # "b" once, from the newer record
    assert_gradients_equal(blocks[("b",)], new)
    assert_gradients_equal(blocks[("a", "c")], old.slice("batch", [0, 2]))


@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_batches_are_the_items_unchanged(tmp_path, workers):
    store, groups = filled_store(tmp_path / "s")
    steps = [1, 2, 5]
    loader = make_gradient_multistep_dataloader(store, steps, make_args(workers), layer_name="lin")
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert loader.batch_size == 1 and loader.num_workers == workers
    assert isinstance(loader.sampler, torch.utils.data.SequentialSampler)
    batches = list(loader)
    assert len(batches) == 3
    for batch, group in zip(batches, groups):
        assert_items_equal(batch, expected_item(group, steps, ["lin"]))


def test_dataloader_settings_come_from_args(tmp_path):
    store, _ = filled_store(tmp_path / "disk")
    args = make_args(workers=2, persistent=True, prefetch=3)
    loader = make_gradient_multistep_dataloader(store, [0], args)
    assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 3
    assert not loader.pin_memory
    ram, _ = filled_store(tmp_path / "ram", residency="memory")
    assert make_gradient_multistep_dataloader(ram, [0], args).num_workers == 0


@pytest.mark.parametrize(
    ("module", "capable"),
    [
        (nn.Linear(2, 3), True),
        (nn.Embedding(5, 2), True),
        (nn.Conv2d(1, 2, 3), True),
        (nn.ConvTranspose1d(1, 2, 3), True),
        (nn.LayerNorm(3), True),
        (nn.GroupNorm(1, 2), True),
        (nn.InstanceNorm2d(2), True),
        (nn.Bilinear(2, 2, 1), False),  # its gradient needs both inputs
        (nn.BatchNorm1d(3), False),
        (nn.Sequential(nn.Linear(2, 2)), False),
    ],
)
def test_is_linear_io_capable_by_type(module, capable):
    assert _is_linear_io_capable(module) is capable


def test_is_linear_io_capable_ignores_names_and_decides_assignment(monkeypatch):
    class Renamed(nn.Linear):
        pass

    model = nn.Sequential()
    model.add_module("linear", nn.BatchNorm1d(2))  # a name saying "linear" is not enough
    model.add_module("norm", Renamed(2, 2))  # a subclass counts, whatever its name
    assert not _is_linear_io_capable(model.linear) and _is_linear_io_capable(model.norm)
    assert resolve_hook_assignments(model, HookManagerConfig()) == {
        "linear": "param_grad",
        "norm": "linear_io",
    }
    import dattri_llm.gradient.hooks.config as config

    monkeypatch.setattr(config, "is_linear_io_capable", lambda module: False)
    assert resolve_hook_assignments(model, HookManagerConfig()) == {
        "linear": "param_grad",
        "norm": "param_grad",
    }

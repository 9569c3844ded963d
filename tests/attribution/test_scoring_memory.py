"""Scoring from stores holds what the block being scored needs (peak memory of from-cache calls).

A store directory is opened once per call, so its identifier index is in memory
once (not once per step of the call that reads it).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dattri_llm.attribution.algorithm.kronecker import KFACAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager


def _dense(n: int, seed: int, width: int = 6) -> Gradient:
    gen = torch.Generator().manual_seed(seed)
    data = {f"l{i}": torch.randn(n, width, generator=gen) for i in range(2)}
    return Gradient(
        {name: "materialized" for name in data}, data, {name: "nn.Linear" for name in data}
    )


def _write(path, n: int, group: int, prefix: str, seed: int) -> str:
    store = GradientStorageManager(path)
    for start in range(0, n, group):
        size = min(group, n - start)
        ids = [f"{prefix}{start + i}" for i in range(size)]
        store.save_bulk([GradientRecord(0, ids, _dense(size, seed + start))])
    return str(path)


def _args(tmp_path, batch: int = 4) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
    )


class _Opened:
    """Counts the stores opened per directory (``GradientStorageManager.__init__``)."""

    def __init__(self, monkeypatch) -> None:
        self.dirs: list[str] = []
        real = GradientStorageManager.__init__

        def counting(store, save_dir, *args, **kwargs):
            self.dirs.append(str(save_dir))
            real(store, save_dir, *args, **kwargs)

        monkeypatch.setattr(GradientStorageManager, "__init__", counting)


@pytest.mark.parametrize(
    "call",
    [
        lambda a, train, test: TracInAttributor(a).attribute_from_cache(train, test),
        lambda a, train, test: TracInAttributor(a).top_k_from_cache(train, test, 3),
        lambda a, train, test: KFACAttributor(a).attribute_from_cache(
            train, test, non_kfac_strategy="direct"
        ),
        lambda a, train, test: KFACAttributor(a).top_k_from_cache(train, test, 3),
    ],
    ids=["grad-dot", "grad-dot-top-k", "kfac", "kfac-top-k"],
)
def test_a_store_directory_is_opened_once_per_call(tmp_path, monkeypatch, call):
    train = _write(tmp_path / "train", 12, 5, "t", 0)
    test = _write(tmp_path / "test", 3, 2, "q", 100)
    opened = _Opened(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # K-FAC: dense layers use the dense Fisher
        call(_args(tmp_path), train, test)
    assert sorted(opened.dirs) == [test, train]


def test_checkpoint_stores_are_opened_once_each(tmp_path, monkeypatch):
    trains = [_write(tmp_path / f"train{k}", 8, 3, "t", 10 * k) for k in range(2)]
    tests = [_write(tmp_path / f"test{k}", 2, 2, "q", 100 + k) for k in range(2)]
    opened = _Opened(monkeypatch)
    TracInAttributor(_args(tmp_path)).top_k_from_cache(trains, tests, 2)
    assert sorted(opened.dirs) == sorted(trains + tests)

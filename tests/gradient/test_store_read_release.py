"""Reading a store holds only the block being scored (peak memory of scoring from a store).

A block the consumer has dropped is not kept alive by the reader (not by the
group it came from, nor while the next group is awaited), and the blocks are
built on the consuming thread: the background prefetch only maps the next
group's file and reads its pages, so the block copies are allocated and freed
by one thread and their memory is reused from block to block.
"""

from __future__ import annotations

import threading
import types
import weakref

import pytest
import torch
from store_helpers import assert_gradients_equal, make_records

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.datasets import iter_gradient_blocks
from dattri_llm.gradient.gradient import Factorized
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.stream import readers
from dattri_llm.gradient.streaming import DiskGradientSource


def _args(workers: int = 0):
    return types.SimpleNamespace(dataloader_num_workers=workers, should_log=False)


def _store(path, kind: str = "factorized", per_sample: bool = True, seed: int = 0):
    store = GradientStorageManager(path)
    for group in make_records(kind, per_sample, seed):  # 3 groups of 2 steps each
        store.save_bulk(group)
    return store


def _tensor_refs(block) -> list[weakref.ref]:
    refs = []
    for value in block.data.values():
        parts = (
            (value.activation, value.pre_activation_grad)
            if isinstance(value, Factorized)
            else (value,)
        )
        refs += [weakref.ref(t) for t in parts]
    return refs


@pytest.mark.parametrize("per_sample", [True, False])  # copied blocks, and memmap views
def test_a_dropped_block_is_not_kept_alive_by_the_reader(tmp_path, per_sample):
    store = _store(tmp_path / "s", per_sample=per_sample)
    earlier: list[weakref.ref] = []
    alive_at_yield = []
    count = 0
    for _step, block, _ids in DiskGradientSource(store, _args()):
        alive_at_yield.append(sum(ref() is not None for ref in earlier))
        earlier += _tensor_refs(block)
        count += 1
        del block
    assert count == 6 and earlier  # two blocks per group: the group list once held both
    assert alive_at_yield == [0] * 6


def test_blocks_are_built_on_the_consuming_thread_and_equal_the_stored_ones(tmp_path, monkeypatch):
    store = _store(tmp_path / "s")
    builders = []
    real = readers.group_blocks

    def recording(*args, **kwargs):
        builders.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(readers, "group_blocks", recording)
    got = list(DiskGradientSource(store, _args()))
    assert builders and set(builders) == {threading.get_ident()}
    monkeypatch.setattr(readers, "group_blocks", real)
    want = list(iter_gradient_blocks(store))
    assert len(got) == len(want) == 6
    for (s1, g1, i1), (s2, g2, i2) in zip(got, want):
        assert s1 == s2 and i1 == i2
        assert_gradients_equal(g1, g2)


def test_scoring_from_stores_drops_each_scored_train_block(tmp_path):
    """Each train rep the inner product met is released before the next one is scored."""
    train = _store(tmp_path / "train", kind="dense", seed=0)
    test = _store(tmp_path / "test", kind="dense", seed=1)
    refs: list[weakref.ref] = []
    alive_at_call = []

    class Recording(TracInAttributor):
        def inner_product(self, train_rep, test_rep, *, dense_cache=None):
            alive_at_call.append(sum(ref() is not None for ref in refs))
            refs.extend(_tensor_refs(train_rep))
            return super().inner_product(train_rep, test_rep, dense_cache=dense_cache)

    args = AttributionArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=1
    )
    score = Recording(args).attribute_from_cache(train, test)
    reference = TracInAttributor(args).attribute_from_cache(train, test)
    assert torch.equal(score.scores, reference.scores)
    assert len(alive_at_call) == 6 and refs
    assert alive_at_call == [0] * 6

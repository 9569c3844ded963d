from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest
import torch
from store_helpers import assert_records_equal, build_gradient, crash_record, make_gradient

from dattri_llm.gradient.async_writer import THREAD_NAME, AsyncGradientWriter
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager

TESTS_DIR = Path(__file__).resolve().parents[1]


def record(step: int, ids: tuple[str, ...] = ("a",)) -> GradientRecord:
    return GradientRecord(step, list(ids), make_gradient("mixed", step, len(ids)))


class GatedStore:
    """Fake store whose ``save_bulk`` waits for a gate and records what it wrote."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()  # set once the writer thread is inside save_bulk
        self.saved: list[list[int]] = []
        self.fail_at = fail_at

    def save_bulk(self, records):
        self.entered.set()
        self.gate.wait(timeout=10)
        if self.fail_at is not None and len(self.saved) == self.fail_at:
            self.saved.append(None)
            raise OSError("disk full")
        self.saved.append([r.step for r in records])
        return f"group_{len(self.saved)}"


def test_groups_written_in_submission_order(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    groups = [[record(2 * k), record(2 * k + 1, ("b", "c"))] for k in range(4)]
    with AsyncGradientWriter(store, max_pending=2) as writer:
        for group in groups:
            writer.submit(group)
        writer.submit([])  # ignored
    assert len(store.locations()) == 4
    for location, group in zip(store.locations(), groups):
        for got, want in zip(store.load_records(location), group):
            assert_records_equal(got, want)


def test_submit_blocks_while_max_pending_groups_wait_besides_the_one_written():
    """compat.md §5: the group being written does not count; max_pending=2 → 4th submit blocks."""
    store = GatedStore()
    writer = AsyncGradientWriter(store, max_pending=2)
    writer.submit([record(0)])
    assert store.entered.wait(timeout=10)  # the writer thread took group 0 and is stalled
    writer.submit([record(1)])
    writer.submit([record(2)])  # two groups wait besides the one being written: no block
    fourth = threading.Thread(target=writer.submit, args=([record(3)],))
    fourth.start()
    fourth.join(timeout=0.3)
    assert fourth.is_alive()  # blocked: max_pending groups already wait
    assert store.saved == []
    store.gate.set()
    fourth.join(timeout=10)
    assert not fourth.is_alive()
    writer.flush()
    assert store.saved == [[0], [1], [2], [3]]
    writer.close()


def test_write_error_is_reraised_then_cleared_by_close():
    store = GatedStore(fail_at=1)
    store.gate.set()
    writer = AsyncGradientWriter(store)
    writer.submit([record(0)])
    writer.submit([record(1)])
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    with pytest.raises(OSError, match="disk full"):
        writer.submit([record(2)])
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    writer.close()  # idempotent, error cleared
    assert store.saved == [[0], None]
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit([record(3)])


def test_groups_after_a_failure_are_dropped():
    store = GatedStore(fail_at=0)
    writer = AsyncGradientWriter(store)
    writer.submit([record(0)])
    writer.submit([record(1)])
    store.gate.set()
    with pytest.raises(OSError):
        writer.close()
    assert store.saved == [None]


def test_context_manager_does_not_swallow_body_exception():
    store = GatedStore()
    store.gate.set()
    with pytest.raises(KeyError, match="body"):
        with AsyncGradientWriter(store) as writer:
            writer.submit([record(0)])
            raise KeyError("body")
    assert store.saved == [[0]]


def test_body_exception_wins_over_a_write_error_at_exit():
    """A write error found by ``close`` on exit must not replace the ``with`` body's error."""
    store = GatedStore(fail_at=0)
    store.gate.set()
    with (
        pytest.raises(KeyError, match="body") as caught,
        pytest.warns(RuntimeWarning, match="disk full"),
    ):
        with AsyncGradientWriter(store) as writer:
            writer.submit([record(0)])
            raise KeyError("body")
    assert store.saved == [None]
    assert any("disk full" in note for note in getattr(caught.value, "__notes__", []))
    writer.close()  # the write error was reported with the body's exception and cleared


def test_close_in_finally_keeps_the_propagating_exception():
    """``try: ... finally: writer.close()`` (as collect_gradients does): the body's error wins."""
    store = GatedStore(fail_at=0)
    store.gate.set()
    writer = AsyncGradientWriter(store)
    with (
        pytest.raises(KeyError, match="body") as caught,
        pytest.warns(RuntimeWarning, match="disk full"),
    ):
        try:
            writer.submit([record(0)])
            raise KeyError("body")
        finally:
            writer.close()
    assert any("OSError('disk full')" in note for note in caught.value.__notes__)
    writer.close()  # reported once, then cleared


def test_close_without_other_exception_raises_the_write_error():
    store = GatedStore(fail_at=0)
    store.gate.set()
    writer = AsyncGradientWriter(store)
    writer.submit([record(0)])
    try:
        raise KeyError("handled before close")
    except KeyError:
        pass
    with pytest.raises(OSError, match="disk full"):
        writer.close()


def test_writer_thread_is_named():
    writer = AsyncGradientWriter(GatedStore())
    assert THREAD_NAME == "dattri-llm-gradient-writer"
    assert writer._worker.thread.name == THREAD_NAME and writer._worker.thread.daemon
    writer.close()


UNCLOSED_WRITER = """
import time
from dattri_llm.gradient.async_writer import AsyncGradientWriter
from dattri_llm.gradient.storage_manager import GradientStorageManager
from store_helpers import crash_record

store = GradientStorageManager({root!r})
save_bulk = store.save_bulk
def slow_save_bulk(records):
    time.sleep(0.2)
    return save_bulk(records)
store.save_bulk = slow_save_bulk
writer = AsyncGradientWriter(store, max_pending=8)
for step in range(4):
    writer.submit([crash_record(step)])
# exit without close(): the queued groups must still be written
"""


def test_queued_groups_are_flushed_at_interpreter_exit(tmp_path):
    root = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    code = textwrap.dedent(UNCLOSED_WRITER.format(root=str(root)))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    store = GradientStorageManager(root)
    assert store.available_steps() == [0, 1, 2, 3]
    for location in store.locations():
        [got] = store.load_records(location)
        assert_records_equal(got, crash_record(got.step))


def test_unclosed_writer_is_collectable_and_flushed(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    writer = AsyncGradientWriter(store)
    writer.submit([record(0)])
    thread = writer._worker.thread
    ref = weakref.ref(writer)
    del writer
    gc.collect()
    assert ref() is None  # the thread does not keep the writer alive
    thread.join(timeout=10)
    assert not thread.is_alive()  # the finalizer stopped it after writing the queue
    assert store.available_steps() == [0]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_invalid_max_pending(bad):
    with pytest.raises(ValueError, match="max_pending"):
        AsyncGradientWriter(GatedStore(), max_pending=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_payloads_are_copied_after_the_producer_stream(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = torch.ones(2, 4096, 4096, device="cuda")
        for _ in range(5):
            big = big * 1.0001  # queued work the writer must wait for
        layers = {"lin": ("materialized", "nn.Linear", "batch", big.reshape(2, -1))}
        rec = GradientRecord(0, ["a", "b"], build_gradient(layers))
        with AsyncGradientWriter(store) as writer:
            writer.submit([rec])
    [got] = store.load_records(store.locations()[0])
    assert got.gradient.data["lin"].device.type == "cpu"
    assert torch.equal(got.gradient.data["lin"], big.reshape(2, -1).cpu())

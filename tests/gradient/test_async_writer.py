from __future__ import annotations

import threading

import pytest
import torch
from store_helpers import assert_records_equal, build_gradient, make_gradient

from dattri_llm.gradient.async_writer import AsyncGradientWriter
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager


def record(step: int, ids: tuple[str, ...] = ("a",)) -> GradientRecord:
    return GradientRecord(step, list(ids), make_gradient("mixed", step, len(ids)))


class GatedStore:
    """Fake store whose ``save_bulk`` waits for a gate and records what it wrote."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.gate = threading.Event()
        self.saved: list[list[int]] = []
        self.fail_at = fail_at

    def save_bulk(self, records):
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


def test_submit_blocks_while_max_pending_groups_are_pending():
    store = GatedStore()
    writer = AsyncGradientWriter(store, max_pending=2)
    writer.submit([record(0)])
    writer.submit([record(1)])
    third = threading.Thread(target=writer.submit, args=([record(2)],))
    third.start()
    third.join(timeout=0.3)
    assert third.is_alive()  # blocked: two groups pending
    store.gate.set()
    third.join(timeout=10)
    assert not third.is_alive()
    writer.flush()
    assert store.saved == [[0], [1], [2]]
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
    with pytest.raises(KeyError, match="body") as caught:
        with AsyncGradientWriter(store) as writer:
            writer.submit([record(0)])
            raise KeyError("body")
    assert store.saved == [None]
    assert any("disk full" in note for note in getattr(caught.value, "__notes__", []))
    writer.close()  # the write error was reported with the body's exception and cleared


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

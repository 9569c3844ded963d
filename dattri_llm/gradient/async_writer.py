"""Background writer: hands groups of records to a store on a single daemon thread.

The thread runs a `_Worker` that holds the queue, the store and the first
write error, never the `AsyncGradientWriter` itself, so an unclosed writer can
be garbage-collected; a `weakref.finalize` then (or at interpreter exit, when
the writer is still alive) drains the queue and stops the thread, so queued
groups are written even when `AsyncGradientWriter.close` is never called.
"""

from __future__ import annotations

import queue
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence

import torch

from dattri_llm.gradient.model.container import GradientRecord
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.storage_manager import GradientStorageManager

__all__ = ["AsyncGradientWriter"]

THREAD_NAME = "dattri-llm-gradient-writer"
_STOP = object()


def _cuda_devices(records: Sequence[GradientRecord]) -> set[torch.device]:
    """CUDA devices holding any payload of ``records``."""
    devices = set()
    for record in records:
        for value in record.gradient.data.values():
            if isinstance(value, Factorized):
                tensors = (value.activation, value.pre_activation_grad)
            else:
                tensors = (value,)
            devices.update(t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda)
    return devices


def _producer_events(records: Sequence[GradientRecord]) -> list[torch.cuda.Event]:
    """One event per CUDA device, recorded on that device's current (producer) stream."""
    events = []
    for device in _cuda_devices(records):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def _to_cpu(record: GradientRecord) -> GradientRecord:
    return GradientRecord(
        step=record.step,
        input_hash=record.input_hash,
        gradient=record.gradient.to("cpu"),
        sample_id_key=record.sample_id_key,
    )


class _Worker:
    """State shared with the writer thread: the bounded queue, the store, the first error.

    The queue holds at most ``max_pending`` groups; the group being written has
    left it, so ``max_pending + 1`` groups can be in flight.
    """

    def __init__(self, file_manager: GradientStorageManager, max_pending: int) -> None:
        self.file_manager = file_manager
        self.queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self.run, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def run(self) -> None:
        """Write queued groups in order; after an error, dequeue the rest without writing."""
        while True:
            item = self.queue.get()
            try:
                if item is _STOP:
                    return
                records, events = item
                if self.error is None:
                    for event in events:
                        event.synchronize()
                    self.file_manager.save_bulk([_to_cpu(r) for r in records])
            except BaseException as err:  # surfaced to the producer thread
                self.error = err
            finally:
                self.queue.task_done()

    def stop(self) -> None:
        """Drain the queue and join the thread (idempotent)."""
        if self.stopped:
            return
        self.stopped = True
        if threading.current_thread() is self.thread:  # finalised on the writer thread itself
            return
        self.queue.put(_STOP)
        self.thread.join()

    def stop_unclosed(self) -> None:
        """Finalizer of a writer never closed: write what is queued, report a write error."""
        self.stop()
        if self.error is not None:
            warnings.warn(
                f"AsyncGradientWriter was never closed; flushing its queued gradient groups "
                f"at {'interpreter exit' if sys.is_finalizing() else 'garbage collection'} "
                f"failed: {self.error!r}. Call close() (or use it as a context manager) to "
                f"get write errors raised.",
                RuntimeWarning,
                stacklevel=1,
            )


class AsyncGradientWriter:
    """Write submitted groups through ``file_manager.save_bulk`` on one daemon thread.

    Groups are written in submission order. Device payloads are copied to CPU
    on the writer thread, after waiting on CUDA events recorded on the
    producer's streams at submit time. `submit` blocks while ``max_pending``
    groups wait in the queue *besides* the one being written (so with
    ``max_pending=2`` and a stalled store, the fourth `submit` blocks).

    After a failed write the remaining queued groups are dropped and the error
    is re-raised by the next `submit` / `flush` and by `close` (which clears
    it). A writer that is never closed is flushed when it is garbage-collected
    or at interpreter exit. While the writer is open, the store must not be
    used from other threads.

    Args:
        file_manager: the `GradientStorageManager` to write into.
        max_pending: bound on queued groups (``< 1`` → `ValueError`).
    """

    def __init__(self, file_manager: GradientStorageManager, max_pending: int = 2) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(
                f"AsyncGradientWriter: max_pending must be an int >= 1, got {max_pending!r}."
            )
        self._file_manager = file_manager
        self._max_pending = max_pending
        self._closed = False
        self._worker = _Worker(file_manager, max_pending)
        self._finalizer = weakref.finalize(self, self._worker.stop_unclosed)

    @property
    def file_manager(self) -> GradientStorageManager:
        """The store groups are written into."""
        return self._file_manager

    @property
    def max_pending(self) -> int:
        """Maximum number of groups waiting besides the one being written."""
        return self._max_pending

    def submit(self, records: Sequence[GradientRecord]) -> None:
        """Enqueue a copy of one group (blocks while ``max_pending`` groups wait).

        An empty list is ignored. Re-raises an earlier write error (without
        clearing it); after `close` → `RuntimeError`.
        """
        if self._closed:
            raise RuntimeError("AsyncGradientWriter.submit: the writer is closed.")
        self._raise_error()
        records = list(records)
        if not records:
            return
        self._worker.queue.put((records, _producer_events(records)))

    def flush(self) -> None:
        """Wait until every submitted group is written; re-raise a write error."""
        self._worker.queue.join()
        self._raise_error()

    def close(self) -> None:
        """Flush, stop the thread and re-raise (then clear) a pending write error.

        Idempotent. When ``close`` runs while another exception is being
        handled or propagating (``__exit__`` of a failing ``with`` body, a
        ``finally`` clause), that exception stays the one that propagates: the
        write error is attached to it as a note and reported with a
        `RuntimeWarning` instead of replacing it.
        """
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            self._worker.stop()
        error, self._worker.error = self._worker.error, None
        if error is None:
            return
        in_flight = sys.exc_info()[1]
        if in_flight is None or in_flight is error:
            raise error
        _attach_write_error(in_flight, error)

    def __enter__(self) -> AsyncGradientWriter:
        """Return ``self``."""
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """`close` on exit; never swallows the ``with`` body's exception (see `close`)."""
        self.close()

    def _raise_error(self) -> None:
        if self._worker.error is not None:
            raise self._worker.error


def _attach_write_error(in_flight: BaseException, error: BaseException) -> None:
    """Report ``error`` on the exception already propagating without replacing it."""
    message = f"AsyncGradientWriter: a gradient group write also failed: {error!r}"
    in_flight.add_note(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)

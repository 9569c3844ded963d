"""Background writer: hands groups of records to a store on a single daemon thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dattri_llm.gradient.gradient import Factorized, GradientRecord

if TYPE_CHECKING:
    from dattri_llm.gradient.storage_manager import GradientStorageManager

__all__ = ["AsyncGradientWriter"]

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


class AsyncGradientWriter:
    """Write submitted groups through ``file_manager.save_bulk`` on one daemon thread.

    Groups are written in submission order. Device payloads are copied to CPU
    on the writer thread, after waiting on CUDA events recorded on the
    producer's streams at submit time. At most ``max_pending`` groups are
    pending (submitted, not yet written); `submit` blocks beyond that.

    After a failed write the remaining queued groups are dropped and the error
    is re-raised by the next `submit` / `flush` and by `close` (which clears
    it). While the writer is open, the store must not be used from other
    threads.

    Args:
        file_manager: the `GradientStorageManager` to write into.
        max_pending: bound on pending groups (``< 1`` → `ValueError`).
    """

    def __init__(self, file_manager: GradientStorageManager, max_pending: int = 2) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(
                f"AsyncGradientWriter: max_pending must be an int >= 1, got {max_pending!r}."
            )
        self._file_manager = file_manager
        self._max_pending = max_pending
        self._slots = threading.Semaphore(max_pending)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="dattri-llm-gradient-writer", daemon=True
        )
        self._thread.start()

    @property
    def file_manager(self) -> GradientStorageManager:
        """The store groups are written into."""
        return self._file_manager

    @property
    def max_pending(self) -> int:
        """Maximum number of groups submitted but not yet written."""
        return self._max_pending

    def submit(self, records: Sequence[GradientRecord]) -> None:
        """Enqueue one group (blocks while ``max_pending`` groups are pending).

        An empty list is ignored. Re-raises an earlier write error; after
        `close` → `RuntimeError`.
        """
        if self._closed:
            raise RuntimeError("AsyncGradientWriter.submit: the writer is closed.")
        self._raise_error()
        records = list(records)
        if not records:
            return
        events = _producer_events(records)
        self._slots.acquire()
        self._queue.put((records, events))

    def flush(self) -> None:
        """Wait until every submitted group is written; re-raise a write error."""
        self._queue.join()
        self._raise_error()

    def close(self) -> None:
        """Flush, stop the thread and re-raise (then clear) a pending error; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def __enter__(self) -> AsyncGradientWriter:
        """Return ``self``."""
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """`close` on exit; an exception of the ``with`` body is never swallowed.

        When the body raised, a write error found by `close` is attached to the
        body's exception as a note instead of replacing it.
        """
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as write_error:
            exc.add_note(
                f"AsyncGradientWriter: a gradient group write also failed: {write_error!r}"
            )

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            records, events = item
            try:
                if self._error is None:
                    for event in events:
                        event.synchronize()
                    self._file_manager.save_bulk([_to_cpu(r) for r in records])
            except BaseException as err:  # surfaced to the producer thread
                self._error = err
            finally:
                self._slots.release()
                self._queue.task_done()

"""``OffloadCallback``: stage captured records and write them to a gradient store."""

from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING

from dattri_llm.gradient.async_writer import AsyncGradientWriter
from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.model.container import GradientRecord
from dattri_llm.utils.hashing import occurrence_ids

if TYPE_CHECKING:
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.options import RecordingType

__all__ = ["OffloadCallback"]

RECORDING_TYPES = ("per_sample", "per_batch")


def _identifiers(record: GradientRecord) -> list[str]:
    hashes = record.input_hash
    return [hashes] if isinstance(hashes, str) else list(hashes)


def merge_window(records: list[GradientRecord], step: int) -> GradientRecord:
    """One record for an accumulation window, stamped ``step``.

    Gradients are batch-concatenated in order (unequal token lengths padded),
    identifier lists concatenated and made distinct per occurrence
    (`occurrence_ids`: a repeat across micro-batches gets a ``#k`` suffix),
    ``sample_id_key`` taken from the first.
    """
    gradient = reduce(lambda g1, g2: g1.concatenate(g2, dim="batch"), (r.gradient for r in records))
    identifiers = occurrence_ids([h for r in records for h in _identifiers(r)])
    return GradientRecord(
        step=step,
        input_hash=identifiers,
        gradient=gradient,
        sample_id_key=records[0].sample_id_key,
    )


def split_per_sample(record: GradientRecord) -> list[GradientRecord]:
    """``B`` single-sample records (``input_hash`` a string, ``gradient.slice("batch", i)``)."""
    if isinstance(record.input_hash, str):
        return [record]
    return [
        GradientRecord(
            step=record.step,
            input_hash=identifier,
            gradient=record.gradient.slice("batch", i),
            sample_id_key=record.sample_id_key,
        )
        for i, identifier in enumerate(record.input_hash)
    ]


class OffloadCallback(HookManagerCallback):
    """Write every captured step's record to a `GradientStorageManager`.

    With ``gradient_accumulation_steps = N > 1`` the records of each window of
    ``N`` capture steps are merged into one record (see `merge_window`)
    re-stamped with this callback's optimizer-step counter ``0, 1, 2, …``.
    Records are staged (sliced into single-sample records for
    ``"per_sample"``) and written as one group via ``save_bulk`` once a record
    with a new step arrives while ``offload_interval`` distinct steps are
    already staged (or through an `AsyncGradientWriter` with ``async_write``).
    ``on_context_end`` merges a ragged trailing window, flushes, and drains
    and closes the writer, so the store is complete after the context.
    Attaching it to a `HookManager` declares the manager's projection
    (``config.projection_kwargs`` and ``config.projector``) to the store.

    Args:
        offload_interval: distinct steps per written group (``>= 1``).
        file_manager: the store; its accumulation convention is declared here
            (a conflicting store → `ValueError`).
        recording_type: ``"per_batch"`` (one record per step) or ``"per_sample"``.
        gradient_accumulation_steps: micro-batches per optimizer step (``>= 1``).
        async_write: write on a background thread.
        max_pending_writes: bound on groups queued for the background thread.
    """

    def __init__(
        self,
        offload_interval: int,
        file_manager: GradientStorageManager,
        recording_type: RecordingType = "per_batch",
        gradient_accumulation_steps: int = 1,
        async_write: bool = False,
        max_pending_writes: int = 2,
    ) -> None:
        if (
            isinstance(offload_interval, bool)
            or not isinstance(offload_interval, int)
            or offload_interval < 1
        ):
            raise ValueError(
                f"OffloadCallback: offload_interval must be an int >= 1, got {offload_interval!r}."
            )
        if recording_type not in RECORDING_TYPES:
            raise ValueError(
                f"OffloadCallback: recording_type must be one of {RECORDING_TYPES}, got "
                f"{recording_type!r}."
            )
        if (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1
        ):
            raise ValueError(
                f"OffloadCallback: gradient_accumulation_steps must be an int >= 1, got "
                f"{gradient_accumulation_steps!r}."
            )
        if (
            isinstance(max_pending_writes, bool)
            or not isinstance(max_pending_writes, int)
            or max_pending_writes < 1
        ):
            raise ValueError(
                f"OffloadCallback: max_pending_writes must be an int >= 1, got "
                f"{max_pending_writes!r}."
            )
        file_manager.declare_gradient_accumulation_steps(gradient_accumulation_steps)
        self.file_manager = file_manager
        self.offload_interval = offload_interval
        self.recording_type = recording_type
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.async_write = async_write
        self.max_pending_writes = max_pending_writes
        self._window: list[GradientRecord] = []
        self._optimizer_step = 0
        self._staged: list[GradientRecord] = []
        self._staged_steps: set[int] = set()
        self._writer: AsyncGradientWriter | None = None

    @property
    def staged(self) -> list[GradientRecord]:
        """Copy of the list of records staged but not yet written."""
        return list(self._staged)

    def on_register(self, hook_manager: HookManager) -> None:
        """Declare the manager's capture projection to the store (conflict → `ValueError`)."""
        config = hook_manager.config
        self.file_manager.declare_projection(config.projection_kwargs, config.projector)

    def on_step_end(self, record: GradientRecord) -> None:
        """Merge accumulation windows, then stage the record (flushing first if due)."""
        if self.gradient_accumulation_steps == 1:
            self._stage(record)
            return
        self._window.append(record)
        if len(self._window) == self.gradient_accumulation_steps:
            self._close_window()

    def on_context_end(self) -> None:
        """Merge a ragged trailing window, write everything staged, drain the writer."""
        if self._window:
            self._close_window()
        self._flush()
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def _close_window(self) -> None:
        merged = merge_window(self._window, self._optimizer_step)
        self._window = []
        self._optimizer_step += 1
        self._stage(merged)

    def _stage(self, record: GradientRecord) -> None:
        if record.step not in self._staged_steps and (
            len(self._staged_steps) >= self.offload_interval
        ):
            self._flush()
        if self.recording_type == "per_sample":
            self._staged.extend(split_per_sample(record))
        else:
            self._staged.append(record)
        self._staged_steps.add(record.step)

    def _flush(self) -> None:
        if not self._staged:
            return
        records, self._staged, self._staged_steps = self._staged, [], set()
        if not self.async_write:
            self.file_manager.save_bulk(records)
            return
        if self._writer is None:
            self._writer = AsyncGradientWriter(
                self.file_manager, max_pending=self.max_pending_writes
            )
        self._writer.submit(records)

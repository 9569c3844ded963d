"""``CaptureCallback``: keep the most recent capture record in memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dattri_llm.gradient.callbacks.base import HookManagerCallback

if TYPE_CHECKING:
    from dattri_llm.gradient.model.container import GradientRecord


class CaptureCallback(HookManagerCallback):
    """Store the latest :class:`GradientRecord` in ``self.record`` (``None`` until a step ends)."""

    def __init__(self) -> None:
        self.record: GradientRecord | None = None

    def on_step_end(self, record: GradientRecord) -> None:
        """Replace ``self.record`` with ``record``."""
        self.record = record

"""``AttributionArguments``: device, precision, batching and training settings.

Field names and defaults mirror the Hugging Face ``TrainingArguments`` subset an
attribution run needs, so the dataclass works with ``HfArgumentParser``. The
fields, their checks and the device / rank properties are the gradient tier's
`TrainingSettings` (:mod:`dattri_llm.gradient.stream.settings`); this class adds
the attribution-facing properties (effective batch sizes, output path).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dattri_llm.gradient.stream.settings import FSDP_OPTIONS as FSDP_OPTIONS  # its old home
from dattri_llm.gradient.stream.settings import TrainingSettings


@dataclass
class AttributionArguments(TrainingSettings):
    """Settings of an attribution run (HfArgumentParser-compatible)."""

    @property
    def train_batch_size(self) -> int:
        """``per_device_train_batch_size × max(1, n_gpu)``."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """``per_device_eval_batch_size × max(1, n_gpu)``."""
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @property
    def output_path(self) -> Path:
        """``output_dir`` as a ``Path``."""
        return Path(self.output_dir)

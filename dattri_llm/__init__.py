"""dattri_llm: training data attribution at LLM scale.

Capture per-sample gradients from an unmodified training loop
(``with HookManager(model).collect(): trainer.train()``), store them, and score
training samples against queries with exact, FLOP-routed inner products.

Importing this package needs only ``torch``: the attribution layer and the
live streamer are resolved lazily on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from dattri_llm.gradient.callbacks import (
    CaptureCallback,
    DataSelectionCallback,
    HookManagerCallback,
    KroneckerCovarianceCallback,
    OffloadCallback,
    OptimizerStateCallback,
    ParameterSnapshotCallback,
    TrainingDynamicsCallback,
)
from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.hooks import (
    REGISTER_ALL,
    HookManager,
    HookManagerConfig,
    default_hook_assignment,
)
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.hashing import hash_batch, hash_sample

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "GradientStreamer": "dattri_llm.gradient.streaming",
    "DiskGradientSource": "dattri_llm.gradient.streaming",
    "ReplayGradientSource": "dattri_llm.gradient.streaming",
    "AttributionArguments": "dattri_llm.attribution.arguments",
    "AttributionTask": "dattri_llm.task",
    "AttributionScore": "dattri_llm.attribution.score",
    "BaseAttributor": "dattri_llm.attribution",
    "BaseInnerProductAttributor": "dattri_llm.attribution",
    "TracInAttributor": "dattri_llm.attribution",
    "KroneckerAttributor": "dattri_llm.attribution",
    "KFACAttributor": "dattri_llm.attribution",
    "EKFACAttributor": "dattri_llm.attribution",
    "LoRIFAttributor": "dattri_llm.attribution",
    "TRAKAttributor": "dattri_llm.attribution",
    "TrackStarAttributor": "dattri_llm.attribution",
    "margin_loss": "dattri_llm.task",
    "margin_and_weights": "dattri_llm.task",
    "DataInfAttributor": "dattri_llm.attribution",
    "InfluenceFunctionAttributor": "dattri_llm.attribution",
    "LESSAttributor": "dattri_llm.attribution",
    "TrajectoryAttributor": "dattri_llm.attribution",
    "DVEmbAttributor": "dattri_llm.attribution",
    "AdamWInfluenceAttributor": "dattri_llm.attribution",
    "TrajectoryTracInAttributor": "dattri_llm.attribution",
    "StrideAttributor": "dattri_llm.attribution",
    "StrideConfig": "dattri_llm.attribution",
    "MetagradientAttributor": "dattri_llm.attribution",
    "SourceAttributor": "dattri_llm.attribution",
}

__all__ = [
    "REGISTER_ALL",
    "CaptureCallback",
    "DataSelectionCallback",
    "Factorized",
    "Gradient",
    "GradientRecord",
    "GradientStorageManager",
    "HookManager",
    "HookManagerCallback",
    "HookManagerConfig",
    "KroneckerCovarianceCallback",
    "OffloadCallback",
    "OptimizerStateCallback",
    "ParameterSnapshotCallback",
    "TrainingDynamicsCallback",
    "TrajectorySnapshots",
    "default_hook_assignment",
    "hash_batch",
    "hash_sample",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dattri_llm' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""Capture callbacks (``HookManagerCallback`` and the shipped implementations)."""

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.callbacks.data_selection_callback import DataSelectionCallback
from dattri_llm.gradient.callbacks.kronecker_covariance_callback import KroneckerCovarianceCallback
from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
from dattri_llm.gradient.callbacks.optimizer_state_callback import OptimizerStateCallback
from dattri_llm.gradient.callbacks.parameter_snapshot_callback import ParameterSnapshotCallback
from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback

__all__ = [
    "CaptureCallback",
    "DataSelectionCallback",
    "HookManagerCallback",
    "KroneckerCovarianceCallback",
    "OffloadCallback",
    "OptimizerStateCallback",
    "ParameterSnapshotCallback",
    "TrainingDynamicsCallback",
]

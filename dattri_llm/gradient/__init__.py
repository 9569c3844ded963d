"""The gradient tier: data model, ops, capture hooks and callbacks, store, sources.

Its parts have folders: ``model/`` (the data model), ``ops/`` (exact kernels),
``hooks/`` and ``callbacks/`` (capture), ``store/`` (the store's parts, behind
``storage_manager.py``), ``state/`` (optimizer state, recorded trajectories) and
``stream/`` (gradient sources). ``Gradient`` and ``Factorized`` are exported from
:mod:`dattri_llm` and :mod:`dattri_llm.gradient.gradient`; the gradient sources
(``GradientStreamer``, ``DiskGradientSource``) from
:mod:`dattri_llm.gradient.streaming`.
"""

from dattri_llm.gradient import ops
from dattri_llm.gradient.async_writer import AsyncGradientWriter
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
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.hooks import (
    REGISTER_ALL,
    HookManager,
    HookManagerConfig,
    default_hook_assignment,
    register_linear_io_hooks,
    register_linear_param_hooks,
    register_param_grad_hooks,
    remove_hooks,
)
from dattri_llm.gradient.ops import (
    FisherAccumulator,
    KroneckerAccumulator,
    LayerFisherAccumulator,
    LayerKroneckerAccumulator,
    canonical_class_name,
    dot,
    fim,
    grad_norm_sq,
    kfac,
    materialize,
    pairwise_dot,
)
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.gradient.storage_manager import GradientStorageManager

__all__ = [
    "REGISTER_ALL",
    "AsyncGradientWriter",
    "CaptureCallback",
    "DataSelectionCallback",
    "FisherAccumulator",
    "GradientRecord",
    "GradientStorageManager",
    "HookManager",
    "HookManagerCallback",
    "HookManagerConfig",
    "KroneckerAccumulator",
    "KroneckerCovarianceCallback",
    "LayerFisherAccumulator",
    "LayerKroneckerAccumulator",
    "OffloadCallback",
    "OptimizerStateCallback",
    "ParameterSnapshotCallback",
    "TrainingDynamicsCallback",
    "TrajectorySnapshots",
    "canonical_class_name",
    "default_hook_assignment",
    "dot",
    "fim",
    "grad_norm_sq",
    "kfac",
    "materialize",
    "ops",
    "pairwise_dot",
    "register_linear_io_hooks",
    "register_linear_param_hooks",
    "register_param_grad_hooks",
    "remove_hooks",
]

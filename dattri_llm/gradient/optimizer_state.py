"""Read a training optimizer's state in the coordinates of captured gradients (public path).

Re-exports; the code lives in :mod:`dattri_llm.gradient.state`:
``optimizer_snapshot.py`` (:class:`OptimizerSnapshot`, :class:`LayerOptimizerState`),
``layout.py`` (the materialize layout of parameter-shaped state), ``sharding.py``
(DDP / FSDP1 / FSDP2 reads), ``preconditioner.py`` (:class:`GradientPreconditioner`)
and ``names.py`` (:func:`optimizer_type`, :func:`hf_trainer_param_names`,
:func:`optimizer_from_state_dict`).
"""

from dattri_llm.gradient.state.names import (
    hf_trainer_param_names,
    optimizer_from_state_dict,
    optimizer_type,
)
from dattri_llm.gradient.state.optimizer_snapshot import LayerOptimizerState, OptimizerSnapshot

# Not in __all__: the optimizer argument type, which hooks/manager.py imports from here.
from dattri_llm.gradient.state.optimizer_snapshot import OptimizerLike as OptimizerLike
from dattri_llm.gradient.state.preconditioner import GradientPreconditioner

__all__ = [
    "GradientPreconditioner",
    "LayerOptimizerState",
    "OptimizerSnapshot",
    "hf_trainer_param_names",
    "optimizer_from_state_dict",
    "optimizer_type",
]

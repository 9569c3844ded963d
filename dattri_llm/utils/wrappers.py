"""Model wrappers: the wrapped module of DataParallel / DDP / FSDP, and FSDP detection.

Neither helper imports ``torch.distributed.fsdp``: a model wrapped in FSDP has
already imported it, so it is looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["is_fsdp", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """``model.module`` for DataParallel / DDP / FSDP wrappers, else ``model``."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is a ``FullyShardedDataParallel`` wrapper (never imports FSDP)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel)

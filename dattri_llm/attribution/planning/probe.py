"""Measured capture speed: seconds per record of real forward+backward capture.

The plan's time estimate scales this by the records the run captures; the
measurement runs on the hardware the run will use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dattri_llm.attribution.planning.layers import default_plan_config
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager

__all__ = ["measure_capture_seconds"]


def _batch_size(batch: object) -> int:
    """Records in ``batch``: the leading size of its first tensor (dict values, items)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, Mapping):
        for item in items:
            if isinstance(item, torch.Tensor) and item.ndim:
                return int(item.shape[0])
    raise TypeError(
        f"measure_capture_seconds: cannot tell the batch size of a {type(batch).__name__}; pass "
        "a tensor, or a dict / list / tuple whose first tensor is batch-first."
    )


def _sync(model: nn.Module) -> None:
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        torch.cuda.synchronize(param.device)


def measure_capture_seconds(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    hook_config: HookManagerConfig | None = None,
    repeats: int = 2,
) -> float:
    """Seconds per record of one captured forward+backward of ``batch`` (the fastest repeat).

    Args:
        model: the model, on the device the run will use.
        batch: one batch; its size is the leading size of its first tensor.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        hook_config: the run's hook config (``None``: ``linear_io=REGISTER_ALL``).
        repeats: timed captures after one untimed warm-up (``>= 1``).

    Returns:
        The fastest repeat's seconds divided by the batch size. The captured
        record is dropped; the parameters' ``.grad`` are cleared after.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"measure_capture_seconds: repeats must be an int >= 1, got {repeats!r}.")
    records = _batch_size(batch)
    manager = HookManager(model, default_plan_config() if hook_config is None else hook_config)
    times: list[float] = []
    try:
        for attempt in range(repeats + 1):
            _sync(model)
            start = time.perf_counter()
            with manager.collect():
                loss_fn(model, batch).backward()
                manager.get_gradient()
            _sync(model)
            if attempt:
                times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    finally:
        manager.remove()
    return min(times) / records

"""The index of the coming optimizer update: the check the optimizer maps and kernels share.

``ops.optimizer.precondition`` and the AdamW-influence kernels
(``ops/adamw_influence.py``) take ``step``, the index ``t >= 1`` of the update
they model (the optimizer's ``state["step"] + 1``).
"""

from __future__ import annotations

import torch


def check_step(step: int | float | torch.Tensor, fn: str) -> float:
    """``step`` as a float; ``ValueError`` unless it is at least 1."""
    value = float(step.item() if isinstance(step, torch.Tensor) else step)
    if not value >= 1:
        raise ValueError(
            f"{fn}: step must be the index of the coming optimizer update (>= 1), got {step!r}; "
            "pass the optimizer's state['step'] + 1."
        )
    return value

"""Process-wide compute-dtype policy for the gradient kernels.

The default policy ``"auto"`` computes in the promoted dtype of the floating
operands (integer operands are ignored; all-integer operands give float32).
An explicit dtype forces that dtype everywhere. ``minimum`` arguments raise
the floor (used by covariance, eigen and inverse kernels, which always run at
least in float32).

Integer tensors are embedding token ids: kernels pass them through `align`,
which never casts them, so a forced 16-bit policy cannot round ids above 256.
`as_float` (integers too) is only for integers used as feature values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

Policy = Literal["auto"] | torch.dtype

_POLICY_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_ACCEPTED_DTYPES = frozenset(_POLICY_NAMES.values())

_policy: Policy = "auto"


def _parse_policy(policy: str | torch.dtype) -> Policy:
    """Validate ``policy`` and return ``"auto"`` or a floating ``torch.dtype``."""
    if isinstance(policy, torch.dtype):
        if policy in _ACCEPTED_DTYPES:
            return policy
    elif isinstance(policy, str):
        if policy == "auto":
            return "auto"
        if policy in _POLICY_NAMES:
            return _POLICY_NAMES[policy]
    valid = ", ".join(repr(name) for name in ("auto", *_POLICY_NAMES))
    raise ValueError(
        f"Invalid compute dtype policy {policy!r}; it must be one of {valid} "
        "or torch.float32/float64/bfloat16/float16."
    )


def set_compute_dtype(policy: str | torch.dtype) -> Policy:
    """Set the process-wide compute dtype policy and return the previous one.

    Accepts ``"auto"``, ``"float32"``/``"fp32"``, ``"float64"``,
    ``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"`` or the matching
    ``torch.dtype``; anything else raises ``ValueError``.
    """
    global _policy
    new = _parse_policy(policy)
    previous = _policy
    _policy = new
    return previous


def get_compute_dtype() -> Policy:
    """Current policy: ``"auto"`` or the forced ``torch.dtype``."""
    return _policy


@contextmanager
def compute_dtype(policy: str | torch.dtype) -> Iterator[None]:
    """Context manager that sets ``policy`` and restores the previous one on exit."""
    previous = set_compute_dtype(policy)
    try:
        yield
    finally:
        set_compute_dtype(previous)


def resolve(*tensors: torch.Tensor | None, minimum: torch.dtype | None = None) -> torch.dtype:
    """Dtype the kernels compute in for ``tensors`` under the current policy.

    ``"auto"``: promoted dtype of the floating tensors (``None`` and integer
    tensors ignored; none floating → float32). ``minimum`` raises the floor
    (``torch.promote_types(result, minimum)``).
    """
    if _policy == "auto":
        floating = [t.dtype for t in tensors if t is not None and t.is_floating_point()]
        dtype = torch.float32
        if floating:
            dtype = floating[0]
            for other in floating[1:]:
                dtype = torch.promote_types(dtype, other)
    else:
        dtype = _policy
    if minimum is not None:
        dtype = torch.promote_types(dtype, minimum)
    return dtype


def as_float(
    *tensors: torch.Tensor | None, minimum: torch.dtype | None = None
) -> tuple[torch.Tensor | None, ...]:
    """Cast every tensor (integers too) to :func:`resolve`'s dtype; ``None`` passes through."""
    dtype = resolve(*tensors, minimum=minimum)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def align(
    *tensors: torch.Tensor | None, minimum: torch.dtype | None = None
) -> tuple[torch.Tensor | None, ...]:
    """Cast the floating tensors to :func:`resolve`'s dtype; integers and ``None`` untouched."""
    dtype = resolve(*tensors, minimum=minimum)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)

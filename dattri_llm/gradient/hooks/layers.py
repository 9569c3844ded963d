"""Which modules the hook families act on: their capability and the HF ``Conv1D`` lookup.

Hugging Face ``Conv1D`` is recognised lazily from ``sys.modules`` (a model
that contains one has already imported it), so importing this module never
imports ``transformers``. Also the default capture gate the families share.
"""

from __future__ import annotations

import importlib
import sys

from torch import nn

__all__ = [
    "always",
    "hf_conv1d",
    "is_invasive_capable",
    "is_linear_io_capable",
    "owns_trainable_params",
]

_HF_CONV1D_MODULE = "transformers.pytorch_utils"


def hf_conv1d() -> type | None:
    """HF ``Conv1D`` if ``transformers`` is already imported, else ``None`` (never imports it)."""
    module = sys.modules.get(_HF_CONV1D_MODULE)
    if module is None and "transformers" in sys.modules:
        try:
            module = importlib.import_module(_HF_CONV1D_MODULE)
        except ImportError:
            return None
    return getattr(module, "Conv1D", None)


# --------------------------------------------------------------------------- capability


def _torch_capable_classes() -> tuple[type, ...]:
    classes: list[type] = [
        nn.Embedding,
        nn.EmbeddingBag,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.Linear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
    ]
    if hasattr(nn, "RMSNorm"):
        classes.append(nn.RMSNorm)
    return tuple(classes)


_TORCH_CAPABLE = _torch_capable_classes()


def is_linear_io_capable(module: nn.Module) -> bool:
    """Whether ``module``'s type is one whose gradient factorizes for ``linear_io`` capture.

    Decided by ``isinstance`` against the capable classes (less
    ``nn.Bilinear``, whose gradient needs both inputs), never by name. The one
    test every hook-assignment path uses.
    """
    if isinstance(module, _TORCH_CAPABLE):
        return True
    conv1d = hf_conv1d()
    return conv1d is not None and isinstance(module, conv1d)


def is_invasive_capable(module: nn.Module) -> bool:
    """Whether ``module`` can take the invasive forward (exactly ``nn.Linear`` instances)."""
    return isinstance(module, nn.Linear)


def owns_trainable_params(module: nn.Module) -> bool:
    """Whether ``module`` directly (``recurse=False``) owns a parameter with ``requires_grad``."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


def always() -> bool:
    """The default capture gate: buffer every capture."""
    return True

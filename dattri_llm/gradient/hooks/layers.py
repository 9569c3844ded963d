"""Which modules the hook families act on: capability, canonical type and the unwrapped root.

Hugging Face ``Conv1D`` is recognised lazily from ``sys.modules`` (a model
that contains one has already imported it), so importing this module never
imports ``transformers``. Also the default capture gate the families share.
"""

from __future__ import annotations

import importlib
import sys

from torch import nn

from dattri_llm.gradient.ops.types import ALL_LAYER_TYPES, canonical_class_name

__all__ = [
    "always",
    "detect_layer_type",
    "hf_conv1d",
    "is_invasive_capable",
    "is_linear_io_capable",
    "owns_trainable_params",
    "unwrap_model",
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

    Decided by ``isinstance`` against the capable classes (``capture.md`` §1, less
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


def unwrap_model(model: nn.Module) -> nn.Module:
    """``model.module`` for DataParallel / DDP / FSDP wrappers, else ``model``."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def detect_layer_type(module: nn.Module) -> str:
    """Canonical type of ``module``: its own class name, or the nearest supported base class."""
    own = canonical_class_name(module)
    if own in ALL_LAYER_TYPES:
        return own
    for cls in type(module).__mro__[1:]:
        name = (
            f"nn.{cls.__name__}"
            if cls.__module__.startswith("torch.nn")
            else (f"{cls.__module__}.{cls.__name__}")
        )
        if name in ALL_LAYER_TYPES:
            return name
    return own


def always() -> bool:
    """The default capture gate: buffer every capture."""
    return True

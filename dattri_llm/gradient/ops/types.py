"""Canonical layer-type strings and predicates over them.

A layer type is the canonical class name of a module (``"nn.Linear"``,
``"transformers.pytorch_utils.Conv1D"``); see :func:`canonical_class_name`.
"""

from __future__ import annotations

from torch import nn

LINEAR_TYPES: frozenset[str] = frozenset(
    {
        "nn.Linear",
        "nn.Bilinear",
        "nn.NonDynamicallyQuantizableLinear",
        "transformers.pytorch_utils.Conv1D",
    }
)
CONV_TYPES: frozenset[str] = frozenset({"nn.Conv1d", "nn.Conv2d", "nn.Conv3d"})
CONV_TRANSPOSE_TYPES: frozenset[str] = frozenset(
    {"nn.ConvTranspose1d", "nn.ConvTranspose2d", "nn.ConvTranspose3d"}
)
NORM_TYPES: frozenset[str] = frozenset(
    {
        "nn.LayerNorm",
        "nn.RMSNorm",
        "nn.GroupNorm",
        "nn.InstanceNorm1d",
        "nn.InstanceNorm2d",
        "nn.InstanceNorm3d",
    }
)
EMBEDDING_TYPES: frozenset[str] = frozenset({"nn.Embedding", "nn.EmbeddingBag"})
ALL_LAYER_TYPES: frozenset[str] = (
    LINEAR_TYPES | CONV_TYPES | CONV_TRANSPOSE_TYPES | NORM_TYPES | EMBEDDING_TYPES
)
PARAM_GRAD_TYPES: str = "param_grad_layers"


def _short_alias(layer_type: str) -> str:
    """Lower-case class name of a ``torch.nn`` type: ``"nn.Conv2d" -> "conv2d"``."""
    return layer_type.removeprefix("nn.").lower()


# Short lower-case aliases of the torch.nn types (``"linear"``, ``"conv2d"``,
# ``"layernorm"``, ...), derived from the canonical names. Non-torch types (HF
# ``Conv1D``) have none: ``"conv1d"`` names ``nn.Conv1d``.
LAYER_TYPE_ALIASES: dict[str, str] = {
    _short_alias(name): name for name in sorted(ALL_LAYER_TYPES) if name.startswith("nn.")
}


def resolve_layer_type(layer_type: str, where: str) -> str:
    """Canonical layer type of ``layer_type``: a canonical name, or its short alias.

    Args:
        layer_type: canonical type (``"nn.Linear"``) or short alias (``"linear"``).
        where: caller named in the error message (e.g. ``"LayerKroneckerAccumulator.update"``).

    Raises:
        ValueError: ``layer_type`` is neither; the message lists the accepted names.
    """
    if layer_type in ALL_LAYER_TYPES:
        return layer_type
    canonical = LAYER_TYPE_ALIASES.get(layer_type)
    if canonical is not None:
        return canonical
    raise ValueError(
        f"{where}: layer_type must be one of {sorted(ALL_LAYER_TYPES)} or their short aliases "
        f"{sorted(LAYER_TYPE_ALIASES)}, got {layer_type!r}."
    )


def is_linear(layer_type: str) -> bool:
    """Whether ``layer_type`` is in :data:`LINEAR_TYPES` (incl. HF ``Conv1D``)."""
    return layer_type in LINEAR_TYPES


def is_conv(layer_type: str) -> bool:
    """Whether ``layer_type`` is an ``nn.Conv1d/2d/3d``."""
    return layer_type in CONV_TYPES


def is_conv_transpose(layer_type: str) -> bool:
    """Whether ``layer_type`` is an ``nn.ConvTranspose1d/2d/3d``."""
    return layer_type in CONV_TRANSPOSE_TYPES


def is_norm(layer_type: str) -> bool:
    """Whether ``layer_type`` is a normalization layer (:data:`NORM_TYPES`)."""
    return layer_type in NORM_TYPES


def is_embedding(layer_type: str) -> bool:
    """Whether ``layer_type`` is ``nn.Embedding`` or ``nn.EmbeddingBag``."""
    return layer_type in EMBEDDING_TYPES


def is_kfac_eligible(layer_type: str) -> bool:
    """Whether Kronecker factors exist for ``layer_type`` (linear, conv, conv-transpose)."""
    return is_linear(layer_type) or is_conv(layer_type) or is_conv_transpose(layer_type)


def canonical_class_name(module: nn.Module) -> str:
    """Canonical layer-type string of ``module``.

    ``"nn.<Name>"`` when the class is defined under ``torch.nn``, else
    ``"<defining module>.<Name>"`` (e.g. ``"transformers.pytorch_utils.Conv1D"``).
    """
    cls = type(module)
    if cls.__module__.startswith("torch.nn"):
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"


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

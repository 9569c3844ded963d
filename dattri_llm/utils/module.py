"""``module_kwargs`` builders for layers declared by type (``HookManagerConfig``).

Each builder is keyword-only and returns the hyperparameter dict that
``ops.extract_module_kwargs`` would produce for a module of that type. Pair it
with ``layer_types={name: "<type>"}`` in ``HookManagerConfig(module_kwargs=...)``.
Convolution geometry accepts an int or a per-dimension sequence of the right
rank and is stored as tuples; conv builders also take ``groups`` (default 1).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "bilinear_module_kwargs",
    "conv1d_module_kwargs",
    "conv2d_module_kwargs",
    "conv3d_module_kwargs",
    "conv_transpose1d_module_kwargs",
    "conv_transpose2d_module_kwargs",
    "conv_transpose3d_module_kwargs",
    "embedding_bag_module_kwargs",
    "embedding_module_kwargs",
    "group_norm_module_kwargs",
    "instance_norm1d_module_kwargs",
    "instance_norm2d_module_kwargs",
    "instance_norm3d_module_kwargs",
    "layer_norm_module_kwargs",
    "linear_module_kwargs",
    "rms_norm_module_kwargs",
]

_EMBEDDING_BAG_MODES = ("sum", "mean")
_CONV_PADDING_MODES = ("same", "valid")


def _require_bool(builder: str, name: str, value: object) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{builder}: {name} must be a bool, got {value!r}.")
    return value


def _require_positive_int(builder: str, name: str, value: object) -> int:
    """``value`` if it is a positive ``int``, else ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{builder}: {name} must be an int, got {value!r}.")
    if value < 1:
        raise ValueError(f"{builder}: {name} must be >= 1, got {value}.")
    return value


def _require_eps(builder: str, value: object, allow_none: bool = False) -> float | None:
    """``value`` as a non-negative float (or ``None`` when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{builder}: eps must be a float, got {value!r}.")
    if value < 0:
        raise ValueError(f"{builder}: eps must be >= 0, got {value}.")
    return float(value)


def _per_dim(
    builder: str, name: str, value: int | Sequence[int], rank: int, minimum: int
) -> tuple[int, ...]:
    """``value`` as a ``rank``-tuple of ints ``>= minimum`` (an int is repeated)."""
    if isinstance(value, int) and not isinstance(value, bool):
        values: tuple[object, ...] = (value,) * rank
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = tuple(value)
        if len(values) != rank:
            raise ValueError(
                f"{builder}: {name} {value!r} has {len(values)} entries; a {rank}-D layer needs "
                f"an int or {rank} per-dimension values."
            )
    else:
        raise TypeError(f"{builder}: {name} must be an int or a sequence of ints, got {value!r}.")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{builder}: {name} entries must be ints >= {minimum}, got {value!r}.")
    return values  # type: ignore[return-value]


def _conv_padding(
    builder: str, padding: int | Sequence[int] | str, rank: int, allow_mode: bool
) -> tuple[int, ...] | str:
    """Conv padding as a ``rank``-tuple, or the string mode ``"same"``/``"valid"`` (conv only)."""
    if isinstance(padding, str):
        if allow_mode and padding in _CONV_PADDING_MODES:
            return padding
        allowed = f"an int, {rank} ints" + (
            f" or one of {_CONV_PADDING_MODES}" if allow_mode else ""
        )
        raise ValueError(f"{builder}: padding {padding!r} is invalid; use {allowed}.")
    return _per_dim(builder, "padding", padding, rank, minimum=0)


def _conv_kwargs(
    builder: str,
    rank: int,
    *,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int] | str,
    dilation: int | Sequence[int],
    has_bias: bool,
    groups: int,
    transpose: bool,
) -> dict:
    """Shared body of the conv / conv-transpose builders."""
    return {
        "has_bias": _require_bool(builder, "has_bias", has_bias),
        "kernel_size": _per_dim(builder, "kernel_size", kernel_size, rank, minimum=1),
        "stride": _per_dim(builder, "stride", stride, rank, minimum=1),
        "padding": _conv_padding(builder, padding, rank, allow_mode=not transpose),
        "dilation": _per_dim(builder, "dilation", dilation, rank, minimum=1),
        "groups": _require_positive_int(builder, "groups", groups),
    }


def linear_module_kwargs(*, has_bias: bool) -> dict:
    """``module_kwargs`` of ``nn.Linear``, ``NonDynamicallyQuantizableLinear`` and HF ``Conv1D``."""
    return {"has_bias": _require_bool("linear_module_kwargs", "has_bias", has_bias)}


def bilinear_module_kwargs(*, has_bias: bool) -> dict:
    """``module_kwargs`` of ``nn.Bilinear``."""
    return {"has_bias": _require_bool("bilinear_module_kwargs", "has_bias", has_bias)}


def _canonical_padding_idx(
    builder: str, num_embeddings: int, padding_idx: int | None
) -> int | None:
    """``padding_idx`` as a non-negative index (negative counts from the end), or ``None``."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"{builder}: padding_idx must be an int or None, got {padding_idx!r}.")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"{builder}: padding_idx {padding_idx} is outside [-{num_embeddings}, "
            f"{num_embeddings}) for num_embeddings={num_embeddings}."
        )
    return padding_idx % num_embeddings


def embedding_module_kwargs(*, num_embeddings: int, padding_idx: int | None) -> dict:
    """``module_kwargs`` of ``nn.Embedding`` (``padding_idx`` canonicalised to ``>= 0``)."""
    builder = "embedding_module_kwargs"
    num_embeddings = _require_positive_int(builder, "num_embeddings", num_embeddings)
    return {
        "has_bias": False,
        "num_embeddings": num_embeddings,
        "padding_idx": _canonical_padding_idx(builder, num_embeddings, padding_idx),
    }


def embedding_bag_module_kwargs(*, num_embeddings: int, mode: str, padding_idx: int | None) -> dict:
    """``module_kwargs`` of ``nn.EmbeddingBag``; ``mode`` must be ``"sum"`` or ``"mean"``."""
    builder = "embedding_bag_module_kwargs"
    if mode not in _EMBEDDING_BAG_MODES:
        raise ValueError(
            f"{builder}: mode {mode!r} is not supported; use one of {_EMBEDDING_BAG_MODES} "
            "('max' has no factorized gradient)."
        )
    num_embeddings = _require_positive_int(builder, "num_embeddings", num_embeddings)
    return {
        "has_bias": False,
        "num_embeddings": num_embeddings,
        "mode": mode,
        "padding_idx": _canonical_padding_idx(builder, num_embeddings, padding_idx),
    }


def conv1d_module_kwargs(
    *,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int] | str,
    dilation: int | Sequence[int],
    has_bias: bool,
    groups: int = 1,
) -> dict:
    """``module_kwargs`` of ``nn.Conv1d`` (``padding`` may be ``"same"``/``"valid"``)."""
    return _conv_kwargs(
        "conv1d_module_kwargs",
        1,
        kernel_size=kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        has_bias=has_bias,
        groups=groups,
        transpose=False,
    )


def conv2d_module_kwargs(
    *,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int] | str,
    dilation: int | Sequence[int],
    has_bias: bool,
    groups: int = 1,
) -> dict:
    """``module_kwargs`` of ``nn.Conv2d`` (``padding`` may be ``"same"``/``"valid"``)."""
    return _conv_kwargs(
        "conv2d_module_kwargs",
        2,
        kernel_size=kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        has_bias=has_bias,
        groups=groups,
        transpose=False,
    )


def conv3d_module_kwargs(
    *,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int] | str,
    dilation: int | Sequence[int],
    has_bias: bool,
    groups: int = 1,
) -> dict:
    """``module_kwargs`` of ``nn.Conv3d`` (``padding`` may be ``"same"``/``"valid"``)."""
    return _conv_kwargs(
        "conv3d_module_kwargs",
        3,
        kernel_size=kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        has_bias=has_bias,
        groups=groups,
        transpose=False,
    )


def conv_transpose1d_module_kwargs(
    *,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    has_bias: bool,
    groups: int = 1,
) -> dict:
    """``module_kwargs`` of ``nn.ConvTranspose1d``."""
    return _conv_kwargs(
        "conv_transpose1d_module_kwargs",
        1,
        kernel_size=kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        has_bias=has_bias,
        groups=groups,
        transpose=True,
    )


def conv_transpose2d_module_kwargs(
    *,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    has_bias: bool,
    groups: int = 1,
) -> dict:
    """``module_kwargs`` of ``nn.ConvTranspose2d``."""
    return _conv_kwargs(
        "conv_transpose2d_module_kwargs",
        2,
        kernel_size=kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        has_bias=has_bias,
        groups=groups,
        transpose=True,
    )


def conv_transpose3d_module_kwargs(
    *,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    has_bias: bool,
    groups: int = 1,
) -> dict:
    """``module_kwargs`` of ``nn.ConvTranspose3d``."""
    return _conv_kwargs(
        "conv_transpose3d_module_kwargs",
        3,
        kernel_size=kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        has_bias=has_bias,
        groups=groups,
        transpose=True,
    )


def _normalized_shape(builder: str, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    """``normalized_shape`` as a non-empty tuple of positive ints."""
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        shape: tuple[object, ...] = (normalized_shape,)
    elif isinstance(normalized_shape, Sequence) and not isinstance(normalized_shape, str):
        shape = tuple(normalized_shape)
    else:
        raise TypeError(
            f"{builder}: normalized_shape must be an int or a sequence of ints, got "
            f"{normalized_shape!r}."
        )
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(
            f"{builder}: normalized_shape must hold one or more positive ints, got "
            f"{normalized_shape!r}."
        )
    return shape  # type: ignore[return-value]


def layer_norm_module_kwargs(
    *, normalized_shape: int | Sequence[int], eps: float, has_bias: bool
) -> dict:
    """``module_kwargs`` of ``nn.LayerNorm``."""
    builder = "layer_norm_module_kwargs"
    return {
        "has_bias": _require_bool(builder, "has_bias", has_bias),
        "normalized_shape": _normalized_shape(builder, normalized_shape),
        "eps": _require_eps(builder, eps),
    }


def rms_norm_module_kwargs(*, normalized_shape: int | Sequence[int], eps: float | None) -> dict:
    """``module_kwargs`` of ``nn.RMSNorm`` (``eps=None`` = the dtype's machine epsilon)."""
    builder = "rms_norm_module_kwargs"
    return {
        "has_bias": False,
        "normalized_shape": _normalized_shape(builder, normalized_shape),
        "eps": _require_eps(builder, eps, allow_none=True),
    }


def group_norm_module_kwargs(
    *, num_groups: int, num_channels: int, eps: float, has_bias: bool
) -> dict:
    """``module_kwargs`` of ``nn.GroupNorm`` (``num_channels`` divisible by ``num_groups``)."""
    builder = "group_norm_module_kwargs"
    num_groups = _require_positive_int(builder, "num_groups", num_groups)
    num_channels = _require_positive_int(builder, "num_channels", num_channels)
    if num_channels % num_groups:
        raise ValueError(
            f"{builder}: num_channels={num_channels} is not divisible by num_groups={num_groups}."
        )
    return {
        "has_bias": _require_bool(builder, "has_bias", has_bias),
        "num_groups": num_groups,
        "num_channels": num_channels,
        "eps": _require_eps(builder, eps),
    }


def _instance_norm_kwargs(builder: str, num_features: int, eps: float, has_bias: bool) -> dict:
    """Shared body of the instance-norm builders."""
    return {
        "has_bias": _require_bool(builder, "has_bias", has_bias),
        "num_features": _require_positive_int(builder, "num_features", num_features),
        "eps": _require_eps(builder, eps),
    }


def instance_norm1d_module_kwargs(*, num_features: int, eps: float, has_bias: bool) -> dict:
    """``module_kwargs`` of ``nn.InstanceNorm1d``."""
    return _instance_norm_kwargs("instance_norm1d_module_kwargs", num_features, eps, has_bias)


def instance_norm2d_module_kwargs(*, num_features: int, eps: float, has_bias: bool) -> dict:
    """``module_kwargs`` of ``nn.InstanceNorm2d``."""
    return _instance_norm_kwargs("instance_norm2d_module_kwargs", num_features, eps, has_bias)


def instance_norm3d_module_kwargs(*, num_features: int, eps: float, has_bias: bool) -> dict:
    """``module_kwargs`` of ``nn.InstanceNorm3d``."""
    return _instance_norm_kwargs("instance_norm3d_module_kwargs", num_features, eps, has_bias)

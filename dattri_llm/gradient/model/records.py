"""Record types of the gradient data model: one layer's payload and the names around it.

A layer's per-sample gradient is either *factorized* (a :class:`Factorized` pair of
the layer input ``a`` and output gradient ``g``; ``dW_i = Σ_t g_it a_itᵀ``) or
*materialized* (a dense tensor). This module holds that payload type, the aliases
that name the two forms, and the small helpers shared by the :class:`Gradient`
container (``model.container``) and the ``ops`` kernels. It imports nothing else
from the library, so every other module can depend on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

GradientRepresentation = Literal["materialized", "factorized"]
Indexing = Literal["batch", "batch_token"]

# The public module of the public names defined here; they report it.
_SPEC_MODULE = "dattri_llm.gradient.gradient"
# Kernel errors re-raised with the layer name prefixed (exact types only: subclasses
# may have other constructors).
_PREFIXED_ERRORS = (ValueError, TypeError, NotImplementedError)


class GradientShapeError(ValueError, RuntimeError):
    """Two blocks' payloads of one layer disagree in shape (e.g. feature width).

    Both a ``ValueError`` (our errors for bad arguments) and a ``RuntimeError``
    (what ``torch.cat`` raises in the reference design), so either ``except``
    clause catches it.
    """


def base_layer_name(name: str) -> str:
    """Strip a virtual-invocation suffix: ``"lin@2" -> "lin"``; names without ``"@"`` unchanged."""
    return name.split("@", 1)[0]


base_layer_name.__module__ = _SPEC_MODULE


def _pinning_available() -> bool:
    """Whether page-locked host memory can be allocated (an accelerator is present)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available()


def _pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` pinned if it is an unpinned CPU tensor and pinning is possible, else itself."""
    if tensor.device.type != "cpu" or not _pinning_available() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def _moved(
    tensor: torch.Tensor,
    device: torch.device | str | torch.dtype | None,
    dtype: torch.dtype | None,
    non_blocking: bool,
) -> torch.Tensor:
    """``tensor`` on ``device``, cast to ``dtype`` only if it is floating (ids stay integer).

    A dtype given as ``device`` (``to(torch.bfloat16)``, as for tensors) is the ``dtype``.
    """
    if isinstance(device, torch.dtype):
        if dtype is not None:
            raise TypeError(
                f"to(): got a dtype ({device}) as device and dtype={dtype}; pass one dtype."
            )
        device, dtype = None, device
    cast = dtype if tensor.is_floating_point() else None
    return tensor.to(device=device, dtype=cast, non_blocking=non_blocking)


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True, eq=False)
class Factorized:
    """Factorized per-sample gradient of one layer: its input and output gradient.

    Batch-first shapes: linear family ``a:(B,[T,]D_in)``, ``g:(B,[T,]D_out)``; conv
    ``a:(N,C_in,*spatial_in)``, ``g:(N,C_out,*spatial_out)``; embedding ``a:(B,T)``
    integer ids, ``g:(B,T,E)``; embedding-bag ``a:(B,T)``, ``g:(B,E)``; norms ``a``
    and ``g`` shaped like the normalised input. ``module_kwargs=None`` marks *final*
    factors (already preprocessed/projected; kernels use them as given).
    ``batch_first=False`` marks a sequence-first ``(T, B, ...)`` capture.
    """

    activation: torch.Tensor
    pre_activation_grad: torch.Tensor
    module_kwargs: dict | None = field(default=None, repr=False)
    batch_first: bool = True

    def _with_factors(self, activation: torch.Tensor, grad: torch.Tensor) -> Factorized:
        """Copy with new factors, same ``module_kwargs`` and ``batch_first``."""
        return Factorized(activation, grad, self.module_kwargs, self.batch_first)

    def to(
        self,
        device: torch.device | str | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> Factorized:
        """Copy with both factors moved; floating factors cast to ``dtype``.

        Integer factors (embedding token ids) keep their dtype: a 16-bit float
        cannot hold ids above 256 exactly. ``to(torch.bfloat16)`` means
        ``to(dtype=torch.bfloat16)``, as for tensors.
        """
        return self._with_factors(
            _moved(self.activation, device, dtype, non_blocking),
            _moved(self.pre_activation_grad, device, dtype, non_blocking),
        )

    def pin_memory(self) -> Factorized:
        """Copy whose unpinned CPU factors are pinned; other factors pass through (idempotent).

        Without an accelerator, page-locked memory cannot be allocated and the
        factors pass through unchanged.
        """
        return self._with_factors(_pin(self.activation), _pin(self.pre_activation_grad))

    @property
    def nbytes(self) -> int:
        """Bytes of both factors."""
        return _tensor_nbytes(self.activation) + _tensor_nbytes(self.pre_activation_grad)

    @property
    def batch_axis(self) -> int:
        """Axis of the samples in both factors: 0 batch-first, 1 sequence-first."""
        return 0 if self.batch_first else 1

    @property
    def token_axis(self) -> int:
        """Axis of the tokens in both factors: 1 batch-first, 0 sequence-first."""
        return 1 if self.batch_first else 0

    def as_batch_first(self) -> Factorized:
        """``self`` if batch-first, else a copy with axes 0 and 1 of both factors swapped."""
        if self.batch_first:
            return self
        return Factorized(
            self.activation.transpose(0, 1),
            self.pre_activation_grad.transpose(0, 1),
            self.module_kwargs,
            True,
        )


# Stores pickle this class by its public path (after the decorator: a dataclass resolves its
# string annotations in the namespace its ``__module__`` names).
Factorized.__module__ = _SPEC_MODULE

GradientData = torch.Tensor | Factorized


def _layer_batch(value: GradientData) -> int:
    """Per-sample count of one layer's payload (factor batch axis, or dense dim 0)."""
    if isinstance(value, Factorized):
        return value.activation.shape[value.batch_axis]
    return value.shape[0]


class GradientBlock(Protocol):
    """What code below the container reads of a :class:`Gradient` block (for annotations).

    The ``ops`` kernels that take whole blocks (``layerwise_cross_dot``, the similarity
    maths) read these fields only; :class:`Gradient` provides them.
    """

    @property
    def representation(self) -> dict[str, GradientRepresentation]:
        """``{layer: "factorized" | "materialized"}``."""

    @property
    def data(self) -> dict[str, GradientData]:
        """``{layer: Factorized | Tensor}``."""

    @property
    def layer_types(self) -> dict[str, str]:
        """``{layer: canonical type string | "param_grad_layers"}``."""

    @property
    def indexing(self) -> dict[str, Indexing]:
        """``{layer: "batch" | "batch_token"}``."""

    @property
    def batch_size(self) -> int:
        """Largest per-layer sample count (``ValueError`` with only ``param_grad`` layers)."""


def _check_choice(method: str, label: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` if ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"Gradient.{method}: {label} must be one of {choices}, got {value!r}.")


@contextmanager
def _naming_layer(op: str, name: str) -> Iterator[None]:
    """Re-raise a kernel's ``ValueError``/``TypeError``/``NotImplementedError`` inside the
    block with ``"Gradient.<op>: layer '<name>': "`` prefixed, so the message names the layer."""
    try:
        yield
    except _PREFIXED_ERRORS as error:
        if type(error) not in _PREFIXED_ERRORS:
            raise
        raise type(error)(f"Gradient.{op}: layer {name!r}: {error}") from error

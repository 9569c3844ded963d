"""Per-sample identifiers of a capture step, from the model inputs of its root forward.

A :class:`SampleIdentity` keeps the ``sample_id_key`` / ``sample_hash_fields``
settings of a :class:`HookManager`, picks the identity fields out of each root
forward's arguments, and turns them into one identifier per sample at step end:
the stringified ``sample_id_key`` values, or content hashes of the captured
inputs, with ``#k`` suffixes on repeats (:func:`occurrence_ids`).
:meth:`SampleIdentity.forward_inputs` takes the same fields from the model
call of any function without running the model, so code that never captures
gradients (``StrideAttributor``) names samples exactly as a capture does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.model.container import Gradient
from dattri_llm.utils.hashing import hash_batch, occurrence_ids

__all__ = ["MISSING", "SampleIdentity"]

MISSING = object()
"""Marks an identity field absent from the model inputs."""


class _ForwardReached(BaseException):
    """Cuts a call short at its model forward (:meth:`SampleIdentity.forward_inputs`).

    A ``BaseException``, so an ``except Exception`` inside the caller's
    objective does not swallow it.
    """


class SampleIdentity:
    """Where a step's per-sample identifiers come from, and how they are formed.

    ``sample_id_key``: an input field (a kwarg name, or a positional index)
    whose values are the identifiers; ``None`` for content hashing, over the
    ``sample_hash_fields`` when given (exclusive with ``sample_id_key``).
    """

    def __init__(
        self,
        sample_id_key: str | int | None,
        sample_hash_fields: Iterable[str | int] | str | int | None,
    ) -> None:
        self.sample_id_key = _check_sample_id_key(sample_id_key)
        self.sample_hash_fields = _check_hash_fields(sample_hash_fields, sample_id_key)

    def capture_inputs(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], Any]:
        """Identity fields of one root forward, plus the raw ``sample_id_key`` value."""

        def lookup(key: str | int) -> Any:
            if isinstance(key, int):
                return args[key] if key < len(args) else MISSING
            return kwargs.get(key, MISSING)

        def detach(value: Any) -> Any:
            return value.detach() if isinstance(value, torch.Tensor) else value

        sample_ids = MISSING if self.sample_id_key is None else lookup(self.sample_id_key)
        if self.sample_hash_fields is not None:
            inputs = {
                _field_key(key): detach(value)
                for key in self.sample_hash_fields
                if (value := lookup(key)) is not MISSING
            }
        else:
            inputs = {k: v.detach() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            if not inputs:
                inputs = {
                    f"_arg{i}": v.detach()
                    for i, v in enumerate(args)
                    if isinstance(v, torch.Tensor)
                }
        return inputs, sample_ids

    def forward_inputs(
        self, model: nn.Module, call: Callable[[], object]
    ) -> tuple[dict[str, Any], Any]:
        """:meth:`capture_inputs` of the first ``model`` forward inside ``call()``.

        A forward pre-hook (with kwargs) on ``model`` reads the arguments as
        :class:`HookManager`'s root pre-hook does, then stops ``call()`` there:
        the model body never runs, so this costs no forward, needs no working
        loss (a model without ``labels`` support, a loss that would fail) and
        changes no state. Feed the result to :meth:`identifiers` (``gradient``
        ``None``) for the ids a capture of the same call records. A call
        that forwards ``model`` several times is read at its first forward,
        where a capture keeps the last.

        Raises:
            ValueError: ``call()`` returned without calling ``model``.
        """
        captured: list[tuple[dict[str, Any], Any]] = []

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured.append(self.capture_inputs(args, kwargs))
            raise _ForwardReached

        handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
        try:
            call()
        except _ForwardReached:
            pass
        finally:
            handle.remove()
        if not captured:
            raise ValueError(
                f"the objective never called the model ({type(model).__name__}), so its inputs "
                "cannot identify the samples; call the task's model inside the objective"
            )
        return captured[0]

    def identifiers(
        self,
        gradient: Gradient | None,
        inputs: dict[str, Any] | None,
        sample_ids: Any,
        model: nn.Module,
    ) -> list[str]:
        """The step's per-sample identifiers in batch order, one per occurrence.

        ``inputs`` / ``sample_ids`` are what :meth:`capture_inputs` took from
        the step's root forward (``model`` is named in the error for none);
        ``gradient`` gives the batch size, which ``None`` infers from the inputs.
        Content hashes (or ``sample_id_key`` values) repeated within the step
        get ``#k`` suffixes (`occurrence_ids`), so every row keeps its own id.
        """
        batch_size: int | None = None
        if gradient is not None:
            try:
                batch_size = gradient.batch_size
            except ValueError:
                batch_size = None
        if self.sample_id_key is not None:
            ids = sample_ids
            if ids is MISSING:
                raise KeyError(
                    f"sample_id_key {self.sample_id_key!r} was not among the model inputs of "
                    "this step; pass it to the model call or drop sample_id_key."
                )
            values = _stringify_ids(ids)
            if batch_size is not None and len(values) != batch_size:
                raise ValueError(
                    f"sample_id_key {self.sample_id_key!r} holds {len(values)} values but the "
                    f"step batch size is {batch_size}; pass one identifier per sample."
                )
            return occurrence_ids(values)
        inputs = inputs or {}
        if self.sample_hash_fields is not None:
            for key in self.sample_hash_fields:
                if _field_key(key) not in inputs:
                    raise KeyError(
                        f"sample_hash_fields entry {key!r} was not among the model inputs of "
                        "this step."
                    )
        if not inputs:
            raise ValueError(
                "No model inputs were captured for this step, so samples cannot be identified: "
                f"call the model given to HookManager ({type(model).__name__}) inside "
                "collect(), or set sample_id_key."
            )
        lengths = [_leading_len(v) for v in inputs.values()]
        if batch_size is None or batch_size not in lengths:
            batch_size = next(
                (n for v, n in zip(inputs.values(), lengths) if isinstance(v, torch.Tensor) and n),
                batch_size,
            )
        return occurrence_ids(hash_batch(inputs, batch_size))


def _leading_len(value: object) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.ndim > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def _stringify_ids(values: object) -> list[str]:
    if isinstance(values, torch.Tensor):
        values = values.tolist() if values.ndim > 0 else [values.item()]
    return [str(v) for v in values]


def _field_key(key: str | int) -> str:
    return f"_arg{key}" if isinstance(key, int) else key


def _check_sample_id_key(key: object) -> str | int | None:
    if key is not None and (not isinstance(key, (str, int)) or isinstance(key, bool)):
        raise TypeError(
            f"sample_id_key must be a kwarg name (str), a positional index (int) or None, "
            f"got {key!r}."
        )
    return key


def _check_hash_fields(
    fields: Iterable[str | int] | str | int | None, sample_id_key: object
) -> tuple[str | int, ...] | None:
    if fields is None:
        return None
    result = (fields,) if isinstance(fields, (str, int)) else tuple(fields)
    if not result:
        raise ValueError("sample_hash_fields is empty; pass at least one field or None.")
    for key in result:
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"sample_hash_fields entries must be str or int, got {key!r}.")
    if sample_id_key is not None:
        raise ValueError(
            "sample_hash_fields and sample_id_key are exclusive: identifiers come either from "
            "a content hash or from the sample_id_key field."
        )
    return result

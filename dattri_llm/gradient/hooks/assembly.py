"""Assembly of one completed capture step into its :class:`GradientRecord`.

A :class:`StepAssembler` turns the step's buffered layer captures and
``param_grad`` sums into one record: the invocations of a reused module become
virtual layers ``name``, ``name@2``, … (forward order), per-device chunks are
merged along the batch axis, ``param_grad`` sums are averaged over ranks when
DDP synchronizes, and layers that ran forward without a gradient or were
captured with batch 1 are warned about once. :class:`StepState` is the per-step
bookkeeping the assembly reads besides the layer buffers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.hooks.identity import MISSING, SampleIdentity
from dattri_llm.gradient.hooks.layer_capture import Capture, LayerCapture
from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.model.records import Factorized, base_layer_name
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.utils.distributed import all_reduce_sum, dist_world_size

__all__ = ["StepAssembler", "StepState"]


@dataclass
class StepState:
    """Per-step bookkeeping that is not held in the layer buffers."""

    inputs: dict[str, Any] | None = None
    sample_ids: Any = MISSING
    forward_layers: set[str] = field(default_factory=set)
    end_queued: bool = False
    orphan_layers: set[str] = field(default_factory=set)

    def copy(self) -> StepState:
        """A copy whose layer sets are the copy's own."""
        return StepState(
            self.inputs,
            self.sample_ids,
            set(self.forward_layers),
            self.end_queued,
            set(self.orphan_layers),
        )


def _device_order(device: torch.device) -> tuple[str, int]:
    return (device.type, -1 if device.index is None else device.index)


def _batch_of(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return data.shape[0]
    return data.activation.shape[0 if data.batch_first else 1]


def _merge_chunks(chunks: list[Capture]) -> Any:
    """Concatenate one virtual layer's per-device captures along the batch axis."""
    chunks = sorted(chunks, key=lambda c: _device_order(c.device))
    first = chunks[0].data
    if len(chunks) == 1:
        return first
    device = chunks[0].device
    if isinstance(first, torch.Tensor):
        return torch.cat([c.data.to(device) for c in chunks], dim=0)
    axis = 0 if first.batch_first else 1
    a = torch.cat([c.data.activation.to(device) for c in chunks], dim=axis)
    g = torch.cat([c.data.pre_activation_grad.to(device) for c in chunks], dim=axis)
    return Factorized(a, g, first.module_kwargs, first.batch_first)


def _virtual_layers(name: str, captures: list[Capture]) -> dict[str, list[Capture]]:
    """``{name, name@2, …: per-device chunks}``; invocations numbered per device, forward order."""
    per_device: dict[tuple[str, int], list[Capture]] = {}
    for capture in captures:
        per_device.setdefault(_device_order(capture.device), []).append(capture)
    layers: dict[str, list[Capture]] = {}
    for device_captures in per_device.values():
        for k, capture in enumerate(sorted(device_captures, key=lambda c: c.seq)):
            layers.setdefault(name if k == 0 else f"{name}@{k + 1}", []).append(capture)
    return layers


class StepAssembler:
    """Builds each completed step's :class:`GradientRecord`; warns once per layer (set).

    ``identity`` forms the record's per-sample identifiers.
    """

    def __init__(self, identity: SampleIdentity) -> None:
        self.identity = identity
        self._warned_missing: set[frozenset[str]] = set()
        self._warned_broadcast: set[str] = set()

    def assemble(
        self,
        model: nn.Module,
        captures: dict[str, LayerCapture],
        param_buffers: dict[str, dict],
        state: StepState,
        step: int,
    ) -> GradientRecord:
        """The record of step ``step`` from the hooked layers' buffers (``RuntimeError`` if empty).

        ``model`` is the model as given to the manager (DDP-wrapped or not).
        """
        representation: dict[str, str] = {}
        data: dict[str, Any] = {}
        layer_types: dict[str, str] = {}
        indexing: dict[str, str] = {}
        for name, capture in captures.items():
            for virtual, chunks in _virtual_layers(name, capture.buffer["captures"]).items():
                first = min(chunks, key=lambda c: c.seq)
                representation[virtual] = first.representation
                data[virtual] = _merge_chunks(chunks)
                layer_types[virtual] = first.layer_type
                indexing[virtual] = first.indexing
        self._check_missing(set(data), state.forward_layers)
        for layer, grads in param_buffers.items():
            for pname, grad in grads.items():
                if grad is not None:
                    key = f"{layer}.{pname}" if layer else pname
                    representation[key] = "materialized"
                    data[key] = _synchronized_param_grad(model, grad)
                    layer_types[key] = PARAM_GRAD_TYPES
                    indexing[key] = "batch"
        if not data:
            if state.forward_layers:
                raise RuntimeError(
                    f"No hooked layer received a gradient in this backward although "
                    f"{sorted(state.forward_layers)} ran forward; the loss does not "
                    "depend on the hooked layers (detached or frozen path)."
                )
            raise RuntimeError(
                f"A backward through {type(model).__name__} inside collect() reached none "
                f"of the hooked layers ({list(captures) + list(param_buffers)}), so no "
                "record could be assembled; hook the layers this loss depends on, or run this "
                "backward outside collect()."
            )
        gradient = Gradient(representation, data, layer_types, indexing)
        self._warn_broadcast(gradient)
        return GradientRecord(
            step=step,
            input_hash=self.identity.identifiers(gradient, state.inputs, state.sample_ids, model),
            gradient=gradient,
            sample_id_key=self.identity.sample_id_key,
        )

    def _check_missing(self, assembled: set[str], forward_layers: set[str]) -> None:
        got = {base_layer_name(name) for name in assembled}
        missing = frozenset(forward_layers - got)
        if got and missing and missing not in self._warned_missing:
            self._warned_missing.add(missing)
            warnings.warn(
                f"Layers {sorted(missing)} ran forward but received no gradient in this "
                "backward; they are left out of the record.",
                UserWarning,
                stacklevel=2,
            )

    def _warn_broadcast(self, gradient: Gradient) -> None:
        """Warn once per layer captured with batch 1 in a step of batch > 1.

        Every captured layer counts, factorized or dense (a materialized or
        optimizer-preconditioned capture of a broadcast input is a ``(1, d)``
        row too); ``param_grad`` layers hold batch-summed gradients by design.
        """
        batches = {
            name: _batch_of(value)
            for name, value in gradient.data.items()
            if gradient.layer_types[name] != PARAM_GRAD_TYPES
        }
        step_batch = max(batches.values(), default=1)
        for name, batch in batches.items():
            if batch == 1 and step_batch > 1 and name not in self._warned_broadcast:
                self._warned_broadcast.add(name)
                warnings.warn(
                    f"Layer {name!r} has batch size 1 while the step batch is {step_batch} "
                    "(an input shared by all samples, e.g. positional ids): its gradient is "
                    "summed over the batch, not per sample. Exclude it from the linear_io "
                    "selector to score only per-sample layers.",
                    UserWarning,
                    stacklevel=2,
                )


def _synchronized_param_grad(model: nn.Module, grad: torch.Tensor) -> torch.Tensor:
    """A batch-level gradient as DDP applies it: averaged over ranks when DDP syncs.

    Parameter tensor hooks see the local gradient before DDP's all-reduce; a
    synchronizing DDP step (not inside ``no_sync()``) averages it over ranks, so
    the record does too. Every rank completes the step, so the collective matches.
    """
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(model, ddp) or not model.require_backward_grad_sync:
        return grad
    return all_reduce_sum(grad.clone()) / dist_world_size()

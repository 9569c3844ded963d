"""Training-step pieces of the live sources: batches, loss, records, update, RNG, gradients.

Used by `GradientStreamer` and `ReplayGradientSource`;
:mod:`dattri_llm.gradient.streaming` re-exports the public helpers
`autocast_for` and `move_batch`. The optimizer, scheduler and update step
mirror the Hugging Face ``Trainer`` (no weight decay on biases and 1-D
parameters; clip → ``optimizer.step`` → ``scheduler.step``).
`stash_gradients` / `restore_gradients` set a trajectory's gradients aside
while a probe runs and hand them back exactly, also when a wrapper keeps them
in its own buffers (DDP buckets, FSDP flat gradients).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from dattri_llm.gradient.stream.settings import TrainingSettings
from dattri_llm.utils.wrappers import is_fsdp

if TYPE_CHECKING:
    from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.model.container import GradientRecord


# --------------------------------------------------------------------------- batches and records


def autocast_for(args: Any) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``args.device`` for ``args.bf16`` / ``args.fp16``, else a no-op."""
    if getattr(args, "bf16", False):
        dtype = torch.bfloat16
    elif getattr(args, "fp16", False):
        dtype = torch.float16
    else:
        return contextlib.nullcontext()
    device = torch.device(getattr(args, "device", "cpu"))
    return torch.autocast(device_type=device.type, dtype=dtype)


def move_batch(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor moved to ``device`` (tensor, mapping, list/tuple; else as is)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        moved = {key: move_batch(value, device) for key, value in batch.items()}
        return moved if type(batch) is dict else _rebuild_mapping(batch, moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_batch(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(value, device) for value in batch)
    return batch


def _rebuild_mapping(original: Mapping, moved: dict) -> Mapping:
    """A mapping of ``original``'s type holding ``moved`` (plain dict when it cannot be rebuilt)."""
    try:
        return type(original)(moved)
    except TypeError:
        return moved


def take_record(capture: CaptureCallback, step: int, what: str) -> GradientRecord:
    """The record ``capture`` holds after one forward+backward labelled ``step``; then clear it.

    ``what`` names the pass in errors (``"batch 3"``, ``"replayed step 3"``).

    Raises:
        RuntimeError: no record (no hooked layer took part in the backward), or a
            record stamped with another step (the loss ran more than one step).
    """
    record, capture.record = capture.record, None
    if record is None:
        raise RuntimeError(
            f"{what} produced no gradient record: no hooked layer took part in the "
            "backward (check the hook config and that loss_fn calls the model on the batch)"
        )
    if record.step != step:
        raise RuntimeError(
            f"step desync: the capture record of {what} is stamped step {record.step}; "
            "loss_fn must run exactly one forward+backward step per batch"
        )
    return record


def record_identifiers(record: GradientRecord) -> list[str]:
    """The record's per-sample identifiers as a list (a single hash becomes ``[hash]``)."""
    ids = record.input_hash
    return list(ids) if isinstance(ids, list) else [ids]


@contextlib.contextmanager
def precondition_mode(manager: HookManager, enabled: bool) -> Iterator[None]:
    """Switch ``manager``'s preconditioned capture to ``enabled`` inside the block.

    The previous setting comes back afterwards, so sources sharing one manager
    (a preconditioned trajectory and a raw probe) each capture their own way.
    A manager built without an optimizer is left alone (it captures raw).
    """
    if not manager.supports_preconditioning:
        yield
        return
    previous = manager.precondition
    manager.precondition = enabled
    try:
        yield
    finally:
        manager.precondition = previous


def restore_modes(modes: dict[nn.Module, bool]) -> None:
    """Put each module back in the train/eval mode recorded in ``modes``."""
    for module, training in modes.items():
        module.train(training)


def check_loss(loss: object, batch_index: int, role: str = "training") -> torch.Tensor:
    """Return ``loss`` if it is a finite 0-d tensor, else raise ``ValueError``.

    The message names the batch as ``"<role> batch <batch_index>"`` (``role``
    is ``"training"`` or ``"query"``). A non-scalar loss is not reduced for the
    caller: the reduction sets the scale of every score.
    """
    where = f"{role} batch {batch_index}"
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn returned {shape} for {where}; it must return a scalar tensor. Reduce the "
            "per-sample losses with .sum() so that each sample's gradient is its own loss's "
            "gradient; a .mean() over a batch of B samples makes every per-sample gradient, "
            "and every score, B times smaller"
        )
    if not bool(torch.isfinite(loss.detach())):
        raise ValueError(
            f"loss_fn returned a non-finite loss ({loss.item()}) for {where}; "
            "check the batch and the model's numerical stability"
        )
    return loss


def decay_parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable parameters into a decayed group and a no-decay group.

    Parameters with ``ndim < 2`` or whose names end with ``.bias`` get weight
    decay 0; the others ``weight_decay``. Empty groups are omitted.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.endswith(".bias") or name == "bias":
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(groups: list[dict[str, Any]], args: TrainingSettings) -> torch.optim.Optimizer:
    """The optimizer ``args`` describes over the parameter ``groups``.

    ``groups`` come from :func:`decay_parameter_groups`, taken before any FSDP
    wrapping (which flattens parameters to 1-D shards).
    ``optim`` ``"adamw_torch"``/``"adamw"`` → ``AdamW(lr, betas, eps)``;
    ``"sgd"`` → ``SGD(lr)``; anything else → ``ValueError``.
    """
    if not groups:
        raise ValueError(
            "enable_update=True but the model has no trainable parameter "
            "(every parameter has requires_grad=False)"
        )
    if args.optim in ("adamw_torch", "adamw"):
        return torch.optim.AdamW(
            groups,
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        )
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    raise ValueError(
        f"unsupported optim {args.optim!r}; use 'adamw_torch', 'adamw' or 'sgd', or pass an "
        "optimizer= to GradientStreamer"
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, args: TrainingSettings, batches: int
) -> object:
    """``transformers.get_scheduler`` of ``args`` over ``ceil(batches / accumulation)`` updates."""
    # optional dependency: transformers
    from transformers import get_scheduler

    windows = math.ceil(batches / args.gradient_accumulation_steps)
    return get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.warmup_steps,
        num_training_steps=windows,
    )


def apply_update(
    optimizer: torch.optim.Optimizer,
    scheduler: object | None,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    model: nn.Module,
    forward_model: nn.Module,
) -> None:
    """Clip to ``max_grad_norm``, ``optimizer.step()``, then ``scheduler.step()``.

    With a loss ``scaler`` the gradients are unscaled before clipping and the
    step goes through the scaler, which then updates its scale.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_grad_norm is not None and max_grad_norm > 0:
        clip_gradients(model, forward_model, max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()


def clip_gradients(model: nn.Module, forward_model: nn.Module, max_norm: float) -> None:
    """Clip to total norm ``max_norm``; under FSDP the norm spans every rank's shard."""
    if is_fsdp(forward_model):
        forward_model.clip_grad_norm_(max_norm)
        return
    trainable = [p for p in model.parameters() if p.requires_grad]
    nn.utils.clip_grad_norm_(trainable, max_norm)


def rng_state() -> dict[str, object]:
    """The global CPU (and, once initialised, CUDA) RNG states."""
    state: dict[str, object] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    """Restore states saved by :func:`rng_state`."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- gradient stash


class StashedGradient(NamedTuple):
    """One parameter's gradient as :func:`stash_gradients` set it aside.

    ``grad`` is the ``.grad`` tensor itself (``None`` when there was none).
    ``values`` is ``None`` for a gradient taken off the parameter; for one left
    attached (it lives in a wrapper's buffer) it is a copy of its values.
    """

    param: nn.Parameter
    grad: torch.Tensor | None
    values: torch.Tensor | None


def stash_gradients(params: Iterable[nn.Parameter]) -> list[StashedGradient]:
    """Set the gradients on ``params`` aside so that a probe's backward cannot change them.

    A standalone gradient (nothing else references its storage) is taken off
    the parameter (``.grad = None``) and kept as it is. A gradient whose
    storage a wrapper owns (a view into a DDP bucket under
    ``gradient_as_bucket_view=True`` or into an FSDP flat gradient, or an FSDP
    ``keep_low_precision_grads`` gradient in another dtype than its parameter)
    stays attached, because the wrapper keeps those views and its buffers
    consistent (and may move a buffer to a new storage or dtype during a
    backward) and the probe's backward writes into the buffer anyway: its
    values are copied (memory: those gradients, while the stash is held) and
    it is zeroed in place. Either way the parameters start the probe with no
    gradient.
    """
    stash = [StashedGradient(p, p.grad, _copy_if_wrapper_owned(p)) for p in params]
    clear_probe_gradients(stash)  # only once every copy exists: a failed copy changes nothing
    return stash


def clear_probe_gradients(stash: list[StashedGradient]) -> None:
    """Empty the parameters' gradients for the next probe batch.

    ``.grad = None`` where the stash took the gradient off; zeros written in
    place where it left a wrapper-owned gradient attached. Each probe
    batch's backward thus leaves only its own gradient in ``.grad``.
    """
    with torch.no_grad():
        for entry in stash:
            if entry.values is None:
                entry.param.grad = None
            elif entry.param.grad is not None:
                entry.param.grad.zero_()


def restore_gradients(stash: list[StashedGradient]) -> None:
    """Hand every stashed gradient back with its dtype, shape and values.

    A gradient taken off is re-attached (the same tensor). One left attached
    gets its values written back into the gradient tensor the wrapper now
    exposes, so it keeps the storage the wrapper expects; if the parameter has
    no gradient any more, the stashed tensor is re-attached and refilled.
    """
    for param, grad, values in stash:
        if values is None:
            attach_gradient(param, grad)
            continue
        if param.grad is None:
            attach_gradient(param, grad)
        with torch.no_grad():
            param.grad.copy_(values)


def attach_gradient(param: nn.Parameter, grad: torch.Tensor | None) -> None:
    """``param.grad = grad``, also for a gradient kept in another dtype than ``param``'s.

    FSDP ``MixedPrecision(keep_low_precision_grads=True)`` keeps bf16/fp16
    gradients on full-precision parameters, which a plain assignment refuses;
    such a gradient is attached as FSDP attaches it: a placeholder of the
    parameter's dtype is assigned and its ``.data`` set to ``grad``, so
    ``param.grad`` has ``grad``'s storage, dtype and shape.
    """
    accepted = getattr(param, "grad_dtype", param.dtype)  # None: any dtype is accepted
    if grad is None or accepted is None or grad.dtype == accepted:
        param.grad = grad
        return
    param.grad = torch.empty_like(param)
    param.grad.data = grad


def _copy_if_wrapper_owned(param: nn.Parameter) -> torch.Tensor | None:
    """A copy of ``param.grad`` if a wrapper may own its storage, else ``None``.

    Wrapper-owned: a view or a slice of a larger storage (DDP bucket views,
    FSDP flat-gradient views), or a dtype other than the parameter's (FSDP
    ``keep_low_precision_grads`` attaches those through ``.data``, which
    hides the view).
    """
    grad = param.grad
    if grad is None or grad.layout != torch.strided:  # sparse gradients are standalone
        return None
    own_bytes = grad.numel() * grad.element_size()
    shared = grad._is_view() or grad.untyped_storage().nbytes() > own_bytes
    if shared or grad.dtype != param.dtype:
        return grad.detach().clone()
    return None

"""What to attribute: the model, its objectives and the checkpoints to score at.

An :class:`AttributionTask` bundles a live model with a train-side loss
``loss_func(model, batch) -> scalar`` and a test-side target
``target_func(model, batch) -> scalar``, both evaluated by calling the model on
a loader batch, plus one or more checkpoints (an ensemble).

Loss convention: per-sample gradients are shares of the gradient of the scalar
returned by the loss. Use a sum over samples to obtain ``∇ℓ_i`` per sample
(e.g. ``model(**batch).loss * batch_size`` for a Hugging Face mean loss); a
mean loss yields ``∇ℓ_i / B``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

LossFunc = Callable[[nn.Module, object], torch.Tensor]
CheckpointLoadFunc = Callable[[nn.Module, object], nn.Module]


def default_loss_func(model: nn.Module, batch: object) -> torch.Tensor:
    """Return ``model(**batch).loss`` (a Hugging Face style loss).

    Raises ``TypeError`` for a non-dict batch and ``ValueError`` when the model
    output carries no ``loss`` (pass ``labels`` or give a ``loss_func``).
    """
    if not isinstance(batch, dict):
        raise TypeError(
            f"default_loss_func calls model(**batch) and needs a dict batch, got "
            f"{type(batch).__name__}; pass loss_func=(model, batch) -> scalar to the task"
        )
    output = model(**batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None:
        raise ValueError(
            f"default_loss_func: the output of {type(model).__name__}(**batch) has no "
            f"'loss' (batch keys {sorted(batch)}); include 'labels' in the batch or pass "
            "loss_func=(model, batch) -> scalar to the task"
        )
    return loss


def _model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter or buffer (CPU for an empty module)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def default_checkpoint_load_func(model: nn.Module, checkpoint: object) -> nn.Module:
    """Load ``checkpoint`` into ``model`` in place and return ``model``.

    ``None`` keeps the current parameters; a ``str``/``Path`` is read with
    ``torch.load(map_location=<model device>, weights_only=True)``; a mapping is
    used as a state dict (``load_state_dict``).
    """
    if checkpoint is None:
        return model
    if isinstance(checkpoint, (str, Path)):
        checkpoint = torch.load(checkpoint, map_location=_model_device(model), weights_only=True)
    if not isinstance(checkpoint, dict):
        raise TypeError(
            f"checkpoint must be None, a path or a state dict, got {type(checkpoint).__name__}; "
            "pass checkpoints_load_func for other formats"
        )
    model.load_state_dict(checkpoint)
    return model


def _unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """Split a DDP/FSDP/DataParallel wrapper into ``(inner module, wrapper or None)``.

    A wrapper exposes the wrapped model as ``.module`` and owns no parameter of
    its own; a model that merely has a submodule called ``module`` next to other
    parameters (a backbone plus a head) is not a wrapper.
    """
    inner = getattr(model, "module", None)
    if not isinstance(inner, nn.Module) or inner is model:
        return model, None
    inner_params = {id(p) for p in inner.parameters()}
    if any(id(p) not in inner_params for p in model.parameters()):
        return model, None
    return inner, model


class AttributionTask:
    """Model, objectives and checkpoints of an attribution run.

    Args:
        loss_func: train-side objective ``(model, batch) -> scalar`` called on the
            live model; ``None`` → :func:`default_loss_func`.
        model: the model, unwrapped or already DDP/FSDP-wrapped (the wrapped
            module is the hook target, the wrapper the forward target). A
            wrapper is recognised as a module exposing ``.module`` that owns no
            parameter outside it.
        checkpoints: one checkpoint or a list/tuple of them (ensemble); each a
            state dict, a path, or ``None`` (= current parameters).
        target_func: test-side objective; ``None`` → ``loss_func``.
        checkpoints_load_func: ``(model, checkpoint) -> model`` replacing
            :func:`default_checkpoint_load_func`.
    """

    def __init__(
        self,
        loss_func: LossFunc | None,
        model: nn.Module,
        checkpoints: object = None,
        target_func: LossFunc | None = None,
        checkpoints_load_func: CheckpointLoadFunc | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.loss_func: LossFunc = loss_func if loss_func is not None else default_loss_func
        self.target_func: LossFunc = target_func if target_func is not None else self.loss_func
        self._model, self._forward_model = _unwrap(model)
        self.checkpoints: list[object] = (
            list(checkpoints) if isinstance(checkpoints, (list, tuple)) else [checkpoints]
        )
        if not self.checkpoints:
            raise ValueError("checkpoints is an empty list; pass None to use the current weights")
        self._custom_loader = checkpoints_load_func is not None
        self.checkpoints_load_func: CheckpointLoadFunc = (
            checkpoints_load_func
            if checkpoints_load_func is not None
            else default_checkpoint_load_func
        )
        if self.is_wrapped and not self._custom_loader:
            loaded = [i for i, ckpt in enumerate(self.checkpoints) if ckpt is not None]
            if loaded:
                raise ValueError(
                    f"checkpoints {loaded} need loading into a wrapped "
                    f"({type(self._forward_model).__name__}) model, which the default loader "
                    "cannot do safely; pass checkpoints_load_func or load the weights before "
                    "wrapping and use checkpoints=None"
                )
        self.current_checkpoint_idx: int | None = None

    @property
    def model(self) -> nn.Module:
        """The (unwrapped) module that carries the hooks."""
        return self._model

    @property
    def forward_model(self) -> nn.Module | None:
        """The DDP/FSDP wrapper to run forwards through, or ``None`` when unwrapped."""
        return self._forward_model

    @property
    def is_wrapped(self) -> bool:
        """Whether the task was given a wrapped model."""
        return self._forward_model is not None

    def get_model(self) -> nn.Module:
        """Return the (unwrapped) model."""
        return self._model

    def get_checkpoints(self) -> list[object]:
        """Return the list of checkpoints."""
        return self.checkpoints

    def num_checkpoints(self) -> int:
        """Number of checkpoints in the ensemble."""
        return len(self.checkpoints)

    def load_checkpoint(self, index: int) -> nn.Module:
        """Load checkpoint ``index`` into the model (no-op if already loaded) and return it."""
        if not 0 <= index < len(self.checkpoints):
            raise IndexError(
                f"checkpoint index {index} out of range for {len(self.checkpoints)} checkpoint(s)"
            )
        if self.current_checkpoint_idx == index:
            return self._model
        loaded = self.checkpoints_load_func(self._model, self.checkpoints[index])
        if loaded is not None and loaded is not self._model:
            if self.is_wrapped:
                raise ValueError(
                    "checkpoints_load_func returned a new module for a wrapped model; "
                    "load the weights in place (return the model it was given)"
                )
            if not isinstance(loaded, nn.Module):
                raise TypeError(
                    f"checkpoints_load_func must return the model, got {type(loaded).__name__}"
                )
            self._model = loaded
        self.current_checkpoint_idx = index
        return self._model

    @classmethod
    def from_dattri(cls, task: object) -> AttributionTask:
        """Return ``task`` if it is an :class:`AttributionTask`, else adapt a dattri task.

        A dattri task's functions take ``(params, data)``; they are called with
        ``dict(model.named_parameters())`` so gradients flow through the live
        model. Its ``checkpoints_load_func`` is kept.
        """
        if isinstance(task, AttributionTask):
            return task
        required = ("original_loss_func", "original_target_func", "model", "checkpoints")
        missing = [name for name in required if not hasattr(task, name)]
        if missing:
            raise TypeError(
                f"expected an AttributionTask or a dattri task; {type(task).__name__} lacks "
                f"{missing}"
            )
        loss = _params_to_model_func(task.original_loss_func)
        target_original = task.original_target_func
        target = loss if target_original is None else _params_to_model_func(target_original)
        return cls(
            loss_func=loss,
            model=task.model,
            checkpoints=task.checkpoints,
            target_func=target,
            checkpoints_load_func=getattr(task, "checkpoints_load_func", None),
        )


def _params_to_model_func(fn: Callable[[dict, object], torch.Tensor]) -> LossFunc:
    """Adapt a dattri ``(params, data)`` function to ``(model, batch)``."""

    def model_func(model: nn.Module, batch: object) -> torch.Tensor:
        return fn(dict(model.named_parameters()), batch)

    model_func.__name__ = getattr(fn, "__name__", "dattri_func")
    return model_func


def as_task(task: object) -> AttributionTask:
    """Return ``AttributionTask.from_dattri(task)``."""
    return AttributionTask.from_dattri(task)


# ---------------------------------------------------------------------------- output functions
OutputFunc = Callable[[nn.Module, object], tuple[torch.Tensor, torch.Tensor]]


def _logits_of(model: nn.Module, batch: object, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, labels)`` of ``model`` on a dict batch carrying ``labels`` (labels not passed)."""
    if not isinstance(batch, dict) or "labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(
            f"{name} needs a dict batch with 'labels' (got {keys}); add the correct class "
            "(classifier) or the token ids (causal LM) as 'labels', or pass your own output_func"
        )
    labels = batch["labels"]
    output = model(**{k: v for k, v in batch.items() if k != "labels"})
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None:
        raise ValueError(
            f"{name}: {type(model).__name__}(**batch) returned neither a tensor nor an output "
            "with 'logits'; pass your own output_func"
        )
    return logits, labels


def margin_and_weights(model: nn.Module, batch: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample TRAK margins and ``1 − p`` weights from one forward.

    The margin of a prediction with correct-label probability ``p`` is
    ``f = log(p / (1 − p)) = z_y − logsumexp_{c≠y} z_c`` (``z`` the logits).

    * Classifier: logits ``(B, C)``, ``labels`` ``(B,)`` → ``f_i`` and ``1 − p_i``.
    * Causal LM: logits ``(B, T, V)``, ``labels`` ``(B, T)`` (shifted inside: the
      logits at ``t`` predict ``labels[t + 1]``; ``-100`` is ignored) → ``f_i`` is
      the sum of the per-token margins of sequence ``i`` and its weight the mean
      of ``1 − p_t`` over its counted tokens (``0`` for a sequence with none).

    ``labels`` is removed from the batch before ``model(**batch)``.

    Returns:
        ``(margins (B,), weights (B,))``; the weights are detached.
    """
    logits, labels = _logits_of(model, batch, "margin_and_weights")
    if logits.dim() == 3:
        logits, labels = logits[:, :-1], labels[:, 1:]
    elif logits.dim() != 2:
        raise ValueError(
            f"margin_and_weights expects logits (B, C) or (B, T, V), got {tuple(logits.shape)}"
        )
    labels = labels.to(logits.device)
    valid = labels != -100
    safe = labels.masked_fill(~valid, 0)
    correct = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, safe.unsqueeze(-1), float("-inf")).logsumexp(-1)
    margins = (correct - others) * valid
    log_p = correct - logits.logsumexp(-1)
    one_minus_p = (-torch.expm1(log_p)).detach() * valid
    if margins.dim() == 2:
        counts = valid.sum(-1)
        return margins.sum(-1), one_minus_p.sum(-1) / counts.clamp_min(1)
    return margins, one_minus_p


def margin_loss(model: nn.Module, batch: object) -> torch.Tensor:
    """``−Σ_i f_i``: the loss-like objective whose per-sample gradients are ``−∇f_i``.

    ``f_i`` is the margin of :func:`margin_and_weights` (classifiers and HF
    causal LMs, with ``labels`` in the batch); usable as a task's ``loss_func``.
    """
    return -margin_and_weights(model, batch)[0].sum()

"""``TrainingDynamicsCallback``: what every optimizer update of a recorded run applied.

The trajectory methods (trajectory TracIn, LESS, DVEmb, AdamW-influence) replay
the updates of a training run. An update does not apply the plain sum of the
captured per-sample gradients: the loop may clip the global gradient norm,
unscale a loss-scaled gradient, accumulate several backwards into one step, and
every parameter group has its own hyperparameters. This callback records, at
each ``optimizer.step()``, what the step really did, whichever loop ran it (a
``GradientStreamer``, a Hugging Face ``Trainer``, accelerate, a hand-written
loop with or without a ``GradScaler``):

``steps`` / ``rows``
    the capture steps (backwards) the update consumed, i.e. its accumulation
    window, and the number of rows of each;
``clip_coef``
    ``c``, the factor the loop applied to the accumulated gradient before the
    step (``min(1, M / (‖g‖ + 1e-6))`` under ``clip_grad_norm_``). It is
    measured, not assumed: a probe parameter's ``.grad`` at the step is
    compared with its value at the end of the window's last backward (the sum
    of the captured shares), ``c = <grad_step, grad_backward> / ‖grad_backward‖²``,
    times the loss scale when a ``GradScaler`` is given;
``row_scale``
    the factor the captured rows carry over the loss's own per-sample shares
    (the ``GradScaler`` loss scale, or 1);
``grad_norm``
    the global 2-norm of the applied gradient over every parameter the
    optimizer holds (the clipped norm);
``groups``
    each parameter group's hyperparameters (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``amsgrad``, ``maximize``, ``decoupled_weight_decay``) and
    its update count after the step;
``loss_divisor``
    what the loop divides each micro-batch loss by (``gradient_accumulation_steps``
    when given, else the window's number of backwards).

Once per run it records, per captured layer, the parameter group of its
weight and of its bias and the positions of the bias coordinates among the
layer's captured coordinates, so every coordinate is propagated with its own
group's values; and ``parameter_groups``, the group of every parameter the
optimizer holds, by its name in the unwrapped model (a replay of the whole
run, such as the exact metagradient, gives each parameter its group's
values). :func:`save_training_dynamics` / :func:`load_training_dynamics`
(``gradient/state/dynamics.py``, re-exported here) keep all of it as
``training_dynamics.json`` beside a run's store.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.gradient import base_layer_name
from dattri_llm.gradient.ops.projection import DattriProjector, mask_coordinates
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.gradient.state.dynamics import (
    TRAINING_DYNAMICS_FILE,
    load_training_dynamics,
    save_training_dynamics,
)
from dattri_llm.gradient.state.names import optimizer_type
from dattri_llm.gradient.state.optimizer_snapshot import OptimizerSnapshot
from dattri_llm.utils.distributed import dist_world_size
from dattri_llm.utils.wrappers import unwrap_model

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import GradientRecord
    from dattri_llm.gradient.hooks.manager import HookManager

__all__ = [
    "TRAINING_DYNAMICS_FILE",
    "TrainingDynamicsCallback",
    "load_training_dynamics",
    "save_training_dynamics",
]

# Relative size of the part of the applied gradient that is not a multiple of the backward's.
_RESIDUAL_RTOL = 1e-3
_GROUP_DEFAULTS: dict[str, Any] = {
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "amsgrad": False,
    "maximize": False,
    "decoupled_weight_decay": False,
}

OptimizerLike = torch.optim.Optimizer | Callable[[], torch.optim.Optimizer] | None


def _number(value: Any) -> float:
    """A float from a number or a one-element tensor (torch allows tensor ``lr`` / betas)."""
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def group_values(group: Mapping[str, Any], step: int, optimizer: str = "") -> dict[str, Any]:
    """The hyperparameters of one parameter group as plain JSON values, with its ``step``.

    ``decoupled_weight_decay`` is true for an ``AdamW`` group also where torch
    does not store the flag.
    """
    values: dict[str, Any] = {"lr": _number(group.get("lr", 0.0)), "step": int(step)}
    defaults = {**_GROUP_DEFAULTS, "decoupled_weight_decay": optimizer == "AdamW"}
    for key, default in defaults.items():
        value = group.get(key, default)
        value = default if value is None else value
        if key == "betas":
            values[key] = [_number(b) for b in value]
        elif isinstance(default, bool):
            values[key] = bool(value)
        else:
            values[key] = _number(value)
    return values


def _step_count(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> int:
    """Updates taken by the group's first parameter that has optimizer state (0 if none)."""
    for param in group["params"]:
        state = optimizer.state.get(param)
        if state and "step" in state:
            return int(_number(state["step"]))
    return 0


class TrainingDynamicsCallback(HookManagerCallback):
    """Record what each optimizer update applied (see the module docstring).

    Attach it to the ``HookManager`` that captures the run. It registers global
    optimizer step hooks at the first captured backward and removes them when
    the ``collect()`` context ends (or, when backwards are still waiting for
    their step, after that step: a loop may open ``collect()`` around each
    backward only); only the optimizer that holds the captured layers'
    parameters is recorded. Records are keyed by the capture step of the
    window's last backward: ``updates[step]``.

    Args:
        model: the trained model (wrapped or not).
        optimizer: its optimizer, a callable returning it, or ``None`` to take
            the first optimizer that steps the captured layers.
        projection_kwargs: the capture's projection configs (``"__default__"``
            fallback), to locate the bias coordinates of ``"mask"`` captures;
            ``None`` means every coordinate is captured.
        layers: record the layer map for these layers only (default: every
            per-sample layer the manager captures).
        grad_scaler: the ``torch.amp.GradScaler`` of a loss-scaled loop (or a
            callable returning it or ``None``): its scale at each backward
            separates the clip coefficient from the scale, and a step it skips
            (an inf/NaN gradient, seen as a scale decrease) leaves its window
            out of every update.
        gradient_accumulation_steps: what the loop divides each micro-batch
            loss by (``None``: the number of backwards in the window).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerLike = None,
        *,
        projection_kwargs: dict[str, dict] | None = None,
        layers: Iterable[str] | None = None,
        grad_scaler: Any = None,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        if gradient_accumulation_steps is not None and (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1
        ):
            raise ValueError(
                "TrainingDynamicsCallback: gradient_accumulation_steps must be None or an int "
                f">= 1, got {gradient_accumulation_steps!r}"
            )
        self.model = model
        self._optimizer_source = optimizer
        self._optimizer: torch.optim.Optimizer | None = None
        self.projection_kwargs = projection_kwargs
        self.layers = None if layers is None else frozenset(layers)
        self.grad_scaler = grad_scaler
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.updates: dict[int, dict] = {}
        self.layer_map: dict[str, dict] = {}
        self.parameter_groups: dict[str, int] = {}
        self.skipped_steps: list[int] = []
        # The streamer yields unscaled rows: the scale is then not carried by the rows.
        self.rows_unscaled = False
        self._manager: HookManager | None = None
        self._window: list[int] = []
        self._window_rows: list[int] = []
        self._window_layers: list[str] = []
        self._window_scale = 1.0
        self._probe: nn.Parameter | None = None
        self._backward_grad: torch.Tensor | None = None
        self._pending: dict | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._closing = False
        self._snapshot: OptimizerSnapshot | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ optimizer
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The recorded optimizer (``None`` until it is known)."""
        if self._optimizer is None and self._optimizer_source is not None:
            source = self._optimizer_source
            resolved = source if isinstance(source, torch.optim.Optimizer) else source()
            self._optimizer = _unwrap_optimizer(resolved)
        return self._optimizer

    @property
    def snapshot(self) -> OptimizerSnapshot:
        """An ``OptimizerSnapshot`` over the model and the recorded optimizer."""
        if self._snapshot is None:
            if self.optimizer is None:
                raise RuntimeError(
                    "TrainingDynamicsCallback: the optimizer is not known yet; it is taken at the "
                    "first optimizer.step() that updates a captured layer"
                )
            self._snapshot = OptimizerSnapshot(self.model, self.optimizer)
        return self._snapshot

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is the recorded one (adopting it when none was given)."""
        optimizer = _unwrap_optimizer(optimizer)
        if self.optimizer is not None:
            return optimizer is self.optimizer
        probe = self._probe
        held = probe is not None and any(
            param is probe for group in optimizer.param_groups for param in group["params"]
        )
        if held:
            self._optimizer = optimizer
        return held

    # ------------------------------------------------------------------ hooks
    def on_register(self, hook_manager: HookManager) -> None:
        """Remember the manager (its captured layers and model)."""
        self._manager = hook_manager

    def on_step_end(self, record: GradientRecord) -> None:
        """Add the backward to the current window and keep the probe's accumulated gradient.

        A backward with the model in eval mode (a frozen query probe sharing
        the hooks) belongs to no update and is ignored.
        """
        if not self.model.training:
            return
        self._closing = False
        self._ensure_hooks()
        scale = self._loss_scale()
        if self._window and scale < self._window_scale:
            # The GradScaler lowered its scale: the window's step was skipped (inf/NaN).
            self.skipped_steps.extend(self._window)
            self._reset_window()
        self._window_scale = scale
        self._window.append(int(record.step))
        self._window_rows.append(int(record.gradient.batch_size))
        if not self._window_layers:
            self._window_layers = [
                name
                for name, kind in record.gradient.layer_types.items()
                if kind != PARAM_GRAD_TYPES and (self.layers is None or name in self.layers)
            ]
        probe = self._probe_parameter()
        grad = None if probe is None else probe.grad
        self._backward_grad = None if grad is None else grad.detach().clone()

    def on_context_end(self) -> None:
        """Remove the optimizer hooks, or, while backwards wait for their step (a loop that
        opens ``collect()`` around each backward only), after that step."""
        if self._window:
            self._closing = True
        else:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._closing = False

    def _ensure_hooks(self) -> None:
        if not self._handles:
            self._handles = [
                register_optimizer_step_pre_hook(self._before_step),
                register_optimizer_step_post_hook(self._after_step),
            ]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._window or not self._owns(optimizer):
            return
        optimizer = self.optimizer
        if not self.layer_map:
            self.layer_map = self.build_layer_map(self._window_layers)
        if not self.parameter_groups:
            self.parameter_groups = parameter_groups(self.model, optimizer)
        clip = self._clip_coefficient()
        self._pending = {
            "steps": list(self._window),
            "rows": list(self._window_rows),
            "loss_divisor": self.gradient_accumulation_steps or len(self._window),
            "clip_coef": clip,
            "row_scale": 1.0 if self.rows_unscaled else self._window_scale,
            "grad_norm": _global_norm(optimizer),
            "optimizer": _optimizer_name(optimizer),
            "world_size": dist_world_size(),
        }

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        pending, self._pending = self._pending, None
        if pending is None or _unwrap_optimizer(optimizer) is not self.optimizer:
            return
        optimizer = self.optimizer
        pending["groups"] = [
            group_values(group, _step_count(optimizer, group), pending["optimizer"])
            for group in optimizer.param_groups
        ]
        pending["update"] = len(self.updates)
        last = pending["steps"][-1]
        self.updates[last] = pending
        self._reset_window()
        if self._closing:
            self._remove_hooks()
        self.on_update(last, pending)

    def on_update(self, step: int, update: dict) -> None:
        """Called after each recorded update (its window's last capture step); no-op."""

    def _reset_window(self) -> None:
        self._window, self._window_rows = [], []
        self._backward_grad = None

    # ------------------------------------------------------------------ measurements
    def _scaler(self) -> Any:
        scaler = self.grad_scaler
        return scaler() if callable(scaler) and not hasattr(scaler, "get_scale") else scaler

    def _loss_scale(self) -> float:
        """The ``GradScaler``'s current scale (1 without one)."""
        scaler = self._scaler()
        return 1.0 if scaler is None else float(scaler.get_scale())

    def _probe_parameter(self) -> nn.Parameter | None:
        """The parameter whose gradient measures the clip (largest gradient among the
        captured layers' weights, chosen at the first backward)."""
        if self._probe is None:
            best, best_norm = None, 0.0
            for name in self._window_layers:
                module = _module_of(self.model, name)
                weight = getattr(module, "weight", None)
                if isinstance(weight, nn.Parameter) and weight.grad is not None:
                    norm = float(weight.grad.detach().float().norm())
                    if norm > best_norm:
                        best, best_norm = weight, norm
            self._probe = best
        return self._probe

    def _clip_coefficient(self) -> float:
        """``c`` of the coming step (see the module docstring)."""
        probe, backward = self._probe, self._backward_grad
        if probe is None or probe.grad is None or backward is None:
            self._warn_once(
                "probe",
                "TrainingDynamicsCallback: no captured layer's weight has a gradient to measure "
                "the clip coefficient; the updates are recorded unclipped (c = 1)",
            )
            return 1.0
        applied = probe.grad.detach().to(torch.float64).reshape(-1)
        backward = backward.to(device=applied.device, dtype=torch.float64).reshape(-1)
        energy = float(backward @ backward)
        if energy == 0.0:
            return 1.0
        ratio = float(applied @ backward) / energy
        residual = float((applied - ratio * backward).norm())
        if residual > _RESIDUAL_RTOL * max(float(applied.norm()), 1e-30):
            self._warn_once(
                "residual",
                "TrainingDynamicsCallback: the gradient at optimizer.step() is not a multiple of "
                f"the gradient the backwards accumulated (relative residual "
                f"{residual / max(float(applied.norm()), 1e-30):.2e}): the loop changed it by "
                "more than a clip or a loss scale (a gradient hook, noise, a distributed "
                "reduction after the backward). The trajectory methods model the best scalar fit",
            )
        coef = ratio * self._window_scale
        if self._scaler() is None and 0 < coef < 0.5 and _is_power_of_two(1.0 / coef):
            self._warn_once(
                "scaler",
                f"TrainingDynamicsCallback: the step applied {coef:.3g}× the accumulated gradient, "
                "a power of two: a loss scale. Pass grad_scaler= (the loop's GradScaler) so the "
                "scale is not taken for a clip",
            )
        return coef

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ layer map
    def build_layer_map(self, layer_names: Iterable[str]) -> dict[str, dict]:
        """``{layer: {"weight_group", "bias_group", "bias_index", "width"}}`` of captured layers.

        ``weight_group`` / ``bias_group`` index ``optimizer.param_groups``
        (``None`` for a parameter the optimizer does not hold, or no bias);
        ``bias_index`` lists the positions of bias coordinates among the
        layer's captured coordinates (``None`` for a projection that mixes
        coordinates, ``"logra"`` or ``"dense"``); ``width`` is the number of
        captured coordinates (``None`` under such a projection).
        """
        groups = {
            id(p): i
            for i, g in enumerate(self.snapshot.optimizer.param_groups)
            for p in g["params"]
        }
        result = {}
        for name in layer_names:
            try:
                result[name] = self._layer_entry(name, groups)
            except (NotImplementedError, KeyError, ValueError) as error:
                # Never fail the training step: the sweep refuses the layer, with this reason.
                result[name] = {"weight_group": None, "bias_group": None, "bias_index": None,
                                "width": None, "error": str(error)}  # fmt: skip
        return result

    def _layer_entry(self, name: str, groups: Mapping[int, int]) -> dict[str, Any]:
        config = self._config(name)
        include_bias = True if config is None else bool(config.get("include_bias", True))
        roles = dict(self.snapshot.parameters(name, include_bias=True))
        entry: dict[str, Any] = {
            "weight_group": groups.get(id(roles.get("weight"))),
            "bias_group": groups.get(id(roles.get("bias"))) if include_bias else None,
            "bias_index": None,
            "width": None,
        }
        style = None if config is None else config.get("style", "logra")
        if style in (None, "mask"):
            entry.update(self._bias_positions(name, include_bias))
        return entry

    def _config(self, layer_name: str) -> dict | None:
        if not self.projection_kwargs:
            return None
        return self.projection_kwargs.get(layer_name, self.projection_kwargs.get("__default__"))

    def _bias_positions(self, name: str, include_bias: bool) -> dict[str, Any]:
        """``bias_index`` and ``width`` of a layer captured on all or on mask coordinates."""
        shapes = dict(self.snapshot.shapes(name, include_bias=include_bias))
        indicator = {"weight": torch.zeros(shapes["weight"])}
        if "bias" in shapes:
            indicator["bias"] = torch.ones(shapes["bias"])
        width = self.snapshot.width(name, include_bias=include_bias)
        index = mask_coordinates(self.projection_kwargs, name, width, DattriProjector())
        flat = self.snapshot.flatten(name, indicator, idx=index)
        positions = torch.nonzero(flat.reshape(-1) > 0.5).reshape(-1)
        return {"bias_index": positions.tolist(), "width": int(flat.numel())}

    # ------------------------------------------------------------------ results
    def dynamics(self) -> dict[int, dict]:
        """``{step: update}`` of every recorded update (keyed by its window's last capture step)."""
        return dict(self.updates)

    def save(self, directory: str | Path) -> Path:
        """Write the records as ``training_dynamics.json`` in ``directory`` (atomically)."""
        return save_training_dynamics(
            directory,
            self.updates,
            self.layer_map,
            skipped_steps=self.skipped_steps,
            parameter_groups=self.parameter_groups,
        )

    def records(self) -> dict[str, Any]:
        """What :meth:`save` writes, as :func:`load_training_dynamics` reads it back:
        ``{"layers", "updates", "skipped_steps", "parameter_groups"}``."""
        return {
            "layers": dict(self.layer_map),
            "updates": dict(self.updates),
            "skipped_steps": list(self.skipped_steps),
            "parameter_groups": dict(self.parameter_groups),
        }


def parameter_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{name: group index}`` of every parameter ``optimizer`` holds, named in the unwrapped
    ``model`` (a held tensor the model does not name is left out)."""
    index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return {
        name: index[id(param)]
        for name, param in unwrap_model(model).named_parameters()
        if id(param) in index
    }


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` behind a wrapper (accelerate's ``AcceleratedOptimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """``optimizer_type`` for the supported maps, else the class name."""
    try:
        return optimizer_type(optimizer)
    except NotImplementedError:
        return type(optimizer).__name__


def _module_of(model: nn.Module, layer_name: str) -> nn.Module | None:
    """The module behind a captured (possibly virtual ``name@k``) layer name, or ``None``."""
    root = getattr(model, "module", model)
    try:
        return root.get_submodule(base_layer_name(layer_name))
    except AttributeError:
        return None


def _global_norm(optimizer: torch.optim.Optimizer) -> float:
    """2-norm of every gradient the optimizer holds, as ``clip_grad_norm_`` computes it: a norm
    per gradient on its device, then the norm of those (one host sync, no copies)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grad = param.grad.detach()
                by_device.setdefault(grad.device, []).append(torch.linalg.vector_norm(grad).float())
    per_device = [
        torch.linalg.vector_norm(torch.stack(norms).double()).cpu() for norms in by_device.values()
    ]
    return float(torch.linalg.vector_norm(torch.stack(per_device))) if per_device else 0.0


def _is_power_of_two(value: float) -> bool:
    exponent = round(math.log2(value))
    return abs(value / 2.0**exponent - 1.0) < 1e-5

"""``OptimizerStateCallback``: Adam moments before and after every update, on captured coordinates.

Entries (``pre[step]``, ``post[step]``, or the snapshot store's dynamics files)::

    {"moments": {layer: (exp_avg (k,), exp_avg_sq (k,)[, max_exp_avg_sq (k,)])},  # float32 CPU
     "step": <updates taken when read>, "lr": float, "betas": (β1, β2),
     "eps": float, "weight_decay": float}

``k`` is the layer's materialize-layout width, or its mask size under a
``"mask"`` projection; ``max_exp_avg_sq`` is read for ``amsgrad`` groups.
The scalar values are the first recorded layer's weight group's (older
readers use them); the post entry of an update recorded at
``optimizer.step()`` also carries ``"update"`` (what the update applied:
window, clip, loss scale, every group's values) and ``"layers"`` (each
layer's groups and bias coordinates), see
:class:`~dattri_llm.gradient.callbacks.training_dynamics_callback.TrainingDynamicsCallback`.
:func:`assemble_dynamics` (``gradient/state/dynamics.py``, re-exported here) joins
the two sides of a step into the entry AdamW-influence consumes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback
from dattri_llm.gradient.gradient import base_layer_name
from dattri_llm.gradient.ops.projection import DattriProjector, mask_coordinates
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES
from dattri_llm.gradient.state.dynamics import assemble_dynamics
from dattri_llm.gradient.state.optimizer_snapshot import LayerOptimizerState, OptimizerSnapshot
from dattri_llm.gradient.state.snapshots import LazyDynamics, TrajectorySnapshots

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import GradientRecord

__all__ = ["OptimizerStateCallback", "assemble_dynamics"]

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
_AMSGRAD_KEY = "max_exp_avg_sq"
_SUPPORTED_OPTIMIZERS = ("Adam", "AdamW")
_GROUP_KEYS = ("step", "lr", "betas", "eps", "weight_decay")


def _group_values(layer: LayerOptimizerState) -> dict:
    """``step``, ``lr``, ``betas``, ``eps``, ``weight_decay`` of one layer's read."""
    hp = layer.hyperparameters
    betas = tuple(float(b) for b in hp.get("betas", (0.9, 0.999)))
    return {
        "step": layer.step,
        "lr": layer.lr,
        "betas": betas,
        "eps": float(hp.get("eps", 1e-8)),
        "weight_decay": float(hp.get("weight_decay", 0.0)),
    }


class OptimizerStateCallback(TrainingDynamicsCallback):
    """Record Adam / AdamW first and second moments around every optimizer update.

    ``on_step_end`` (which fires at the end of the backward, before
    ``optimizer.step()``) reads each captured layer's ``(exp_avg, exp_avg_sq)``
    (and ``max_exp_avg_sq`` under ``amsgrad``) on its captured coordinates into
    ``pre[step]``; after each ``optimizer.step()`` the same read goes into
    ``post[step]`` of the window's last capture step, automatically (a global
    optimizer step hook, as :class:`TrainingDynamicsCallback` records the
    update itself). Calling :meth:`record_post` after ``optimizer.step()``
    (the protocol of earlier versions) reads the same values again. With
    ``snapshots`` the entries go to ``snapshots.save_dynamics`` instead of
    memory.

    Args:
        model: the trained model (as the optimizer sees it; wrapped or not).
        optimizer: the optimizer, or a callable returning it (resolved on first read).
        projection_kwargs: the capture's per-layer projection configs
            (``"__default__"`` fallback); ``"mask"`` layers are read on their
            mask coordinates, layers without a config on all coordinates. It
            must match the hook manager's config: ``None`` means all coordinates.
        layers: record only these layer names (default: every layer of the record).
        snapshots: a :class:`TrajectorySnapshots` store to write the entries to.
        grad_scaler: the loop's ``GradScaler`` (see :class:`TrainingDynamicsCallback`).
        gradient_accumulation_steps: what the loop divides each micro-batch loss
            by (see :class:`TrainingDynamicsCallback`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Callable[[], torch.optim.Optimizer],
        *,
        projection_kwargs: dict[str, dict] | None = None,
        layers: Iterable[str] | None = None,
        snapshots: TrajectorySnapshots | None = None,
        grad_scaler: Any = None,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            projection_kwargs=projection_kwargs,
            layers=layers,
            grad_scaler=grad_scaler,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        self.snapshots = snapshots
        self.pre: dict[int, dict] = {}
        self.post: dict[int, dict] = {}
        self._projector = DattriProjector()
        self._coordinates: dict[str, torch.Tensor | None] = {}
        self._layers_at: dict[int, list[str]] = {}

    @property
    def snapshot(self) -> OptimizerSnapshot:
        """The :class:`~dattri_llm.gradient.optimizer_state.OptimizerSnapshot` (built on first use).

        Raises:
            NotImplementedError: the optimizer is not an ``Adam`` / ``AdamW``.
        """
        if self._snapshot is None:
            snapshot = OptimizerSnapshot(self.model, lambda: self.optimizer)
            kind = snapshot.optimizer_type
            if kind not in _SUPPORTED_OPTIMIZERS:
                raise NotImplementedError(
                    f"OptimizerStateCallback records Adam-family moments (exp_avg, exp_avg_sq); "
                    f"the optimizer is a {type(snapshot.optimizer).__name__} ({kind}). Use "
                    "torch.optim.Adam or AdamW."
                )
            self._snapshot = snapshot
        return self._snapshot

    def _include_bias(self, layer_name: str) -> bool:
        config = self._config(layer_name)
        return True if config is None else bool(config.get("include_bias", True))

    def _config(self, layer_name: str) -> dict | None:
        if not self.projection_kwargs:
            return None
        return self.projection_kwargs.get(layer_name, self.projection_kwargs.get("__default__"))

    def coordinates(self, layer_name: str) -> torch.Tensor | None:
        """Mask indices of ``layer_name`` from ``projection_kwargs`` (``None`` = all coordinates).

        ``ValueError`` when the layer's config is not a ``"mask"`` projection.
        """
        if layer_name not in self._coordinates:
            width = self.snapshot.layer_width(layer_name, self._include_bias(layer_name))
            self._coordinates[layer_name] = mask_coordinates(
                self.projection_kwargs, layer_name, width, self._projector
            )
        return self._coordinates[layer_name]

    # ---- hooks

    def on_layer_forward(
        self,
        layer_name: str,
        activation: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Bind the layer while FSDP holds it unsharded (its forward); no-op otherwise.

        The forward is the reliable place: FSDP1 may run a root unit's first
        backward hook before it re-exposes the unsharded parameters.
        """
        if self._wanted(layer_name):
            self.snapshot.bind(layer_name)

    def on_layer_backward(
        self,
        layer_name: str,
        grad_output: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Bind the layer while its parameters are unsharded (FSDP); no-op otherwise."""
        if self._wanted(layer_name):
            self.snapshot.bind(layer_name)

    def on_step_end(self, record: GradientRecord) -> None:
        """Add the backward to the update's window; read the pre-update moments of the record's
        layers into ``pre[record.step]``."""
        super().on_step_end(record)
        names = [
            name
            for name, layer_type in record.gradient.layer_types.items()
            if layer_type != PARAM_GRAD_TYPES and self._wanted(name)
        ]
        self._layers_at[record.step] = names
        self._save(record.step, "pre", self._read(names))

    def on_update(self, step: int, update: dict) -> None:
        """After ``optimizer.step()``: the post-update read of the window's last capture step."""
        self.record_post(step)

    def record_post(self, step: int) -> None:
        """Read the post-update moments of the layers seen at ``step`` into ``post[step]``.

        Runs automatically after each ``optimizer.step()``; calling it again
        after the step reads the same values. ``KeyError`` if ``step`` has no
        pre entry.
        """
        names = self._layers_at.get(step)
        if names is None:
            pre = self.snapshots.load_dynamics(step, "pre") if self.snapshots else None
            if pre is None:
                raise KeyError(
                    f"OptimizerStateCallback.record_post({step}): no pre-update entry for step "
                    f"{step}; recorded steps: {sorted(self._layers_at)}. Call record_post with "
                    "the step of the capture record after that step's optimizer.step()."
                )
            names = list(pre["moments"])
        entry = self._read(names)
        if step in self.updates:
            entry.update(update=self.updates[step], layers=self.layer_map)
        self._save(step, "post", entry)

    def dynamics(self) -> Mapping[int, dict]:
        """``{step: assemble_dynamics(pre, post)}`` for every step having both sides.

        A plain dict from memory, or a lazy read-only mapping over the snapshot store.
        """
        if self.snapshots is not None:
            return LazyDynamics(self.snapshots)
        return {
            s: assemble_dynamics(self.pre[s], self.post[s])
            for s in sorted(self.pre)
            if s in self.post
        }

    # ---- reading

    def _wanted(self, layer_name: str) -> bool:
        return self.layers is None or layer_name in self.layers

    def _read(self, names: list[str]) -> dict:
        """Entry for ``names``: moments per layer (use sites share their module's read)."""
        moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        by_module: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        values: dict[str, dict] = {}
        for name in names:
            base = base_layer_name(name)
            key = (base, self._include_bias(name))
            if key not in by_module:
                amsgrad = bool(self.snapshot.group(name).get("amsgrad", False))
                keys = (*_MOMENT_KEYS, _AMSGRAD_KEY) if amsgrad else _MOMENT_KEYS
                layer = self.snapshot.read(
                    name,
                    keys,
                    coordinates=self.coordinates(name),
                    include_bias=key[1],
                    zeros_for_missing=True,
                )
                by_module[key] = tuple(layer.state[k] for k in keys)
                values[name] = _group_values(layer)
            moments[name] = by_module[key]
        return {"moments": moments, **self._common(values)}

    def _common(self, values: dict[str, dict]) -> dict:
        """The entry's scalar step / hyperparameters: the first layer's weight group's.

        Every group's own values are in the update record (``"update"``).
        """
        if not values:  # every layer of the record filtered out: the first group's values
            group = self.snapshot.optimizer.param_groups[0]
            state = self.snapshot.optimizer.state.get(group["params"][0], {})
            return _group_values(
                LayerOptimizerState({}, int(state.get("step", 0)), group, float(group["lr"]))
            )
        return next(iter(values.values()))

    def _save(self, step: int, side: str, entry: dict) -> None:
        if self.snapshots is not None:
            self.snapshots.save_dynamics(step, side, entry)
        else:
            (self.pre if side == "pre" else self.post)[step] = entry

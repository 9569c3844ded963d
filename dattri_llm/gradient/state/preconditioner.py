"""``GradientPreconditioner``: per-sample gradients mapped through the optimizer's update rule.

What ``HookManager(optimizer=...)`` buffers: each layer's per-sample gradient
on its captured coordinates goes through ``ops.optimizer.precondition`` with
the layer's current state from an :class:`OptimizerSnapshot`, read (under FSDP:
gathered) once per optimizer step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from dattri_llm.gradient.model.records import base_layer_name
from dattri_llm.gradient.ops.optimizer import precondition, second_moment_normalize
from dattri_llm.gradient.ops.projection import mask_coordinates, project_materialized
from dattri_llm.gradient.ops.projector import DattriProjector
from dattri_llm.gradient.state.optimizer_snapshot import OptimizerSnapshot

__all__ = ["PRECONDITION_RULES", "GradientPreconditioner"]

# What the map computes: the optimizer's update direction (``ops.precondition``), or the
# gradient over the optimizer's second-moment denominator (``ops.second_moment_normalize``).
PRECONDITION_RULES = ("update", "second_moment")


class GradientPreconditioner:
    """Map a layer's per-sample gradients through the optimizer's update rule.

    Called as ``preconditioner(layer_name, entries, proj_kw=None)`` where
    ``entries`` is the layer's per-sample gradient as a dense ``(B, k)`` tensor
    in materialize layout on the captured coordinates:

    * ``proj_kw is None`` — all ``k = d`` coordinates (bias included when the
      layer has one); the result is ``(B, d)``;
    * ``proj_kw["style"] == "mask"`` — the ``k = proj_dim`` masked coordinates
      (``ops.mask_coordinates`` of that config: ``proj_dim``, ``proj_seed``,
      ``include_bias``); the result is ``(B, proj_dim)`` on the same coordinates;
    * ``proj_kw["style"] == "dense"`` — all ``k = d`` coordinates
      (``include_bias`` of the config, default ``True``); the preconditioned
      ``(B, d)`` is then projected with ``projector`` and the config, so the
      result is ``(B, proj_dim)``.

    The map is :meth:`OptimizerSnapshot.precondition`: ``ops.optimizer.precondition``
    with the layer's current state on those coordinates, ``step = state step +
    1`` and the weight's group hyperparameters; the result is float32. With
    ``enabled = False`` the map is skipped (the ``"dense"`` projection still
    applies), so a raw pass can share the hooks. :attr:`rule` ``"second_moment"``
    maps with ``ops.second_moment_normalize`` instead (the gradient over the
    optimizer's second-moment denominator; Adam, AdamW, Adafactor) and ignores
    the step. ``"logra"`` configs raise
    ``ValueError`` (a preconditioned gradient is not rank-structured).

    Caching: with ``cache = True`` (default) each layer's state read
    (:meth:`OptimizerSnapshot.states` and the step, per layer, coordinates,
    ``include_bias`` and device) is kept until the optimizer's state changes —
    :attr:`OptimizerSnapshot.state_version`, bumped by ``optimizer.step()`` and
    ``optimizer.load_state_dict()`` — so the micro-batches of one accumulation
    window read (under FSDP: gather) each layer's state once. The cache holds
    one copy of every preconditioned layer's state on its captured coordinates,
    on the capture device. State edited by hand in between is not seen until
    :meth:`clear_cache`; ``cache = False`` reads on every call.

    Args:
        snapshot: the model's :class:`OptimizerSnapshot`.
        projector: the capture's projector (mask coordinates, dense matrices);
            ``None`` → a default ``DattriProjector``.
    """

    def __init__(self, snapshot: OptimizerSnapshot, projector: Any = None) -> None:
        self.snapshot = snapshot
        self.projector = DattriProjector.coerce(projector)
        self.enabled = True
        self.rule = "update"
        self.cache = True
        self.loss_reduction: str | None = None
        self.loss_divisor = 1
        self._cache: dict[tuple, tuple[dict[str, torch.Tensor | None], int, dict]] = {}
        self._cache_version: tuple | None = None
        self._lock = threading.RLock()

    def sample_scale(self, batch_size: int) -> float:
        """The factor taking a captured share to the sample's own gradient before the map.

        ``1`` unless a loss convention is set (``loss_reduction``,
        ``loss_divisor``): then ``(batch_size if "mean" else 1) · loss_divisor``
        (see ``HookManager.set_loss_convention``).
        """
        if self.loss_reduction is None:
            return 1.0
        rows = batch_size if self.loss_reduction == "mean" else 1
        return float(rows * self.loss_divisor)

    def clear_cache(self) -> None:
        """Forget the cached state reads (the next call of each layer reads again)."""
        with self._lock:
            self._cache.clear()
            self._cache_version = None

    def __call__(
        self, layer_name: str, entries: torch.Tensor, proj_kw: dict | None = None
    ) -> torch.Tensor:
        """Preconditioned ``(B, k)`` (or projected ``(B, proj_dim)`` for ``"dense"``)."""
        style = None if proj_kw is None else proj_kw.get("style", "logra")
        if style not in (None, "mask", "dense"):
            raise ValueError(
                f"GradientPreconditioner: layer {layer_name!r} is configured with projection "
                f"style {style!r}; preconditioned capture supports no projection, 'mask' or "
                "'dense' (a preconditioned gradient is no longer rank-structured)."
            )
        include_bias = True if proj_kw is None else bool(proj_kw.get("include_bias", True))
        coordinates = self.coordinates(layer_name, proj_kw, entries.device)
        self._check_width(layer_name, entries, include_bias, coordinates)
        mask_key = (
            None
            if coordinates is None
            else (int(proj_kw["proj_dim"]), int(proj_kw.get("proj_seed", 0)))
        )
        key = (base_layer_name(layer_name), include_bias, mask_key, str(entries.device))
        out = self._precondition(layer_name, entries, coordinates, include_bias, key)
        if style == "dense":
            proj = {k: v for k, v in proj_kw.items() if k != "style"}
            return project_materialized(
                out, self.snapshot.layer_type(layer_name), self.projector, **proj
            )
        return out

    def coordinates(
        self, layer_name: str, proj_kw: dict | None, device: torch.device | str = "cpu"
    ) -> torch.Tensor | None:
        """Mask indices of a ``"mask"`` config (``None`` for no projection and ``"dense"``)."""
        if proj_kw is None or proj_kw.get("style", "logra") != "mask":
            return None
        width = self.snapshot.layer_width(layer_name, bool(proj_kw.get("include_bias", True)))
        return mask_coordinates({layer_name: proj_kw}, layer_name, width, self.projector, device)

    def _check_width(
        self,
        layer_name: str,
        entries: torch.Tensor,
        include_bias: bool,
        coordinates: torch.Tensor | None,
    ) -> None:
        expected = (
            self.snapshot.layer_width(layer_name, include_bias)
            if coordinates is None
            else coordinates.numel()
        )
        if entries.ndim != 2 or entries.shape[1] != expected:
            raise ValueError(
                f"GradientPreconditioner: layer {layer_name!r} expects per-sample gradients of "
                f"shape (B, {expected}) in materialize layout on the captured coordinates, got "
                f"{tuple(entries.shape)}."
            )

    def _read(
        self,
        layer_name: str,
        coordinates: torch.Tensor | None,
        include_bias: bool,
        device: torch.device,
    ) -> tuple[dict[str, torch.Tensor | None], int, dict]:
        """``(states on device, step count, update hyperparameters)`` of the layer."""
        snapshot = self.snapshot
        hyper = snapshot._update_hyperparameters(layer_name)
        states = snapshot.states(layer_name, coordinates, include_bias)
        states = {k: None if v is None else v.to(device) for k, v in states.items()}
        return states, snapshot.step_count(layer_name), hyper

    def _cached_read(
        self,
        layer_name: str,
        coordinates: torch.Tensor | None,
        include_bias: bool,
        device: torch.device,
        key: tuple,
    ) -> tuple[dict[str, torch.Tensor | None], int, dict]:
        if not self.cache:
            return self._read(layer_name, coordinates, include_bias, device)
        with self._lock:
            version = self.snapshot.state_version
            if version != self._cache_version:
                self._cache.clear()
                self._cache_version = version
            if key not in self._cache:
                self._cache[key] = self._read(layer_name, coordinates, include_bias, device)
            return self._cache[key]

    def _precondition(
        self,
        layer_name: str,
        entries: torch.Tensor,
        coordinates: torch.Tensor | None,
        include_bias: bool,
        key: tuple,
    ) -> torch.Tensor:
        if not self.enabled:
            return entries
        states, step, hyper = self._cached_read(
            layer_name, coordinates, include_bias, entries.device, key
        )
        scale = self.sample_scale(entries.shape[0])
        if scale != 1.0:
            entries = entries * scale
        if self.rule == "second_moment":
            return second_moment_normalize(
                entries, states, optimizer_type=self.snapshot.optimizer_type, **hyper
            )
        return precondition(
            entries, states, optimizer_type=self.snapshot.optimizer_type, step=step + 1, **hyper
        )

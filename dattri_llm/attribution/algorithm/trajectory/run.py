"""What the recorded run did at each update: windows, clip and scale, per-coordinate values.

A trajectory store holds per-sample rows labelled by *store steps*: a capture
step (one backward) for a ``GradientStreamer`` run or a plain ``OffloadCallback``,
or an optimizer-update index for a store whose ``OffloadCallback`` merged each
accumulation window (declared ``gradient_accumulation_steps > 1``). The
recorded dynamics (:mod:`dattri_llm.gradient.callbacks.training_dynamics_callback`)
say which capture steps each optimizer update consumed, how the loop scaled
them (clip coefficient ``c``, the loss scale ``ρ`` the rows carry), and every
parameter group's hyperparameters. :class:`RunDynamics` joins the two into
:class:`Window` s (one optimizer update each, in store steps) and gives, per
window, each coordinate's hyperparameters.

A run recorded before these dynamics existed (only ``lr_schedule.json``, or
AdamW moments with one set of hyperparameters per step) reads as one update
per store step, unclipped, every coordinate with the step's values.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

LearningRate = float | Mapping[int, float] | None
LR_RTOL = 1e-6
# Per-coordinate hyperparameters a window can give (``group_values`` keys).
_SCALAR_KEYS = ("lr", "eps", "weight_decay", "step")


@dataclass(frozen=True)
class Window:
    """One optimizer update, in store steps.

    Attributes:
        key: the window's last store step (the AdamW dynamics key).
        steps: its store steps, ascending.
        update: the recorded update (``None`` for a run without records).
        micro_rows: rows of each backward of the window, in order (``None``:
            take them from the store, one backward per store step).
    """

    key: int
    steps: tuple[int, ...]
    update: Mapping[str, Any] | None = None
    micro_rows: tuple[int, ...] | None = None

    @property
    def record_key(self) -> int:
        """The capture step the update was recorded under (its last backward's)."""
        if self.update is None:
            return self.key
        return int(self.update.get("steps", [self.key])[-1])

    @property
    def clip_coef(self) -> float:
        """``c``: the factor the loop applied to the accumulated gradient (1 unrecorded)."""
        return 1.0 if self.update is None else float(self.update.get("clip_coef", 1.0))

    @property
    def row_scale(self) -> float:
        """``ρ``: the factor the stored rows carry over the loss's shares (1 unrecorded)."""
        return 1.0 if self.update is None else float(self.update.get("row_scale", 1.0))

    @property
    def clipped(self) -> bool:
        """Whether the clip was active (``c < 1``)."""
        return self.clip_coef < 1.0 - 1e-7

    @property
    def grad_norm(self) -> float | None:
        """Global norm of the applied gradient (``None`` unrecorded)."""
        return None if self.update is None else self.update.get("grad_norm")

    @property
    def loss_divisor(self) -> int:
        """What the loop divided each micro-batch loss by (1 unrecorded)."""
        return 1 if self.update is None else int(self.update.get("loss_divisor", 1))

    @property
    def row_step_scale(self) -> float:
        """``c / ρ``: what the update applied per stored row."""
        return self.clip_coef / self.row_scale


@dataclass
class RunDynamics:
    """The updates of a recorded run, and every coordinate's hyperparameters per update.

    Attributes:
        updates: ``{last capture step: update}`` as recorded (empty for an
            unrecorded run).
        layer_map: ``{layer: {"weight_group", "bias_group", "bias_index", "width"}}``.
        skipped_steps: capture steps whose update a ``GradScaler`` skipped.
        merged: whether the store's steps are update indices (windows merged
            into one record each).
        legacy: ``{store step: {"lr", "betas", "eps", "weight_decay", "step"}}``,
            the one set of values per step of an unrecorded run.
    """

    updates: dict[int, dict] = field(default_factory=dict)
    layer_map: dict[str, dict] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    merged: bool = False
    legacy: dict[int, dict] = field(default_factory=dict)
    _warned: set[str] = field(default_factory=set, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_records(
        cls,
        recorded: Mapping[str, Any] | None,
        *,
        entries: Mapping[int, Mapping[str, Any]] | None = None,
        merged: bool = False,
    ) -> RunDynamics:
        """Dynamics from a ``load_training_dynamics`` payload and/or AdamW dynamics entries.

        ``entries`` (``OptimizerStateCallback.dynamics()``) carry the update
        records too (``entry["update"]``, ``entry["layers"]``) when recorded by
        this version; older entries give one set of values per step.
        """
        updates = dict((recorded or {}).get("updates", {}))
        layer_map = dict((recorded or {}).get("layers", {}))
        skipped = list((recorded or {}).get("skipped_steps", []))
        legacy: dict[int, dict] = {}
        for step, entry in (entries or {}).items() if not updates else ():
            update = entry.get("update")
            if update is not None:
                updates[int(step)] = dict(update)
                layer_map = layer_map or dict(entry.get("layers", {}))
            else:
                legacy[int(step)] = _legacy_values(entry)
        if updates and legacy:
            raise ValueError(
                "the AdamW dynamics mix steps recorded with update records and steps without; "
                "record the whole run with one version of OptimizerStateCallback"
            )
        return cls(updates, layer_map, skipped, merged, legacy)

    @property
    def recorded(self) -> bool:
        """Whether the run's updates were recorded (windows, clip, groups)."""
        return bool(self.updates)

    # ------------------------------------------------------------------ windows
    def windows(self, store_steps: Iterable[int]) -> list[Window]:
        """The run's updates over ``store_steps``, ascending; one per store step when unrecorded.

        Store steps no recorded update consumed (an update a ``GradScaler``
        skipped, backwards never followed by a step) are left out with a
        ``UserWarning``; so is a run recorded under several processes.
        """
        steps = sorted({int(s) for s in store_steps})
        if not self.recorded:
            return [Window(step, (step,)) for step in steps]
        world = max(int(u.get("world_size", 1)) for u in self.updates.values())
        if world > 1:
            self.warn_once(
                "world",
                f"the run was recorded under {world} processes: a data-parallel step averages "
                "the ranks' gradients, which the trajectory methods do not model (they are "
                "exact for single-process runs); each rank's rows are scored as if its own "
                "batch made the update",
            )
        ordered = sorted(self.updates.items(), key=lambda item: int(item[1].get("update", 0)))
        windows: list[Window] = []
        if self.merged:
            by_index = {
                int(update.get("update", i)): update for i, (_, update) in enumerate(ordered)
            }
            for step in steps:
                update = by_index.get(step)
                if update is not None:
                    windows.append(Window(step, (step,), update, tuple(update.get("rows", ()))))
        else:
            present = set(steps)
            for last, update in ordered:
                inside = tuple(s for s in update.get("steps", [last]) if s in present)
                if inside:
                    windows.append(Window(inside[-1], inside, update))
        covered = {s for window in windows for s in window.steps}
        stray = [s for s in steps if s not in covered]
        if stray:
            skipped = sorted(set(stray) & set(self.skipped_steps))
            self.warn_once(
                "stray",
                f"store steps {stray} belong to no recorded optimizer update"
                + (f" (the GradScaler skipped steps {skipped})" if skipped else "")
                + "; they changed no parameter and are left out of the trajectory scores",
            )
        return windows

    # ------------------------------------------------------------------ coordinates
    def values(
        self, window: Window, layout: Mapping[str, int], key: str, *, dtype: torch.dtype
    ) -> torch.Tensor:
        """``(p,)`` per-coordinate value of hyperparameter ``key`` at ``window``.

        ``key`` is ``"lr"``, ``"eps"``, ``"weight_decay"``, ``"step"``,
        ``"beta1"``, ``"beta2"``, ``"amsgrad"`` (0/1) or
        ``"decoupled_weight_decay"`` (0/1). ``layout`` is ``{layer: width}`` in
        concatenation order. A layer's coordinates take its weight's group
        value, its bias coordinates the bias group's.

        Raises:
            ValueError: a layer the recorded layer map lacks or whose captured
                width differs from the record.
        """
        if not self.recorded:
            value = _legacy_value(self.legacy.get(window.key), key)
            return torch.full((sum(layout.values()),), value, dtype=dtype)
        groups = window.update["groups"]
        parts = []
        for name, width in layout.items():
            entry = self._layer_entry(name, width)
            part = torch.full(
                (width,), _group_value(groups, entry["weight_group"], key, name), dtype=dtype
            )
            bias_group = entry.get("bias_group")
            if bias_group is not None and bias_group != entry["weight_group"]:
                index = entry.get("bias_index")
                if index is None:
                    self.warn_once(
                        f"projected:{name}",
                        f"layer {name!r} is captured under a projection that mixes its weight "
                        "and bias coordinates, and its bias is in another parameter group; its "
                        "coordinates are propagated with the weight group's values",
                    )
                elif index:
                    part[torch.as_tensor(index)] = _group_value(groups, bias_group, key, name)
            parts.append(part)
        return torch.cat(parts)

    def uniform(self, window: Window, key: str) -> float | None:
        """The value of ``key`` when every group agrees on it at ``window`` (else ``None``)."""
        if not self.recorded:
            return _legacy_value(self.legacy.get(window.key), key)
        used = self._used_groups()
        values = {_group_value(window.update["groups"], g, key, "") for g in used}
        return values.pop() if len(values) == 1 else None

    def reference_lr(self, window: Window) -> float:
        """The learning rate of the first parameter group at ``window`` (``lr_schedule.json``'s).

        An unrecorded run gives the window's one recorded rate.

        Raises:
            ValueError: an unrecorded run holding no values for the window.
        """
        if not self.recorded:
            return _legacy_value(self.legacy.get(window.key), "lr")
        return float(window.update["groups"][0]["lr"])

    def _used_groups(self) -> list[int]:
        groups = {entry.get("weight_group") for entry in self.layer_map.values()}
        groups |= {entry.get("bias_group") for entry in self.layer_map.values()}
        return sorted(g for g in groups if g is not None) or [0]

    def _layer_entry(self, name: str, width: int) -> Mapping[str, Any]:
        entry = self.layer_map.get(name)
        if entry is None:
            raise ValueError(
                f"layer {name!r} is not in the recorded run's layer map (it covers "
                f"{sorted(self.layer_map)}); record the run with a TrainingDynamicsCallback on "
                "the same HookManager that captured this layer"
            )
        if entry.get("width") is not None and int(entry["width"]) != width:
            raise ValueError(
                f"layer {name!r}: the store holds {width} coordinates per sample but the run was "
                f"recorded with {entry['width']}; score the store captured with that run's "
                "projection"
            )
        if entry.get("error"):
            raise ValueError(
                f"layer {name!r}: the recorded run could not map its coordinates to the "
                f"optimizer's parameter groups ({entry['error']}); leave the layer out "
                "(layer_name=...)"
            )
        if entry.get("weight_group") is None:
            raise ValueError(
                f"layer {name!r}: its weight is in no parameter group of the recorded optimizer; "
                "the run did not train it, so the trajectory cannot be replayed through it"
            )
        return entry

    def optimizers(self) -> set[str]:
        """Optimizer types the recorded updates name (empty when unrecorded)."""
        return {str(update.get("optimizer")) for update in self.updates.values()}

    def group_settings(self, key: str) -> set[Any]:
        """Every value the used groups take for ``key`` over the recorded updates."""
        used = self._used_groups()
        return {
            _raw_group_value(update["groups"], g, key)
            for update in self.updates.values()
            for g in used
            if g < len(update.get("groups", []))
        }

    def warn_once(self, key: str, message: str) -> None:
        """A ``UserWarning`` the first time ``key`` is seen on this run."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=4)

    # ------------------------------------------------------------------ learning rates
    def learning_rates(
        self,
        windows: list[Window],
        learning_rate: LearningRate,
        recorded_lr: Mapping[int, float] | None,
        *,
        where: str = "learning_rate",
        warn: bool = True,
    ) -> dict[int, float] | None:
        """``{window key: η}`` overriding the recorded rates, or ``None`` to use them.

        ``learning_rate=None`` takes the recorded rates: the run's per-group
        values when recorded (``None`` is returned), else ``recorded_lr``
        (``lr_schedule.json``); a float applies to every window; a ``{step: lr}``
        mapping gives a window its key step's rate (or any of its steps'). A
        configured rate differing from the recorded one warns; it is used.

        Raises:
            ValueError: a negative or non-finite rate; a window without a
                rate; ``None`` without anything recorded.
            TypeError: another type.
        """
        if learning_rate is None:
            if self.recorded:
                return None
            if recorded_lr is None:
                raise ValueError(
                    f"{where}=None takes the learning rates the run recorded, but the train "
                    "source has neither training_dynamics.json nor lr_schedule.json; pass "
                    f"{where}=<float> or {{step: lr}}"
                )
            return _covering(recorded_lr, windows, "the recorded schedule (lr_schedule.json)")
        if isinstance(learning_rate, Mapping):
            rates = _covering(learning_rate, windows, where)
        elif isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
            rate = _checked_rate(learning_rate, where)
            rates = {window.key: rate for window in windows}
        else:
            raise TypeError(
                f"{where} must be a float, a {{step: lr}} mapping or None, got "
                f"{type(learning_rate).__name__}"
            )
        if warn:
            self._warn_on_disagreement(rates, windows, recorded_lr, where)
        return rates

    def _warn_on_disagreement(
        self,
        rates: Mapping[int, float],
        windows: list[Window],
        recorded_lr: Mapping[int, float] | None,
        where: str,
    ) -> None:
        table = None if recorded_lr is None else {int(k): float(v) for k, v in recorded_lr.items()}
        reference: dict[int, float] = {}
        for window in windows:
            value = None if table is None else _window_rate(table, window)
            if value is None and self.recorded:
                value = self.uniform(window, "lr")
            if value is not None:
                reference[window.key] = value
        differing = [
            key
            for key, rate in rates.items()
            if key in reference and not math.isclose(rate, reference[key], rel_tol=LR_RTOL)
        ]
        if differing:
            shown = ", ".join(f"{s}: {rates[s]:g} vs {reference[s]:g}" for s in differing[:5])
            warnings.warn(
                f"the configured {where} differs from the run's recorded schedule at "
                f"{len(differing)} step(s) ({shown}, ...); the configured value is used. Pass "
                f"{where}=None to use the recorded rates",
                UserWarning,
                stacklevel=5,
            )


# ---------------------------------------------------------------------------- helpers
def _legacy_values(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The one set of values of an AdamW dynamics entry recorded without update records."""
    betas = entry.get("betas", (0.9, 0.999))
    return {
        "lr": float(entry.get("lr", 0.0)),
        "betas": [float(b) for b in betas],
        "eps": float(entry.get("eps", 1e-8)),
        "weight_decay": float(entry.get("weight_decay", 0.0)),
        "step": int(entry.get("step", 1)),
        "amsgrad": False,
        "maximize": False,
        "decoupled_weight_decay": True,  # AdamW-influence recorded AdamW runs only
    }


def _legacy_value(values: Mapping[str, Any] | None, key: str) -> float:
    if values is None:
        raise ValueError(
            f"no recorded value of {key!r} for this step; pass the run's dynamics (or "
            "learning rates) covering every propagated step"
        )
    return float(_raw_group_value([values], 0, key))


def _raw_group_value(groups: list[Mapping[str, Any]], index: int, key: str) -> Any:
    group = groups[index]
    if key == "beta1":
        return float(group["betas"][0])
    if key == "beta2":
        return float(group["betas"][1])
    if key in ("amsgrad", "decoupled_weight_decay", "maximize"):
        return float(bool(group.get(key, False)))
    return float(group[key])


def _group_value(groups: list[Mapping[str, Any]], index: int, key: str, layer: str) -> float:
    if not 0 <= index < len(groups):
        raise ValueError(
            f"layer {layer!r}: the recorded update has {len(groups)} parameter groups but the "
            f"layer map names group {index}; the optimizer's groups changed during the run"
        )
    return _raw_group_value(groups, index, key)


def _checked_rate(value: object, where: str) -> float:
    rate = float(value)
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"{where} must be a finite learning rate >= 0, got {value!r}")
    return rate


def _window_rate(table: Mapping[int, float], window: Window) -> float | None:
    """The rate of a window: its key step's, else any of its steps'."""
    for step in (window.key, *window.steps):
        if step in table:
            return table[step]
    return None


def _covering(table: Mapping[int, float], windows: list[Window], where: str) -> dict[int, float]:
    """``{window key: rate}`` from a ``{step: lr}`` table; ``ValueError`` naming uncovered steps."""
    rates = {int(step): float(lr) for step, lr in table.items()}
    result, missing = {}, []
    for window in windows:
        rate = _window_rate(rates, window)
        if rate is None:
            missing.append(window.key)
        else:
            result[window.key] = _checked_rate(rate, f"{where}[{window.key}]")
    if missing:
        raise ValueError(
            f"no learning rate for propagated step(s) {sorted(missing)}: {where} covers steps "
            f"{sorted(rates)}; pass learning_rate={{step: lr}} covering every propagated step "
            "(or a single float)"
        )
    return result

"""The DVEmb recurrences over dense per-step gradients (private to ``dvemb.py``).

Notation (attribution.md §10): step ``s`` has per-sample gradients ``ĝ_b`` (rows
of ``G``, ``(B, d)``), learning rate ``η_s`` and curvature
``H_s = c Σ_b ĝ_b ĝ_bᵀ`` (``c = |B_s|`` for a mean loss, 1 for a sum). The
layers are split into *groups* sharing one curvature block: every layer
together (``hessian_mode="full"``) or one group per layer (``"diagonal"``).

* :class:`TrainOperator` carries ``M = I − Π_{k>s}(I − η_k H_k)`` per group
  (``(d_g, d_g)``); the step's embeddings are ``η_s (ĝ − Mĝ)``.
* :class:`QueryOperator` carries ``W = Q Π_{k>s}(I − η_k H_k)`` per layer
  (``(Q, d_l)``, ``Q`` queries); the step's rows are ``η_s <ĝ, w>``.

Both are updated once per step, after every block of the step was read.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from dattri_llm.attribution.utils import per_sample_layers

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import Gradient

HESSIAN_MODES = ("full", "diagonal")
OPERATOR_WARN_BYTES = 2 * 1024**3
LR_RTOL = 1e-6

Rows = dict[str, torch.Tensor]


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def curvature_scale(loss_reduction: str, batch: int) -> float:
    """``c`` of ``H = c Σ ĝĝᵀ``: ``|B|`` for a mean loss (ĝ = ∇ℓ/|B|), 1 for a sum."""
    return float(batch) if loss_reduction == "mean" else 1.0


def layer_groups(layers: list[str], hessian_mode: str) -> list[list[str]]:
    """Curvature blocks: ``[layers]`` (full) or ``[[layer], ...]`` (diagonal)."""
    return [list(layers)] if hessian_mode == "full" else [[name] for name in layers]


# ---------------------------------------------------------------------------- dense rows
def dense_rows(block: Gradient, dtype: torch.dtype, device: torch.device) -> Rows:
    """Per-sample gradients ``{layer: (B, d_l)}`` of a block's per-sample layers.

    Token axes are summed, factors materialized (``[W | b]`` layout), a
    broadcast layer's single row repeated for every sample.

    Raises:
        ValueError: the block holds no per-sample layer.
    """
    layers = per_sample_layers(block)
    if not layers:
        raise ValueError(
            "a training block holds only batch-level param_grad layers; DVEmb needs "
            "per-sample gradients (capture layers with the linear_io hook family)"
        )
    dense = block.select_layers(layers).aggregate().materialize()
    batch = block.batch_size
    rows = {}
    for name in layers:
        value = dense.data[name].to(device=device, dtype=dtype)
        value = value.reshape(value.shape[0], -1)
        rows[name] = value.expand(batch, -1) if value.shape[0] != batch else value
    return rows


def check_same_layers(rows: Rows, layers: list[str], step: int) -> None:
    """``ValueError`` when a block of ``step`` has other layers than the first block."""
    if sorted(rows) != layers:
        raise ValueError(
            f"training blocks disagree on layers: step {step} has {sorted(rows)}, earlier "
            f"blocks {layers}; record the whole run with the same hook config"
        )


# ---------------------------------------------------------------------------- learning rates
def resolve_learning_rates(
    learning_rate: float | Mapping[int, float] | None,
    steps: Iterable[int],
    recorded: Mapping[int, float] | None,
) -> dict[int, float]:
    """``{step: η}`` for every step in ``steps``.

    ``learning_rate`` is a float ≥ 0 (every step), a ``{step: lr}`` mapping, or
    ``None`` (the recorded schedule). A configured value that disagrees with
    ``recorded`` raises a ``UserWarning``; the configured value is used.

    Raises:
        ValueError: a negative or non-finite rate; a step without a rate;
            ``None`` without a recorded schedule.
        TypeError: ``learning_rate`` of another type.
    """
    steps = list(steps)
    if learning_rate is None:
        if recorded is None:
            raise ValueError(
                "learning_rate=None takes the learning rates from the run's lr_schedule.json, "
                "but the train source has none; pass learning_rate=<float> or {step: lr}"
            )
        return _covering(recorded, steps, "the recorded schedule (lr_schedule.json)")
    if isinstance(learning_rate, Mapping):
        lrs = _covering(learning_rate, steps, "learning_rate")
    elif isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
        lrs = dict.fromkeys(steps, _checked_rate(learning_rate, "learning_rate"))
    else:
        raise TypeError(
            f"learning_rate must be a float, a {{step: lr}} mapping or None, got "
            f"{type(learning_rate).__name__}"
        )
    if recorded is not None:
        _warn_on_disagreement(lrs, recorded)
    return lrs


def _checked_rate(value: object, where: str) -> float:
    """``float(value)``; ``ValueError`` unless finite and ≥ 0."""
    rate = float(value)
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"{where} must be a finite learning rate >= 0, got {value!r}")
    return rate


def _covering(table: Mapping[int, float], steps: list[int], where: str) -> dict[int, float]:
    """``table`` restricted to ``steps``; ``ValueError`` naming the steps it lacks."""
    rates = {int(step): lr for step, lr in table.items()}
    missing = [step for step in steps if step not in rates]
    if missing:
        raise ValueError(
            f"no learning rate for propagated step(s) {sorted(missing)}: {where} covers steps "
            f"{sorted(rates)}; pass learning_rate={{step: lr}} covering every propagated step "
            "(or a single float)"
        )
    return {step: _checked_rate(rates[step], f"{where}[{step}]") for step in steps}


def _warn_on_disagreement(lrs: Mapping[int, float], recorded: Mapping[int, float]) -> None:
    """``UserWarning`` listing the steps whose configured rate differs from the recorded one."""
    recorded = {int(step): float(lr) for step, lr in recorded.items()}
    differing = [
        step
        for step, lr in lrs.items()
        if step in recorded and not math.isclose(lr, recorded[step], rel_tol=LR_RTOL)
    ]
    if differing:
        shown = ", ".join(f"{s}: {lrs[s]:g} vs {recorded[s]:g}" for s in sorted(differing)[:5])
        warnings.warn(
            f"the configured learning_rate differs from the run's recorded schedule at "
            f"{len(differing)} step(s) ({shown}, ...); the configured value is used. Pass "
            "learning_rate=None to use the recorded schedule",
            UserWarning,
            stacklevel=4,
        )


# ---------------------------------------------------------------------------- operators
class TrainOperator:
    """``M`` per curvature group; train-side (embedding) propagation.

    Args:
        groups: the layer groups (see :func:`layer_groups`).
        dtype: dtype of ``M``.
        device: device of ``M``.
    """

    def __init__(self, groups: list[list[str]], dtype: torch.dtype, device: torch.device) -> None:
        self.groups = groups
        self.dtype, self.device = dtype, device
        self.operator: list[torch.Tensor | None] = [None] * len(groups)
        self.pending: list[torch.Tensor | None] = [None] * len(groups)

    @staticmethod
    def operator_bytes(widths: Mapping[str, int], groups: list[list[str]], itemsize: int) -> int:
        """Bytes of every group's ``(d_g, d_g)`` operator."""
        return sum(sum(widths[name] for name in group) ** 2 * itemsize for group in groups)

    def warn_if_large(self, rows: Rows) -> None:
        """``UserWarning`` when the operators of these widths exceed ~2 GiB."""
        widths = {name: value.shape[1] for name, value in rows.items()}
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        size = self.operator_bytes(widths, self.groups, itemsize)
        if size > OPERATOR_WARN_BYTES:
            largest = max(sum(widths[n] for n in group) for group in self.groups)
            warnings.warn(
                f"DVEmb's train-side operator holds {size / 1024**3:.1f} GiB (largest block "
                f"({largest}, {largest})); use propagation='test' (memory ∝ queries × d), "
                "hessian_mode='diagonal', a projection, or fewer layers",
                UserWarning,
                stacklevel=4,
            )

    def residuals(self, rows: Rows) -> Rows:
        """``{layer: (B, d_l)}`` rows of ``ĝ − Mĝ`` (``ĝ`` itself before any update)."""
        out = dict(rows)
        for group, operator in zip(self.groups, self.operator, strict=True):
            if operator is None:
                continue
            moved = torch.cat([rows[name] for name in group], dim=1) @ operator.T
            for name, part in zip(group, _split(moved, group, rows), strict=True):
                out[name] = rows[name] - part
        return out

    def accumulate(self, residuals: Rows, rows: Rows) -> None:
        """Add ``Σ_b (ĝ_b − Mĝ_b) ĝ_bᵀ`` of one block to the step's pending update."""
        for i, group in enumerate(self.groups):
            left = torch.cat([residuals[name] for name in group], dim=1)
            right = torch.cat([rows[name] for name in group], dim=1)
            term = left.T @ right
            self.pending[i] = term if self.pending[i] is None else self.pending[i] + term

    def step(self, scale: float) -> None:
        """``M ← M + scale · pending`` (``scale = η_s c``); clears the pending update."""
        for i, pending in enumerate(self.pending):
            if pending is None:
                continue
            update = scale * pending
            self.operator[i] = update if self.operator[i] is None else self.operator[i] + update
            self.pending[i] = None


class QueryOperator:
    """``W`` per layer; query-side propagation of ``(Q, d_l)`` query rows.

    Args:
        groups: the layer groups (see :func:`layer_groups`).
        queries: ``{layer: (Q, d_l)}`` for every propagated layer (zeros for a
            layer the queries lack).
    """

    def __init__(self, groups: list[list[str]], queries: Rows) -> None:
        self.groups = groups
        self.weights = dict(queries)
        self.pending: Rows = {}

    def alignments(self, rows: Rows) -> list[torch.Tensor]:
        """Per group ``(B, Q)`` alignments ``<ĝ_b, w_q>`` over the group's layers."""
        return [sum(rows[name] @ self.weights[name].T for name in group) for group in self.groups]

    def accumulate(self, alignments: list[torch.Tensor], rows: Rows) -> None:
        """Add ``Σ_b <ĝ_b, w> ĝ_b`` of one block to the step's pending update."""
        for group, align in zip(self.groups, alignments, strict=True):
            for name in group:
                term = align.T @ rows[name]
                previous = self.pending.get(name)
                self.pending[name] = term if previous is None else previous + term

    def step(self, scale: float) -> None:
        """``W ← W − scale · pending`` (``scale = η_s c``); clears the pending update."""
        for name, pending in self.pending.items():
            self.weights[name] = self.weights[name] - scale * pending
        self.pending = {}


def _split(values: torch.Tensor, group: list[str], rows: Rows) -> tuple[torch.Tensor, ...]:
    """Split concatenated group columns back into the group's layers."""
    return torch.split(values, [rows[name].shape[1] for name in group], dim=1)

"""The exact metagradient's two passes over a recorded run: a forward replay, a reverse sweep.

:class:`MetagradientSweep` replays a run recorded as ``TrajectorySnapshots``
(each update's parameters and micro-batches) plus its dynamics (windows, loss
divisor, every group's values per update), through
:func:`~.unroll.adam_update`:

* :meth:`MetagradientSweep.replay` runs the updates forward from ``m = v = 0``,
  each from its snapshot parameters ``θ_t``; it saves every update's moments
  ``(m_t, v_t)`` to a scratch directory and returns the final parameters
  ``θ_T``. Each replayed ``θ_{t+1}`` is compared with the next snapshot and
  each clip coefficient with the recorded one (a ``UserWarning`` once each
  when they differ: nondeterminism or dynamics the replay does not model);
* :meth:`MetagradientSweep.reverse` carries the queries' adjoints
  ``(θ̄, m̄, v̄)`` from ``θ_T`` back to the first emitted update. Per update it
  rebuilds the update's graph once (loss, gradient with its graph, clip, Adam
  step) and takes one vector-Jacobian product per query, giving the adjoints
  before the update and ``w̄``, the derivative of the query loss in the
  weight of each of the window's samples.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dattri_llm.attribution.algorithm.trajectory.run import Window
from dattri_llm.attribution.algorithm.trajectory.unroll import (
    GroupValues,
    SampleLossFn,
    adam_update,
    batch_size_of,
    bound_parameters,
    cast_batch,
    per_sample_losses,
    window_loss,
)
from dattri_llm.attribution.algorithm.vjp import batched_vjp, looped_vjp, math_attention
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots
from dattri_llm.utils.atomic import atomic_torch_save

__all__ = ["MetagradientSweep", "UnrollSetup"]

_CLIP_RTOL = 1e-3
_LOSS_RTOL = 1e-4
Tensors = list[torch.Tensor]


@dataclass
class UnrollSetup:
    """What the replay needs besides the snapshots.

    Attributes:
        model: the model the losses run on (its parameters are swapped for the
            replayed ones; cast to ``dtype`` beforehand).
        names: the parameters the optimizer holds (differentiated), in order.
        groups: ``{name: parameter group index}`` of each of ``names``.
        loss_fn: the train loss ``loss_fn(model, batch) -> scalar`` the loop used.
        sample_loss_fn: optional ``(model, batch) -> (B,)`` per-sample losses.
        reduction: ``"sum"`` or ``"mean"``, the loop's micro-batch reduction.
        max_grad_norm: the loop's clip threshold (``None``: no clip).
        device, dtype: where and in what the passes compute.
        cast_inputs: cast floating batch tensors to ``dtype``.
        replay_rtol: relative tolerance of the replay checks.
        query_block: queries per batched vector-Jacobian product in the reverse
            sweep (``None``: all; 1: one backward per query).
    """

    model: nn.Module
    names: list[str]
    groups: dict[str, int]
    loss_fn: SampleLossFn
    sample_loss_fn: SampleLossFn | None
    reduction: str
    max_grad_norm: float | None
    device: torch.device
    dtype: torch.dtype
    cast_inputs: bool
    replay_rtol: float
    query_block: int | None = None


class MetagradientSweep:
    """The forward replay and reverse sweep of one recorded run (see the module docstring).

    Args:
        setup: the model, parameters, loss and optimizer settings.
        snapshots: the run's snapshots (parameters at each window start, batches).
        windows: the propagated updates, ascending, the first one the run's first.
        scratch: a directory for the moments of every update.
        progress: wraps the loops' windows in a progress bar.
    """

    def __init__(
        self,
        setup: UnrollSetup,
        snapshots: TrajectorySnapshots,
        windows: list[Window],
        scratch: Path,
        progress: Callable[[Iterable[Window], str], Iterable[Window]] | None = None,
    ) -> None:
        self.setup = setup
        self.snapshots = snapshots
        self.windows = windows
        self.scratch = Path(scratch)
        self.progress = progress or (lambda items, desc: items)
        self.replay_errors: dict[int, float] = {}
        self.clip_coefficients: dict[int, float] = {}
        self._warned: set[str] = set()
        self._batched: bool | None = None  # whether the queries' products run batched

    # ------------------------------------------------------------------ inputs
    def parameters(self, step: int, *, grad: bool) -> dict[str, torch.Tensor]:
        """Every stored parameter of ``step`` on the device in ``dtype``; ``grad``: the
        optimizer's ones require grad (fresh leaves)."""
        s = self.setup
        stored = self.snapshots.parameter_dict(step)
        missing = sorted(set(s.names) - set(stored))
        if missing:
            raise ValueError(
                f"the snapshot of step {step} lacks the trained parameters {missing}; record "
                "every parameter the optimizer holds (TrajectorySnapshots.save_parameters stores "
                "the requires_grad ones)"
            )
        out = {
            name: value.to(device=s.device, dtype=s.dtype) if value.is_floating_point() else value
            for name, value in stored.items()
        }
        if grad:
            for name in s.names:
                out[name] = out[name].detach().requires_grad_(True)
        return out

    def batches(self, window: Window) -> list[Any]:
        """The window's micro-batches, on the device (floating tensors in ``dtype`` when cast)."""
        s = self.setup
        dtype = s.dtype if s.cast_inputs else None
        return [
            cast_batch(self.snapshots.load_batch(step), s.device, dtype) for step in window.steps
        ]

    def values(self, window: Window) -> list[GroupValues]:
        """Each differentiated parameter's group values at ``window``."""
        groups = window.update["groups"]
        per_group = [GroupValues.from_record(group) for group in groups]
        return [per_group[self.setup.groups[name]] for name in self.setup.names]

    def _moments_file(self, window: Window) -> Path:
        return self.scratch / f"moments_{window.key:08d}.pt"

    def _moments(self, window: Window) -> tuple[Tensors, Tensors]:
        stored = torch.load(self._moments_file(window), map_location="cpu", weights_only=True)
        s = self.setup
        m = [t.to(device=s.device, dtype=s.dtype).requires_grad_(True) for t in stored["m"]]
        v = [t.to(device=s.device, dtype=s.dtype).requires_grad_(True) for t in stored["v"]]
        return m, v

    # ------------------------------------------------------------------ one update
    def _update(
        self,
        window: Window,
        theta: dict[str, torch.Tensor],
        m: Tensors,
        v: Tensors,
        weights: Sequence[torch.Tensor],
        batches: Sequence[Any],
        *,
        create_graph: bool,
    ) -> tuple[Tensors, Tensors, Tensors, torch.Tensor]:
        """``(θ', m', v', c)`` of ``window`` from ``theta`` (every stored parameter)."""
        s = self.setup
        leaves = [theta[name] for name in s.names]
        with bound_parameters(s.model, theta), math_attention():
            loss = window_loss(
                s.model,
                batches,
                weights,
                s.loss_fn,
                reduction=s.reduction,
                divisor=window.loss_divisor,
                sample_loss_fn=s.sample_loss_fn,
            )
            grads = torch.autograd.grad(loss, leaves, create_graph=create_graph, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
        with torch.set_grad_enabled(create_graph):
            return adam_update(
                leaves, m, v, grads, self.values(window), max_grad_norm=s.max_grad_norm
            )

    # ------------------------------------------------------------------ forward
    def replay(self) -> dict[str, torch.Tensor]:
        """Replay every window forward; save the moments; return ``θ_T`` (every stored parameter).

        ``self.replay_errors[key]``: the relative difference of the replayed
        ``θ_{t+1}`` from the next window's snapshot; ``self.clip_coefficients``:
        the replayed clip coefficients.
        """
        s = self.setup
        m: Tensors | None = None
        v: Tensors | None = None
        final: dict[str, torch.Tensor] = {}
        for index, window in enumerate(self.progress(self.windows, "replay")):
            theta = self.parameters(window.steps[0], grad=True)
            if m is None or v is None:
                m = [torch.zeros_like(theta[name]) for name in s.names]
                v = [torch.zeros_like(theta[name]) for name in s.names]
            atomic_torch_save(
                {"m": [t.detach().cpu() for t in m], "v": [t.detach().cpu() for t in v]},
                self._moments_file(window),
            )
            batches = self.batches(window)
            if index == 0:
                self._check_reduction(window, theta, batches[0])
            weights = [
                torch.ones(batch_size_of(b), device=s.device, dtype=s.dtype) for b in batches
            ]
            new_theta, m, v, coef = self._update(
                window, theta, m, v, weights, batches, create_graph=False
            )
            m, v = [t.detach() for t in m], [t.detach() for t in v]
            final = {**theta, **dict(zip(s.names, (t.detach() for t in new_theta)))}
            final = {name: t.detach() for name, t in final.items()}
            self._check_clip(window, float(coef))
            if index + 1 < len(self.windows):
                self._check_replay(window, final, self.windows[index + 1].steps[0])
        return final

    def _check_replay(
        self, window: Window, replayed: Mapping[str, torch.Tensor], step: int
    ) -> None:
        stored = self.parameters(step, grad=False)
        diff = sum(float((replayed[n] - stored[n]).double().pow(2).sum()) for n in self.setup.names)
        norm = sum(float(stored[n].double().pow(2).sum()) for n in self.setup.names)
        error = math.sqrt(diff) / max(math.sqrt(norm), 1e-30)
        self.replay_errors[window.key] = error
        if error > self.setup.replay_rtol:
            self._warn_once(
                "replay",
                f"the replayed parameters after the update ending at step {window.key} differ "
                f"from the snapshot of step {step} by {error:.3e} (relative; tolerance "
                f"{self.setup.replay_rtol:g}): the run is not reproduced exactly (nondeterminism, "
                "dropout or other randomness, a loss_reduction / max_grad_norm that is not the "
                "loop's, or dynamics the replay does not model). The metagradient is exact for "
                "the replayed run, not the recorded one",
            )

    def _check_clip(self, window: Window, coef: float) -> None:
        self.clip_coefficients[window.key] = coef
        if window.update is None or "clip_coef" not in window.update:
            return
        recorded = float(window.update["clip_coef"])
        if abs(coef - recorded) > _CLIP_RTOL * max(abs(recorded), 1e-12):
            self._warn_once(
                "clip",
                f"the replayed clip coefficient of the update ending at step {window.key} is "
                f"{coef:.6g} but the run recorded {recorded:.6g}: pass the loop's max_grad_norm "
                f"(the replay used {self.setup.max_grad_norm})",
            )

    def _check_reduction(self, window: Window, theta: dict[str, torch.Tensor], batch: Any) -> None:
        """Warn when the loss of the first micro-batch is not its per-sample losses reduced
        as ``reduction`` says."""
        s = self.setup
        with torch.no_grad(), bound_parameters(s.model, theta), math_attention():
            whole = float(s.loss_fn(s.model, batch))
            losses = per_sample_losses(s.model, batch, s.loss_fn, s.sample_loss_fn)
        parts = float(losses.sum() if s.reduction == "sum" else losses.mean())
        if abs(whole - parts) > _LOSS_RTOL * max(abs(whole), 1e-12):
            self._warn_once(
                "reduction",
                f"the train loss of the batch of step {window.steps[0]} is {whole:.6g} but its "
                f"per-sample losses reduce to {parts:.6g} under loss_reduction="
                f"{s.reduction!r}: the loss is not a {s.reduction} of per-sample losses (pass the "
                "loss_reduction the loop used, or sample_loss_func)",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=4)

    # ------------------------------------------------------------------ reverse
    def reverse(self, adjoint: Tensors, first: int, emitted: set[int]) -> dict[int, torch.Tensor]:
        """Carry the query adjoints from ``θ_T`` back through ``windows[first:]``.

        Args:
            adjoint: ``θ̄`` per parameter, ``(n_test, *shape)``: the query
                losses' gradients at ``θ_T``.
            first: index of the earliest window to sweep.
            emitted: store steps whose rows are kept.

        Returns:
            ``{step: (B_step, n_test)}``: ``dL_j/dw_b`` of each emitted micro-batch's samples.
        """
        s = self.setup
        theta_bar = list(adjoint)
        m_bar = [torch.zeros_like(a) for a in adjoint]
        v_bar = [torch.zeros_like(a) for a in adjoint]
        rows: dict[int, torch.Tensor] = {}
        for window in self.progress(list(reversed(self.windows[first:])), "reverse"):
            theta = self.parameters(window.steps[0], grad=True)
            m, v = self._moments(window)
            batches = self.batches(window)
            weights = [
                torch.ones(batch_size_of(b), device=s.device, dtype=s.dtype, requires_grad=True)
                for b in batches
            ]
            new_theta, new_m, new_v, _ = self._update(
                window, theta, m, v, weights, batches, create_graph=True
            )
            outputs = [*new_theta, *new_m, *new_v]
            leaves = [theta[name] for name in s.names]
            inputs = [*leaves, *m, *v, *weights]
            got = self._vjps(outputs, inputs, [*theta_bar, *m_bar, *v_bar])
            carried = got[: len(outputs)]
            w_bar = [block.T for block in got[len(outputs) :]]  # (B_k, n_test)
            count = len(s.names)
            theta_bar = carried[:count]
            m_bar = carried[count : 2 * count]
            v_bar = carried[2 * count :]
            for step, block in zip(window.steps, w_bar, strict=True):
                if step in emitted:
                    rows[step] = block.detach().cpu()
            del outputs, new_theta, new_m, new_v
        return rows

    def _vjps(self, outputs: Tensors, inputs: Tensors, bars: Tensors) -> list[torch.Tensor]:
        """``(n_test, *input.shape)`` per input: the products of the cotangents ``bars``
        (``(n_test, *output.shape)`` each) with the outputs' Jacobian in the inputs.

        ``setup.query_block`` queries per batched backward (``is_grads_batched``;
        ``None``: all at once; 1: one backward per query). When an operation of
        the graph has no batching rule, one backward per query from then on.
        """
        n_test = bars[0].shape[0]
        result = [torch.zeros(n_test, *x.shape, device=x.device, dtype=x.dtype) for x in inputs]
        block = self.setup.query_block or n_test
        starts = list(range(0, n_test, block))
        for position, start in enumerate(starts):
            chunk = slice(start, min(start + block, n_test))
            last = position == len(starts) - 1
            cotangents = [bar[chunk] for bar in bars]
            got = self._batched_vjp(outputs, inputs, cotangents, last)
            if got is None:  # one query at a time
                got = looped_vjp(outputs, inputs, cotangents, retain_graph=not last)
            for target, value in zip(result, got, strict=True):
                if value is not None:
                    target[chunk] = value
        return result

    def _batched_vjp(
        self, outputs: Tensors, inputs: Tensors, bars: Tensors, last: bool
    ) -> tuple[torch.Tensor | None, ...] | None:
        """One batched backward over the leading axis of ``bars`` (``None``: not batchable)."""
        if self._batched is False or bars[0].shape[0] == 1:
            return None
        got = batched_vjp(outputs, inputs, bars, retain_graph=self._batched is None or not last)
        self._batched = got is not None
        return got

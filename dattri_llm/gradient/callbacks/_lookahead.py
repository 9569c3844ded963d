"""Horizon-K look-ahead scores of a batch under frozen Adam / AdamW dynamics.

Used by :class:`~dattri_llm.gradient.callbacks.data_selection_callback.DataSelectionCallback`
with ``score="lookahead"``. At step ``t`` the optimizer state of every captured
parameter is ``s = (θ, m, v)`` and the coming update is the map
``s' = F(s, g)``. With ``J`` the Jacobian of ``F`` in ``s`` (held fixed: frozen
dynamics) and ``q`` the target gradient (held fixed), sample ``i`` scores

    ``score_i = −[q, 0, 0]·J^{K−1}·(∂s'/∂g)·C'·t_i``

(minus the first-order change of the target loss ``K`` updates later when the
sample's share ``t_i`` of this step's gradient is up-weighted; positive =
helpful). ``C'`` is the Jacobian of gradient-norm clipping (``c·I`` without an
active clip). The query-side row ``U = [U_θ | U_m | U_v]`` is carried through
``J`` with the AdamW-influence kernels of ``ops.adamw_influence``; the optional
Gauss–Newton coupling ``∂g/∂θ ≈ C'·B·Σ_b t_b t_bᵀ`` adds one Grad-Dot of the
batch rows against a dense vector and one weighted sum of the rows per step.

All vectors are dense float32 ``(N,)`` over the captured parameters laid end
to end (each flattened in its own layout; a parameter shared by two captured
layers is one block), ordered so that the parameters of one optimizer update
setting form one contiguous span.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from dattri_llm.gradient.callbacks import _selection as sel
from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.adamw_influence import (
    adam_preconditioner,
    adamw_influence_push,
    adamw_influence_transition,
)

SCORES = ("grad_dot", "lookahead")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon


# ----------------------------------------------------------------------------- options


def check_options(
    score: str,
    horizon: int,
    optimizer: torch.optim.Optimizer | None,
    max_grad_norm: float | None,
    lookahead_curvature: bool,
) -> None:
    """``ValueError`` / ``TypeError`` for a bad look-ahead option, naming the fix."""
    if score not in SCORES:
        raise ValueError(f"DataSelectionCallback: score must be one of {SCORES}, got {score!r}.")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"DataSelectionCallback: horizon must be an int >= 1, got {horizon!r}.")
    if not isinstance(lookahead_curvature, bool):
        raise TypeError(
            f"DataSelectionCallback: lookahead_curvature must be a bool, got "
            f"{lookahead_curvature!r}."
        )
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, (int, float))
        or not max_grad_norm > 0
    ):
        raise ValueError(
            f"DataSelectionCallback: max_grad_norm must be a float > 0 or None, got "
            f"{max_grad_norm!r}."
        )
    if score == "grad_dot":
        if horizon != 1 or optimizer is not None or max_grad_norm is not None:
            raise ValueError(
                "DataSelectionCallback: horizon, optimizer and max_grad_norm are used only by "
                "score='lookahead'; pass score='lookahead' or leave them at their defaults."
            )
        return
    if optimizer is None:
        raise ValueError(
            "DataSelectionCallback: score='lookahead' needs optimizer= (the torch.optim.Adam / "
            "AdamW instance that steps the model)."
        )
    if not isinstance(optimizer, torch.optim.Adam):
        raise ValueError(
            f"DataSelectionCallback: score='lookahead' models torch.optim.Adam / AdamW updates, "
            f"got {type(optimizer).__name__}; use score='grad_dot' with other optimizers."
        )
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag, False):
                raise ValueError(
                    f"DataSelectionCallback: score='lookahead' does not model Adam with "
                    f"{flag}=True; build the optimizer with {flag}=False or use "
                    "score='grad_dot'."
                )


# ----------------------------------------------------------------------------- the update


class _Settings(NamedTuple):
    """One Adam / AdamW update setting: ``decay`` decoupled (AdamW), ``l2`` coupled (Adam)."""

    lr: float
    step: int
    beta1: float
    beta2: float
    eps: float
    decay: float
    l2: float


def _settings(group: dict, state: dict) -> _Settings:
    """The coming update's setting of a parameter (``step`` counts this update)."""
    wd = float(group["weight_decay"])
    decoupled = bool(group.get("decoupled_weight_decay", False))
    beta1, beta2 = (float(b) for b in group["betas"])
    return _Settings(
        lr=float(group["lr"]),
        step=int(float(state.get("step", 0))) + 1,
        beta1=beta1,
        beta2=beta2,
        eps=float(group["eps"]),
        decay=wd if decoupled else 0.0,
        l2=0.0 if decoupled else wd,
    )


class _Layout:
    """The captured parameters end to end, with the batch's per-sample gradients.

    ``rows : (B, N)`` holds ``t_b`` (a shared parameter's rows summed over its
    layers); ``spans`` the ``(start, stop)`` of each parameter; ``runs`` the
    contiguous spans of parameters stepped with one ``_Settings``.
    """

    def __init__(
        self, record: GradientRecord, root: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Order the parameters by optimizer setting and materialize the rows once.

        Raises:
            ValueError: a captured parameter outside ``optimizer``.
        """
        gradient = record.gradient
        self.modules = sel.removable_layers(record, root)
        self.batch = gradient.batch_size
        members = {n: sel.layer_params(m) for n, m in self.modules.items()}
        unique = {id(p): p for params in members.values() for p in params}
        groups = {id(p): (i, g) for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        missing = sorted(tuple(p.shape) for k, p in unique.items() if k not in groups)
        if missing:
            raise ValueError(
                f"DataSelectionCallback(score='lookahead'): captured parameters of shapes "
                f"{missing} are not in the optimizer; pass the optimizer that steps every "
                "captured parameter."
            )
        settings = {
            k: _settings(groups[k][1], optimizer.state.get(p, {})) for k, p in unique.items()
        }
        self.params = sorted(unique.values(), key=lambda p: (groups[id(p)][0], settings[id(p)]))
        self.spans, self.runs, start = {}, [], 0
        for p in self.params:
            self.spans[id(p)] = slice(start, start + p.numel())
            if self.runs and self.runs[-1][1] == settings[id(p)]:
                self.runs[-1] = (slice(self.runs[-1][0].start, start + p.numel()), settings[id(p)])
            else:
                self.runs.append((self.spans[id(p)], settings[id(p)]))
            start += p.numel()
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.rows = torch.zeros(self.batch, start, device=self.device)
        uses = Counter(id(p) for params in members.values() for p in params)
        shared = {k for k, n in uses.items() if n > 1}
        self.pieces: dict[str, list[tuple[slice, torch.Tensor | None]]] = {}
        for name, module in self.modules.items():
            value, kind = gradient.data[name], gradient.layer_types[name]
            self.pieces[name] = []
            for p, rows in sel.sample_rows(value, kind, module):
                span = self.spans[id(p)]
                self.rows[:, span] += rows.to(self.rows)
                self.pieces[name].append((span, rows.to(self.rows) if id(p) in shared else None))

    def flat(self, tensor_of: Callable[[nn.Parameter], torch.Tensor]) -> torch.Tensor:
        """``(N,)`` float32 of ``tensor_of(param)`` for every parameter, end to end."""
        return torch.cat([tensor_of(p).detach().reshape(-1).to(self.rows) for p in self.params])

    def dot(self, x: torch.Tensor) -> torch.Tensor:
        """``(B,)`` with ``<t_b, x>`` (Grad-Dot of the rows against ``x : (N,)``)."""
        return self.rows @ x

    def layer_dots(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{layer: (B,)}``: each layer's part of :meth:`dot`."""
        return {
            name: sum(
                (self.rows[:, span] if own is None else own) @ x[span] for span, own in pieces
            )
            for name, pieces in self.pieces.items()
            if pieces
        }

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``(N,)`` with ``Σ_b w_b t_b`` for ``weights : (B,)``."""
        return weights.to(self.rows) @ self.rows


class _Update(NamedTuple):
    """The coming update linearized at the current state, per coordinate ``(N,)``.

    ``push : (3, N)`` is ``−∂s'/∂g`` (rows ``θ, m, v``); ``d``, ``s`` the
    preconditioner pieces; ``l2`` the coupled weight decay.
    """

    push: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    l2: torch.Tensor


def _linearize(
    layout: _Layout, optimizer: torch.optim.Optimizer, grad: torch.Tensor, clip: float
) -> _Update:
    """Moments of the coming step from ``g = clip·grad (+ l2·θ)``, then ``D``, ``S``, ``push``."""

    def moment(key: str) -> Callable[[nn.Parameter], torch.Tensor]:
        return lambda p: optimizer.state.get(p, {}).get(key, torch.zeros_like(p))

    theta = layout.flat(lambda p: p)
    m_old, v_old = layout.flat(moment("exp_avg")), layout.flat(moment("exp_avg_sq"))
    push = theta.new_empty(3, theta.numel())
    d, s, l2 = torch.empty_like(theta), torch.empty_like(theta), torch.zeros_like(theta)
    for span, st in layout.runs:
        l2[span] = st.l2
        g = clip * grad[span] + st.l2 * theta[span]  # what the moments consume
        m = st.beta1 * m_old[span] + (1.0 - st.beta1) * g
        v = st.beta2 * v_old[span] + (1.0 - st.beta2) * g.square()
        d[span], s[span] = adam_preconditioner(
            m / (1.0 - st.beta1**st.step), v / (1.0 - st.beta2**st.step), eps=st.eps
        )
        push[:, span] = adamw_influence_push(
            torch.ones_like(g)[None],
            g,
            d[span],
            s[span],
            lr=st.lr,
            step=st.step,
            beta1=st.beta1,
            beta2=st.beta2,
        ).reshape(3, -1)
    return _Update(push, d, s, l2)


class _Clip:
    """Jacobian ``C'`` of ``g ↦ c(g)·g`` restricted to the captured coordinates.

    ``c = min(1, max_norm/(‖G‖+1e-6))`` with ``‖G‖`` over every parameter of the
    model holding a gradient; when the clip is active ``C'x = c·(x − G·(G·x)/
    (‖G‖(‖G‖+1e-6)))`` (``G : (N,)`` the captured raw gradient), otherwise ``C' = I``.
    """

    def __init__(self, root: nn.Module, grad: torch.Tensor, max_norm: float | None) -> None:
        """Read the clip coefficient from the gradients of ``root``'s parameters."""
        self.coef, self.active, self.grad, self.norm = 1.0, False, grad, 0.0
        if max_norm is None:
            return
        norms = [p.grad.detach().float().norm() for p in root.parameters() if p.grad is not None]
        self.norm = float(torch.stack(norms).norm()) if norms else 0.0
        ratio = max_norm / (self.norm + CLIP_EPS)
        self.active = ratio < 1.0
        self.coef = min(1.0, ratio)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``C'x``."""
        if not self.active:
            return x
        along = (self.grad @ x) / (self.norm * (self.norm + CLIP_EPS))
        return self.coef * (x - along * self.grad)


# ----------------------------------------------------------------------------- scores


def _target(layout: _Layout, target: Gradient | None) -> torch.Tensor:
    """``q : (N,)``: the target's summed rows over the captured parameters (0 elsewhere)."""
    if target is None:
        return layout.weighted_sum(torch.ones(layout.batch))
    q = torch.zeros_like(layout.rows[0])
    shared = False
    layers = set(sel.sample_layers(target))  # param_grad payloads have no rows
    for name, module in layout.modules.items():
        if name not in layers:
            continue
        value = target.data[name]
        if isinstance(value, Factorized):
            weights = torch.ones(value.activation.shape[value.batch_axis])
            deltas = sel.layer_deltas(value, target.layer_types[name], module, weights)
        else:
            deltas = sel.dense_layer_deltas(value, target.layer_types[name], module)
        for p, delta in deltas:
            q[layout.spans[id(p)]] += delta.reshape(-1).to(q)
            shared = True
    if not shared:
        raise ValueError(
            f"DataSelectionCallback: the target shares no captured per-sample layer with the "
            f"record (captured layers {sorted(layout.modules)}, target layers "
            f"{sorted(target.data)})."
        )
    return q


def _grad_adjoint(u: torch.Tensor, update: _Update) -> torch.Tensor:
    """``U·∂s'/∂g : (N,)`` for ``u : (3, N)`` (``push`` is ``−∂s'/∂g``)."""
    return -(u * update.push).sum(dim=0)


def _transition(u: torch.Tensor, update: _Update, layout: _Layout) -> torch.Tensor:
    """``U·J`` without the gradient's response to ``θ`` (momentum, second moment, decay)."""
    out = torch.empty_like(u)
    for span, st in layout.runs:
        blocks = adamw_influence_transition(
            u[0:1, span],
            u[1:2, span],
            u[2:3, span],
            update.d[span],
            update.s[span],
            lr=st.lr,
            step=st.step,
            beta1=st.beta1,
            beta2=st.beta2,
            weight_decay=st.decay,
        )
        out[:, span] = torch.cat(blocks)
    return out


def lookahead_scores(
    record: GradientRecord,
    root: nn.Module,
    target: Gradient | None,
    optimizer: torch.optim.Optimizer,
    *,
    horizon: int,
    max_grad_norm: float | None,
    curvature: bool,
) -> dict[str, torch.Tensor]:
    """``{layer: (B,)}`` look-ahead scores of the batch (their layer sum is ``score_i``).

    Args:
        record: the step's captured record (raw factors).
        root: the unwrapped model; ``param.grad`` holds the gradient the step applies
            (before clipping).
        target: the target Gradient (rows summed), or ``None`` for the batch itself.
        optimizer: the ``torch.optim.Adam`` / ``AdamW`` about to step.
        horizon: ``K ≥ 1``, the number of updates looked ahead.
        max_grad_norm: the clip norm applied before the step, or ``None``.
        curvature: add the batch's Gauss–Newton coupling ``∂g/∂θ ≈ C'·B·Σ_b t_b t_bᵀ``.

    Raises:
        ValueError: a captured parameter outside ``optimizer``; a dense target layer
            that cannot be split into weight and bias; a target sharing no captured
            layer.
    """
    layout = _Layout(record, root, optimizer)
    if not layout.params:
        return {}
    grad = layout.flat(lambda p: p.grad)
    clip = _Clip(root, grad, max_grad_norm)
    update = _linearize(layout, optimizer, grad, clip.coef)
    u = grad.new_zeros(3, grad.numel())
    u[0] = _target(layout, target)
    for _ in range(horizon - 1):
        u_g = _grad_adjoint(u, update)
        u = _transition(u, update, layout)
        u[0] += update.l2 * u_g
        if curvature:
            u[0] += layout.weighted_sum(layout.batch * layout.dot(clip.apply(u_g)))
    r = clip.apply(_grad_adjoint(u, update))
    return {name: -score for name, score in layout.layer_dots(r).items()}

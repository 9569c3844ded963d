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

All vectors are dense, float32, flattened in each parameter's own layout and
keyed by ``id(param)`` (a parameter shared by two captured layers is one block).
"""

from __future__ import annotations

from dataclasses import dataclass

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

Vectors = dict[int, torch.Tensor]  # id(param) -> (k,) float32


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


# ----------------------------------------------------------------------------- batch rows


class BatchRows:
    """The batch's per-sample gradients ``t_b`` of every captured parameter.

    Args:
        record: the step's record; its factorized per-sample layers under ``root``
            (``_selection.removable_layers``) are materialized once.
        root: the unwrapped model.
    """

    def __init__(self, record: GradientRecord, root: nn.Module) -> None:
        """Materialize the rows: ``B·numel`` float32 numbers per captured parameter."""
        gradient = record.gradient
        self.modules = sel.removable_layers(record, root)
        self.batch = gradient.batch_size
        self.layers = {
            name: sel.sample_rows(gradient.data[name], gradient.layer_types[name], module)
            for name, module in self.modules.items()
        }
        self.params = {id(p): p for pairs in self.layers.values() for p, _ in pairs}

    def dots(self, x: Vectors) -> dict[str, torch.Tensor]:
        """``{layer: (B,)}`` with ``Σ_{param of layer} <t_b, x>`` (Grad-Dot against ``x``)."""
        return {
            name: sum(rows @ x[id(p)].to(rows.device) for p, rows in pairs)
            for name, pairs in self.layers.items()
            if pairs
        }

    def weighted_sum(self, weights: torch.Tensor) -> Vectors:
        """``{id(param): (k,)}`` with ``Σ_b w_b t_b`` for ``weights : (B,)``."""
        out: Vectors = {}
        for pairs in self.layers.values():
            for p, rows in pairs:
                part = weights.to(rows) @ rows
                out[id(p)] = out[id(p)] + part if id(p) in out else part
        return out


# ----------------------------------------------------------------------------- the update


@dataclass(frozen=True)
class _Update:
    """The coming Adam / AdamW update of one parameter, linearized at the current state.

    ``push`` holds ``−∂s'/∂g`` per coordinate ``(3, k)`` (rows ``θ, m, v``);
    ``d``, ``s`` the preconditioner pieces; ``decay`` the decoupled weight decay,
    ``l2`` the coupled one (``torch.optim.Adam``).
    """

    push: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    lr: float
    step: int
    beta1: float
    beta2: float
    decay: float
    l2: float


def _optimizer_groups(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def _update(
    param: nn.Parameter, grad: torch.Tensor, group: dict, state: dict, clip: float
) -> _Update:
    """The linearized update of ``param`` whose flat raw gradient is ``grad : (k,)``."""
    theta = param.detach().reshape(-1).float()
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    decoupled = bool(group.get("decoupled_weight_decay", False))
    step = int(float(state.get("step", 0))) + 1
    m = state.get("exp_avg", torch.zeros_like(param)).detach().reshape(-1).float()
    v = state.get("exp_avg_sq", torch.zeros_like(param)).detach().reshape(-1).float()
    l2 = 0.0 if decoupled else wd
    g = clip * grad + l2 * theta  # what the moments consume
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g.square()
    d, s = adam_preconditioner(
        m / (1.0 - beta1**step), v / (1.0 - beta2**step), eps=float(group["eps"])
    )
    push = adamw_influence_push(
        torch.ones_like(g)[None], g, d, s, lr=lr, step=step, beta1=beta1, beta2=beta2
    ).reshape(3, -1)
    decay = wd if decoupled else 0.0
    return _Update(push, d, s, lr, step, beta1, beta2, decay, l2)


class _Clip:
    """Jacobian ``C'`` of ``g ↦ c(g)·g`` restricted to the captured coordinates.

    ``c = min(1, max_norm/(‖G‖+1e-6))`` with ``‖G‖`` over every parameter of the
    model holding a gradient; when the clip is active ``C'x = c·(x − G·(G·x)/
    (‖G‖(‖G‖+1e-6)))`` (``G·x`` over the captured coordinates, where ``x`` lives),
    otherwise ``C' = I``.
    """

    def __init__(self, root: nn.Module, grads: Vectors, max_norm: float | None) -> None:
        """Read the clip coefficient from the gradients of ``root``'s parameters."""
        self.coef, self.active, self.grads, self.norm = 1.0, False, grads, 0.0
        if max_norm is None:
            return
        norms = [p.grad.detach().float().norm() for p in root.parameters() if p.grad is not None]
        self.norm = float(torch.stack(norms).norm()) if norms else 0.0
        ratio = max_norm / (self.norm + CLIP_EPS)
        self.active = ratio < 1.0
        self.coef = min(1.0, ratio)

    def apply(self, x: Vectors) -> Vectors:
        """``C'x``."""
        if not self.active:
            return x
        along = sum(float(self.grads[k] @ x[k]) for k in x)
        along /= self.norm * (self.norm + CLIP_EPS)
        return {k: self.coef * (x[k] - along * self.grads[k]) for k in x}


# ----------------------------------------------------------------------------- scores


def _target(rows: BatchRows, target: Gradient | None) -> Vectors:
    """``q``: the target's summed rows over the captured parameters (zeros elsewhere)."""
    if target is None:
        return rows.weighted_sum(torch.ones(rows.batch))
    q = {k: torch.zeros(p.numel(), device=p.device) for k, p in rows.params.items()}
    shared = False
    for name, module in rows.modules.items():
        value = target.data.get(name)
        if value is None:
            continue
        if not isinstance(value, Factorized):
            raise ValueError(
                f"DataSelectionCallback(score='lookahead'): target layer {name!r} is dense; the "
                "look-ahead needs a factorized target (capture it with capture_style="
                "'factorized' and no projection), or use score='grad_dot'."
            )
        weights = torch.ones(value.activation.shape[value.batch_axis])
        for p, delta in sel.layer_deltas(value, target.layer_types[name], module, weights):
            q[id(p)] += delta.reshape(-1).to(q[id(p)])
            shared = True
    if not shared:
        raise ValueError(
            f"DataSelectionCallback: the target shares no captured per-sample layer with the "
            f"record (captured layers {sorted(rows.modules)}, target layers {sorted(target.data)})."
        )
    return q


def _grad_adjoint(u: dict[str, Vectors], updates: dict[int, _Update]) -> Vectors:
    """``U·∂s'/∂g`` per parameter (``push`` is ``−∂s'/∂g``)."""
    return {
        k: -(u["theta"][k] * up.push[0] + u["m"][k] * up.push[1] + u["v"][k] * up.push[2])
        for k, up in updates.items()
    }


def _transition(u: dict[str, Vectors], updates: dict[int, _Update]) -> dict[str, Vectors]:
    """``U·J`` without the gradient's response to ``θ`` (momentum, second moment, decay)."""
    out: dict[str, Vectors] = {"theta": {}, "m": {}, "v": {}}
    for k, up in updates.items():
        blocks = adamw_influence_transition(
            u["theta"][k][None],
            u["m"][k][None],
            u["v"][k][None],
            up.d,
            up.s,
            lr=up.lr,
            step=up.step,
            beta1=up.beta1,
            beta2=up.beta2,
            weight_decay=up.decay,
        )
        for key, block in zip(("theta", "m", "v"), blocks):
            out[key][k] = block[0]
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
        ValueError: a captured parameter outside ``optimizer``; a dense target layer;
            a target sharing no captured layer.
    """
    rows = BatchRows(record, root)
    groups = _optimizer_groups(optimizer)
    missing = [tuple(p.shape) for k, p in rows.params.items() if k not in groups]
    if missing:
        raise ValueError(
            f"DataSelectionCallback(score='lookahead'): captured parameters of shapes {missing} "
            "are not in the optimizer; pass the optimizer that steps every captured parameter."
        )
    grads = {k: p.grad.detach().reshape(-1).float() for k, p in rows.params.items()}
    clip = _Clip(root, grads, max_grad_norm)
    updates = {
        k: _update(p, grads[k], groups[k], optimizer.state.get(p, {}), clip.coef)
        for k, p in rows.params.items()
    }
    q = _target(rows, target)
    u = {
        "theta": q,
        "m": {k: torch.zeros_like(x) for k, x in q.items()},
        "v": {k: torch.zeros_like(x) for k, x in q.items()},
    }
    for _ in range(horizon - 1):
        u_g = _grad_adjoint(u, updates)
        u = _transition(u, updates)
        for k, up in updates.items():
            if up.l2:
                u["theta"][k] = u["theta"][k] + up.l2 * u_g[k]
        if curvature:
            x = clip.apply(u_g)
            coupled = rows.batch * sum(rows.dots(x).values())
            for k, h in rows.weighted_sum(coupled).items():
                u["theta"][k] = u["theta"][k] + h.to(u["theta"][k])
    r = clip.apply(_grad_adjoint(u, updates))
    return {name: -s for name, s in rows.dots(r).items()}

"""Optimizer maps: per-sample update directions of coordinate-wise optimizers.

``precondition`` maps per-sample gradients ``g : (B, k)`` on ``k`` coordinates to
the update direction a coordinate-wise ``torch.optim`` optimizer would take if
the sample alone formed the coming step, from the optimizer state *before* that
step (``(k,)`` tensors on the same coordinates). The direction is the update
with the learning rate factored out and weight decay dropped:
``θ_after = θ_before − lr·precondition(g)`` for a one-sample batch (with
``weight_decay=0``; Adagrad's ``lr_decay`` schedule is part of the direction).

Arithmetic runs in the compute dtype of ``ops.dtypes`` (the promoted dtype of
``g`` and the state, at least float32, so float64 inputs are mapped in float64);
every result is returned as float32. ``maximize=True`` (a torch option) maps
``-g``, as torch does.

Lion is not in ``torch.optim``; the map follows its published rule (Chen et al.,
2023): the update is ``sign(β1·m + (1−β1)·g)`` and the state afterwards is
``m ← β2·m + (1−β2)·g`` (state key ``exp_avg``, default ``betas=(0.9, 0.99)``),
so ``exp_avg`` passed here is ``m`` before that state update.

``second_moment_normalize`` is another map: a per-sample gradient divided
coordinate-wise by the optimizer's second-moment denominator as it stands
(``sqrt(v) + eps`` for Adam / AdamW, ``sqrt(max(v, eps1²))`` for Adafactor,
whose ``v`` is the rank-1 reconstruction of its factored moments), without
momentum, bias correction or a state update: the optimizer-normalised gradient
of TrackStar (Chang et al., 2024).

The AdamW-influence kernels (``adam_preconditioner``, ``adamw_influence_push``,
``adamw_influence_transition``, ``adamw_influence_coupling``) live in
``ops/adamw_influence.py`` and are re-exported here (their public path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.adamw_influence import (
    adam_preconditioner as adam_preconditioner,
)
from dattri_llm.gradient.ops.adamw_influence import (
    adamw_influence_coupling as adamw_influence_coupling,
)
from dattri_llm.gradient.ops.adamw_influence import (
    adamw_influence_push as adamw_influence_push,
)
from dattri_llm.gradient.ops.adamw_influence import (
    adamw_influence_transition as adamw_influence_transition,
)
from dattri_llm.gradient.ops.step import check_step

Tensor = torch.Tensor

OPTIMIZER_STATE_KEYS: dict[str, tuple[str, ...]] = {
    "SGD": ("momentum_buffer",),
    "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "Adamax": ("exp_avg", "exp_inf"),
    "NAdam": ("exp_avg", "exp_avg_sq", "mu_product"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
    "RMSprop": ("square_avg", "grad_avg", "momentum_buffer"),
    "Adagrad": ("sum",),
    "Adadelta": ("square_avg", "acc_delta"),
    "Lion": ("exp_avg",),
}

# Per-coordinate second-moment state of the optimizers ``second_moment_normalize`` serves;
# Adafactor's ``variance`` is the rank-1 reconstruction of its factored moments for matrices
# (``OptimizerSnapshot`` derives it from ``row_var`` / ``col_var``) and its own state for vectors.
SECOND_MOMENT_STATE_KEYS: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg_sq", "max_exp_avg_sq"),
    "Adafactor": ("variance",),
}

# State keys holding one scalar for the whole parameter rather than one value per coordinate.
_SCALAR_STATE_KEYS = frozenset({"mu_product"})

_ADAM_BETAS = (0.9, 0.999)
_LION_BETAS = (0.9, 0.99)


# --------------------------------------------------------------------------- helpers


def _hyper(hyperparameters: Mapping[str, Any], name: str, default: Any) -> Any:
    """``hyperparameters[name]`` or ``default`` when missing or ``None``."""
    value = hyperparameters.get(name)
    return default if value is None else value


def _scalar(value: float | Tensor) -> float:
    """A Python float from a number or a one-element tensor (torch allows tensor betas)."""
    return float(value.item() if isinstance(value, Tensor) else value)


def _betas(hyperparameters: Mapping[str, Any], default: tuple[float, float]) -> tuple[float, float]:
    """``(β1, β2)`` from ``hyperparameters["betas"]`` (default ``default``)."""
    beta1, beta2 = _hyper(hyperparameters, "betas", default)
    return _scalar(beta1), _scalar(beta2)


class _State:
    """Pre-step optimizer state of one parameter, cast to the compute dtype on ``g``'s device."""

    def __init__(self, state: Mapping[str, Any] | None, keys: tuple[str, ...], g: Tensor) -> None:
        tensors = {}
        for key in keys:
            value = None if state is None else state.get(key)
            if value is not None:
                tensors[key] = self._checked(torch.as_tensor(value), key, g.shape[1])
        self.dtype = dtypes.resolve(g, *tensors.values(), minimum=torch.float32)
        self._tensors = {key: t.to(device=g.device, dtype=self.dtype) for key, t in tensors.items()}

    @staticmethod
    def _checked(tensor: Tensor, key: str, k: int) -> Tensor:
        """``tensor`` if its shape fits ``key`` (``(k,)``, or one element for a scalar key)."""
        fits = tensor.numel() == 1 if key in _SCALAR_STATE_KEYS else tuple(tensor.shape) == (k,)
        if not fits:
            expected = "a single value" if key in _SCALAR_STATE_KEYS else f"shape ({k},)"
            raise ValueError(
                f"precondition: state[{key!r}] has shape {tuple(tensor.shape)} but must be "
                f"{expected} for g with k={k} coordinates; pass the pre-step optimizer state "
                "flattened to the same coordinates as g."
            )
        return tensor.reshape(-1) if key not in _SCALAR_STATE_KEYS else tensor.reshape(())

    def get(self, key: str) -> Tensor | None:
        """The state tensor ``key`` (``(k,)`` or 0-d), ``None`` if missing."""
        return self._tensors.get(key)

    def zeros_if_missing(self, key: str, g: Tensor) -> Tensor:
        """The state tensor ``key``, or a zero scalar (broadcasts like ``(k,)``) if missing."""
        value = self._tensors.get(key)
        return g.new_zeros(()) if value is None else value


def _ema(previous: Tensor, new: Tensor, decay: float) -> Tensor:
    """``decay·previous + (1−decay)·new`` as ``(B, k)``; ``previous`` is ``(k,)`` or 0-d."""
    return decay * previous + (1.0 - decay) * new


# --------------------------------------------------------------------------- per-optimizer rules
# Each rule takes ``g : (B, k)`` (compute dtype, sign of ``maximize`` applied), the pre-step
# ``_State``, the coming step ``t`` and the hyperparameters, and returns the ``(B, k)`` direction.

_Rule = Callable[[Tensor, _State, float, Mapping[str, Any]], Tensor]


def _sgd(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """SGD: ``g``; with momentum ``buf' = μ·buf + (1−dampening)·g`` (``g`` without a buffer)."""
    momentum = _scalar(_hyper(hp, "momentum", 0.0))
    if momentum == 0:
        return g
    dampening = _scalar(_hyper(hp, "dampening", 0.0))
    buf = state.get("momentum_buffer")
    new_buf = g if buf is None else momentum * buf + (1.0 - dampening) * g
    return g + momentum * new_buf if _hyper(hp, "nesterov", False) else new_buf


def _adam(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """Adam / AdamW: ``m'/(1−β1^t) / (sqrt(v')/sqrt(1−β2^t) + eps)``.

    With ``amsgrad`` the second moment is ``max(max_exp_avg_sq, v')``.
    """
    beta1, beta2 = _betas(hp, _ADAM_BETAS)
    eps = _scalar(_hyper(hp, "eps", 1e-8))
    m = _ema(state.zeros_if_missing("exp_avg", g), g, beta1)
    v = _ema(state.zeros_if_missing("exp_avg_sq", g), g * g, beta2)
    if _hyper(hp, "amsgrad", False):
        v = torch.maximum(state.zeros_if_missing("max_exp_avg_sq", g), v)
    denom = v.sqrt() / math.sqrt(1.0 - beta2**t) + eps
    return m / (1.0 - beta1**t) / denom


def _adamax(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """Adamax: ``m'/((1−β1^t)·max(β2·u, |g|+eps))``."""
    beta1, beta2 = _betas(hp, _ADAM_BETAS)
    eps = _scalar(_hyper(hp, "eps", 1e-8))
    m = _ema(state.zeros_if_missing("exp_avg", g), g, beta1)
    u = torch.maximum(beta2 * state.zeros_if_missing("exp_inf", g), g.abs() + eps)
    return m / ((1.0 - beta1**t) * u)


def _nadam_mu(beta1: float, t: float, momentum_decay: float) -> float:
    """NAdam's momentum coefficient ``μ_t = β1(1 − 0.5·0.96^(t·ψ))``."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))


def _nadam(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """NAdam: ``(1−μ_t)/(1−Π')·g/den + μ_{t+1}/(1−Π'μ_{t+1})·m'/den``.

    A missing ``mu_product`` is ``Π = μ_1···μ_{t−1}`` (torch's value under constant
    hyperparameters; 1 at the first step).
    """
    beta1, beta2 = _betas(hp, _ADAM_BETAS)
    eps = _scalar(_hyper(hp, "eps", 1e-8))
    psi = _scalar(_hyper(hp, "momentum_decay", 4e-3))
    mu, mu_next = _nadam_mu(beta1, t, psi), _nadam_mu(beta1, t + 1, psi)
    mu_product = state.get("mu_product")
    if mu_product is None:
        mu_product = math.prod(_nadam_mu(beta1, i, psi) for i in range(1, int(t)))
    mu_product = mu_product * mu
    m = _ema(state.zeros_if_missing("exp_avg", g), g, beta1)
    v = _ema(state.zeros_if_missing("exp_avg_sq", g), g * g, beta2)
    den = (v / (1.0 - beta2**t)).sqrt() + eps
    grad_coef = (1.0 - mu) / (1.0 - mu_product)
    momentum_coef = mu_next / (1.0 - mu_product * mu_next)
    return (grad_coef * g + momentum_coef * m) / den


def _radam(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """RAdam: ``m̂`` while ``ρ_t ≤ 5``, else ``m̂·r·sqrt(1−β2^t)/(sqrt(v')+eps)``."""
    beta1, beta2 = _betas(hp, _ADAM_BETAS)
    eps = _scalar(_hyper(hp, "eps", 1e-8))
    m_hat = _ema(state.zeros_if_missing("exp_avg", g), g, beta1) / (1.0 - beta1**t)
    bias_correction2 = 1.0 - beta2**t
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho_t = rho_inf - 2.0 * t * beta2**t / bias_correction2
    if rho_t <= 5.0:
        return m_hat
    rect = math.sqrt(
        (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
    )
    v = _ema(state.zeros_if_missing("exp_avg_sq", g), g * g, beta2)
    return m_hat * (rect * math.sqrt(bias_correction2)) / (v.sqrt() + eps)


def _rmsprop(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """RMSprop: ``g/(sqrt(v' [− ḡ'²])+eps)``; with momentum ``μ·buf + that``."""
    alpha = _scalar(_hyper(hp, "alpha", 0.99))
    eps = _scalar(_hyper(hp, "eps", 1e-8))
    momentum = _scalar(_hyper(hp, "momentum", 0.0))
    v = _ema(state.zeros_if_missing("square_avg", g), g * g, alpha)
    if _hyper(hp, "centered", False):
        mean = _ema(state.zeros_if_missing("grad_avg", g), g, alpha)
        v = (v - mean * mean).clamp_min(0.0)
    scaled = g / (v.sqrt() + eps)
    if momentum > 0:
        return momentum * state.zeros_if_missing("momentum_buffer", g) + scaled
    return scaled


def _adagrad(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """Adagrad: ``g/(sqrt(sum+g²)+eps)/(1+(t−1)·lr_decay)``."""
    eps = _scalar(_hyper(hp, "eps", 1e-10))
    lr_decay = _scalar(_hyper(hp, "lr_decay", 0.0))
    total = state.zeros_if_missing("sum", g) + g * g
    return g / (total.sqrt() + eps) / (1.0 + (t - 1.0) * lr_decay)


def _adadelta(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """Adadelta: ``sqrt(acc+eps)/sqrt(v'+eps)·g`` with ``v' = ρv+(1−ρ)g²``."""
    rho = _scalar(_hyper(hp, "rho", 0.9))
    eps = _scalar(_hyper(hp, "eps", 1e-6))
    v = _ema(state.zeros_if_missing("square_avg", g), g * g, rho)
    return (state.zeros_if_missing("acc_delta", g) + eps).sqrt() / (v + eps).sqrt() * g


def _lion(g: Tensor, state: _State, t: float, hp: Mapping[str, Any]) -> Tensor:
    """Lion: ``sign(β1·m + (1−β1)·g)`` (``m`` = ``exp_avg`` before its ``β2`` update)."""
    beta1, _ = _betas(hp, _LION_BETAS)
    return torch.sign(_ema(state.zeros_if_missing("exp_avg", g), g, beta1))


_RULES: dict[str, _Rule] = {
    "SGD": _sgd,
    "Adam": _adam,
    "AdamW": _adam,
    "Adamax": _adamax,
    "NAdam": _nadam,
    "RAdam": _radam,
    "RMSprop": _rmsprop,
    "Adagrad": _adagrad,
    "Adadelta": _adadelta,
    "Lion": _lion,
}


# --------------------------------------------------------------------------- public maps


def precondition(
    g: Tensor,
    state: Mapping[str, Any] | None,
    *,
    optimizer_type: str,
    step: int | float | Tensor,
    **hyperparameters: Any,
) -> Tensor:
    """Per-sample update directions ``(B, k)`` float32 of ``optimizer_type``.

    Args:
        g: ``(B, k)`` per-sample gradients on ``k`` coordinates.
        state: pre-step optimizer state of those coordinates, keys of
            ``OPTIMIZER_STATE_KEYS[optimizer_type]`` with ``(k,)`` tensors
            (``mu_product``: one value); other keys (e.g. ``"step"``) are ignored.
            ``None`` or a missing key means zeros, except SGD's
            ``momentum_buffer`` (missing → ``buf' = g``, torch's first step) and
            NAdam's ``mu_product`` (missing → ``μ_1···μ_{t−1}``).
        optimizer_type: a key of ``OPTIMIZER_STATE_KEYS`` (a ``torch.optim`` class
            name, or ``"Lion"``).
        step: index ``t ≥ 1`` of the coming update (``state["step"] + 1``).
        **hyperparameters: the optimizer's param-group values (``betas``, ``eps``,
            ``momentum``, ...); missing ones take the torch defaults; ``lr`` and
            ``weight_decay`` are accepted and ignored (learning rate factored out,
            weight decay dropped); ``maximize=True`` maps ``-g``.

    Returns:
        ``(B, k)`` float32: row ``i`` is the update direction if sample ``i`` alone
        formed the step (``θ ← θ − lr·direction``).

    Raises:
        NotImplementedError: ``optimizer_type`` is not supported.
        ValueError: ``step < 1``, ``g`` not 2-D, or a state tensor of the wrong shape.
    """
    rule = _RULES.get(optimizer_type)
    if rule is None:
        raise NotImplementedError(
            f"precondition: optimizer type {optimizer_type!r} has no update map; supported "
            f"types: {', '.join(_RULES)}."
        )
    t = check_step(step, "precondition")
    if g.ndim != 2:
        raise ValueError(
            f"precondition: g must be (B, k) per-sample gradients, got shape {tuple(g.shape)}."
        )
    pre_step = _State(state, OPTIMIZER_STATE_KEYS[optimizer_type], g)
    grads = g.to(pre_step.dtype)
    if _hyper(hyperparameters, "maximize", False):
        grads = -grads
    return rule(grads, pre_step, t, hyperparameters).to(torch.float32)


def adafactor_variance(row_var: Tensor, col_var: Tensor, eps1: float | None = None) -> Tensor:
    """``torch.optim.Adafactor``'s second moment of a matrix from its factors, like the parameter.

    The rank-1 reconstruction ``v ≈ r cᵀ / Σ r`` of the row sums ``r`` and
    column sums ``c`` of ``v``, in the mean form torch keeps and divides by:
    ``row_var · col_var / max(mean(row_var), eps1)`` (``row_var`` ``(..., m, 1)``,
    ``col_var`` ``(..., 1, n)``, means over the rows; ``eps1=None``: float32's
    machine epsilon).

    Returns:
        ``(..., m, n)`` in the promoted dtype of the factors.
    """
    eps = torch.finfo(torch.float32).eps if eps1 is None else _scalar(eps1)
    return row_var * col_var / row_var.mean(dim=-2, keepdim=True).clamp(min=eps)


def _second_moment(
    state: _State, optimizer_type: str, hyperparameters: Mapping[str, Any]
) -> Tensor:
    """The stored second moment ``v`` ``(k,)`` the optimizer divides by."""
    if optimizer_type == "Adafactor":
        key = "variance"
    else:
        amsgrad = bool(_hyper(hyperparameters, "amsgrad", False))
        key = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
    v = state.get(key)
    if v is None:
        raise ValueError(
            f"second_moment_normalize: the {optimizer_type} state has no {key!r}: the optimizer "
            "has taken no step. Pass the optimizer (or its state_dict) of the trained model."
        )
    return v


def second_moment_normalize(
    g: Tensor,
    state: Mapping[str, Any] | None,
    *,
    optimizer_type: str,
    **hyperparameters: Any,
) -> Tensor:
    """``g`` divided coordinate-wise by the optimizer's second-moment denominator ``(B, k)``.

    Adam / AdamW: ``g / (sqrt(v) + eps)`` with ``v = exp_avg_sq`` as stored
    (``max_exp_avg_sq`` with ``amsgrad``), ``eps`` the group's (default
    ``1e-8``). Adafactor: ``g / sqrt(max(v, eps1²))``, ``eps1 = eps[0]`` of the
    group (``None``: float32's machine epsilon, torch's value for float32
    parameters), ``v = state["variance"]``. No momentum, no bias correction and
    no update of ``v`` with ``g``: the map is linear in ``g``.

    Args:
        g: ``(B, k)`` per-sample gradients on ``k`` coordinates.
        state: the optimizer state of those coordinates, keys of
            ``SECOND_MOMENT_STATE_KEYS[optimizer_type]`` with ``(k,)`` tensors.
        optimizer_type: ``"Adam"``, ``"AdamW"`` or ``"Adafactor"``.
        **hyperparameters: the param-group values (``eps``, ``amsgrad``);
            others are ignored.

    Returns:
        ``(B, k)`` float32 (arithmetic in the promoted dtype, at least float32).

    Raises:
        NotImplementedError: another optimizer type.
        ValueError: ``g`` not 2-D, a state tensor of the wrong shape, or no
            second moment in ``state`` (an optimizer that has not stepped).
    """
    keys = SECOND_MOMENT_STATE_KEYS.get(optimizer_type)
    if keys is None:
        raise NotImplementedError(
            f"second_moment_normalize: optimizer type {optimizer_type!r} keeps no per-coordinate "
            f"second moment this map reads; supported types: "
            f"{', '.join(SECOND_MOMENT_STATE_KEYS)}."
        )
    if g.ndim != 2:
        raise ValueError(
            "second_moment_normalize: g must be (B, k) per-sample gradients, got shape "
            f"{tuple(g.shape)}."
        )
    stored = _State(state, keys, g)
    v = _second_moment(stored, optimizer_type, hyperparameters)
    grads = g.to(stored.dtype)
    if optimizer_type == "Adafactor":
        eps1 = _hyper(hyperparameters, "eps", (None, None))[0]
        eps1 = torch.finfo(torch.float32).eps if eps1 is None else _scalar(eps1)
        denominator = v.clamp_min(eps1 * eps1).sqrt()
    else:
        denominator = v.sqrt() + _scalar(_hyper(hyperparameters, "eps", 1e-8))
    return (grads / denominator).to(torch.float32)

"""The methods' algebra in the shared sweep: one :class:`~.sweep.Fold` per trajectory method.

Notation (per update, see :mod:`.sweep`): ``Z`` the stored rows ``(B, p)``,
``t = z/ρ`` a sample's share of the loss gradient, ``c/ρ`` what the update
applied per stored row (:attr:`WindowRows.scale`), ``c_b`` the Gauss–Newton
weight of row ``b``, ``η`` the per-coordinate learning rates, ``U`` the
summary carried from the end of the run (``(R, p)``: ``R`` queries, or ``p``
on the train side). Emitted rows are ``(B, R)``.

* :class:`TracInFold`: ``η ⊙ c t`` against the queries, no propagation.
* :class:`DVEmbFold`: the same rows through ``U``, then
  ``U ← U(I − diag(η) c H)`` with ``H = Σ_b c_b t_b t_bᵀ``.
* :class:`AdamWFold`: ``U = [U_θ | U_m | U_v (| U_u)]`` over the AdamW state
  (``U_u``: the ``amsgrad`` maximum); rows ``K·(C t)`` with ``K`` the
  sensitivity of ``U`` to the update's gradient and ``C = c(I − ĝĝᵀ)`` the
  clip's Jacobian (``c I`` when inactive); then ``U ← U·J`` with the AdamW
  state Jacobian, the batch gradient linearised as ``C H`` (plus ``wd·I`` for
  Adam's coupled L2 decay).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics, Window
from dattri_llm.attribution.algorithm.trajectory.sweep import Columns, Fold, WindowRows, select
from dattri_llm.gradient.ops.adamw_influence import adam_preconditioner

ADAMW_OPTIMIZERS = ("Adam", "AdamW")


def _coupling(u: torch.Tensor, y: torch.Tensor, z: torch.Tensor, rows: WindowRows) -> None:
    """``U += Σ_b c_b Y_b t_bᵀ`` in place (``Y`` rows ``(B, R)``, ``t = z/ρ``)."""
    u.addmm_((y * rows.curvature[:, None]).T, z, alpha=1.0 / rows.rho)


class TracInFold(Fold):
    """Learning-rate-weighted TracIn at ``θ_T``: ``<η ⊙ c t, q>``; nothing propagates."""

    propagates = False

    def start(self, initial: torch.Tensor) -> torch.Tensor:
        """The queries (or ``I``), unchanged through the sweep."""
        return initial

    def step(
        self,
        summary: torch.Tensor,
        rows: WindowRows,
        columns: Columns,
        *,
        emit: bool,
        fold: bool,
    ) -> torch.Tensor | None:
        """Rows ``(η ⊙ z)·Uᵀ · c/ρ``."""
        if not emit:
            return None
        z = select(rows.z, columns) * select(rows.values("lr"), columns)
        return (z @ summary.T).mul_(rows.scale)


class DVEmbFold(Fold):
    """DVEmb: ``η ⊙ c t`` through ``Π_{k>s}(I − diag(η_k) c_k H_k)`` (SGD dynamics)."""

    def start(self, initial: torch.Tensor) -> list[torch.Tensor]:
        """``[U]`` (a holder, so the step replaces nothing the sweep keeps)."""
        return [initial]

    def step(
        self,
        summary: list[torch.Tensor],
        rows: WindowRows,
        columns: Columns,
        *,
        emit: bool,
        fold: bool,
    ) -> torch.Tensor | None:
        """Rows ``Y = (η ⊙ z)·Uᵀ · c/ρ``; fold ``U −= Σ_b c_b Y_b t_bᵀ``."""
        u = summary[0]
        z = select(rows.z, columns)
        y = ((z * select(rows.values("lr"), columns)) @ u.T).mul_(rows.scale)
        if fold:
            _coupling(u, -y, z, rows)
        return y if emit else None


@dataclass
class _AdamSummary:
    theta: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    u: torch.Tensor | None
    k: torch.Tensor  # the sensitivity K, rewritten in place every update


@dataclass
class AdamCoefficients:
    """Per-coordinate pieces of one AdamW update's Jacobian (``(p_g,)`` each)."""

    a_theta: torch.Tensor  # ∂θ'/∂g
    a_m: torch.Tensor  # ∂m'/∂g
    a_v: torch.Tensor  # ∂v'/∂g
    a_u: torch.Tensor | None  # ∂u'/∂g (amsgrad)
    theta_m: torch.Tensor  # ∂θ'/∂m
    theta_v: torch.Tensor  # ∂θ'/∂v' through v'
    theta_u: torch.Tensor | None  # ∂θ'/∂u through the kept maximum (amsgrad)
    select_v: torch.Tensor | None  # 1 where v' is the amsgrad maximum
    beta1: torch.Tensor
    beta2: torch.Tensor
    decay: torch.Tensor  # 1 − lr·wd (decoupled) or 1
    l2: torch.Tensor | None  # wd of Adam's coupled L2 decay (∂g/∂θ), None when 0
    theta_mp: torch.Tensor  # ∂θ'/∂m' (through the new first moment)
    theta_mv: torch.Tensor | None = None  # ∂²θ'/∂m'∂v' (second_order only)
    theta_vv: torch.Tensor | None = None  # ∂²θ'/∂v'² (second_order only)


class AdamWFold(Fold):
    """AdamW-influence over ``torch.optim.Adam`` / ``AdamW`` (amsgrad, coupled or decoupled decay).

    ``combine="mean"``: disjoint coordinate groups (``num_masks``) are
    independent estimates and are averaged.
    """

    combine = "mean"

    def __init__(self, amsgrad: bool = False) -> None:
        self.amsgrad = amsgrad

    def summary_bytes(self, rows: int, width: int, itemsize: int) -> int:
        """``U_θ, U_m, U_v`` (and ``U_u``) plus ``K``."""
        return (5 if self.amsgrad else 4) * rows * width * itemsize

    def check_run(self, run: RunDynamics, windows: list[Window]) -> None:
        """Refuse an optimizer other than Adam/AdamW and ``maximize=True``."""
        other = sorted(run.optimizers() - set(ADAMW_OPTIMIZERS))
        if other:
            raise ValueError(
                f"AdamW-influence models torch.optim.Adam and AdamW; the recorded run used "
                f"{other}. Use DVEmb or TracIn for other optimizers"
            )
        if run.recorded and 1.0 in run.group_settings("maximize"):
            raise ValueError(
                "AdamW-influence: the recorded optimizer has maximize=True (it ascends the "
                "loss); only maximize=False is supported"
            )

    def start(self, initial: torch.Tensor) -> _AdamSummary:
        """``U_θ = initial``, the moment blocks zero."""
        zeros = torch.zeros_like(initial)
        ams = zeros.clone() if self.amsgrad else None
        return _AdamSummary(initial, zeros, zeros.clone(), ams, torch.empty_like(initial))

    def step(
        self,
        summary: _AdamSummary,
        rows: WindowRows,
        columns: Columns,
        *,
        emit: bool,
        fold: bool,
    ) -> torch.Tensor | None:
        """Rows ``K·(C t)``; then carry ``U`` back through the update."""
        co = adam_coefficients(rows, columns, amsgrad=self.amsgrad)
        s = summary
        k = torch.mul(s.theta, co.a_theta, out=s.k)
        k.addcmul_(s.m, co.a_m).addcmul_(s.v, co.a_v)
        if s.u is not None:
            k.addcmul_(s.u, co.a_u)
        z = select(rows.z, columns)
        y = z @ k.T
        if rows.hat is not None:  # clip Jacobian c(I − ĝĝᵀ)
            y.sub_(torch.outer(rows.hat_rows, k @ select(rows.hat, columns)))
        y.mul_(rows.scale)
        if fold:
            self._transition(s, co, k)
            _coupling(s.theta, y, z, rows)
        return y if emit else None

    @staticmethod
    def _transition(s: _AdamSummary, co: AdamCoefficients, k: torch.Tensor) -> None:
        """``U ← U·J`` (all from the pre-update ``U``), except the coupling term."""
        s.m.mul_(co.beta1).addcmul_(s.theta, co.theta_m)
        if s.u is None:
            s.v.addcmul_(s.theta, co.theta_v).mul_(co.beta2)
        else:
            kept = s.u * co.select_v
            s.v.add_(kept).addcmul_(s.theta, co.theta_v).mul_(co.beta2)
            s.u.sub_(kept).addcmul_(s.theta, co.theta_u)
        s.theta.mul_(co.decay)
        if co.l2 is not None:
            s.theta.addcmul_(k, co.l2)


def adam_coefficients(
    rows: WindowRows, columns: Columns, *, amsgrad: bool = False, second_order: bool = False
) -> AdamCoefficients:
    """The per-coordinate pieces of one AdamW update's Jacobian (``(p_g,)`` each).

    Read from the update's recorded moments and each coordinate's group values;
    the applied gradient is ``g = (m' − β1 m)/(1 − β1)``. ``second_order`` adds
    the second derivatives of ``θ'`` in ``(m', v')`` (``theta_mv``,
    ``theta_vv``), which the forward error-proxy sweep needs.

    Raises:
        NotImplementedError: ``second_order`` with ``amsgrad``.
    """

    def value(key: str) -> torch.Tensor:
        return select(rows.values(key), columns)

    if amsgrad and second_order:
        raise NotImplementedError("the second-order AdamW pieces do not model amsgrad")
    moments = _moments(rows.entry, rows, columns, amsgrad)
    lr, eps, n = value("lr"), value("eps"), value("step")
    beta1, beta2 = value("beta1"), value("beta2")
    bc1, bc2 = 1.0 - beta1.pow(n), 1.0 - beta2.pow(n)
    g = (moments["m_post"] - beta1 * moments["m_pre"]) / (1.0 - beta1)
    second = moments["u_post"] if amsgrad else moments["v_post"]
    d, s = adam_preconditioner(moments["m_post"] / bc1, second / bc2, eps=eps)
    d, s = d.to(lr), s.to(lr)
    lr_s = lr * s / bc2
    a_v = 2.0 * (1.0 - beta2) * g
    select_v = theta_u = a_u = None
    theta_v = lr_s
    if amsgrad:
        select_v = (moments["v_post"] >= moments["u_pre"]).to(lr)
        theta_v, theta_u, a_u = lr_s * select_v, lr_s * (1.0 - select_v), a_v * select_v
    wd, decoupled = value("weight_decay"), value("decoupled_weight_decay")
    l2 = wd * (1.0 - decoupled)
    theta_mv = theta_vv = None
    if second_order:
        theta_mv, theta_vv = _second_derivatives(moments["m_post"], second, lr, eps, bc1, bc2)
    return AdamCoefficients(
        a_theta=-lr * d * (1.0 - beta1) / bc1 + theta_v * a_v,
        a_m=1.0 - beta1,
        a_v=a_v,
        a_u=a_u,
        theta_m=-lr * d * beta1 / bc1,
        theta_v=theta_v,
        theta_u=theta_u,
        select_v=select_v,
        beta1=beta1,
        beta2=beta2,
        decay=1.0 - lr * wd * decoupled,
        l2=l2 if bool((l2 != 0).any()) else None,
        theta_mp=-lr * d / bc1,
        theta_mv=theta_mv,
        theta_vv=theta_vv,
    )


def _second_derivatives(
    m_post: torch.Tensor,
    v_post: torch.Tensor,
    lr: torch.Tensor,
    eps: torch.Tensor,
    bc1: torch.Tensor,
    bc2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∂²θ'/∂m'∂v', ∂²θ'/∂v'²)`` of ``θ' = … − (lr/bc1)·m'·D(v')``.

    ``D(v') = 1/(r + eps)`` with ``r = √(v'/bc2)``: ``D' = −1/(2 bc2 r (r+eps)²)``,
    ``D'' = (3r + eps)/(4 bc2² r³ (r+eps)³)``, computed in float64 and taken
    as 0 where ``r = 0`` (as the first derivative is).
    """
    f64 = torch.float64
    bc2_64, eps_64 = bc2.to(f64), eps.to(f64)
    r = (v_post.to(f64) / bc2_64).sqrt()
    positive = r > 0
    safe = torch.where(positive, r, torch.ones_like(r))
    d1 = -1.0 / (2.0 * bc2_64 * safe * (safe + eps_64) ** 2)
    d2 = (3.0 * safe + eps_64) / (4.0 * bc2_64**2 * safe**3 * (safe + eps_64) ** 3)
    d1, d2 = torch.where(positive, d1, 0.0), torch.where(positive, d2, 0.0)
    rate = -(lr.to(f64) / bc1.to(f64))
    return (rate * d1).to(lr), (rate * m_post.to(f64) * d2).to(lr)


def _moments(
    entry: Mapping[str, Any] | None,
    rows: WindowRows,
    columns: Columns,
    amsgrad: bool,
) -> dict[str, torch.Tensor]:
    """``m_pre, m_post, v_post`` (and ``u_pre, u_post``) on the group's columns of the layout.

    Concatenated once per update (kept in ``rows.cache``).

    Raises:
        ValueError: no entry for the update, a layer without moments, or
            moments of another width than the stored rows.
    """
    if "adam_moments" not in rows.cache:
        rows.cache["adam_moments"] = _layout_moments(entry, rows, amsgrad)
    return {key: select(value, columns) for key, value in rows.cache["adam_moments"].items()}


def _layout_moments(
    entry: Mapping[str, Any] | None, rows: WindowRows, amsgrad: bool
) -> dict[str, torch.Tensor]:
    step = rows.window.key
    if entry is None:
        raise ValueError(
            f"no AdamW dynamics for training step {step}; record every step with "
            "OptimizerStateCallback"
        )
    keys = (
        ("m_pre", "m_post", "v_post", "u_pre", "u_post")
        if amsgrad
        else ("m_pre", "m_post", "v_post")
    )
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    for name, width in rows.layout.items():
        if name not in entry["pre"] or name not in entry["post"]:
            raise ValueError(
                f"the AdamW dynamics of step {step} hold no moments for layer {name!r} (they "
                f"cover {sorted(entry['post'])}); record them with OptimizerStateCallback on the "
                "same layers as the gradients"
            )
        pre, post = entry["pre"][name], entry["post"][name]
        if pre[0].numel() != width:
            raise ValueError(
                f"layer {name!r}: step {step} gradients have {width} coordinates but the AdamW "
                f"dynamics {pre[0].numel()}; capture the gradients and record the moments with "
                "the same projection_kwargs (masks)"
            )
        if amsgrad and (len(pre) < 3 or len(post) < 3):
            raise ValueError(
                f"layer {name!r}: the run used amsgrad but its dynamics hold no max_exp_avg_sq; "
                "record it with this version's OptimizerStateCallback"
            )
        values = {"m_pre": pre[0], "m_post": post[0], "v_post": post[1]}
        if amsgrad:
            values.update(u_pre=pre[2], u_post=post[2])
        for key in keys:
            parts[key].append(values[key].reshape(-1))
    z = rows.z
    return {
        key: torch.cat(value).to(device=z.device, dtype=z.dtype) for key, value in parts.items()
    }

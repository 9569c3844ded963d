"""Independent ground truth for the trajectory methods: a training run written out by hand.

A :class:`Run` is a list of optimizer updates. Each holds the parameters at the
update's start, its micro-batches, and every parameter's optimizer values
(its group's ``lr``, ``weight_decay``, betas, ``eps``, ``amsgrad``, decoupled
or coupled decay) and update count; the run has the loop's clip threshold,
loss divisor (gradient accumulation) and loss reduction.

:class:`Reference` takes per-sample shares of the loss from ``torch.func`` at
each update's parameters (the share of sample ``b`` is ``a_b ∇ℓ_b`` with
``a_b = 1/(B_mb·N)`` for a mean loss, ``1/N`` for a sum), replays the
optimizer by hand in float64 (and checks that the replay reproduces the
recorded parameters), and builds each method's scores from the maths:

* AdamW-influence: the derivative of the query loss at ``θ_T`` in the weight
  of each sample, through the AdamW updates written out below (the batch
  gradient linearised by the Gauss–Newton matrix ``Σ_b c_b t_b t_bᵀ``,
  ``c_b = 1/a_b``; the real clip ``G·min(1, M/(‖G‖+1e-6))``), Jacobians by
  ``torch.func.jacrev``, the chain unrolled with explicit matrices;
* DVEmb: ``qᵀ Π_{k>s}(I − D_k c_k H_k) D_s c_s t`` with ``D = diag(lr)``;
* trajectory TracIn: ``qᵀ D_s c_s t``.

Nothing here imports ``dattri_llm``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

Batch = dict[str, torch.Tensor]


@dataclass
class Update:
    """One optimizer update: parameters at its start, micro-batches, per-parameter values."""

    theta: dict[str, torch.Tensor]
    micro: list[Batch]
    hyper: dict[str, dict]


@dataclass
class Run:
    """A recorded run (see the module docstring); ``final``: the parameters after it."""

    updates: list[Update]
    final: dict[str, torch.Tensor]
    names: list[str]
    divisor: int = 1
    reduction: str = "sum"
    max_norm: float | None = None


def optimizer_values(optimizer: torch.optim.Optimizer, names: dict[int, str], step: int) -> dict:
    """``{param name: values}`` of every parameter the optimizer holds, at update ``step``."""
    out = {}
    for group in optimizer.param_groups:
        decoupled = bool(group.get("decoupled_weight_decay", False)) or isinstance(
            optimizer, torch.optim.AdamW
        )
        for param in group["params"]:
            out[names[id(param)]] = {
                "lr": float(group["lr"]),
                "wd": float(group["weight_decay"]),
                "beta1": float(group.get("betas", (0.9, 0.999))[0]),
                "beta2": float(group.get("betas", (0.9, 0.999))[1]),
                "eps": float(group.get("eps", 1e-8)),
                "amsgrad": bool(group.get("amsgrad", False)),
                "decoupled": decoupled,
                "step": step,
            }
    return out


def snapshot(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """float64 copies of the named parameters."""
    params = dict(model.named_parameters())
    return {name: params[name].detach().to(torch.float64).clone() for name in names}


class Reference:
    """Scores of the trajectory methods for a :class:`Run` (see the module docstring).

    Args:
        model: the model (any parameters; a float64 copy is used).
        sample_loss: ``sample_loss(call, sample) -> ℓ`` for one sample, where
            ``call(**inputs)`` runs the model and ``sample`` is a batch of one.
        run: the recorded run.
        queries: the query batch; each query's gradient of ``sample_loss`` at
            the final parameters is its row (the sum convention).
        check_replay: check that the hand replay reproduces each update's end.
        replay_rtol: tolerance of that check.
    """

    def __init__(
        self,
        model: nn.Module,
        sample_loss: Callable,
        run: Run,
        queries: Batch,
        *,
        check_replay: bool = True,
        replay_rtol: float = 1e-4,
    ) -> None:
        self.model = copy.deepcopy(model).double()
        self.sample_loss = sample_loss
        self.run = run
        self.names = run.names
        sizes = [run.updates[0].theta[name].numel() for name in self.names]
        self.sizes = sizes
        self.shares: list[torch.Tensor] = []  # (B_w, p) per update
        self.curvature: list[torch.Tensor] = []  # c_b per update
        self.micro_sizes: list[list[int]] = []
        for update in run.updates:
            parts, weights = [], []
            for batch in update.micro:
                b = next(iter(batch.values())).shape[0]
                a = 1.0 / (b * run.divisor) if run.reduction == "mean" else 1.0 / run.divisor
                parts.append(a * self.per_sample(update.theta, batch))
                weights.append(torch.full((b,), 1.0 / a, dtype=torch.float64))
            self.shares.append(torch.cat(parts))
            self.curvature.append(torch.cat(weights))
            self.micro_sizes.append([next(iter(b.values())).shape[0] for b in update.micro])
        self.q = self.per_sample(run.final, queries)
        self.replay(check_replay, replay_rtol)

    # ------------------------------------------------------------------ pieces
    def flat(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([params[name].reshape(-1).to(torch.float64) for name in self.names])

    def vector(self, update: Update, key: str) -> torch.Tensor:
        """``(p,)`` per-coordinate value of ``key`` at ``update``."""
        return torch.cat(
            [
                torch.full((size,), float(update.hyper[name][key]), dtype=torch.float64)
                for name, size in zip(self.names, self.sizes, strict=True)
            ]
        )

    def per_sample(self, theta: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        """``(B, p)`` per-sample gradients of ``sample_loss`` at ``theta`` (float64)."""
        others = {n: p.detach() for n, p in self.model.named_parameters()}

        def loss(params, sample):
            full = {**others, **params}
            single = {k: v.unsqueeze(0) for k, v in sample.items()}

            def call(*args, **kwargs):
                return functional_call(self.model, full, args, kwargs)

            return self.sample_loss(call, single)

        batch64 = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
        params = {n: theta[n].to(torch.float64) for n in self.names}
        grads = vmap(grad(loss), in_dims=(None, 0))(params, batch64)
        b = next(iter(batch.values())).shape[0]
        return torch.cat([grads[n].reshape(b, -1) for n in self.names], dim=1)

    def clip_coef(self, t: int) -> float:
        """``min(1, M/(‖G‖+1e-6))`` of update ``t`` (1 without clipping)."""
        if self.run.max_norm is None:
            return 1.0
        norm = float(self.shares[t].sum(0).norm())
        return min(1.0, self.run.max_norm / (norm + 1e-6))

    def step_map(self, t: int) -> Callable:
        """``(θ, m, v, u, w) -> (θ', m', v', u')`` of update ``t`` (batch gradient linearised)."""
        update, shares, c = self.run.updates[t], self.shares[t], self.curvature[t]
        theta_t = self.flat(update.theta)
        g_t = shares.sum(0)
        hessian = (shares.T * c) @ shares
        lr, wd = self.vector(update, "lr"), self.vector(update, "wd")
        b1, b2, eps = (
            self.vector(update, "beta1"),
            self.vector(update, "beta2"),
            self.vector(update, "eps"),
        )
        n = self.vector(update, "step")
        decoupled, amsgrad = self.vector(update, "decoupled"), self.vector(update, "amsgrad")
        bc1, bc2 = 1 - b1**n, 1 - b2**n
        max_norm = self.run.max_norm

        def step(theta, m, v, u, w):
            big_g = g_t + hessian @ (theta - theta_t) + shares.T @ w
            if max_norm is not None:
                big_g = big_g * torch.clamp(max_norm / (big_g.norm() + 1e-6), max=1.0)
            g = big_g + (1 - decoupled) * wd * theta
            m2 = b1 * m + (1 - b1) * g
            v2 = b2 * v + (1 - b2) * g * g
            u2 = torch.where(v2 >= u, v2, u)
            second = torch.where(amsgrad > 0, u2, v2)
            denom = second.sqrt() / bc2.sqrt() + eps
            theta2 = theta * (1 - decoupled * lr * wd) - (lr / bc1) * m2 / denom
            return torch.cat([theta2, m2, v2, u2])

        return step

    def replay(self, check: bool, rtol: float) -> None:
        """Replay the optimizer (float64); keep each update's starting ``(m, v, u)``."""
        p = sum(self.sizes)
        m = v = u = torch.zeros(p, dtype=torch.float64)
        self.states = []
        for t, update in enumerate(self.run.updates):
            self.states.append((m, v, u))
            theta = self.flat(update.theta)
            w = torch.zeros(self.shares[t].shape[0], dtype=torch.float64)
            out = self.step_map(t)(theta, m, v, u, w)
            theta2, m, v, u = out.split(p)
            if check:
                nxt = (
                    self.run.updates[t + 1].theta
                    if t + 1 < len(self.run.updates)
                    else self.run.final
                )
                want = self.flat(nxt)
                scale = float(want.abs().max())
                torch.testing.assert_close(theta2, want, rtol=rtol, atol=rtol * scale)

    # ------------------------------------------------------------------ methods
    def adamw(self) -> list[torch.Tensor]:
        """``[(B_t, n_test)]`` per update: ``d L_q(θ_T) / d w_b`` (helpful samples negative)."""
        p = sum(self.sizes)
        jacobians, pushes = [], []
        for t, update in enumerate(self.run.updates):
            m, v, u = self.states[t]
            theta = self.flat(update.theta)
            w = torch.zeros(self.shares[t].shape[0], dtype=torch.float64)
            jac = jacrev(self.step_map(t), argnums=(0, 1, 2, 3, 4))(theta, m, v, u, w)
            jacobians.append(torch.cat(jac[:4], dim=1))
            pushes.append(jac[4])
        phi = torch.cat([torch.eye(p), torch.zeros(p, 3 * p)], dim=1).double()
        out: list[torch.Tensor] = [None] * len(self.run.updates)
        for t in reversed(range(len(self.run.updates))):
            out[t] = (self.q @ phi @ pushes[t]).T
            phi = phi @ jacobians[t]
        return out

    def dvemb(self, blocks: list[int] | None = None) -> list[torch.Tensor]:
        """``[(B_t, n_test)]``: ``qᵀ Π_{k>t}(I − D_k c_k H_k) D_t c_t t_b`` (``blocks``: the
        per-layer widths of a block-diagonal ``H``, ``None`` for the full matrix)."""
        p = sum(self.sizes)
        mask = torch.ones(p, p, dtype=torch.float64)
        if blocks is not None:
            mask = torch.block_diag(*[torch.ones(w, w, dtype=torch.float64) for w in blocks])
        product = torch.eye(p, dtype=torch.float64)
        out: list[torch.Tensor] = [None] * len(self.run.updates)
        for t in reversed(range(len(self.run.updates))):
            scale = self.vector(self.run.updates[t], "lr") * self.clip_coef(t)
            out[t] = (self.shares[t] * scale) @ product.T @ self.q.T
            hessian = ((self.shares[t].T * self.curvature[t]) @ self.shares[t]) * mask
            product = product @ (torch.eye(p, dtype=torch.float64) - scale[:, None] * hessian)
        return out

    def tracin(self) -> list[torch.Tensor]:
        """``[(B_t, n_test)]``: ``qᵀ D_t c_t t_b``."""
        return [
            (self.shares[t] * self.vector(u, "lr") * self.clip_coef(t)) @ self.q.T
            for t, u in enumerate(self.run.updates)
        ]

    def less(self, reference: str) -> list[torch.Tensor]:
        """``[(B_t, n_test)]``: ``η_ref c_t cos((η/η_ref) ⊙ Γ(∇ℓ_b), q)``, ``Γ`` the Adam direction
        of the sample's own gradient from the pre-update moments, ``η_ref`` the rate of the
        parameter ``reference``."""
        out = []
        for t, update in enumerate(self.run.updates):
            m, v, u = self.states[t]
            own = self.shares[t] * self.curvature[t][:, None]
            b1, b2 = self.vector(update, "beta1"), self.vector(update, "beta2")
            n, eps = self.vector(update, "step"), self.vector(update, "eps")
            m2 = b1 * m + (1 - b1) * own
            v2 = b2 * v + (1 - b2) * own * own
            second = torch.where(self.vector(update, "amsgrad") > 0, torch.maximum(u, v2), v2)
            gamma = (m2 / (1 - b1**n)) / ((second / (1 - b2**n)).sqrt() + eps)
            ref = update.hyper[reference]["lr"]
            direction = gamma * self.vector(update, "lr") / ref
            cosine = (
                torch.nn.functional.normalize(direction, dim=1)
                @ torch.nn.functional.normalize(self.q, dim=1).T
            )
            out.append(ref * self.clip_coef(t) * cosine)
        return out

    def split(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-update rows split into per-micro-batch blocks, in run order."""
        return [
            block
            for t, update_rows in enumerate(rows)
            for block in update_rows.split(self.micro_sizes[t])
        ]


@dataclass
class HandLoop:
    """A hand-written training loop recording a :class:`Run` (what a user's loop does).

    Each update: ``zero_grad``, the micro-batches' ``(loss / N).backward()``
    (scaled by the ``GradScaler`` when given), ``unscale_``, the clip of the
    global norm over ``clip_params`` (all trainable parameters by default),
    ``optimizer.step()`` (or ``scaler.step``), ``scaler.update()``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    accumulation: int = 1
    max_norm: float | None = None
    scaler: object = None
    reduction: str = "sum"
    after_step: Callable[[], None] | None = None
    names: list[str] = field(default_factory=list)

    def run(self, windows: list[list[Batch]]) -> Run:
        model = self.model
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = [n for n, _ in trainable]
        ids = {id(p): n for n, p in trainable}
        updates = []
        for t, micro in enumerate(windows):
            theta = snapshot(model, names)
            self.optimizer.zero_grad(set_to_none=True)
            for batch in micro:
                loss = self.loss(model, batch) / self.accumulation
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.max_norm is not None:
                nn.utils.clip_grad_norm_([p for _, p in trainable], self.max_norm)
            hyper = optimizer_values(self.optimizer, ids, t + 1)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.after_step is not None:
                self.after_step()
            updates.append(Update(theta, micro, hyper))
        self.names = names
        return Run(
            updates,
            snapshot(model, names),
            names,
            self.accumulation,
            self.reduction,
            self.max_norm,
        )

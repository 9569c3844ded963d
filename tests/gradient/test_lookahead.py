"""DataSelectionCallback(score="lookahead") against independent Adam / AdamW references.

Per-sample gradients come from ``torch.func`` (``data_selection_helpers``); the
references restate the update by hand (K = 1) or differentiate an explicit
update map with ``torch.func.jacrev`` (K steps), in float64.
"""

from __future__ import annotations

import data_selection_helpers as h
import pytest
import torch
from torch.func import jacrev

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.callbacks.data_selection_callback import DataSelectionCallback
from dattri_llm.gradient.hooks.manager import HookManager

BATCH = 6
BETAS = (0.9, 0.99)
EPS = 1e-8
KEEP_ALL = {"threshold": -1e30}


class Spy(HookManagerCallback):
    """Scores and drops the selection callback exposed after each step (runs after it)."""

    def __init__(self, selection: DataSelectionCallback) -> None:
        self.selection = selection
        self.seen: list[tuple[torch.Tensor, list[int]]] = []

    def on_step_end(self, record) -> None:
        self.seen.append((self.selection.last_scores.clone(), list(self.selection.last_dropped)))


def optimizer(net, kind: str) -> torch.optim.Optimizer:
    """Two parameter groups with different lr and weight decay."""
    first = [*net.emb.parameters(), *net.conv.parameters()]
    second = [*net.norm.parameters(), *net.head.parameters()]
    groups = [
        {"params": first, "lr": 2e-2, "weight_decay": 0.1},
        {"params": second, "lr": 5e-3, "weight_decay": 0.03},
    ]
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(groups, betas=BETAS, eps=EPS)


def warmed_up(kind: str, reduction: str):
    """A net and its optimizer after two plain training steps (non-trivial moments)."""
    net = h.build()
    opt = optimizer(net, kind)
    for seed in (1, 2):
        opt.zero_grad(set_to_none=True)
        h.batch_loss(net, h.batch(seed, BATCH), reduction).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return net, opt


def capture_target(net, data):
    cap = CaptureCallback()
    with HookManager(net, callbacks=[cap]).collect(deregister_on_exit=True):
        h.batch_loss(net, data, "sum").backward()
    net.zero_grad(set_to_none=True)
    return cap.record.gradient


def run_callback(net, opt, data, reduction, target, **kwargs) -> DataSelectionCallback:
    """One backward with the callback attached (scores only: nothing is dropped)."""
    extra = {"target_gradient": capture_target(net, target)} if target is not None else {}
    selection = DataSelectionCallback(
        net,
        target="fixed" if target is not None else "batch",
        score="lookahead",
        optimizer=opt,
        selection_kwargs=KEEP_ALL,
        **extra,
        **kwargs,
    )
    with HookManager(net, callbacks=[selection]).collect(deregister_on_exit=True):
        h.batch_loss(net, data, reduction).backward()
    return selection


def flat_state(net, opt):
    """Per-coordinate ``θ, m, v, lr, wd`` (float64, ``named_parameters`` order) and the step."""
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    cols = {k: [] for k in ("theta", "m", "v", "lr", "wd")}
    for p in net.parameters():
        state, group = opt.state[p], groups[id(p)]
        cols["theta"].append(p.detach().reshape(-1))
        cols["m"].append(state["exp_avg"].reshape(-1))
        cols["v"].append(state["exp_avg_sq"].reshape(-1))
        cols["lr"].append(torch.full((p.numel(),), group["lr"]))
        cols["wd"].append(torch.full((p.numel(),), group["weight_decay"]))
        step = int(state["step"]) + 1
    return {k: torch.cat(v).double() for k, v in cols.items()}, step


def flat_rows(grads: dict) -> torch.Tensor:
    """``(B, n)`` per-sample gradients in ``named_parameters`` order."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1).double()


def clip_map(max_norm: float | None):
    def clip(x):
        if max_norm is None:
            return x
        return x * torch.clamp(max_norm / (x.norm() + 1e-6), max=1.0)

    return clip


def update_map(st: dict, step: int, decoupled: bool, clip, rows: torch.Tensor, curvature: bool):
    """``F(θ, m, v, G) -> [θ' | m' | v']`` with ``g(θ) = clip(G + H(θ − θ_t))``."""
    b1, b2 = BETAS
    hess = rows.shape[0] * rows.T @ rows if curvature else torch.zeros(rows.shape[1], rows.shape[1])
    hess = hess.double()
    lr, wd, theta_t = st["lr"], st["wd"], st["theta"]

    def f(theta, m, v, grad):
        g = clip(grad + hess @ (theta - theta_t))
        if not decoupled:
            g = g + wd * theta
        m2 = b1 * m + (1 - b1) * g
        v2 = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m2 / (1 - b1**step), v2 / (1 - b2**step)
        decay = 1 - lr * wd if decoupled else 1.0
        return torch.cat([theta * decay - lr * m_hat / (v_hat.sqrt() + EPS), m2, v2])

    return f


def jacobian_scores(net, opt, kind, rows, query, horizon, max_norm, curvature):
    """``−[q, 0, 0]·J^{K−1}·∂F/∂G·t_i`` from ``jacrev`` of the explicit update map."""
    st, step = flat_state(net, opt)
    f = update_map(st, step, kind == "adamw", clip_map(max_norm), rows, curvature)
    args = (st["theta"], st["m"], st["v"], rows.sum(0))
    jac = torch.cat(jacrev(f, argnums=(0, 1, 2))(*args), dim=1)
    dg = jacrev(f, argnums=3)(*args)
    n = rows.shape[1]
    u = torch.cat([query, torch.zeros(2 * n, dtype=query.dtype)])
    for _ in range(horizon - 1):
        u = u @ jac
    return -(u @ dg) @ rows.T


@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("clipped", [False, True])
def test_horizon_one_is_the_adam_preconditioned_alignment(kind, clipped):
    net, opt = warmed_up(kind, "sum")
    data, query_batch = h.batch(10, BATCH), h.batch(99, 3)
    rows = flat_rows(h.per_sample(net, data))
    query = flat_rows(h.per_sample(net, query_batch)).sum(0)
    grad = rows.sum(0)
    max_norm = 0.3 * float(grad.norm()) if clipped else None
    st, step = flat_state(net, opt)  # before the callback's step: the state it reads

    # by hand: θ' = θ(1 − lr·wd) − lr·m̂/(√v̂ + eps), m̂, v̂ from g = c·G (+ wd·θ for Adam)
    b1, b2 = BETAS
    coef = min(1.0, max_norm / float(grad.norm())) if clipped else 1.0
    g = coef * grad + (0.0 if kind == "adamw" else st["wd"] * st["theta"])
    m_hat = (b1 * st["m"] + (1 - b1) * g) / (1 - b1**step)
    v_hat = (b2 * st["v"] + (1 - b2) * g * g) / (1 - b2**step)
    root = v_hat.sqrt()
    dtheta_dg = -st["lr"] * (
        (1 - b1) / ((1 - b1**step) * (root + EPS))
        - m_hat * (1 - b2) * g / ((1 - b2**step) * root * (root + EPS) ** 2)
    )
    applied = coef * rows
    if clipped:
        unit = grad / grad.norm()
        applied = applied - coef * (rows @ unit)[:, None] * unit
    expected = -(applied * (query * dtheta_dg)).sum(1)

    selection = run_callback(net, opt, data, "sum", query_batch, horizon=1, max_grad_norm=max_norm)
    got = selection.last_scores.double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())
    assert selection.last_dropped == []


@pytest.mark.parametrize(
    ("kind", "curvature", "clipped", "target"),
    [
        ("adamw", True, False, "fixed"),
        ("adamw", False, False, "fixed"),
        ("adam", True, True, "fixed"),
        ("adamw", True, True, "batch"),
    ],
)
@pytest.mark.parametrize("horizon", [1, 2, 5])
def test_horizon_k_equals_explicit_jacobian_products(kind, curvature, clipped, target, horizon):
    net, opt = warmed_up(kind, "mean")
    data, query_batch = h.batch(10, BATCH), h.batch(99, 3)
    grads = h.per_sample(net, data)
    rows = flat_rows({n: g / BATCH for n, g in grads.items()})  # the mean loss's shares
    query = flat_rows(h.per_sample(net, query_batch)).sum(0) if target == "fixed" else rows.sum(0)
    max_norm = 0.3 * float(rows.sum(0).norm()) if clipped else None
    expected = jacobian_scores(net, opt, kind, rows, query, horizon, max_norm, curvature)
    selection = run_callback(
        net,
        opt,
        data,
        "mean",
        query_batch if target == "fixed" else None,
        horizon=horizon,
        max_grad_norm=max_norm,
        lookahead_curvature=curvature,
    )
    got = selection.last_scores.double()
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4 * expected.abs().max())


@pytest.mark.parametrize(("reduction", "n_micro"), [("sum", 1), ("sum", 2), ("mean", 2)])
def test_removal_stays_exact(reduction, n_micro):
    net, opt = warmed_up("adamw", reduction)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    micro = [h.batch(20 + m, BATCH) for m in range(n_micro)]
    selection = DataSelectionCallback(
        net,
        target="fixed",
        target_gradient=capture_target(net, h.batch(99, 3)),
        renormalize=reduction == "mean",
        selection_kwargs={"threshold": 0.5, "threshold_mode": "bottom_fraction"},
        score="lookahead",
        horizon=3,
        optimizer=opt,
        max_grad_norm=1.0,
    )
    spy = Spy(selection)
    with HookManager(net, callbacks=[selection, spy]).collect(deregister_on_exit=True):
        for data in micro:
            h.batch_loss(net, data, reduction).backward()
    expected = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    for data, (scores, dropped) in zip(micro, spy.seen):
        assert dropped == h.expected_drop(scores, 0.5, "bottom_fraction")
        assert len(dropped) == BATCH // 2
        kept = [i for i in range(BATCH) if i not in dropped]
        for n, g in h.kept_gradient(state, data, kept, reduction).items():
            expected[n] += g
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-5)


def _sgd(net):
    return torch.optim.SGD(net.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"score": "lookahead"}, ValueError, "needs optimizer="),
        ({"score": "lookahead", "optimizer": _sgd}, ValueError, "got SGD"),
        (
            {
                "score": "lookahead",
                "optimizer": lambda n: torch.optim.Adam(n.parameters(), amsgrad=True),
            },
            ValueError,
            "amsgrad=False",
        ),
        (
            {
                "score": "lookahead",
                "optimizer": lambda n: torch.optim.AdamW(n.parameters(), maximize=True),
            },
            ValueError,
            "maximize=False",
        ),
        ({"score": "lookahead", "optimizer": _sgd, "horizon": 0}, ValueError, "horizon"),
        ({"score": "lookahead", "horizon": 2.0}, ValueError, "horizon must be an int"),
        ({"score": "lookahead", "horizon": True}, ValueError, "horizon must be an int"),
        ({"score": "tracin"}, ValueError, "score must be one of"),
        ({"horizon": 3}, ValueError, "only by score='lookahead'"),
        ({"optimizer": _sgd}, ValueError, "only by score='lookahead'"),
        ({"score": "lookahead", "max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
        ({"lookahead_curvature": 1}, TypeError, "lookahead_curvature"),
    ],
)
def test_invalid_lookahead_options_raise(kwargs, error, match):
    net = h.build()
    kwargs = {k: v(net) if callable(v) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        DataSelectionCallback(net, **kwargs)


def test_collective_steps_refuse_lookahead():
    net, opt = warmed_up("adamw", "sum")
    selection = DataSelectionCallback(net, score="lookahead", optimizer=opt)
    selection._is_collective = lambda: True  # a synchronizing DDP step
    with pytest.raises(NotImplementedError, match="score='grad_dot'"):
        with HookManager(net, callbacks=[selection]).collect(deregister_on_exit=True):
            h.batch_loss(net, h.batch(3, BATCH), "sum").backward()


def test_parameters_outside_the_optimizer_raise():
    net = h.build()
    opt = torch.optim.AdamW(net.head.parameters())
    selection = DataSelectionCallback(net, score="lookahead", optimizer=opt)
    with pytest.raises(ValueError, match="not in the optimizer"):
        with HookManager(net, callbacks=[selection]).collect(deregister_on_exit=True):
            h.batch_loss(net, h.batch(3, BATCH), "sum").backward()

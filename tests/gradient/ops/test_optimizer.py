"""Optimizer maps (ops/optimizer.py) against the optimizers' own steps.

The per-sample direction of a one-sample batch *is* the optimizer's update: a
parameter of ``K`` coordinates is trained for a few steps on random gradients by
the real ``torch.optim`` optimizer, its pre-step state is copied into
``precondition`` with the next gradient, and the map must equal
``-(θ_after - θ_before)/lr`` of the real step. Lion (not in torch) is stepped by a
hand-written implementation of its published rule.

Tolerances: float32 inputs ``rtol=1e-5, atol=1e-6`` (the map and torch round in
a different order); float64 inputs ``rtol=2e-7, atol=1e-12`` — the map computes in
float64 and only rounds its output to float32 (relative error ≤ 2⁻²⁴ ≈ 6e-8).
The AdamW-influence kernels are compared with explicit diagonal-matrix formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

from dattri_llm.gradient.ops.optimizer import (
    OPTIMIZER_STATE_KEYS,
    adam_preconditioner,
    adamw_influence_coupling,
    adamw_influence_push,
    adamw_influence_transition,
    precondition,
)

K = 17
LR = 0.5  # a power of two: -(θ_after - 0)/lr is exact
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: {"rtol": 2e-7, "atol": 1e-12}}


class Lion(torch.optim.Optimizer):
    """Reference Lion (Chen et al., 2023): ``θ ← θ − lr(sign(β1m+(1−β1)g) + λθ)``,
    then ``m ← β2m + (1−β2)g``."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                update = torch.sign(beta1 * m + (1 - beta1) * p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(group["lr"] * update)
                m.mul_(beta2).add_((1 - beta2) * p.grad)


OPTIMIZERS = {
    "SGD": torch.optim.SGD,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "Adamax": torch.optim.Adamax,
    "NAdam": torch.optim.NAdam,
    "RAdam": torch.optim.RAdam,
    "RMSprop": torch.optim.RMSprop,
    "Adagrad": torch.optim.Adagrad,
    "Adadelta": torch.optim.Adadelta,
    "Lion": Lion,
}

# (optimizer type, hyperparameters other than lr/weight_decay)
CASES = [
    ("SGD", {}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.9, "dampening": 0.3}),
    ("SGD", {"momentum": 0.9, "nesterov": True}),
    ("Adam", {}),
    ("Adam", {"amsgrad": True}),
    ("Adam", {"amsgrad": True, "betas": (0.9, 0.5)}),  # fast β2: the running max matters
    ("Adam", {"betas": (0.8, 0.99), "eps": 1e-3}),
    ("AdamW", {}),
    ("AdamW", {"amsgrad": True, "betas": (0.9, 0.5)}),
    ("Adamax", {}),
    ("Adamax", {"betas": (0.8, 0.9), "eps": 1e-2}),
    ("NAdam", {}),
    ("NAdam", {"momentum_decay": 0.05}),
    ("RAdam", {}),
    ("RMSprop", {}),
    ("RMSprop", {"centered": True}),
    ("RMSprop", {"momentum": 0.9}),
    ("RMSprop", {"centered": True, "momentum": 0.9, "alpha": 0.9}),
    ("Adagrad", {}),
    ("Adagrad", {"lr_decay": 0.1, "initial_accumulator_value": 0.2}),
    ("Adadelta", {}),
    ("Adadelta", {"rho": 0.8, "eps": 1e-3}),
    ("Lion", {}),
    ("Lion", {"betas": (0.95, 0.98)}),
]
CASE_IDS = [
    f"{name}-{'-'.join(f'{k}={v}' for k, v in hp.items()) or 'defaults'}" for name, hp in CASES
]
# prior updates before the compared one: the first step, and later steps (bias correction;
# RAdam's ρ_t ≤ 5 branch at steps 1–5, > 5 from step 6 with β2 = 0.999)
PRIOR_STEPS = [0, 2, 7]


def _train(name, hp, dtype, prior_steps, weight_decay=0.0, seed=0):
    """Run the real optimizer ``prior_steps`` times; return ``(p, optimizer, generator)``."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(K, generator=gen, dtype=dtype))
    opt = OPTIMIZERS[name]([p], lr=LR, weight_decay=weight_decay, **hp)
    for _ in range(prior_steps):
        p.grad = torch.randn(K, generator=gen, dtype=dtype)
        opt.step()
    return p, opt, gen


def _pre_step(opt, p, name, prior_steps):
    """Copy of the pre-step state (keys of OPTIMIZER_STATE_KEYS) and the coming step index."""
    state = opt.state[p]
    copied = {key: state[key].clone() for key in OPTIMIZER_STATE_KEYS[name] if key in state}
    step = int(state["step"]) + 1 if "step" in state else prior_steps + 1
    return copied, step


def _torch_direction(name, hp, dtype, prior_steps, seed=0):
    """``(g, pre-step state, step, -(θ_after-θ_before)/lr)`` of one real step on gradient ``g``."""
    p, opt, gen = _train(name, hp, dtype, prior_steps, seed=seed)
    state, step = _pre_step(opt, p, name, prior_steps)
    g = torch.randn(K, generator=gen, dtype=dtype) * 2.0
    with torch.no_grad():
        p.zero_()  # θ_before = 0 (no weight decay, so θ does not enter the update)
    p.grad = g.clone()
    opt.step()
    return g, state, step, -p.detach() / LR


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("prior_steps", PRIOR_STEPS)
@pytest.mark.parametrize(("name", "hp"), CASES, ids=CASE_IDS)
def test_precondition_equals_one_sample_optimizer_step(name, hp, prior_steps, dtype):
    g, state, step, expected = _torch_direction(name, hp, dtype, prior_steps)
    out = precondition(g[None], state, optimizer_type=name, step=step, lr=LR, **hp)
    assert out.shape == (1, K) and out.dtype == torch.float32
    torch.testing.assert_close(out[0].double(), expected.double(), **TOL[dtype])


def test_radam_covers_both_branches():
    """PRIOR_STEPS puts RAdam's compared step on both sides of ρ_t = 5."""
    beta2 = 0.999
    rho_inf = 2 / (1 - beta2) - 1
    rho = [rho_inf - 2 * (n + 1) * beta2 ** (n + 1) / (1 - beta2 ** (n + 1)) for n in PRIOR_STEPS]
    assert min(rho) <= 5 < max(rho)


@pytest.mark.parametrize(("name", "hp"), CASES, ids=CASE_IDS)
def test_batch_equals_one_sample_calls(name, hp):
    _, state, step, _ = _torch_direction(name, hp, torch.float32, prior_steps=3)
    g = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    batch = precondition(g, state, optimizer_type=name, step=step, **hp)
    rows = [
        precondition(g[i : i + 1], state, optimizer_type=name, step=step, **hp) for i in range(3)
    ]
    torch.testing.assert_close(batch, torch.cat(rows), rtol=0, atol=0)


@pytest.mark.parametrize("prior_steps", [0, 4])
@pytest.mark.parametrize(("name", "hp"), CASES, ids=CASE_IDS)
def test_weight_decay_is_dropped(name, hp, prior_steps):
    """With weight decay in the group, the map is still the weight-decay-free step."""
    g, state, step, expected = _torch_direction(name, hp, torch.float64, prior_steps)
    out = precondition(g[None], state, optimizer_type=name, step=step, weight_decay=0.1, **hp)
    torch.testing.assert_close(out[0].double(), expected, **TOL[torch.float64])


@pytest.mark.parametrize("name", ["AdamW", "Lion"])
def test_decoupled_weight_decay_separates_from_the_map(name):
    """AdamW / Lion: θ_after = (1 − lr·wd)·θ_before − lr·map, with θ_before ≠ 0."""
    wd = 0.1
    p, opt, gen = _train(name, {}, torch.float64, prior_steps=5, weight_decay=wd)
    state, step = _pre_step(opt, p, name, 5)
    g = torch.randn(K, generator=gen, dtype=torch.float64)
    before = p.detach().clone()
    p.grad = g.clone()
    opt.step()
    expected = -(p.detach() - (1 - LR * wd) * before) / LR
    out = precondition(g[None], state, optimizer_type=name, step=step, weight_decay=wd)
    torch.testing.assert_close(out[0].double(), expected, rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad"])
def test_maximize_maps_negated_gradient(name):
    hp = {"momentum": 0.9} if name == "SGD" else {}
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(K, dtype=torch.float64))
    opt = OPTIMIZERS[name]([p], lr=LR, maximize=True, **hp)
    for _ in range(3):
        p.grad = torch.randn(K, generator=gen, dtype=torch.float64)
        opt.step()
    state, step = _pre_step(opt, p, name, 3)
    g = torch.randn(K, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        p.zero_()
    p.grad = g.clone()
    opt.step()
    out = precondition(g[None], state, optimizer_type=name, step=step, maximize=True, **hp)
    torch.testing.assert_close(out[0].double(), -p.detach() / LR, **TOL[torch.float64])


@pytest.mark.parametrize(
    ("name", "hp"), [case for case in CASES if "initial_accumulator_value" not in case[1]]
)
def test_missing_state_is_zeros(name, hp):
    """``state=None`` reproduces the first step from a fresh optimizer (SGD: no buffer)."""
    g, _, step, expected = _torch_direction(name, hp, torch.float64, prior_steps=0)
    assert step == 1
    out = precondition(g[None], None, optimizer_type=name, step=1, **hp)
    torch.testing.assert_close(out[0].double(), expected, **TOL[torch.float64])


def test_nadam_missing_mu_product_is_product_of_past_momenta():
    g, state, step, expected = _torch_direction("NAdam", {}, torch.float64, prior_steps=6)
    del state["mu_product"]
    out = precondition(g[None], state, optimizer_type="NAdam", step=step)
    torch.testing.assert_close(out[0].double(), expected, rtol=1e-6, atol=1e-9)


def test_fp64_input_is_mapped_in_fp64():
    """Adam on float64 data agrees with a float64 formula to float32 output rounding."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(4, K, generator=gen, dtype=torch.float64) * 1e-3
    m = torch.randn(K, generator=gen, dtype=torch.float64) * 1e-3
    v = torch.rand(K, generator=gen, dtype=torch.float64) * 1e-6
    step, beta1, beta2, eps = 9, 0.9, 0.999, 1e-8
    m1 = beta1 * m + (1 - beta1) * g
    v1 = beta2 * v + (1 - beta2) * g**2
    expected = (m1 / (1 - beta1**step)) / (v1.sqrt() / math.sqrt(1 - beta2**step) + eps)
    out = precondition(g, {"exp_avg": m, "exp_avg_sq": v}, optimizer_type="Adam", step=step)
    torch.testing.assert_close(out.double(), expected, rtol=7e-8, atol=0)


@pytest.mark.parametrize("step", [0, -1, 0.5])
def test_step_below_one_raises(step):
    with pytest.raises(ValueError, match="step"):
        precondition(torch.ones(2, K), None, optimizer_type="Adam", step=step)
    with pytest.raises(ValueError, match="step"):
        adamw_influence_push(torch.ones(2, K), *[torch.ones(K)] * 3, lr=0.1, step=step)


def test_unknown_optimizer_type_raises_naming_supported_ones():
    with pytest.raises(NotImplementedError) as info:
        precondition(torch.ones(2, K), None, optimizer_type="LBFGS", step=1)
    message = str(info.value)
    assert "LBFGS" in message
    assert all(name in message for name in OPTIMIZER_STATE_KEYS)


def test_state_of_wrong_shape_raises():
    with pytest.raises(ValueError, match="exp_avg"):
        precondition(
            torch.ones(2, K), {"exp_avg": torch.zeros(K + 1)}, optimizer_type="Adam", step=2
        )


def test_state_keys_cover_every_supported_type():
    assert OPTIMIZER_STATE_KEYS == {
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


# --------------------------------------------------------------------------- AdamW-influence


def _influence_inputs(seed=0, batch=3, rows=4):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return {
        "g_z": r(batch, K),
        "g_t": r(K),
        "d": r(K).abs(),
        "s": r(K),
        "w_theta": r(rows, K),
        "w_m": r(rows, K),
        "w_v": r(rows, K),
    }


def test_adam_preconditioner_matches_formula():
    gen = torch.Generator().manual_seed(0)
    m_hat = torch.randn(K, generator=gen)
    v_hat = torch.rand(K, generator=gen) * 1e-4
    v_hat[[2, 5]] = 0.0
    eps = 1e-8
    d, s = adam_preconditioner(m_hat, v_hat, eps=eps)
    assert d.dtype == s.dtype == torch.float32 and d.shape == s.shape == (K,)
    for i in range(K):
        m, v = float(m_hat[i]), float(v_hat[i])
        assert d[i].item() == pytest.approx(1 / (math.sqrt(v) + eps), rel=1e-6)
        expected_s = 0.0 if v == 0 else m / (2 * math.sqrt(v) * (math.sqrt(v) + eps) ** 2)
        assert s[i].item() == pytest.approx(expected_s, rel=1e-6, abs=0)


def test_adam_preconditioner_is_the_adam_jacobian():
    """D and −S are the derivatives of m̂/(sqrt(v̂)+eps) in m̂ and v̂ (float64 autograd)."""
    gen = torch.Generator().manual_seed(1)
    m_hat = torch.randn(K, generator=gen, dtype=torch.float64, requires_grad=True)
    v_hat = (torch.rand(K, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    (m_hat / (v_hat.sqrt() + 1e-3)).sum().backward()
    d, s = adam_preconditioner(m_hat.detach(), v_hat.detach(), eps=1e-3)
    torch.testing.assert_close(d.double(), m_hat.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(-s.double(), v_hat.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("step", [1, 5])
def test_adamw_influence_push_matches_formula(step):
    x = _influence_inputs()
    lr, b1, b2 = 0.01, 0.8, 0.95
    out = adamw_influence_push(
        x["g_z"], x["g_t"], x["d"], x["s"], lr=lr, step=step, beta1=b1, beta2=b2
    )
    assert out.shape == (3, 3 * K) and out.dtype == torch.float32
    D, S, G_t = torch.diag(x["d"]), torch.diag(x["s"]), torch.diag(x["g_t"])
    for i in range(3):
        gz = x["g_z"][i]
        m_dot = -(1 - b1) * gz
        v_dot = -2 * (1 - b2) * (G_t @ gz)
        theta_dot = -lr * (D @ m_dot / (1 - b1**step) - S @ v_dot / (1 - b2**step))
        expected = torch.cat([theta_dot, m_dot, v_dot])
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("step", [1, 5])
def test_adamw_influence_transition_matches_formula(step):
    x = _influence_inputs()
    lr, b1, b2, wd = 0.01, 0.8, 0.95, 0.1
    w_theta, w_m, w_v = adamw_influence_transition(
        x["w_theta"], x["w_m"], x["w_v"], x["d"], x["s"],
        lr=lr, step=step, beta1=b1, beta2=b2, weight_decay=wd,
    )  # fmt: skip
    D, S = torch.diag(x["d"]), torch.diag(x["s"])
    expected = (
        (1 - lr * wd) * x["w_theta"],
        x["w_theta"] @ (-lr * b1 / (1 - b1**step) * D) + b1 * x["w_m"],
        x["w_theta"] @ (lr * b2 / (1 - b2**step) * S) + b2 * x["w_v"],
    )
    for got, want in zip((w_theta, w_m, w_v), expected, strict=True):
        assert got.dtype == torch.float32 and got.shape == (4, K)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("step", [1, 5])
def test_adamw_influence_coupling_matches_formula(step):
    x = _influence_inputs()
    lr, b1, b2 = 0.01, 0.8, 0.95
    out = adamw_influence_coupling(
        x["w_theta"], x["w_m"], x["w_v"], x["g_z"], x["g_t"], x["d"], x["s"],
        lr=lr, step=step, beta1=b1, beta2=b2,
    )  # fmt: skip
    assert out.shape == (3, 4) and out.dtype == torch.float32
    D, S, G_t = torch.diag(x["d"]), torch.diag(x["s"]), torch.diag(x["g_t"])
    for i in range(3):
        G_z = torch.diag(x["g_z"][i])
        r_theta = (
            -lr * (1 - b1) / (1 - b1**step) * D + 2 * lr * (1 - b2) / (1 - b2**step) * S @ G_t
        ) @ x["g_z"][i]
        r_m = (1 - b1) * x["g_z"][i]
        r_v = 2 * (1 - b2) * G_z @ x["g_t"]
        expected = x["w_theta"] @ r_theta + x["w_m"] @ r_m + x["w_v"] @ r_v
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-6, atol=1e-7)

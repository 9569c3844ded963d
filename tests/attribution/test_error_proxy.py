"""AdamW-influence's second-order error proxy against closed forms and real runs.

The ground truth is a hand-made run where AdamW-influence's model is exact:
every update's per-sample losses are quadratic around the recorded
parameters, ``ℓ_b(θ) = t_b·(θ−θ_t) + ½c_b (t_b·(θ−θ_t))²``, so the stored rows
are the exact gradients and ``c_b t_b t_bᵀ`` the exact Hessian; the run is
trained by AdamW written out below, and the query loss is
``q·θ + ½(θ−θ_T)ᵀA(θ−θ_T)``. ``a(w) = L_q(θ_T(w))`` with every sample's loss
weighted ``1 + w_z`` is differentiated twice by ``torch.func``.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings

import pytest
import torch
from torch import nn
from torch.func import jacfwd, jacrev

from dattri_llm.attribution.algorithm.adamw_influence import (
    RELIABILITY_THRESHOLD,
    AdamWInfluenceAttributor,
    ErrorProxy,
)
from dattri_llm.attribution.algorithm.trajectory import ErrorProxy as PackageErrorProxy
from dattri_llm.attribution.algorithm.trajectory.second_order import _summarise
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.task import AttributionTask

F64 = torch.float64


# ---------------------------------------------------------------------------- the surrogate run
class Surrogate:
    """A quadratic-loss run (see the module docstring): ``N`` samples, batches of ``B``."""

    P, N, B, EPOCHS = 6, 8, 4, 3
    BETAS, EPS, WD = (0.9, 0.99), 1e-8, 0.1

    def __init__(self, lr: float, reduction: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lr, self.reduction = lr, reduction
        self.order = []
        for _ in range(self.EPOCHS):  # every sample recurs: the cross term matters
            perm = torch.randperm(self.N, generator=gen)
            self.order += [perm[i : i + self.B] for i in range(0, self.N, self.B)]
        base = torch.randn(self.N, self.P, generator=gen, dtype=F64)
        self.rows = [
            (base[b] + 0.5 * torch.randn(self.B, self.P, generator=gen, dtype=F64)) / self.c
            for b in self.order
        ]  # stored shares t_b
        self.theta0 = torch.randn(self.P, generator=gen, dtype=F64)
        self.q = torch.randn(2, self.P, generator=gen, dtype=F64)
        m = torch.randn(self.P, self.P, generator=gen, dtype=F64)
        self.a = m @ m.T / self.P
        self.thetas: list[torch.Tensor] = []
        self.moments: list[tuple] = []
        self.theta_t = self.train(torch.zeros(self.N, dtype=F64), record=True)

    @property
    def c(self) -> float:
        """``c_b``: the inverse of a row's share (the batch size for a mean loss)."""
        return float(self.B) if self.reduction == "mean" else 1.0

    def train(self, w: torch.Tensor, *, record: bool = False) -> torch.Tensor:
        (b1, b2), theta = self.BETAS, self.theta0.clone()
        m = v = torch.zeros(self.P, dtype=F64)
        for t, (batch, rows) in enumerate(zip(self.order, self.rows, strict=True)):
            n = t + 1
            anchor = theta if record else self.thetas[t]
            grads = rows + self.c * rows * (rows @ (theta - anchor))[:, None]
            g = ((1.0 + w[batch])[:, None] * grads).sum(0)
            m_pre, v_pre = m, v
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            if record:
                self.thetas.append(theta.clone())
                self.moments.append((m_pre, v_pre, m, v))
            step = (m / (1 - b1**n)) / ((v / (1 - b2**n)).sqrt() + self.EPS)
            theta = theta * (1 - self.lr * self.WD) - self.lr * step
        return theta

    def loss(self, w: torch.Tensor) -> torch.Tensor:
        """``(n_test,)`` query losses at ``θ_T(w)``."""
        theta = self.train(w)
        d = theta - self.theta_t
        return self.q @ theta + 0.5 * (d @ self.a @ d)

    def derivatives(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a'(0), diag a''(0))``, ``(n_test, N)`` each."""
        zero = torch.zeros(self.N, dtype=F64)
        hessian = jacfwd(jacrev(self.loss))(zero)
        return jacrev(self.loss)(zero), torch.diagonal(hessian, dim1=1, dim2=2)

    def write(self, root) -> tuple[GradientStorageManager, GradientStorageManager, dict]:
        """The train and query stores and the AdamW dynamics the attributor reads."""
        train = GradientStorageManager(str(root / "train"))
        dynamics = {}
        for t, (batch, rows) in enumerate(zip(self.order, self.rows, strict=True)):
            train.save_bulk([GradientRecord(t, [f"s{i}" for i in batch.tolist()], _dense(rows))])
            m_pre, v_pre, m, v = self.moments[t]
            dynamics[t] = {
                "pre": {"lin": (m_pre, v_pre)}, "post": {"lin": (m, v)}, "lr": self.lr,
                "betas": self.BETAS, "eps": self.EPS, "weight_decay": self.WD, "step": t + 1,
            }  # fmt: skip
        test = GradientStorageManager(str(root / "test"))
        test.save_bulk([GradientRecord(len(self.order), ["q0", "q1"], _dense(self.q))])
        return train, test, dynamics


def _dense(rows: torch.Tensor) -> Gradient:
    return Gradient(
        representation={"lin": "materialized"},
        data={"lin": rows.clone()},
        layer_types={"lin": "nn.Linear"},
        indexing={"lin": "batch"},
    )


def _cache_only(tmp_path) -> AdamWInfluenceAttributor:
    return AdamWInfluenceAttributor(
        AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True)
    )


def _by_sample(proxy: ErrorProxy, values: torch.Tensor) -> torch.Tensor:
    """``(N, n_test)`` rows of ``values`` in the sample order ``s0, s1, …``."""
    order = sorted(range(len(proxy.train_ids)), key=lambda i: int(proxy.train_ids[i][1:]))
    return values[order]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_quadratic_run_matches_the_closed_form(tmp_path, reduction):
    run = Surrogate(lr=0.05, reduction=reduction)
    train, test, dynamics = run.write(tmp_path)
    first, second = run.derivatives()
    attributor = _cache_only(tmp_path)
    proxy = attributor.error_proxy(
        train, test, dynamics=dynamics, loss_reduction=reduction, query_hessian=run.a,
        block_dtype=F64, sample_block=3,
    )  # fmt: skip
    assert proxy.mode == "per_sample" and proxy.num_samples == run.N
    assert sorted(proxy.train_ids) == sorted(f"s{i}" for i in range(run.N))
    assert proxy.test_ids == ["q0", "q1"]
    scale = float(first.abs().max())
    torch.testing.assert_close(
        _by_sample(proxy, proxy.linear), -first.T, rtol=1e-6, atol=1e-6 * scale
    )
    scale = float(second.abs().max())
    torch.testing.assert_close(
        _by_sample(proxy, proxy.second_order), 0.5 * second.T, rtol=1e-6, atol=1e-6 * scale
    )
    assert float(proxy.second_order.abs().min()) > 1e-4 * scale  # nothing vanished
    torch.testing.assert_close(proxy.mean_second_order, proxy.second_order.mean(0))
    torch.testing.assert_close(proxy.rms_linear, proxy.linear.square().mean(0).sqrt())
    # float32 agrees to its precision
    single = attributor.error_proxy(
        train, test, dynamics=dynamics, loss_reduction=reduction, query_hessian=run.a,
        block_dtype=torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(
        single.second_order.double(), proxy.second_order, rtol=1e-3, atol=1e-4 * scale
    )


def test_quadratic_removal_is_the_taylor_series(tmp_path):
    """``a(ε) − a(0) = εa'(0) + ½ε²a''(0) + O(ε³)``: the remainder after ``E`` is third order."""
    run = Surrogate(lr=0.05, reduction="sum")
    first, second = run.derivatives()
    zero = torch.zeros(run.N, dtype=F64)
    base = run.loss(zero)
    remainders, quadratic = [], []
    for eps in (-0.02, -0.01, -0.005):
        rows = []
        for z in range(run.N):
            w = zero.clone()
            w[z] = eps
            rows.append(run.loss(w) - base - eps * first[:, z] - 0.5 * eps**2 * second[:, z])
        remainders.append(torch.stack(rows).abs().mean())
        quadratic.append((0.5 * eps**2 * second).abs().mean())
    for k in (0, 1):
        assert 6.0 < remainders[k] / remainders[k + 1] < 10.0  # third order: 8x per halving
        assert 3.5 < quadratic[k] / quadratic[k + 1] < 4.5
    assert remainders[-1] < 0.2 * quadratic[-1]


def test_adamw_curvature_scales_like_the_linear_term():
    """At small η both ``a'`` and ``E`` scale as ``η``: AdamW's own curvature in ``g`` sets an
    ``η``-independent floor of the relative error (the couplings add ``O(η)`` on top)."""
    sizes = []
    for lr in (1e-3, 1e-4):
        first, second = Surrogate(lr=lr, reduction="sum").derivatives()
        sizes.append((float(first.abs().mean()), float((0.5 * second).abs().mean())))
    (lin_a, e_a), (lin_b, e_b) = sizes
    assert 9.0 < lin_a / lin_b < 11.0 and 9.0 < e_a / e_b < 11.0
    assert e_b > 0.05 * lin_b  # the floor is not negligible for batches of 4


# ---------------------------------------------------------------------------- real runs
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6, bias=False)
        self.fc2 = nn.Linear(6, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def mlp_data(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


N_TRAIN, N_TEST = 8, 4


def mlp_run(tmp_path, *, lr: float, epochs: int = 1, max_grad_norm: float | None = None):
    """Train the MLP through the library (captured run + AdamW moments), ``epochs`` passes."""
    torch.manual_seed(0)
    model = MLP()
    args = AttributionArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, learning_rate=lr, weight_decay=0.05, adam_beta1=0.9,
        adam_beta2=0.99, max_grad_norm=max_grad_norm, lr_scheduler_type="constant",
    )  # fmt: skip
    attributor = AdamWInfluenceAttributor(args, task=AttributionTask(mlp_loss, model))
    ((train_dir, test_dir),) = attributor.cache(
        mlp_data(N_TRAIN, 1) * epochs, mlp_data(N_TEST, 2), cache_dir=str(tmp_path / "run")
    )
    return attributor, train_dir, test_dir


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory):
    """``{(lr, epochs): run}``: three rates over three epochs, three lengths at the largest."""
    tmp = tmp_path_factory.mktemp("proxy")
    settings = [(0.03, 3), (0.1, 3), (0.3, 1), (0.3, 2), (0.3, 3)]
    return {(lr, n): mlp_run(tmp / f"{lr}_{n}", lr=lr, epochs=n) for lr, n in settings}


def test_grows_with_the_learning_rate_and_the_trajectory(mlp_runs):
    proxies = {
        key: attributor.error_proxy(train_dir, test_dir, loss_reduction="sum")
        for key, (attributor, train_dir, test_dir) in mlp_runs.items()
    }
    size = {key: float(p.second_order.abs().mean()) for key, p in proxies.items()}
    relative = {key: p.median_relative_error for key, p in proxies.items()}
    assert size[0.03, 3] < size[0.1, 3] < size[0.3, 3]  # with η
    assert relative[0.03, 3] < relative[0.1, 3] < relative[0.3, 3]
    assert size[0.3, 1] < size[0.3, 2] < size[0.3, 3]  # with T (epochs of the same samples)
    assert proxies[0.03, 3].reliable and not proxies[0.3, 3].reliable


def summed_rows(score, train_ids: list[str]) -> torch.Tensor:
    """``(N, n_test)`` a sample's AdamW-influence rows summed over its steps."""
    position = {sample: i for i, sample in enumerate(train_ids)}
    out = torch.zeros(len(train_ids), score.scores.shape[1], dtype=F64)
    for row, sample in zip(score.scores.double(), score.row_train_ids, strict=True):
        out[position[sample]] += row
    return out


def test_first_order_is_adamw_influence(mlp_runs):
    attributor, train_dir, test_dir = mlp_runs[0.1, 3]
    proxy = attributor.error_proxy(train_dir, test_dir, loss_reduction="sum", sample_block=3)
    assert proxy.num_samples == N_TRAIN and len(proxy.train_ids) == N_TRAIN  # 3 epochs, 8 ids
    score = attributor.attribute_from_cache(
        train_dir, test_dir, loss_reduction="sum", propagation="test"
    )
    assert proxy.test_ids == score.test_ids
    want = summed_rows(score, proxy.train_ids)
    torch.testing.assert_close(
        -proxy.linear.double(), want, rtol=1e-4, atol=1e-5 * float(want.abs().max())
    )
    # perturbing only the occurrences at some steps: the rows emitted at those steps
    steps = [1, 4, 9]
    picked = attributor.error_proxy(
        train_dir, test_dir, loss_reduction="sum", selected_training_steps=steps
    )
    rows = attributor.attribute_from_cache(
        train_dir, test_dir, loss_reduction="sum", selected_training_steps=steps
    )
    assert sorted(set(rows.row_steps)) == steps and picked.num_samples == len(
        set(rows.row_train_ids)
    )
    want = summed_rows(rows, picked.train_ids)
    torch.testing.assert_close(
        -picked.linear.double(), want, rtol=1e-4, atol=1e-5 * float(want.abs().max())
    )


def test_first_order_with_an_active_clip(tmp_path):
    """The forward tangents carry the clip's Jacobian as the backward sweep does."""
    attributor, train_dir, test_dir = mlp_run(tmp_path, lr=0.1, epochs=2, max_grad_norm=0.5)
    with pytest.warns(UserWarning, match="clip was active at 8 of the 8 swept updates"):
        proxy = attributor.error_proxy(train_dir, test_dir, loss_reduction="sum")
    score = attributor.attribute_from_cache(
        train_dir, test_dir, loss_reduction="sum", propagation="test"
    )
    assert score.algorithm_meta["clip_coefficients"]  # the clip was active
    want = summed_rows(score, proxy.train_ids)
    scale = float(want.abs().max())
    torch.testing.assert_close(-proxy.linear.double(), want, rtol=1e-4, atol=1e-5 * scale)


def test_probes_estimate_the_per_sample_statistics(mlp_runs):
    attributor, train_dir, test_dir = mlp_runs[0.1, 3]
    exact = attributor.error_proxy(train_dir, test_dir, loss_reduction="sum")
    probes = attributor.error_proxy(
        train_dir, test_dir, loss_reduction="sum", per_sample=False, num_probes=4000, seed=1
    )
    assert probes.mode == "probes" and probes.linear is None and probes.second_order is None
    assert probes.train_ids is None and probes.num_samples == N_TRAIN
    spread = exact.second_order.abs().mean(0)
    assert ((probes.mean_second_order - exact.mean_second_order).abs() < 0.1 * spread).all()
    torch.testing.assert_close(probes.rms_linear, exact.rms_linear, rtol=0.05, atol=0.0)


# ---------------------------------------------------------------------------- attribute_from_cache
def test_attribute_from_cache_records_the_proxy_and_warns(mlp_runs):
    attributor, train_dir, test_dir = mlp_runs[0.03, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The first update's rows are ~5.5x the others here (test_first_update.py covers it).
        warnings.filterwarnings("ignore", message=r".*optimizer's first update")
        score = attributor.attribute_from_cache(
            train_dir, test_dir, loss_reduction="sum", error_proxy=True
        )
    meta = score.algorithm_meta["error_proxy"]
    json.dumps(meta)  # JSON-safe
    assert meta["mode"] == "probes" and meta["reliable"] and meta["num_samples"] == N_TRAIN
    assert meta["threshold"] == RELIABILITY_THRESHOLD == 0.3
    assert meta["test_ids"] == score.test_ids and len(meta["relative_error"]) == N_TEST
    plain = attributor.attribute_from_cache(train_dir, test_dir, loss_reduction="sum")
    assert "error_proxy" not in plain.algorithm_meta
    torch.testing.assert_close(plain.scores, score.scores)
    attributor, train_dir, test_dir = mlp_runs[0.3, 3]
    with pytest.warns(
        UserWarning,
        match=r"median over the queries; threshold 0.3.*selected_training_steps / final_step"
        r".*smaller learning rate",
    ):
        score = attributor.attribute_from_cache(
            train_dir, test_dir, loss_reduction="sum", error_proxy=True
        )
    assert not score.algorithm_meta["error_proxy"]["reliable"]


def test_attribute_passes_the_keyword(tmp_path):
    attributor, _train_dir, _test_dir = mlp_run(tmp_path / "first", lr=0.03)
    score = attributor.attribute(
        mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2), cache_dir=str(tmp_path / "live"),
        loss_reduction="sum", error_proxy=True,
    )  # fmt: skip
    assert score.algorithm_meta["error_proxy"]["num_samples"] == N_TRAIN


def test_refusals(mlp_runs, tmp_path):
    attributor, train_dir, test_dir = mlp_runs[0.03, 3]
    with pytest.raises(ValueError, match=r"query_hessian must be a square \(p, p\) tensor"):
        attributor.error_proxy(train_dir, test_dir, query_hessian=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"captured coordinates number 36 .*pass a \(36, 36\)"):
        attributor.error_proxy(train_dir, test_dir, query_hessian=torch.eye(5))
    with pytest.raises(ValueError, match="sample_block must be an int >= 1"):
        attributor.error_proxy(train_dir, test_dir, sample_block=0)
    with pytest.raises(ValueError, match="num_probes must be an int >= 1"):
        attributor.error_proxy(train_dir, test_dir, per_sample=False, num_probes=0)
    with pytest.raises(TypeError, match="error_prox"):
        attributor.attribute_from_cache(train_dir, test_dir, error_proxi=True)
    amsgrad = tmp_path / "amsgrad"
    shutil.copytree(train_dir, amsgrad)
    path = amsgrad / "training_dynamics.json"
    recorded = json.loads(path.read_text())
    for update in recorded["updates"].values():
        for group in update["groups"]:
            group["amsgrad"] = True
    path.write_text(json.dumps(recorded))
    with pytest.raises(NotImplementedError, match="error_proxy does not model amsgrad"):
        attributor.error_proxy(amsgrad, test_dir)
    assert ErrorProxy is PackageErrorProxy


def test_a_non_finite_term_is_not_reliable():
    """An overflowed second-order term makes its query unreliable (never a relative error of 0)."""
    mean = torch.tensor([1e-4, float("nan"), float("inf"), 0.0])
    rms = torch.tensor([1.0, 1.0, 1.0, 0.0])
    proxy = _summarise(mean, rms, test_ids=["a", "b", "c", "d"], num_samples=3, mode="probes")
    assert proxy.relative_error.tolist() == [pytest.approx(1e-4), math.inf, math.inf, 0.0]
    assert not proxy.reliable  # median over (1e-4, 0, inf, inf) is inf
    assert proxy.to_meta()["relative_error"][1] is None

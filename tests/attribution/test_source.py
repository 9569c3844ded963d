"""SOURCE (approximate unrolling) against explicit dense operators on a tiny float64 MLP.

Checkpoints come from a short real SGD run. Per segment the dense curvature
``H_ℓ`` is built from the factors the attributor fitted (checked against
explicit covariances / eigenvalue corrections), ``S_ℓ`` by
``torch.linalg.matrix_exp``, ``r_ℓ`` by ``eigh``; per-sample gradients come from
a loop of single-sample backwards (``reference.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from attribution_helpers import (
    MLP,
    MLP_LAYERS,
    capture_factors,
    dense_reference,
    mlp_data,
    mlp_loss,
    sample_ids,
    write_store,
)
from kfac_helpers import covariances, dict_loss, dict_samples, linear_rows
from torch import nn

from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.source import SourceAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.ops.kronecker import unrolled_propagator, unrolled_response
from dattri_llm.task import AttributionTask

N_TRAIN, N_TEST, LR = 6, 3, 0.1
RATES3 = [0.3, 0.2, 0.5]
# the pipeline runs in float64; the scoring engine stores scores as float32 (round-off 6e-8)
RTOL = 1e-7


def _args(path):
    return AttributionArguments(
        output_dir=str(path), use_cpu=True, per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
    )  # fmt: skip


def _trajectory(num_checkpoints: int):
    """float64 MLP, data, and the state dicts after every 2 full-batch SGD steps."""
    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(N_TRAIN, 1, torch.float64), mlp_data(N_TEST, 2, torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    states = []
    for _ in range(num_checkpoints):
        for _step in range(2):
            opt.zero_grad()
            (mlp_loss(model, train) / N_TRAIN).backward()
            opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return model, train, test, states


def _model_at(state):
    model = MLP().double()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """Stores per checkpoint (L = 3) and the query store at the last one."""
    root = tmp_path_factory.mktemp("source")
    _model, train, test, states = _trajectory(3)
    train_dirs = [
        write_store(root / f"tr{k}", _model_at(s), MLP_LAYERS, mlp_loss, train, batch_sizes=[4, 2])
        .save_dir
        for k, s in enumerate(states)
    ]  # fmt: skip
    test_dir = write_store(
        root / "te", _model_at(states[-1]), MLP_LAYERS, mlp_loss, test, batch_sizes=[2, 1]
    ).save_dir
    return train, test, states, train_dirs, test_dir


def _dense_h(attributor, k, name, damping):
    """Dense ``H_ℓ`` of one layer from the attributor's damping-free fit (float64)."""
    raw = attributor.raw_fits[k][name]
    relative = attributor.relative_damping
    if attributor.curvature == "kfac":

        def damped(m):
            shift = damping * m.trace() / m.shape[0] if relative else damping
            return m + shift * torch.eye(m.shape[0], dtype=m.dtype)

        return torch.kron(damped(raw[1]), damped(raw[0]))
    rot = torch.kron(raw["U_G"], raw["U_A"])
    shift = damping * raw["lam"].mean() if relative else damping
    return rot @ torch.diag(raw["lam"] + shift) @ rot.T


def _response(h, rate):
    """Dense ``(I − exp(−η̄H)) H⁻¹`` via ``eigh``."""
    s, v = torch.linalg.eigh(h)
    return v @ torch.diag(-torch.expm1(-rate * s) / s) @ v.T


def _check_operators(attributor, k, q, rate, damping):
    """Each layer's ``S_ℓ q`` and ``r_ℓ q`` (float64) against dense ``matrix_exp`` / ``eigh``."""
    for name, curv in attributor.segment_curvatures[k].items():
        h = _dense_h(attributor, k, name, damping)
        got_s = curv.apply(q[name], unrolled_propagator(curv.eigenvalues, rate))
        got_r = curv.apply(q[name], unrolled_response(curv.eigenvalues, rate))
        want_s = q[name] @ torch.linalg.matrix_exp(-rate * h)
        want_r = q[name] @ _response(h, rate)
        for got, want in ((got_s, want_s), (got_r, want_r)):
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * want.abs().max().item())


def _check_fit(attributor, k, state, train, damping):
    """The attributor's factors against explicit covariances / eigenvalue corrections."""
    model = _model_at(state)
    grads = dense_reference(model, MLP_LAYERS, mlp_loss, train)
    captured = capture_factors(model, MLP_LAYERS, mlp_loss, train)
    for name in MLP_LAYERS:
        f = captured.data[name]
        a_cov, g_cov = covariances(*linear_rows(f.activation, f.pre_activation_grad))
        raw = attributor.raw_fits[k][name]
        if attributor.curvature == "kfac":
            torch.testing.assert_close(raw[0], a_cov, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(raw[1], g_cov, rtol=1e-10, atol=1e-12)
        else:
            rot = torch.kron(raw["U_G"], raw["U_A"])
            torch.testing.assert_close(
                raw["lam"], ((grads[name] @ rot) ** 2).mean(0), rtol=1e-9, atol=1e-12
            )
            torch.testing.assert_close(rot @ rot.T, torch.eye(rot.shape[0], dtype=rot.dtype))


def _reference(attributor, states, train, test, rates, damping, reverse=False):
    """``{ℓ: (N, Q)}`` rows ``g_ℓ r_ℓ S_{ℓ+1} ⋯ S_L q`` from dense matrices.

    ``reverse`` propagates in the wrong order (``S_L ⋯ S_{ℓ+1}``), a broken variant.
    """
    q = dense_reference(_model_at(states[-1]), MLP_LAYERS, mlp_loss, test)
    rows = {}
    for k in range(len(states)):
        g = dense_reference(_model_at(states[k]), MLP_LAYERS, mlp_loss, train)
        total = 0
        for name in MLP_LAYERS:
            op = _response(_dense_h(attributor, k, name, damping), rates[k])
            later = range(k + 1, len(states))
            for j in reversed(later) if reverse else later:
                op = op @ torch.linalg.matrix_exp(
                    -rates[j] * _dense_h(attributor, j, name, damping)
                )
            total = total + g[name] @ op @ q[name].T
        rows[k] = total
    return rows


def _rows(score, train, test, k):
    """The ``(N, Q)`` rows of checkpoint ``k`` in data order (``train=None``: in row order)."""
    if train is None:
        return score.scores[[s == k for s in score.row_steps]].double()
    train_ids, test_ids = sample_ids(train[0]), sample_ids(test[0])
    where = {(i, s): r for r, (i, s) in enumerate(zip(score.row_train_ids, score.row_steps))}
    cols = [score.test_ids.index(t) for t in test_ids]
    return score.scores[[where[(i, k)] for i in train_ids]][:, cols].double()


def _assert_rows(score, expected, train, test, rtol):
    for k, exp in expected.items():
        got = _rows(score, train, test, k)
        torch.testing.assert_close(got, exp, rtol=rtol, atol=rtol * exp.abs().max().item())


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
@pytest.mark.parametrize("damping", [None, 0.05])
def test_matches_dense_unrolling_three_segments(case, tmp_path, curvature, damping):
    train, test, states, train_dirs, test_dir = case
    attributor = SourceAttributor(
        _args(tmp_path),
        segment_learning_rates=RATES3,
        curvature=curvature,
        damping=damping,
        keep_fits=True,
    )
    score = attributor.attribute_from_cache(train_dirs, test_dir)
    d = damping or 0.0
    q = dense_reference(_model_at(states[-1]), MLP_LAYERS, mlp_loss, test)
    for k, state in enumerate(states):
        _check_fit(attributor, k, state, train, d)
        _check_operators(attributor, k, q, RATES3[k], d)
    expected = _reference(attributor, states, train, test, RATES3, d)
    _assert_rows(score, expected, train, test, RTOL)
    assert score.algorithm == "SOURCE" and score.polarity == 1
    assert score.row_steps == sorted(score.row_steps) and set(score.row_steps) == {0, 1, 2}
    total = sum(expected.values())
    got = score.query(sample_ids(train[0]), sample_ids(test[0])).double()
    torch.testing.assert_close(got, total, rtol=RTOL, atol=RTOL * total.abs().max().item())
    # a broken variant (propagation in the wrong order) does not match
    broken = _reference(attributor, states, train, test, RATES3, d, reverse=True)
    with pytest.raises(AssertionError):
        _assert_rows(score, broken, train, test, 1e-6)


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_single_segment_and_num_train(case, tmp_path, curvature):
    train, test, states, train_dirs, test_dir = case
    attributor = SourceAttributor(
        _args(tmp_path), segment_learning_rates={0: 0.7}, curvature=curvature, damping=0.01,
        num_train=N_TRAIN, keep_fits=True,
    )  # fmt: skip
    score = attributor.attribute_from_cache(train_dirs[2:], test_dir)
    expected = _reference(attributor, states[2:], train, test, [0.7], 0.01)
    _assert_rows(score, {0: expected[0] / N_TRAIN}, train, test, RTOL)
    assert score.algorithm_meta["num_train"] == N_TRAIN


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_relative_damping(case, tmp_path, curvature):
    train, test, states, train_dirs, test_dir = case
    attributor = SourceAttributor(
        _args(tmp_path), segment_learning_rates=RATES3, curvature=curvature, damping=0.3,
        relative_damping=True, keep_fits=True,
    )  # fmt: skip
    score = attributor.attribute_from_cache(train_dirs, test_dir)
    _assert_rows(score, _reference(attributor, states, train, test, RATES3, 0.3), train, test, RTOL)
    assert score.algorithm_meta["relative_damping"] is True


def test_small_rates_give_grad_dot(case, tmp_path):
    """``η̄ → 0``: every segment's rows tend to ``η̄ · g_ℓ·q`` (TracIn-like)."""
    train, test, states, train_dirs, test_dir = case
    eps = 1e-7
    attributor = SourceAttributor(_args(tmp_path), segment_learning_rates=[eps] * 3)
    score = attributor.attribute_from_cache(train_dirs, test_dir)
    assert attributor.raw_fits == [None] * 3  # keep_fits=False: released once scored
    q = dense_reference(_model_at(states[-1]), MLP_LAYERS, mlp_loss, test)
    for k, state in enumerate(states):
        g = dense_reference(_model_at(state), MLP_LAYERS, mlp_loss, train)
        dot = sum(g[n] @ q[n].T for n in MLP_LAYERS)
        got = _rows(score, train, test, k) / eps
        torch.testing.assert_close(got, dot, rtol=1e-5, atol=1e-5 * dot.abs().max().item())


@pytest.mark.parametrize(
    ("curvature", "cls"), [("kfac", KFACAttributor), ("ekfac", EKFACAttributor)]
)
def test_large_rate_gives_influence(case, tmp_path, curvature, cls):
    """One segment with ``η̄ → ∞``: ``r → H⁻¹``, the library's K-FAC / EK-FAC influence."""
    _train, _test, _states, train_dirs, test_dir = case
    source = SourceAttributor(
        _args(tmp_path / "s"), segment_learning_rates=[1e12], curvature=curvature, damping=0.05
    ).attribute_from_cache(train_dirs[2:], test_dir)
    influence = cls(_args(tmp_path / "i")).attribute_from_cache(
        train_dirs[2], test_dir, damping=0.05
    )
    assert source.row_train_ids == influence.row_train_ids
    assert source.test_ids == influence.test_ids
    ref = influence.scores.double()
    # the library's K-FAC inverts its damped factors in float32
    torch.testing.assert_close(
        source.scores.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()
    )


def test_zero_rate_segment_is_skipped(case, tmp_path):
    """``η̄_ℓ = 0``: ``r_ℓ = 0`` and ``S_ℓ = I``; the checkpoint is not fitted and gives no rows."""
    train, test, states, train_dirs, test_dir = case
    rates = [0.3, 0.0, 0.5]
    attributor = SourceAttributor(
        _args(tmp_path), segment_learning_rates=rates, damping=0.05, keep_fits=True
    )
    score = attributor.attribute_from_cache(train_dirs, test_dir)
    assert sorted(set(score.row_steps)) == [0, 2] and attributor.raw_fits[1] is None
    attributor.raw_fits[1] = attributor.raw_fits[2]  # any fit: S_1 = exp(0) = I
    expected = _reference(attributor, states, train, test, rates, 0.05)
    assert expected[1].abs().max() == 0
    _assert_rows(score, {0: expected[0], 2: expected[2]}, train, test, RTOL)


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_live_matches_cache(case, tmp_path, curvature):
    """``attribute`` over task checkpoints equals the dense reference (and the stores' run)."""
    train, test, states, train_dirs, test_dir = case
    model = _model_at(states[0])
    task = AttributionTask(dict_loss, model, checkpoints=list(states))
    attributor = SourceAttributor(
        _args(tmp_path),
        task=task,
        segment_learning_rates=RATES3,
        curvature=curvature,
        damping=0.05,
        keep_fits=True,
    )
    score = attributor.attribute(dict_samples(train), dict_samples(test))
    expected = _reference(attributor, states, train, test, RATES3, 0.05)
    _assert_rows(score, expected, None, None, RTOL)  # live rows and columns in data order
    total = sum(expected.values())
    torch.testing.assert_close(
        score.agnostic_matrix()[1].double(), total, rtol=RTOL, atol=RTOL * total.abs().max().item()
    )
    cached = SourceAttributor(
        _args(tmp_path / "c"), segment_learning_rates=RATES3, curvature=curvature, damping=0.05
    ).attribute_from_cache(train_dirs, test_dir)
    _assert_rows(cached, expected, train, test, RTOL)


def test_validation(tmp_path):
    args = _args(tmp_path)
    _model, _train, _test, states = _trajectory(2)
    task = AttributionTask(dict_loss, _model_at(states[0]), checkpoints=list(states))
    with pytest.raises(ValueError, match="2 segment"):
        SourceAttributor(args, task=task, segment_learning_rates=[0.1, 0.1, 0.1])
    with pytest.raises(ValueError, match="finite and >= 0"):
        SourceAttributor(args, segment_learning_rates=[0.1, -1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        SourceAttributor(args, segment_learning_rates=[float("nan")])
    with pytest.raises(ValueError, match="0..L-1"):
        SourceAttributor(args, segment_learning_rates={1: 0.1, 2: 0.1})
    with pytest.raises(ValueError, match="sequence of floats"):
        SourceAttributor(args, segment_learning_rates=0.1)
    with pytest.raises(ValueError, match="must be a float"):
        SourceAttributor(args, segment_learning_rates=[0.1, "0.2"])
    assert SourceAttributor(args, segment_learning_rates=(1, 0.5)).segment_learning_rates == [
        1.0,
        0.5,
    ]
    with pytest.raises(ValueError, match="all 0"):
        SourceAttributor(args, segment_learning_rates=[0.0, 0.0])
    with pytest.raises(ValueError, match="empty"):
        SourceAttributor(args, segment_learning_rates=[])
    with pytest.raises(ValueError, match="curvature must be one of"):
        SourceAttributor(args, segment_learning_rates=[0.1], curvature="fisher")
    with pytest.raises(ValueError, match="damping"):
        SourceAttributor(args, segment_learning_rates=[0.1], damping=-1.0)
    with pytest.raises(ValueError, match="num_train"):
        SourceAttributor(args, segment_learning_rates=[0.1], num_train=0)


def test_from_cache_validation(case, tmp_path):
    _train, _test, _states, train_dirs, test_dir = case
    attributor = SourceAttributor(_args(tmp_path), segment_learning_rates=[0.1, 0.1])
    with pytest.raises(ValueError, match="3 segment"):
        attributor.attribute_from_cache(train_dirs, test_dir)
    with pytest.raises(ValueError, match="list of training stores"):
        attributor.attribute_from_cache(train_dirs[0], test_dir)
    with pytest.raises(NotImplementedError, match="not available"):
        attributor.top_k_from_cache(train_dirs[:2], test_dir, 2)


def test_dense_layers_without_factors_are_refused(case, tmp_path):
    train, _test, states, _train_dirs, test_dir = case
    dense = write_store(
        tmp_path / "dense", _model_at(states[-1]), MLP_LAYERS, mlp_loss, train,
        batch_sizes=[4, 2], materialize=True,
    ).save_dir  # fmt: skip
    attributor = SourceAttributor(_args(tmp_path / "o"), segment_learning_rates=[0.1])
    with pytest.warns(UserWarning, match="dense empirical Fisher"):
        with pytest.raises(ValueError, match="no Kronecker factors"):
            attributor.attribute_from_cache([dense], test_dir)


class _NormMLP(nn.Module):
    """The MLP with a LayerNorm (no Kronecker factors) between the linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def test_layers_without_curvature_are_dropped_quietly(tmp_path):
    """A hooked norm layer is not scored, and no one-sided-layer warning is raised."""
    torch.manual_seed(0)
    model = _NormMLP().double()
    train, test = mlp_data(N_TRAIN, 1, torch.float64), mlp_data(N_TEST, 2, torch.float64)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    second = {k: v + 0.1 * torch.randn_like(v) for k, v in first.items()}
    task = AttributionTask(dict_loss, model, checkpoints=[first, second])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attributor = SourceAttributor(
            _args(tmp_path / "l"), task=task, segment_learning_rates=[0.2, 0.3]
        )
        live = attributor.attribute(dict_samples(train), dict_samples(test))
    assert "norm" in attributor._hooked_layers and live.layer_name == list(MLP_LAYERS)
    stores = []
    for k, state in enumerate((first, second)):
        model.load_state_dict(state)
        stores.append(
            write_store(tmp_path / f"t{k}", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4, 2])
        )
    te = write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3])
    cached = SourceAttributor(
        _args(tmp_path / "c"), segment_learning_rates=[0.2, 0.3]
    ).attribute_from_cache([s.save_dir for s in stores], te.save_dir)
    for k in (0, 1):
        want = _rows(cached, train, test, k)
        torch.testing.assert_close(_rows(live, None, None, k), want, rtol=RTOL, atol=1e-12)

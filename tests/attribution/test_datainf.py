"""DataInfAttributor against the explicit dense DataInf formula and the exact inverse (n = 1)."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import (
    MLP,
    MLP_LAYERS,
    dense_inverse_scores,
    mlp_data,
    mlp_loss,
    per_sample_rows,
    write_store,
)

from dattri_llm.attribution.algorithm.datainf import DataInfAttributor, datainf_precondition
from dattri_llm.attribution.arguments import AttributionArguments


def _args(path) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
    )


def dense_datainf_scores(train: dict, test: dict, damping=None) -> torch.Tensor:
    """``Σ_ℓ G H̃⁻¹ Qᵀ``, ``H̃⁻¹ = (1/(nλ)) Σ_i (I − g_i g_iᵀ/(λ+‖g_i‖²))`` built densely (fp64)."""
    total = 0
    for name, g in train.items():
        g, q = g.double(), test[name].double()
        n, d = g.shape
        lam = damping if damping is not None else 0.1 * g.square().sum() / (n * d)
        eye = torch.eye(d, dtype=g.dtype)
        inv = sum(eye - torch.outer(gi, gi) / (lam + gi @ gi) for gi in g) / (n * lam)
        total = total + g @ inv @ q.T
    return total


def _case(tmp_path, n_train: int, n_test: int = 3):
    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(n_train, 1, torch.float64), mlp_data(n_test, 2, torch.float64)
    sizes = [4, n_train - 4] if n_train > 4 else [n_train]
    tr = write_store(tmp_path / "train", model, MLP_LAYERS, mlp_loss, train, batch_sizes=sizes)
    te = write_store(tmp_path / "test", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[n_test])

    def rows(data):
        samples = [tuple(t[i : i + 1] for t in data) for i in range(data[0].shape[0])]
        return per_sample_rows(model, mlp_loss, samples, MLP_LAYERS)

    return tr, te, rows(train), rows(test)


def _close(got, expected, rtol=1e-6):
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("damping", [None, 0.5])
def test_scores_equal_dense_datainf_formula(tmp_path, damping):
    tr, te, train_rows, test_rows = _case(tmp_path, 6)
    score = DataInfAttributor(_args(tmp_path / "o"), damping=damping).attribute_from_cache(tr, te)
    _close(score.scores, dense_datainf_scores(train_rows, test_rows, damping))
    assert score.polarity == 1 and score.algorithm == "DataInf"
    with pytest.raises(ValueError, match="loop_over_test=False"):
        DataInfAttributor(_args(tmp_path / "l")).attribute_from_cache(tr, te, loop_over_test=True)


def test_single_training_row_is_the_exact_inverse(tmp_path):
    tr, te, train_rows, test_rows = _case(tmp_path, 1)
    score = DataInfAttributor(_args(tmp_path / "o")).attribute_from_cache(tr, te)
    _close(score.scores, dense_inverse_scores(train_rows, test_rows))


def test_precondition_rank_one_exact_and_errors():
    gen = torch.Generator().manual_seed(0)
    g, q = (
        torch.randn(1, 7, generator=gen, dtype=torch.float64),
        torch.randn(2, 7, dtype=torch.float64),
    )
    exact = torch.linalg.solve(g.T @ g + 0.3 * torch.eye(7, dtype=g.dtype), q.T).T
    torch.testing.assert_close(datainf_precondition([g], q, 0.3), exact)
    with pytest.raises(ValueError, match="damping"):
        datainf_precondition([g], q, 0.0)
    with pytest.raises(ValueError, match="no rows"):
        datainf_precondition([], q, 0.3)
    with pytest.raises(ValueError, match="projection"):
        datainf_precondition([g[:, :3]], q, 0.3)
    with pytest.raises(ValueError, match="> 0"):
        DataInfAttributor(_args("/tmp/unused"), damping=-1.0)


def test_live_attribute_equals_the_dense_formula(tmp_path):
    pytest.importorskip("transformers")
    from dattri_llm.task import AttributionTask

    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(5, 1, torch.float64), mlp_data(3, 2, torch.float64)

    def as_dicts(data):
        return [{"x": data[0][i], "y": data[1][i]} for i in range(data[0].shape[0])]

    def dict_loss(m, batch):
        return mlp_loss(m, (batch["x"], batch["y"]))

    def rows(data):
        samples = [tuple(t[i : i + 1] for t in data) for i in range(data[0].shape[0])]
        return per_sample_rows(model, mlp_loss, samples, MLP_LAYERS)

    attributor = DataInfAttributor(_args(tmp_path), task=AttributionTask(dict_loss, model))
    score = attributor.attribute(as_dicts(train), as_dicts(test), gradient_cache_residency="memory")
    _close(score.scores, dense_datainf_scores(rows(train), rows(test)), rtol=1e-5)
    live = attributor.attribute(as_dicts(train), as_dicts(test))  # a frozen probe: reusable
    _close(live.scores, score.scores.double(), rtol=1e-5)


def test_approximation_error_shrinks_as_damping_dominates():
    """Both inverses tend to ``q/λ``; the relative gap falls as ``λ`` outgrows ``‖g_i‖²``."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(20, 6, generator=gen, dtype=torch.float64)
    q = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    gram = g.T @ g / g.shape[0]
    errors = []
    for lam in (0.1, 1.0, 10.0, 100.0):
        exact = torch.linalg.solve(gram + lam * torch.eye(6, dtype=g.dtype), q.T).T
        approx = datainf_precondition([g[:7], g[7:]], q, lam)
        errors.append(float((approx - exact).norm() / exact.norm()))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-2

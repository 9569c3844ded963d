"""InfluenceFunctionAttributor against ``G (H + λI)⁻¹ Qᵀ`` with a dense torch.func Hessian."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, mlp_data, mlp_loss, per_sample_rows, write_store

from dattri_llm.attribution.algorithm.influence import InfluenceFunctionAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.task import AttributionTask

DAMPING = 2.0


def _args(path) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=3,
    )


def _dense_hessian(model, samples) -> torch.Tensor:
    """``(D, D)`` Hessian of the mean per-sample loss over the ``[W | b]`` rows of both layers."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes = [(f"{n}.weight", f"{n}.bias") for n in MLP_LAYERS]

    def loss(flat):
        p, offset = {}, 0
        for w_key, b_key in shapes:
            out, inp = params[w_key].shape
            block = flat[offset : offset + out * (inp + 1)].reshape(out, inp + 1)
            p[w_key], p[b_key] = block[:, :inp], block[:, inp]
            offset += out * (inp + 1)
        call = lambda *a: torch.func.functional_call(model, p, a)  # noqa: E731
        return sum(mlp_loss(call, s) for s in samples) / len(samples)

    flat = torch.cat([torch.cat([params[w], params[b][:, None]], 1).reshape(-1) for w, b in shapes])
    return torch.func.hessian(loss)(flat)


@pytest.mark.parametrize("solver", ["cg", "direct", "lissa"])
def test_scores_equal_dense_formula(tmp_path, solver):
    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(5, 1, torch.float64), mlp_data(3, 2, torch.float64)
    tr = write_store(tmp_path / "train", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[5])
    te = write_store(tmp_path / "test", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3])
    samples = [tuple(t[i : i + 1] for t in train) for i in range(5)]
    g = per_sample_rows(model, mlp_loss, samples, MLP_LAYERS)
    q = per_sample_rows(
        model, mlp_loss, [tuple(t[i : i + 1] for t in test) for i in range(3)], MLP_LAYERS
    )
    g_all = torch.cat([g[n] for n in MLP_LAYERS], 1)
    q_all = torch.cat([q[n] for n in MLP_LAYERS], 1)
    h = _dense_hessian(model, samples)
    damping = DAMPING + max(0.0, -float(torch.linalg.eigvalsh(h).min()))
    matrix = h + damping * torch.eye(h.shape[0], dtype=h.dtype)
    expected = g_all @ torch.linalg.solve(matrix, q_all.T)
    options = {"cg": {"max_iter": 200, "tol": 1e-12}, "direct": {}}
    options["lissa"] = {"scale": 1.1 * float(torch.linalg.eigvalsh(matrix).max()), "depth": 120}
    attributor = InfluenceFunctionAttributor(
        _args(tmp_path / "o"),
        task=AttributionTask(mlp_loss, model),
        hessian_batches=samples,
        solver=solver,
        damping=damping,
        solver_options=options[solver],
    )
    score = attributor.attribute_from_cache(tr, te)
    rtol = 1e-3 if solver == "lissa" else 1e-6  # LiSSA: truncated series, looser
    scale = expected.abs().max().item()
    torch.testing.assert_close(score.scores.double(), expected, rtol=rtol, atol=rtol * scale)
    assert score.polarity == 1


def test_errors(tmp_path):
    model = MLP().double()
    task = AttributionTask(mlp_loss, model)
    with pytest.raises(ValueError, match="needs a task"):
        InfluenceFunctionAttributor(_args(tmp_path), hessian_batches=[1])
    with pytest.raises(ValueError, match="solver"):
        InfluenceFunctionAttributor(_args(tmp_path), task=task, hessian_batches=[1], solver="x")
    with pytest.raises(ValueError, match="hessian_batches"):
        InfluenceFunctionAttributor(_args(tmp_path), task=task)
    small = InfluenceFunctionAttributor(
        _args(tmp_path), task=task, hessian_batches=[1], max_params=10
    )
    with pytest.raises(ValueError, match="max_params"):
        small.hvp_function(list(MLP_LAYERS))


def test_live_attribute_equals_cache(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(4, 1, torch.float64), mlp_data(2, 2, torch.float64)
    tr = write_store(tmp_path / "train", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4])
    te = write_store(tmp_path / "test", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[2])

    def dict_loss(m, batch):
        return mlp_loss(m, (batch["x"], batch["y"]))

    samples = [{"x": train[0][i : i + 1], "y": train[1][i : i + 1]} for i in range(4)]
    attributor = InfluenceFunctionAttributor(
        _args(tmp_path / "o"),
        task=AttributionTask(dict_loss, model),
        hessian_batches=samples,
        solver="direct",
        damping=DAMPING + 5.0,
    )
    cached = attributor.attribute_from_cache(tr, te)
    as_dicts = [{"x": train[0][i], "y": train[1][i]} for i in range(4)]
    queries = [{"x": test[0][i], "y": test[1][i]} for i in range(2)]
    live = attributor.attribute(as_dicts, queries)  # through a memory store
    with pytest.raises(ValueError, match="gradient_cache_residency"):
        attributor.attribute(as_dicts, queries, gradient_cache_residency=None)
    scale = cached.scores.abs().max().item()
    torch.testing.assert_close(live.scores, cached.scores, rtol=1e-5, atol=1e-5 * scale)

"""Frozen probes backpropagate to the hooked outputs only: no weight gradient is computed.

Each test counts the weight gradients autograd computes during a live
attribution with a hook on every parameter (``Tensor.register_hook`` fires
exactly when a parameter's gradient is computed) and checks the scores
against per-sample gradients from independent single-sample backward passes.
"""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, dense_gram, dense_reference, mlp_loss

from dattri_llm import HookManagerConfig
from dattri_llm.attribution.algorithm.kronecker import KFACAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.task import AttributionTask

pytest.importorskip("transformers")


def tuple_loss(model, batch):
    return mlp_loss(model, batch)


def dict_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def as_dicts(x, y):
    return [{"x": x[i], "y": y[i]} for i in range(x.shape[0])]


def data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 4, generator=gen), torch.randn(n, 3, 3, generator=gen)


def count_weight_gradients(model):
    """A list whose length is the number of parameter gradients computed from now on."""
    fired: list[str] = []
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: fired.append(name))
    return fired


@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    args = AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
    )
    return model, data(5, 1), data(3, 2), args


def expected_scores(model, train, test, layers=MLP_LAYERS):
    return dense_gram(
        dense_reference(model, layers, tuple_loss, train),
        dense_reference(model, layers, tuple_loss, test),
    )


def test_grad_dot_probe_computes_no_weight_gradient(setup):
    model, train, test, args = setup
    expected = expected_scores(model, train, test)
    fired = count_weight_gradients(model)
    score = TracInAttributor(args, task=AttributionTask(dict_loss, model)).attribute(
        as_dicts(*train), as_dicts(*test)
    )
    assert fired == []
    torch.testing.assert_close(score.scores, expected, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_kfac_passes_compute_no_weight_gradient(setup):
    model, train, test, args = setup
    fired = count_weight_gradients(model)
    kept = KFACAttributor(args, task=AttributionTask(dict_loss, model)).attribute(
        as_dicts(*train), as_dicts(*test), damping=0.1, kept_gradient_budget=0
    )
    assert fired == []
    assert kept.algorithm_meta["pass_plan"]["source_passes"] == 2  # the model ran twice


def test_param_grad_layers_keep_the_full_backward(setup):
    model, train, test, args = setup
    expected = expected_scores(model, train, test, layers=("fc1",))  # param_grad: batch-level
    fired = count_weight_gradients(model)
    config = HookManagerConfig(linear_io=["fc1"], param_grad=["fc2"])
    with pytest.warns(UserWarning, match="batch-level"):
        score = TracInAttributor(args, task=AttributionTask(dict_loss, model)).attribute(
            as_dicts(*train), as_dicts(*test), hook_config=config
        )
    assert "fc2.weight" in fired  # the param_grad capture needs its parameter gradient
    torch.testing.assert_close(score.scores, expected, rtol=1e-5, atol=1e-5)


def test_output_modified_in_place_keeps_the_full_backward(tmp_path):
    """``ReLU(inplace=True)`` on a hooked output moves it off the node its hook sits on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.ReLU(inplace=True), torch.nn.Linear(5, 3)
    )
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 3, generator=gen)

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    def per_sample_gradient(i):
        model.zero_grad()
        loss(model, {"x": x[i : i + 1], "y": y[i : i + 1]}).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    grads = torch.stack([per_sample_gradient(i) for i in range(4)])
    model.zero_grad(set_to_none=True)
    args = AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
    )
    data = as_dicts(x, y)
    score = TracInAttributor(args, task=AttributionTask(loss, model)).attribute(data, data)
    torch.testing.assert_close(score.scores, grads @ grads.T, rtol=1e-5, atol=1e-5)
    assert sorted(score.layer_name) == ["0", "2"]

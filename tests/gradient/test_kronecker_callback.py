"""KroneckerCovarianceCallback: covariances at capture equal explicit covariances of the batch."""

from __future__ import annotations

import gc
import weakref

import torch
from kfac_helpers import conv_rows, covariances, linear_layer_io, linear_rows
from torch import nn

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.callbacks.kronecker_covariance_callback import (
    KroneckerCovarianceCallback,
)
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.ops.kronecker import KroneckerAccumulator


class _Net(nn.Module):
    """conv → flatten tokens → linear → layernorm (norm not K-FAC: ignored)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 2, padding=1, stride=2)
        self.fc = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)  # (B, 3, 3, 3)
        tokens = h.flatten(2).transpose(1, 2)  # (B, 9, 3)
        return self.norm(self.fc(tokens))


def _run(net: _Net, batches, mask, callbacks):
    """Capture ``len(batches)`` steps of the loss ``Σ y⊙r⊙mask``; return per-layer (a, g) lists."""
    seen = {"conv": [], "fc": []}
    hooks = [
        net.conv.register_forward_hook(lambda m, i, o: seen["conv"].append([i[0], o])),
        net.fc.register_forward_hook(lambda m, i, o: seen["fc"].append([i[0], o])),
    ]
    manager = HookManager(
        net, HookManagerConfig(linear_io=["conv", "fc", "norm"]), callbacks=callbacks
    )
    try:
        with manager.collect():
            for x, r in zip(batches, mask):
                y = net(x)
                for entry in seen.values():
                    entry[-1][1].retain_grad()
                (y * r).sum().backward()
    finally:
        for h in hooks:
            h.remove()
        manager.remove()
    return {k: [(a.detach(), o.grad) for a, o in v] for k, v in seen.items()}


def test_callback_matches_explicit_covariances_and_fit_pass():
    torch.manual_seed(0)
    net = _Net()
    batches = [torch.randn(2, 2, 5, 5), torch.randn(3, 2, 5, 5)]
    weights = [torch.randn(2, 9, 4), torch.randn(3, 9, 4)]
    weights[0][0, 6:] = 0  # padded tokens: zero output gradient
    cov, capture = KroneckerCovarianceCallback(), CaptureCallback()
    fit = KroneckerAccumulator()

    class _Fit(CaptureCallback):
        def on_step_end(self, record) -> None:
            fit.update(record.gradient, ["conv", "fc"])

    io = _run(net, batches, weights, [cov, capture, _Fit()])
    cov.all_reduce()
    got = cov.result()
    assert set(got) == {"conv", "fc"}

    conv_a = torch.cat([conv_rows(net.conv, a, g)[0] for a, g in io["conv"]])
    conv_g = torch.cat([conv_rows(net.conv, a, g)[1] for a, g in io["conv"]])
    fc_rows = [linear_rows(a, g) for a, g in io["fc"]]
    expected = {
        "conv": covariances(conv_a, conv_g),
        "fc": covariances(torch.cat([r[0] for r in fc_rows]), torch.cat([r[1] for r in fc_rows])),
    }
    for name, (A, G) in expected.items():
        torch.testing.assert_close(got[name][0], A, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[name][1], G, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fit.result()[name][0], got[name][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fit.result()[name][1], got[name][1], rtol=1e-6, atol=1e-7)
    cov.reset()
    assert cov.result() == {}


def test_backward_without_forward_is_skipped():
    cov = KroneckerCovarianceCallback()
    cov.on_layer_backward("fc", torch.randn(2, 3), "nn.Linear", {"has_bias": True})
    cov.on_layer_forward("norm", torch.randn(2, 3), "nn.LayerNorm", None)
    cov.on_layer_backward("norm", torch.randn(2, 3), "nn.LayerNorm", None)
    assert cov.result() == {}


def _weighted_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, r = batch
    return (model(x) * r).sum()


def test_forwards_never_backpropagated_are_not_paired():
    """Grad-enabled validation forwards before and after the training forward leave A, G alone."""
    torch.manual_seed(0)
    net = _Net()
    batches = [torch.randn(2, 2, 5, 5), torch.randn(3, 2, 5, 5)]
    weights = [torch.randn(2, 9, 4), torch.randn(3, 9, 4)]
    io = [linear_layer_io(net, ("conv", "fc"), _weighted_loss, b) for b in zip(batches, weights)]
    cov = KroneckerCovarianceCallback()
    manager = HookManager(net, HookManagerConfig(linear_io=["conv", "fc", "norm"]), callbacks=[cov])
    try:
        with manager.collect():
            for x, r in zip(batches, weights):
                before = net(torch.randn(4, 2, 5, 5))  # never backpropagated
                loss = (net(x) * r).sum()
                after = net(10 * torch.randn(1, 2, 5, 5))  # never backpropagated
                loss.backward()
                assert before.requires_grad and after.requires_grad
    finally:
        manager.remove()
    conv = [conv_rows(net.conv, *step["conv"]) for step in io]
    fc = [linear_rows(*step["fc"]) for step in io]
    got = cov.result()
    for name, rows in (("conv", conv), ("fc", fc)):
        A, G = covariances(torch.cat([a for a, _ in rows]), torch.cat([g for _, g in rows]))
        torch.testing.assert_close(got[name][0], A, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[name][1], G, rtol=1e-5, atol=1e-6)


def test_activation_of_a_forward_never_backpropagated_is_released_with_its_output():
    torch.manual_seed(0)
    net = _Net()
    kept: dict[str, weakref.ref] = {}

    class _Spy(CaptureCallback):
        def on_layer_forward(self, layer_name, activation, layer_type, module_kwargs) -> None:
            kept[layer_name] = weakref.ref(activation)

    cov = KroneckerCovarianceCallback()
    manager = HookManager(net, HookManagerConfig(linear_io=["conv", "fc"]), callbacks=[cov, _Spy()])
    try:
        out = net(torch.randn(2, 2, 5, 5))  # hooks fire outside collect(); no backward follows
        assert all(ref() is not None for ref in kept.values())
        del out
        gc.collect()
        assert all(ref() is None for ref in kept.values())
    finally:
        manager.remove()

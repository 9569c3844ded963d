"""Captured activations do not alias an input the caller can still edit in place (issue 8.3).

Expected activations are computed independently (plain ``torch.no_grad`` forwards
or clones taken before the edit); the common training path is checked to keep a
view of the layer input, not a copy.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager


class _EditsFrozenInput(nn.Module):
    """``inp`` → frozen layer; the frozen layer's input is then halved in place."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        z = self.frozen(h)
        h.mul_(0.5)  # legal: the frozen layer's backward did not save h
        return self.out(z + h)


class _EditsGuardedInput(nn.Module):
    """Edits in place the input of a trainable layer, which its backward needs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.used = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        y = self.used(h)
        h.add_(1.0)
        return y


def _capture(model: nn.Module, layers: list[str], x: torch.Tensor, **config) -> CaptureCallback:
    capture = CaptureCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # include_frozen warns about frozen layers
        manager = HookManager(model, HookManagerConfig(linear_io=layers, **config), [capture])
    try:
        with manager.collect():
            model(x).sum().backward()
    finally:
        manager.remove()
    return capture


def test_frozen_layer_input_edited_in_place_after_the_layer_keeps_the_forward_value():
    torch.manual_seed(0)
    model = _EditsFrozenInput()
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        expected = model.inp(x)
    record = _capture(model, ["inp", "frozen", "out"], x, include_frozen=True).record
    torch.testing.assert_close(record.gradient.data["frozen"].activation, expected)


def test_input_buffer_reused_after_the_step_leaves_the_record_and_intermediates_are_views():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(2, 3, 4)
    original = x.clone()
    seen = {}
    hook = model[2].register_forward_hook(lambda m, args, out: seen.__setitem__("2", args[0]))
    try:
        record = _capture(model, ["0", "2"], x).record
    finally:
        hook.remove()
    x.mul_(3.0)  # the caller refills its input buffer after the step
    assert torch.equal(record.gradient.data["0"].activation, original)
    # common path: a trainable layer's graph input is kept as a view, not copied
    kept = record.gradient.data["2"].activation
    assert kept.untyped_storage().data_ptr() == seen["2"].untyped_storage().data_ptr()
    assert kept.data_ptr() == seen["2"].data_ptr()


def test_guarded_input_edited_before_the_backward_names_the_layer():
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"Layer 'used': its input was modified in place"):
        _capture(_EditsGuardedInput(), ["inp", "used"], torch.randn(2, 4))

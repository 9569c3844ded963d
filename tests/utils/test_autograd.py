"""Tests of the autograd-engine callback helpers."""

from __future__ import annotations

import torch
from torch import nn

from dattri_llm.utils import autograd as autograd_utils
from dattri_llm.utils.autograd import (
    queue_after_backward_finalization,
    queue_backward_end_callback,
)


def _model_and_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.randn(5, 3)


def test_callback_runs_after_backward_with_all_grads_written():
    model, x = _model_and_input()
    events = []

    def at_end():
        events.append(("end", all(p.grad is not None for p in model.parameters())))

    def hook(grad):  # fires mid-backward, before the first layer's grads exist
        events.append(("hook", model[0].weight.grad is None, queue_backward_end_callback(at_end)))
        return grad

    out = model[0](x)
    out.register_hook(hook)
    model[2](model[1](out)).sum().backward()
    assert events == [("hook", True, True), ("end", True)]


def test_queue_outside_backward_returns_false_and_never_runs():
    ran = []
    assert queue_backward_end_callback(lambda: ran.append(1)) is False
    assert queue_after_backward_finalization(lambda: ran.append(2)) is False
    model, x = _model_and_input()
    model(x).sum().backward()
    assert ran == []


def test_engine_without_queue_returns_false(monkeypatch):
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", object())
    assert queue_backward_end_callback(lambda: None) is False


def test_after_finalization_runs_after_callbacks_queued_later():
    model, x = _model_and_input()
    order = []

    def hook(grad):
        assert queue_after_backward_finalization(lambda: order.append("final"))
        queue_backward_end_callback(lambda: order.append("queued later"))
        return grad

    out = model[0](x)
    out.register_hook(hook)
    model[2](model[1](out)).sum().backward()
    assert order == ["queued later", "final"]


def test_after_finalization_calls_fn_directly_when_requeue_fails(monkeypatch):
    real = autograd_utils.queue_backward_end_callback
    calls = []

    def first_only(fn):
        calls.append(fn)
        return real(fn) if len(calls) == 1 else False

    monkeypatch.setattr(autograd_utils, "queue_backward_end_callback", first_only)
    model, x = _model_and_input()
    ran = []

    def hook(grad):
        assert queue_after_backward_finalization(lambda: ran.append(len(calls)))
        return grad

    out = model[0](x)
    out.register_hook(hook)
    model[2](model[1](out)).sum().backward()
    assert ran == [2]  # the re-queue (2nd call) failed, fn was called directly

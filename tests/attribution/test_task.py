from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dattri_llm.task import (
    AttributionTask,
    as_task,
    default_checkpoint_load_func,
    default_loss_func,
)


class Wrapper(nn.Module):
    """Stands in for DDP/FSDP: exposes the wrapped model as ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x, y=None):
        out = self.lin(x)
        return SimpleNamespace(loss=None if y is None else ((out - y) ** 2).sum(), logits=out)


def loss(model, batch):
    return model(batch).sum()


def test_defaults_and_properties():
    model = nn.Linear(2, 1)
    task = AttributionTask(loss_func=None, model=model)
    assert task.loss_func is default_loss_func and task.target_func is task.loss_func
    assert task.checkpoints == [None] and task.num_checkpoints() == 1
    assert task.model is model and task.get_model() is model
    assert task.forward_model is None and not task.is_wrapped
    assert task.current_checkpoint_idx is None
    assert task.load_checkpoint(0) is model and task.current_checkpoint_idx == 0
    task2 = AttributionTask(loss, model, target_func=None)
    assert task2.target_func is loss


def test_wrapped_model():
    inner = nn.Linear(2, 1)
    wrapped = Wrapper(inner)
    task = AttributionTask(loss, wrapped)
    assert task.model is inner and task.forward_model is wrapped and task.is_wrapped
    with pytest.raises(ValueError, match="wrapped"):
        AttributionTask(loss, wrapped, checkpoints=[inner.state_dict()])
    # a custom in-place loader is fine
    sd = {k: torch.zeros_like(v) for k, v in inner.state_dict().items()}
    task = AttributionTask(
        loss,
        wrapped,
        checkpoints=[sd],
        checkpoints_load_func=lambda m, c: m.load_state_dict(c) and m,
    )
    task.load_checkpoint(0)
    assert torch.count_nonzero(inner.weight) == 0
    task = AttributionTask(
        loss, wrapped, checkpoints=[sd], checkpoints_load_func=lambda m, c: nn.Linear(2, 1)
    )
    with pytest.raises(ValueError, match="new module"):
        task.load_checkpoint(0)


class BackboneAndHead(nn.Module):
    """Not a wrapper: a submodule named ``module`` next to parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.module(x))


def test_submodule_named_module_is_not_a_wrapper():
    model = BackboneAndHead()
    task = AttributionTask(loss, model, checkpoints=[model.state_dict()])
    assert task.model is model and task.forward_model is None and not task.is_wrapped
    assert task.load_checkpoint(0) is model


def test_torch_wrappers_are_unwrapped():
    inner = nn.Linear(2, 1)
    wrapped = nn.DataParallel(inner)
    task = AttributionTask(loss, wrapped)
    assert task.model is inner and task.forward_model is wrapped


def test_checkpoint_loading(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    sd_a = {k: torch.full_like(v, 1.0) for k, v in model.state_dict().items()}
    path_b = tmp_path / "b.pt"
    torch.save({k: torch.full_like(v, 2.0) for k, v in model.state_dict().items()}, path_b)
    original = model.weight.detach().clone()
    task = AttributionTask(loss, model, checkpoints=(None, sd_a, str(path_b)))
    assert task.num_checkpoints() == 3 and isinstance(task.get_checkpoints(), list)
    task.load_checkpoint(0)
    assert torch.equal(model.weight, original)
    task.load_checkpoint(1)
    assert torch.all(model.weight == 1.0)
    model.weight.data.fill_(5.0)
    task.load_checkpoint(1)  # already loaded: no-op
    assert torch.all(model.weight == 5.0)
    task.load_checkpoint(2)
    assert torch.all(model.weight == 2.0)
    with pytest.raises(IndexError):
        task.load_checkpoint(3)
    with pytest.raises(ValueError, match="empty"):
        AttributionTask(loss, model, checkpoints=[])
    with pytest.raises(TypeError):
        default_checkpoint_load_func(model, 3)


def test_loader_returning_new_module_replaces_model():
    model = nn.Linear(2, 1)
    other = nn.Linear(2, 1)
    task = AttributionTask(loss, model, checkpoints=["x"], checkpoints_load_func=lambda m, c: other)
    assert task.load_checkpoint(0) is other and task.model is other


def test_default_loss_func():
    model = WithLoss()
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    out = default_loss_func(model, {"x": x, "y": y})
    assert out.shape == () and torch.isfinite(out)
    with pytest.raises(TypeError, match="dict"):
        default_loss_func(model, (x, y))
    with pytest.raises(ValueError, match="loss"):
        default_loss_func(model, {"x": x})


def test_from_dattri_adapts_params_functions():
    from reference import call

    model = nn.Linear(3, 1)

    def dattri_loss(params, data):
        x, y = data
        return ((call(model, params, x) - y) ** 2).sum()

    dattri_like = SimpleNamespace(
        original_loss_func=dattri_loss,
        original_target_func=None,
        model=model,
        checkpoints=[None],
        checkpoints_load_func=lambda m, c: m,
    )
    task = AttributionTask.from_dattri(dattri_like)
    assert as_task(task) is task
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    value = task.loss_func(model, (x, y))
    value.backward()
    expected = ((model(x) - y) ** 2).sum()
    assert torch.allclose(value, expected)
    assert model.weight.grad is not None  # gradients flow to the live parameters
    assert task.target_func is task.loss_func
    assert task.checkpoints_load_func is dattri_like.checkpoints_load_func
    with pytest.raises(TypeError, match="original_loss_func"):
        as_task(SimpleNamespace(model=model))

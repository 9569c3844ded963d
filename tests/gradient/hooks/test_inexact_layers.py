"""Layers whose per-sample gradient the factors cannot give exactly are refused or rerouted."""

import pytest
import torch
from torch import nn

from dattri_llm.gradient.hooks.config import HookManagerConfig, resolve_hook_assignments
from dattri_llm.gradient.hooks.manager import HookManager


class BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(11, 4, mode="sum")
        self.head = nn.Linear(4, 1)

    def forward(self, ids, offsets=None, per_sample_weights=None):
        return self.head(self.bag(ids, offsets, per_sample_weights))


def test_embedding_bag_with_offsets_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = BagModel()
    hm = HookManager(model)
    ids = torch.randint(0, 11, (6,))
    with hm.collect(), pytest.raises(NotImplementedError, match="bag.*offsets.*padding_idx"):
        model(ids, torch.tensor([0, 2, 4])).sum().backward()


def test_embedding_bag_2d_input_is_captured():
    torch.manual_seed(0)
    model = BagModel()
    hm = HookManager(model)
    with hm.collect():
        model(torch.randint(0, 11, (3, 5))).sum().backward()
    assert "bag" in hm.get_gradient().layer_names


def test_bilinear_falls_back_to_param_grad():
    model = nn.Sequential(nn.Linear(3, 3))
    model.add_module("bil", nn.Bilinear(3, 3, 2))
    assignment = resolve_hook_assignments(model, HookManagerConfig())
    assert assignment["bil"] == "param_grad"
    assert assignment["0"] == "linear_io"

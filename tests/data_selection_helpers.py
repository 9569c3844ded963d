"""Model, losses and independent references for the data-selection tests.

Nothing here imports ``dattri_llm``: per-sample gradients come from
``torch.func`` (:mod:`reference`), the selection rules are restated from the
spec, and "kept-only" gradients come from a fresh backward over the kept rows.
"""

from __future__ import annotations

import torch
from reference import call, per_sample_param_grads
from torch import nn

VOCAB, WIDTH, HIDDEN, OUT, SEQ = 11, 6, 8, 3, 4
# module name -> its parameter names (one scored layer each)
LAYERS = {
    "emb": ["emb.weight"],
    "conv": ["conv.weight", "conv.bias"],
    "norm": ["norm.weight", "norm.bias"],
    "head": ["head.weight", "head.bias"],
}


class SelectionNet(nn.Module):
    """Embedding → HF ``Conv1D`` → tanh → LayerNorm → Linear, per token: ``(B, T) -> (B, T, 3)``."""

    def __init__(self) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.conv = Conv1D(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token outputs of ``ids``."""
        return self.head(self.norm(torch.tanh(self.conv(self.emb(ids)))))


def build(seed: int = 0) -> SelectionNet:
    torch.manual_seed(seed)
    net = SelectionNet()
    with torch.no_grad():  # non-trivial affine parameters
        net.norm.weight.add_(0.3 * torch.randn(HIDDEN))
        net.norm.bias.add_(0.3 * torch.randn(HIDDEN))
    return net


def batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (rows, SEQ), labels (rows, SEQ, OUT))``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    labels = torch.randn(rows, SEQ, OUT, generator=gen)
    return ids, labels


def sample_losses(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample losses ``(B,)``: squared error summed over tokens and outputs."""
    return (out - labels).square().sum(dim=(1, 2))


def batch_loss(net: nn.Module, data: tuple, reduction: str) -> torch.Tensor:
    losses = sample_losses(net(data[0]), data[1])
    return losses.mean() if reduction == "mean" else losses.sum()


def per_sample(net: nn.Module, data: tuple) -> dict[str, torch.Tensor]:
    """``{param: (B, *shape)}`` gradients of each sample's own loss (torch.func)."""

    def loss_of_sample(module, params, sample):
        ids, labels = sample
        return sample_losses(call(module, params, ids), labels).sum()

    return per_sample_param_grads(net, loss_of_sample, data)


def layer_dots(grads: dict, target: dict) -> dict[str, torch.Tensor]:
    """``{layer: (B,)}`` = ``<g_i, target>`` over the layer's parameters (target summed rows)."""
    out = {}
    for layer, names in LAYERS.items():
        out[layer] = sum(
            grads[n].reshape(grads[n].shape[0], -1) @ target[n].reshape(-1) for n in names
        )
    return out


def summed(grads: dict, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {n: g.sum(dim=0) * scale for n, g in grads.items()}


def expected_drop(scores: torch.Tensor, threshold: float, mode: str) -> list[int]:
    """The spec's rules, restated: hard ``< threshold``; fractions: the ``round(B·t)`` lowest."""
    if mode == "hard":
        return [i for i, s in enumerate(scores.tolist()) if s < threshold]
    n = round(len(scores) * threshold)
    order = sorted(range(len(scores)), key=lambda i: scores[i].item())[:n]
    if mode == "negative_bottom_fraction":
        order = [i for i in order if scores[i] < 0]
    return sorted(order)


def kept_gradient(state: dict, data: tuple, kept: list[int], reduction: str) -> dict:
    """``{param: grad}`` of an independent backward over the kept rows only."""
    net = build()
    net.load_state_dict(state)
    if kept:
        index = torch.tensor(kept)
        batch_loss(net, (data[0][index], data[1][index]), reduction).backward()
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p))
        for n, p in net.named_parameters()
    }

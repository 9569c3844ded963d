"""Shared builders and references for the capture tests (tiny GPT-2, flattened references)."""

from __future__ import annotations

import torch
from reference import per_sample_loop_grads
from torch import nn

from dattri_llm.gradient.ops.materialize import materialize

GPT2_KW = dict(
    n_layer=2,
    n_embd=32,
    n_head=2,
    vocab_size=97,
    n_positions=32,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**GPT2_KW))


def untied_copy(model: nn.Module) -> nn.Module:
    """Same function as ``model`` with wte and lm_head as separate parameters (per use site)."""
    copy = tiny_gpt2()
    copy.load_state_dict(model.state_dict())
    copy.lm_head.weight = nn.Parameter(copy.transformer.wte.weight.detach().clone())
    return copy


def lm_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


def gpt2_reference(state: dict, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample shares of the mean-over-tokens batch loss (loop of single-sample backwards)."""
    model = tiny_gpt2()
    model.load_state_dict(state)
    untied = untied_copy(model)
    batch = input_ids.shape[0]
    return per_sample_loop_grads(untied, lambda m, b: lm_loss(m, b[0]) / batch, (input_ids,))


def flat_reference(ref: dict, param_prefix: str, layer_type: str, batch: int) -> torch.Tensor:
    """``(B, d)`` reference of one layer in the normative materialize layout."""
    weight = ref[f"{param_prefix}.weight"]
    bias = ref.get(f"{param_prefix}.bias")
    if layer_type == "transformers.pytorch_utils.Conv1D":
        weight = weight.transpose(-1, -2)
    if layer_type in ("nn.LayerNorm", "nn.Embedding"):
        parts = [weight.reshape(batch, -1)] + ([] if bias is None else [bias.reshape(batch, -1)])
        return torch.cat(parts, dim=1)
    if bias is not None:
        weight = torch.cat([weight, bias[..., None]], dim=-1)
    return weight.reshape(batch, -1)


def dense(gradient, name: str) -> torch.Tensor:
    """Materialized ``(B, d)`` payload of one layer of a captured ``Gradient``."""
    return materialize(gradient.data[name], gradient.layer_types[name])

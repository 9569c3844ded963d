"""Capture side of the loss convention: a mean-reduced HF causal-LM loss over padded batches.

The captured per-sample gradient must be the sample's share of the gradient of
the batch scalar: with the Hugging Face mean over non-padded label tokens,
``Σ_{t valid in i} ∇ CE_{i,t} / N_valid(batch)``. The reference is a loop
of single-sample backwards of a hand-written token cross-entropy (no HF loss code).
"""

import pytest
import torch
from capture_helpers import dense, flat_reference, tiny_gpt2
from reference import per_sample_loop_grads
from torch.nn import functional as F

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager

pytest.importorskip("transformers")

LENGTHS = (6, 3, 5)
LAYERS = {
    "transformer.h.0.attn.c_attn": (
        "transformers.pytorch_utils.Conv1D",
        "transformer.h.0.attn.c_attn",
    ),
    "transformer.h.1.mlp.c_proj": (
        "transformers.pytorch_utils.Conv1D",
        "transformer.h.1.mlp.c_proj",
    ),
    "transformer.h.0.ln_1": ("nn.LayerNorm", "transformer.h.0.ln_1"),
}


def padded_batch() -> dict[str, torch.Tensor]:
    """Right-padded ``(B, T)`` ids, mask and labels (``-100`` on padding)."""
    gen = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    ids = torch.randint(1, 97, (len(LENGTHS), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def token_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over non-ignored labels."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def reference_shares(model, batch) -> dict[str, torch.Tensor]:
    """Per-sample ``Σ_valid ∇CE / N_valid(batch)`` by a loop of single-sample backwards.

    (``torch.func.vmap`` cannot trace the HF padding-mask construction.)
    """
    n_valid = (batch["labels"][:, 1:] != -100).sum()

    def one(m, sample):
        ids, mask, labels = sample
        return token_ce_sum(m(input_ids=ids, attention_mask=mask).logits, labels) / n_valid

    return per_sample_loop_grads(
        model, one, (batch["input_ids"], batch["attention_mask"], batch["labels"])
    )


@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"), [(torch.float32, 1e-5, 1e-7), (torch.float64, 1e-10, 1e-13)]
)
def test_mean_reduced_padded_causal_lm_loss_gives_per_sample_shares(dtype, rtol, atol):
    model = tiny_gpt2().to(dtype).eval()
    batch = padded_batch()
    ref = reference_shares(model, batch)
    cb = CaptureCallback()
    config = HookManagerConfig(linear_io=[rf"^{name}$" for name in LAYERS])
    manager = HookManager(model, config, callbacks=[cb])
    n_valid = (batch["labels"][:, 1:] != -100).sum()
    with manager.collect():
        out = model(**batch)
        # HF computes its loss in float32 (it casts the logits): use it as is in
        # float32, and the same mean over valid label tokens written out in float64.
        mean = token_ce_sum(out.logits, batch["labels"]) / n_valid
        loss = out.loss if dtype == torch.float32 else mean
        torch.testing.assert_close(out.loss, mean.float())
        loss.backward()
    gradient = cb.record.gradient
    assert set(gradient.layer_names) == set(LAYERS)
    for name, (layer_type, prefix) in LAYERS.items():
        assert gradient.layer_types[name] == layer_type
        expected = flat_reference(ref, prefix, layer_type, len(LENGTHS))
        torch.testing.assert_close(dense(gradient, name), expected, rtol=rtol, atol=atol)
    # Shares, not per-sample means: they add up to the batch gradient of the mean loss.
    summed = dense(gradient, "transformer.h.0.ln_1").sum(0)
    batch_grad = torch.cat(
        [model.transformer.h[0].ln_1.weight.grad, model.transformer.h[0].ln_1.bias.grad]
    )
    torch.testing.assert_close(summed, batch_grad, rtol=rtol, atol=atol)


def test_bf16_padded_causal_lm_shares_loosely_match():
    model32 = tiny_gpt2().eval()
    batch = padded_batch()
    ref = reference_shares(model32, batch)
    model = tiny_gpt2().to(torch.bfloat16).eval()
    cb = CaptureCallback()
    manager = HookManager(
        model, HookManagerConfig(linear_io=[r"^transformer\.h\.1\.mlp\.c_proj$"]), callbacks=[cb]
    )
    with manager.collect():
        model(**batch).loss.backward()
    layer_type, prefix = LAYERS["transformer.h.1.mlp.c_proj"]
    expected = flat_reference(ref, prefix, layer_type, len(LENGTHS))
    got = dense(cb.record.gradient, "transformer.h.1.mlp.c_proj").float()
    rel = (got - expected).norm(dim=1) / expected.norm(dim=1)
    assert rel.max() < 5e-2, rel

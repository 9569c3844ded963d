"""TRAKAttributor against a dense fp64 TRAK computation built from torch.func margin gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dattri_llm.attribution.algorithm.trak import TRAKAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.task import AttributionTask, margin_and_weights, margin_loss


def _args(path) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
    )


class Classifier(nn.Module):
    """Tiny MLP classifier taking ``x`` (B, 4) and returning logits (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _classifier_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=gen)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def _per_sample_rows(
    model, samples, layers, use_vmap: bool, mask: dict | None = None
) -> dict[str, torch.Tensor]:
    """``{layer: (N, D)}`` per-sample gradients of ``−f`` (weight and bias, flattened).

    With ``mask`` (``{layer: index}``) the rows are the weight gradient's entries at
    ``index`` (the capture's mask projection, bias left out).
    """
    params = {k: v.detach() for k, v in model.named_parameters()}

    def neg_margin(p, sample):
        batch = {k: v.unsqueeze(0) for k, v in sample.items()}
        call = lambda **kw: torch.func.functional_call(model, p, (), kw)  # noqa: E731
        return margin_loss(call, batch)

    if use_vmap:
        stacked = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        grads = torch.func.vmap(torch.func.grad(neg_margin), in_dims=(None, 0))(params, stacked)
    else:
        per = [torch.func.grad(neg_margin)(params, s) for s in samples]
        grads = {k: torch.stack([g[k] for g in per]) for k in per[0]}
    n = len(samples)
    if mask is not None:
        return {name: grads[f"{name}.weight"].reshape(n, -1)[:, mask[name]] for name in layers}
    return {
        name: torch.cat([grads[f"{name}.weight"].reshape(n, -1), grads[f"{name}.bias"]], dim=1)
        for name in layers
    }


def _weights(model, samples) -> torch.Tensor:
    """``(N,)`` each sample's ``1 − p``, one forward per sample (lengths may differ)."""
    with torch.no_grad():
        return torch.cat(
            [
                margin_and_weights(model, {k: v.unsqueeze(0) for k, v in s.items()})[1]
                for s in samples
            ]
        ).double()


def dense_trak(model, train, test, layers, damping=None, use_vmap=True, mask=None) -> torch.Tensor:
    """``diag(1 − p) Σ_ℓ Φ_ℓ (Φ_ℓᵀΦ_ℓ + λI)⁻¹ Q_ℓᵀ`` with explicit inverses (fp64)."""
    phi = _per_sample_rows(model, train, layers, use_vmap, mask)
    q = _per_sample_rows(model, test, layers, use_vmap, mask)
    total = 0
    for name in layers:
        g = phi[name].double()
        d = g.shape[1]
        lam = damping if damping is not None else 0.1 * g.square().sum() / d
        kernel = torch.linalg.inv(g.T @ g + lam * torch.eye(d, dtype=g.dtype))
        total = total + g @ kernel @ q[name].double().T
    return _weights(model, train)[:, None] * total


def test_classifier_matches_dense(tmp_path):
    torch.manual_seed(0)
    model = Classifier().double()
    train, test = _classifier_data(7, 1), _classifier_data(3, 2)
    attributor = TRAKAttributor(_args(tmp_path), task=AttributionTask(None, model), damping=0.3)
    score = attributor.attribute(train, test)
    expected = dense_trak(model, train, test, ("fc1", "fc2"), damping=0.3)
    assert score.algorithm == "TRAK" and score.polarity == 1
    torch.testing.assert_close(score.agnostic_matrix()[1].double(), expected, rtol=1e-4, atol=1e-6)


def test_projected_classifier_matches_dense(tmp_path):
    """A mask projection: ``φ = P∇f`` with ``P`` the capture's coordinate selection."""
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.ops.projection import DattriProjector

    torch.manual_seed(1)
    model = Classifier().double()
    train, test = _classifier_data(9, 5), _classifier_data(3, 6)
    proj = {"style": "mask", "proj_dim": 5, "proj_seed": 2, "include_bias": False}
    hooks = HookManagerConfig(projection_kwargs={"__default__": proj})
    attributor = TRAKAttributor(_args(tmp_path), task=AttributionTask(None, model))
    score = attributor.attribute(train, test, hook_config=hooks)
    projector = DattriProjector()
    mask = {
        name: projector.mask_indices(size, proj_dim=5, proj_seed=2, device="cpu")
        for name, size in (("fc1", 24), ("fc2", 18))
    }
    expected = dense_trak(model, train, test, ("fc1", "fc2"), mask=mask)
    torch.testing.assert_close(score.agnostic_matrix()[1].double(), expected, rtol=1e-4, atol=1e-6)


def test_ensemble_is_mean_of_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = Classifier().double()
    first = copy.deepcopy(model.state_dict())
    second = {k: v + 0.2 * torch.randn_like(v) for k, v in first.items()}
    train, test = _classifier_data(5, 3), _classifier_data(2, 4)

    def run(checkpoints, name):
        task = AttributionTask(None, model, checkpoints=checkpoints)
        return TRAKAttributor(_args(tmp_path / name), task=task).attribute(train, test)

    both = run([first, second], "both").agnostic_matrix()[1]
    single = [run([c], f"one{i}").agnostic_matrix()[1] for i, c in enumerate((first, second))]
    torch.testing.assert_close(both, (single[0] + single[1]) / 2, rtol=1e-5, atol=1e-7)
    model.load_state_dict(second)
    expected = dense_trak(model, train, test, ("fc1", "fc2"))
    torch.testing.assert_close(single[1].double(), expected, rtol=1e-4, atol=1e-6)


def test_causal_lm_matches_dense(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dattri_llm.gradient.hooks.config import HookManagerConfig

    config = transformers.GPT2Config(
        n_layer=2, n_embd=8, n_head=2, vocab_size=31, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    gen = torch.Generator().manual_seed(5)

    def sample():
        ids = torch.randint(0, 31, (6,), generator=gen)
        return {"input_ids": ids, "labels": ids}

    train, test = [sample() for _ in range(5)], [sample() for _ in range(2)]
    layers = ("transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_proj")
    hooks = HookManagerConfig(linear_io=[r"h\.0\.mlp\.c_fc$", r"h\.1\.attn\.c_proj$"])
    attributor = TRAKAttributor(_args(tmp_path), task=AttributionTask(None, model))
    score = attributor.attribute(train, test, hook_config=hooks)
    expected = dense_trak(model, train, test, layers, use_vmap=False)
    torch.testing.assert_close(score.agnostic_matrix()[1].double(), expected, rtol=1e-4, atol=1e-7)
    tokens = attributor.attribute(train, test, hook_config=hooks, attribution_granularity="token")
    summed = tokens.agnostic_matrix()[1].double()
    torch.testing.assert_close(summed, expected, rtol=1e-4, atol=1e-7)


def test_token_rows_of_batches_of_different_lengths(tmp_path):
    """Token rows: a batch of 6-token samples then one of 3-token samples (30 rows for 6
    samples, so no single repeat factor lines the 1 − p weights up with the rows)."""
    transformers = pytest.importorskip("transformers")
    from dattri_llm.gradient.hooks.config import HookManagerConfig

    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=31, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    gen = torch.Generator().manual_seed(6)

    def sample(length):
        ids = torch.randint(0, 31, (length,), generator=gen)
        return {"input_ids": ids, "labels": ids}

    train = [sample(6) for _ in range(4)] + [sample(3) for _ in range(2)]
    test = [sample(6) for _ in range(2)]
    layers = ("transformer.h.0.mlp.c_fc",)
    hooks = HookManagerConfig(linear_io=[r"h\.0\.mlp\.c_fc$"])
    attributor = TRAKAttributor(_args(tmp_path), task=AttributionTask(None, model))
    tokens = attributor.attribute(train, test, hook_config=hooks, attribution_granularity="token")
    expected = dense_trak(model, train, test, layers, use_vmap=False)
    summed = tokens.agnostic_matrix()[1].double()  # float32 token rows, summed
    scale = float(expected.abs().max())
    torch.testing.assert_close(summed, expected, rtol=1e-4, atol=1e-5 * scale)


def test_margin_and_weights_values():
    logits = torch.tensor([[2.0, 0.0, -1.0]], dtype=torch.float64)
    batch = {"x": None, "labels": torch.tensor([0])}
    margins, weights = margin_and_weights(lambda x: logits, batch)
    p = torch.softmax(logits, -1)[0, 0]
    torch.testing.assert_close(margins, torch.log(p / (1 - p)).reshape(1))
    torch.testing.assert_close(weights, (1 - p).reshape(1))


def test_bad_options_refused(tmp_path):
    with pytest.raises(ValueError, match="damping must be finite and > 0"):
        TRAKAttributor(_args(tmp_path), damping=0.0)
    with pytest.raises(ValueError, match="output_func must be callable"):
        TRAKAttributor(_args(tmp_path), output_func="margin")
    with pytest.raises(ValueError, match="needs a dict batch with 'labels'"):
        margin_loss(Classifier(), {"x": torch.randn(2, 4)})
    model = Classifier().double()
    attributor = TRAKAttributor(_args(tmp_path), task=AttributionTask(None, model))
    data = _classifier_data(3, 0)
    with pytest.raises(ValueError, match="gradient_cache_residency=None"):
        attributor.attribute(data, data, gradient_cache_residency="memory")
    with pytest.raises(ValueError, match="cannot score from gradient stores"):
        attributor.attribute_from_cache("a", "b")
    with pytest.raises(ValueError, match="does not write gradient stores"):
        attributor.cache(data, data)
    with pytest.raises(ValueError, match="does not support top_k"):
        attributor.top_k(data, 1, train_source=data)

"""TrackStarAttributor against a dense TrackStar computation from torch.func per-sample gradients.

The reference: per-sample loss gradients by ``vmap(grad)`` (fp64), divided by the
trained optimizer's denominator read from its real state (``sqrt(exp_avg_sq) + eps``
for Adam, the rank-1 ``row_var · col_var / mean(row_var)`` for Adafactor), projected
with the capture's mask, then ``R = λ Φᵀ Φ / N + (1 − λ) Qᵀ Q / M + δ I`` per layer,
``R^{-1/2}`` by ``eigh``, unit rows over both layers and their inner products. The
capture maps in float32, so scores (cosines in ``[-1, 1]``) agree to ``ATOL``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm.attribution.algorithm.trackstar import TrackStarAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.ops.optimizer import adafactor_variance, second_moment_normalize
from dattri_llm.gradient.ops.projection import DattriProjector
from dattri_llm.task import AttributionTask

LAYERS = ("fc1", "fc2")
ATOL = 1e-5  # float32 capture (observed <= 2e-6); the scores are cosines in [-1, 1]


def _args(path) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
    )


class Classifier(nn.Module):
    """Tiny MLP: ``x`` (B, 4) → logits (B, 3), two hooked Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=gen)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def mean_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["labels"])


def sum_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["labels"], reduction="sum")


def _trained(optimizer_cls, steps: int = 5, seed: int = 0, named: bool = False, **hp):
    """A float64 classifier after ``steps`` real optimizer steps, and its optimizer."""
    torch.manual_seed(seed)
    model = Classifier().double()
    params = model.named_parameters() if named else model.parameters()
    optimizer = optimizer_cls(params, lr=0.05, **hp)
    data = _data(16, 99)
    batch = {k: torch.stack([s[k] for s in data]) for k in data[0]}
    for _ in range(steps):
        optimizer.zero_grad()
        mean_loss(model, batch).backward()
        optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


# ---------------------------------------------------------------------------- dense reference
def _variance(optimizer, param) -> torch.Tensor:
    """The second moment ``v`` the optimizer divides by, shaped like ``param`` (explicit)."""
    state = optimizer.state[param]
    if "exp_avg_sq" in state:
        return state["exp_avg_sq"]
    if "row_var" in state:  # rank-1 reconstruction r cᵀ / sum(r), in torch's mean form
        eps1 = optimizer.param_groups[0]["eps"][0] or torch.finfo(torch.float32).eps
        row, col = state["row_var"], state["col_var"]
        return row @ col / row.mean(dim=-2, keepdim=True).clamp(min=eps1)
    return state["variance"]


def _denominator(optimizer, param, v: torch.Tensor | None = None) -> torch.Tensor:
    """``sqrt(v) + eps`` (Adam) or ``sqrt(max(v, eps1²))`` (Adafactor), like ``param``
    (``v``: the parameter's second moment, or another value of it)."""
    v = _variance(optimizer, param) if v is None else v
    eps = optimizer.param_groups[0]["eps"]
    if "exp_avg_sq" in optimizer.state[param]:
        return v.sqrt() + eps
    eps1 = eps[0] or torch.finfo(torch.float32).eps
    return v.clamp(min=eps1 * eps1).sqrt()


def _rows(model, optimizer, samples, mask=None, normalise=True) -> dict[str, torch.Tensor]:
    """``{layer: (N, D)}`` per-sample ``∇L ⊘ d`` (weight then bias; or the mask entries)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, sample):
        batch = {k: v.unsqueeze(0) for k, v in sample.items()}
        logits = torch.func.functional_call(model, p, (batch["x"],))
        return F.cross_entropy(logits, batch["labels"])

    stacked = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, stacked)
    named = dict(model.named_parameters())
    n, out = len(samples), {}
    for name in LAYERS:
        parts = {}
        for role in ("weight", "bias"):
            g = grads[f"{name}.{role}"]
            if normalise:
                g = g / _denominator(optimizer, named[f"{name}.{role}"])
            parts[role] = g
        if mask is not None:  # weight entries at the mask's flat (row-major) positions
            out[name] = parts["weight"].reshape(n, -1)[:, mask[name]]
        else:  # the Linear layout: (out, in + 1), the bias as the last column
            out[name] = torch.cat([parts["weight"], parts["bias"][..., None]], dim=2)
            out[name] = out[name].reshape(n, -1)
    return out


def dense_trackstar(
    model, optimizer, train, test, *, mixing, damping=None, mask=None, matrix=None,
    normalise=True, unit=True, whiten=True,
) -> torch.Tensor:  # fmt: skip
    """``(N, M)`` TrackStar scores, every step explicit (fp64).

    ``mask``: ``{layer: flat weight positions}``; ``matrix``: ``{layer: (d, k)}`` dense ``P``.
    """
    phi = _rows(model, optimizer, train, mask, normalise)
    q = _rows(model, optimizer, test, mask, normalise)
    if matrix is not None:
        phi = {name: rows @ matrix[name].double() for name, rows in phi.items()}
        q = {name: rows @ matrix[name].double() for name, rows in q.items()}
    return _dense_from_rows(phi, q, LAYERS, mixing, damping, unit, whiten)


def _dense_from_rows(phi, q, layers, mixing, damping=None, unit=True, whiten=True):
    """Per layer ``R``, ``δ``, ``(R + δI)^{-1/2}`` by ``eigh``; unit rows; inner products."""
    white_train, white_test = [], []
    for name in layers:
        a, b = phi[name], q[name]
        d = a.shape[1]
        r = mixing * a.T @ a / a.shape[0] + (1 - mixing) * b.T @ b / b.shape[0]
        delta = damping if damping is not None else 0.1 * torch.trace(r) / d
        values, vectors = torch.linalg.eigh(r + delta * torch.eye(d, dtype=r.dtype))
        root = vectors @ torch.diag(values.rsqrt()) @ vectors.T if whiten else torch.eye(d).double()
        white_train.append(a @ root)
        white_test.append(b @ root)
    a, b = torch.cat(white_train, dim=1), torch.cat(white_test, dim=1)
    if unit:
        a, b = a / a.norm(dim=1, keepdim=True), b / b.norm(dim=1, keepdim=True)
    return a @ b.T


def _score(tmp_path, model, optimizer, train, test, loss=mean_loss, hooks=None, **kwargs):
    attributor = TrackStarAttributor(
        _args(tmp_path), task=AttributionTask(loss, model), optimizer=optimizer, **kwargs
    )
    return attributor.attribute(train, test, hook_config=hooks)


# ---------------------------------------------------------------------------- the map
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.Adafactor])
def test_second_moment_map_matches_explicit_division(optimizer_cls, dtype):
    """float64 to 1e-6; bfloat16 gradients and state (a bf16 model's) to bf16 rounding."""
    model, optimizer = _trained(optimizer_cls)
    rtol = 1e-6 if dtype == torch.float64 else 2e-2
    for name, param in model.named_parameters():
        state, group = optimizer.state[param], optimizer.param_groups[0]
        g = torch.randn(3, param.numel(), dtype=torch.float64).to(dtype)
        v = _variance(optimizer, param).to(dtype)  # the state as a bf16 model keeps it
        expected = g.double() / _denominator(optimizer, param, v.double()).reshape(1, -1)
        kind = "Adam" if "exp_avg_sq" in state else "Adafactor"
        key = "exp_avg_sq" if kind == "Adam" else "variance"
        got = second_moment_normalize(
            g, {key: v.reshape(-1)}, optimizer_type=kind, eps=group["eps"]
        )
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=0, msg=name)


def test_adafactor_variance_is_the_rank_one_reconstruction_of_the_sums():
    """``r cᵀ / Σ r`` with ``r``, ``c`` the row and column sums of ``v`` (torch keeps means)."""
    gen = torch.Generator().manual_seed(0)
    row_mean = torch.rand(5, 1, generator=gen, dtype=torch.float64) + 0.1  # (m, 1)
    col_mean = torch.rand(1, 7, generator=gen, dtype=torch.float64) + 0.1  # (1, n)
    r, c = 7 * row_mean, 5 * col_mean  # sums over the n columns / the m rows
    torch.testing.assert_close(adafactor_variance(row_mean, col_mean), r @ c / r.sum())


def test_precondition_rule_is_validated():
    model, optimizer = _trained(torch.optim.Adam, steps=1)
    manager = HookManager(model, config=HookManagerConfig(), optimizer=optimizer)
    assert manager.precondition_rule == "update"
    with pytest.raises(ValueError, match="precondition_rule must be one of"):
        manager.precondition_rule = "adam"
    manager.remove()
    plain = HookManager(model, config=HookManagerConfig())
    with pytest.raises(ValueError, match="needs a HookManager built with optimizer"):
        plain.precondition_rule = "second_moment"
    plain.remove()


def test_second_moment_map_refuses_other_optimizers_and_empty_state():
    with pytest.raises(NotImplementedError, match="Adam, AdamW, Adafactor"):
        second_moment_normalize(torch.ones(2, 3), {}, optimizer_type="SGD")
    with pytest.raises(ValueError, match="no 'exp_avg_sq'"):
        second_moment_normalize(torch.ones(2, 3), {}, optimizer_type="Adam")


# ---------------------------------------------------------------------------- scores
@pytest.mark.parametrize("mixing", [1.0, 0.5])
def test_adam_matches_dense(tmp_path, mixing):
    model, optimizer = _trained(torch.optim.Adam)
    train, test = _data(9, 1), _data(5, 2)
    score = _score(tmp_path, model, optimizer, train, test, mixing=mixing)
    expected = dense_trackstar(model, optimizer, train, test, mixing=mixing)
    assert score.algorithm == "TrackStar" and score.polarity == 1
    assert score.algorithm_meta["mixing"] == mixing
    torch.testing.assert_close(score.agnostic_matrix()[1].double(), expected, rtol=0, atol=ATOL)


def test_adafactor_and_explicit_damping_match_dense(tmp_path):
    model, optimizer = _trained(torch.optim.Adafactor)
    train, test = _data(9, 3), _data(4, 4)
    score = _score(tmp_path, model, optimizer, train, test, mixing=0.7, damping=0.05)
    expected = dense_trackstar(model, optimizer, train, test, mixing=0.7, damping=0.05)
    torch.testing.assert_close(score.agnostic_matrix()[1].double(), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("style", ["mask", "dense"])
def test_projection_and_sum_loss_match_dense(tmp_path, style):
    """``P`` = the capture's mask or dense matrix; a sum-reduced loss with ``"sum"``."""
    model, optimizer = _trained(torch.optim.AdamW, weight_decay=0.1)
    train, test = _data(8, 5), _data(3, 6)
    proj = {"style": style, "proj_dim": 5, "proj_seed": 2, "include_bias": style == "dense"}
    hooks = HookManagerConfig(projection_kwargs={"__default__": proj})
    score = _score(
        tmp_path, model, optimizer, train, test, loss=sum_loss, hooks=hooks, mixing=0.5,
        loss_reduction="sum",
    )  # fmt: skip
    projector, shapes = DattriProjector(), {"fc1": (6, 4), "fc2": (3, 6)}  # (out, in)
    if style == "mask":  # over the weight entries (include_bias=False)
        mask = {
            name: projector.mask_indices(o * i, proj_dim=5, proj_seed=2, device="cpu")
            for name, (o, i) in shapes.items()
        }
        expected = dense_trackstar(model, optimizer, train, test, mixing=0.5, mask=mask)
    else:  # a (d, 5) matrix over the layer with its bias column, d = out · (in + 1)
        matrix = {
            name: projector.matrix(
                o * (i + 1), proj_dim=5, proj_seed=2, device="cpu", dtype=torch.float32
            )
            for name, (o, i) in shapes.items()
        }
        expected = dense_trackstar(model, optimizer, train, test, mixing=0.5, matrix=matrix)
    torch.testing.assert_close(score.agnostic_matrix()[1].double(), expected, rtol=0, atol=ATOL)


def test_causal_lm_with_adafactor_matches_dense(tmp_path):
    """A tiny GPT-2 (HF ``Conv1D`` layers, Adafactor's factored state) against a loop of grads."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=8, n_head=2, vocab_size=31, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    gen = torch.Generator().manual_seed(5)
    sample = lambda: {"input_ids": torch.randint(0, 31, (6,), generator=gen)}  # noqa: E731
    train, test = [sample() for _ in range(5)], [sample() for _ in range(3)]
    lm_loss = lambda m, batch: m(**batch, labels=batch["input_ids"]).loss  # noqa: E731
    optimizer = torch.optim.Adafactor(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        lm_loss(model, {"input_ids": torch.stack([s["input_ids"] for s in train])}).backward()
        optimizer.step()
    optimizer.zero_grad()
    layers = ("transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_proj")
    hooks = HookManagerConfig(linear_io=[r"h\.0\.mlp\.c_fc$", r"h\.1\.attn\.c_proj$"])
    attributor = TrackStarAttributor(
        _args(tmp_path), task=AttributionTask(lm_loss, model), optimizer=optimizer, mixing=0.5
    )
    got = attributor.attribute(train, test, hook_config=hooks).agnostic_matrix()[1].double()
    named = dict(model.named_parameters())

    def rows(samples):  # one backward per sample; no projection, so any coordinate order
        out = {name: [] for name in layers}
        for s in samples:
            model.zero_grad()
            lm_loss(model, {"input_ids": s["input_ids"][None]}).backward()
            for name in layers:
                parts = [named[f"{name}.{r}"] for r in ("weight", "bias")]
                out[name].append(
                    torch.cat([(p.grad / _denominator(optimizer, p)).reshape(-1) for p in parts])
                )
        model.zero_grad()
        return {name: torch.stack(v) for name, v in out.items()}

    expected = _dense_from_rows(rows(train), rows(test), layers, mixing=0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_each_component_changes_the_scores_beyond_tolerance(tmp_path):
    """The dense check can fail: dropping any one step moves the scores far beyond ATOL."""
    model, optimizer = _trained(torch.optim.Adam)
    train, test = _data(9, 1), _data(5, 2)
    got = _score(tmp_path, model, optimizer, train, test, mixing=0.5).agnostic_matrix()[1].double()
    for dropped in ({"normalise": False}, {"unit": False}, {"whiten": False}, {"mixing": 1.0}):
        options = {"mixing": 0.5, **dropped}
        other = dense_trackstar(model, optimizer, train, test, **options)
        assert (got - other).abs().max() > 100 * ATOL, dropped


def test_cache_then_attribute_from_cache_matches_live(tmp_path):
    model, optimizer = _trained(torch.optim.Adam)
    train, test = _data(7, 7), _data(3, 8)
    args = _args(tmp_path)
    attributor = TrackStarAttributor(
        args,
        task=AttributionTask(mean_loss, model),
        optimizer=optimizer.state_dict(),
        mixing=0.5,
        optimizer_param_names=[name for name, _ in model.named_parameters()],
    )
    live = attributor.attribute(train, test).agnostic_matrix()[1]
    [(train_dir, test_dir)] = attributor.cache(train, test, cache_dir=str(tmp_path / "cache"))
    stored = TrackStarAttributor(args, mixing=0.5).attribute_from_cache(train_dir, test_dir)
    torch.testing.assert_close(stored.agnostic_matrix()[1], live, rtol=0, atol=1e-6)
    expected = dense_trackstar(model, optimizer, train, test, mixing=0.5)
    torch.testing.assert_close(live.double(), expected, rtol=0, atol=ATOL)


def test_top_k_equals_the_full_matrix_ranking(tmp_path):
    model, optimizer = _trained(torch.optim.Adam)
    train, test = _data(7, 11), _data(3, 12)
    attributor = TrackStarAttributor(
        _args(tmp_path), task=AttributionTask(mean_loss, model), optimizer=optimizer
    )
    full = attributor.attribute(train, test).top_k(3)
    top = attributor.top_k(test, 3, train_source=train).as_dict()
    assert full.keys() == top.keys()
    for query, rows in full.items():
        assert [i for i, _ in rows] == [i for i, _ in top[query]]
        torch.testing.assert_close(
            torch.tensor([v for _, v in top[query]]), torch.tensor([v for _, v in rows])
        )


def test_state_dict_file_is_rebuilt_over_the_model(tmp_path):
    """A saved Adafactor state with its parameter names (built over named_parameters)."""
    model, optimizer = _trained(torch.optim.Adafactor, named=True)
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    train, test = _data(6, 9), _data(2, 10)
    score = _score(tmp_path, model, str(path), train, test, mixing=1.0)
    expected = dense_trackstar(model, optimizer, train, test, mixing=1.0)
    torch.testing.assert_close(score.agnostic_matrix()[1].double(), expected, rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mixing": 1.5}, r"mixing must lie in \[0, 1\]"),
        ({"mixing": -0.1}, r"mixing must lie in \[0, 1\]"),
        ({"mixing": "half"}, "mixing must be a float"),
        ({"damping": 0.0}, "damping must be finite and > 0"),
        ({"damping": -1.0}, "damping must be finite and > 0"),
        ({"damping": "small"}, "damping must be finite and > 0"),
        ({"loss_reduction": "none"}, "loss_reduction must be one of"),
        ({"optimizer": "/no/such/optimizer.pt"}, "no optimizer state file"),
        ({"optimizer": {"state": {}}}, "must hold 'state' and 'param_groups'"),
        ({"optimizer": {"state": {0: {"momentum_buffer": 0}}, "param_groups": []}}, "no second"),
        ({"optimizer": 3}, "must be a torch.optim optimizer"),
    ],
)
def test_invalid_arguments_are_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrackStarAttributor(_args(tmp_path), **kwargs)


def test_state_dict_in_another_parameter_order_is_refused(tmp_path):
    model, optimizer = _trained(torch.optim.Adam)
    names = [name for name, _ in model.named_parameters()][::-1]
    attributor = TrackStarAttributor(
        _args(tmp_path),
        task=AttributionTask(mean_loss, model),
        optimizer=optimizer.state_dict(),
        optimizer_param_names=names,
    )
    with pytest.raises(ValueError, match="optimizer_param_names"):
        attributor.attribute(_data(3, 0), _data(2, 1))


def test_sgd_optimizer_is_refused_naming_the_supported_ones(tmp_path):
    sgd = torch.optim.SGD(Classifier().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Adam / AdamW / Adafactor"):
        TrackStarAttributor(_args(tmp_path), optimizer=sgd)


def test_live_scoring_without_optimizer_is_refused(tmp_path):
    model = Classifier().double()
    attributor = TrackStarAttributor(_args(tmp_path), task=AttributionTask(mean_loss, model))
    with pytest.raises(ValueError, match="got no optimizer state"):
        attributor.attribute(_data(3, 0), _data(2, 1))


def test_token_granularity_and_persisted_fits_are_refused(tmp_path):
    model, optimizer = _trained(torch.optim.Adam, steps=1)
    attributor = TrackStarAttributor(
        _args(tmp_path), task=AttributionTask(mean_loss, model), optimizer=optimizer
    )
    with pytest.raises(ValueError, match="attribution_granularity='token' is not supported"):
        attributor.attribute(_data(3, 0), _data(2, 1), attribution_granularity="token")
    with pytest.raises(ValueError, match="no persisted fit"):
        attributor.fit("somewhere")

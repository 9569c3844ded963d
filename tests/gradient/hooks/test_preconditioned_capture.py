"""``HookManager(optimizer=...)``: preconditioned capture (capture.md §5).

Expectations are built in the test: per-sample gradients from ``torch.func``
(``vmap(grad)``, ``tests/reference.py``) arranged by hand in materialize
layout, the optimizer state read by hand from ``opt.state[param]`` and the
group hyperparameters from ``opt.param_groups``, mapped with
``ops.precondition``; masks and projection matrices come from the same
projector the capture uses. Two checks need no library map at all: Adam's
first step is ``g / (|g| + eps)``, and on a one-sample batch the captured
direction is the optimizer's own update ``(θ_before - θ_after) / lr``.
"""

from __future__ import annotations

import pytest
import torch
from reference import call, per_sample_param_grads
from torch import nn
from torch.nn import functional as F

from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.hooks import register_linear_io_hooks, remove_hooks
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.optimizer import OPTIMIZER_STATE_KEYS, precondition
from dattri_llm.gradient.ops.projection import DattriProjector, mask_coordinates, random_project
from dattri_llm.gradient.optimizer_state import GradientPreconditioner, OptimizerSnapshot

B = 4
TOL = dict(rtol=1e-5, atol=1e-6)
ADAM_KEYS = ("betas", "eps", "amsgrad", "maximize")
SGD_KEYS = ("momentum", "dampening", "nesterov", "maximize")


# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    """Linear with bias → tanh → Linear without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def seeded_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


MLP_LAYERS = {"fc1": ("linear", "fc1.weight", "fc1.bias"), "fc2": ("linear", "fc2.weight", None)}


def mlp_batch(n: int = B, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)


def mlp_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).sum()


def mlp_sample_loss(model: nn.Module, params: dict, sample: tuple) -> torch.Tensor:
    x, y = sample
    return ((call(model, params, x) - y) ** 2).sum()


def seeded_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=8,
        n_head=2,
        vocab_size=11,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


GPT2_LAYERS = {
    "transformer.h.0.attn.c_attn": (
        "conv1d",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_attn.bias",
    ),
    "transformer.h.0.mlp.c_proj": (
        "conv1d",
        "transformer.h.0.mlp.c_proj.weight",
        "transformer.h.0.mlp.c_proj.bias",
    ),
    "transformer.h.0.ln_2": ("norm", "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias"),
    "transformer.wpe": ("embedding", "transformer.wpe.weight", None),
}
GPT2_SELECTOR = [r"h\.0\.attn\.c_attn$", r"h\.0\.mlp\.c_proj$", r"h\.0\.ln_2$", r"wpe$"]


def gpt2_batch(n: int = B, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (n, 6), generator=gen)
    # Per-sample position ids, so the position embedding's gradient is per sample.
    return ids, torch.arange(6).expand(n, 6).clone()


def gpt2_logits_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def gpt2_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    ids, pos = batch
    return gpt2_logits_loss(model(input_ids=ids, position_ids=pos).logits, ids)


def gpt2_sample_loss(model: nn.Module, params: dict, sample: tuple) -> torch.Tensor:
    ids, pos = sample
    return gpt2_logits_loss(call(model, params, input_ids=ids, position_ids=pos).logits, ids)


CASES = {
    "mlp": (
        seeded_mlp,
        mlp_batch,
        mlp_loss,
        mlp_sample_loss,
        MLP_LAYERS,
        REGISTER_ALL,
    ),
    "gpt2": (seeded_gpt2, gpt2_batch, gpt2_loss, gpt2_sample_loss, GPT2_LAYERS, GPT2_SELECTOR),
}


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        # eps well above float noise: GPT-2's key bias has an exactly-zero gradient, whose
        # round-off a tiny eps would amplify differently in the capture and the reference.
        return torch.optim.AdamW(
            model.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1
        )
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, dampening=0.1)


def trained(case: str, kind: str, steps: int = 3):
    """The case's model and optimizer after ``steps`` updates on fresh batches."""
    build, batch_of, loss_of, *_ = CASES[case]
    model = build()
    opt = make_optimizer(kind, model)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, batch_of(seed=100 + step)).backward()
        opt.step()
    opt.zero_grad()
    return model, opt


# --------------------------------------------------------------------------- hand expectation


def layout(kind: str, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Batched ``(B, *shape)`` parameter tensors → ``(B, d)`` in materialize layout."""
    n = weight.shape[0]
    if kind == "embedding":
        return weight.reshape(n, -1)
    if kind == "norm":
        return torch.cat([weight, bias], -1)
    if kind == "conv1d":  # HF Conv1D stores (in, out); the layout is (out, in)
        weight = weight.transpose(-1, -2)
    if bias is not None:
        weight = torch.cat([weight, bias[..., None]], -1)
    return weight.reshape(n, -1)


def per_sample(case: str, model: nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
    """torch.func per-sample gradients of every checked layer, ``(B, d)`` materialize layout."""
    *_, sample_loss, layers, _ = CASES[case]
    grads = per_sample_param_grads(model, sample_loss, batch)
    return {
        name: layout(kind, grads[w], None if b is None else grads[b])
        for name, (kind, w, b) in layers.items()
    }


def hand_precondition(case: str, model: nn.Module, opt: torch.optim.Optimizer, grads: dict):
    """``ops.precondition`` of each layer with its state read by hand from ``opt.state``."""
    params = dict(model.named_parameters())
    opt_type = "AdamW" if isinstance(opt, torch.optim.AdamW) else "SGD"
    group = opt.param_groups[0]
    hyper = {k: group[k] for k in (ADAM_KEYS if opt_type == "AdamW" else SGD_KEYS)}
    out = {}
    for name, (kind, w, b) in CASES[case][4].items():
        w_state = opt.state.get(params[w], {})
        b_state = opt.state.get(params[b], {}) if b is not None else {}
        state = {
            key: layout(
                kind,
                w_state[key][None],
                None if b is None else b_state[key][None],
            )[0]
            for key in OPTIMIZER_STATE_KEYS[opt_type]
            if key in w_state
        }
        step = int(w_state.get("step", 0)) + 1
        out[name] = precondition(grads[name], state, optimizer_type=opt_type, step=step, **hyper)
    return out


def capture(case: str, model: nn.Module, manager: HookManager, batch: tuple):
    """One collected forward+backward; the record's gradient."""
    with manager.collect():
        CASES[case][2](model, batch).backward()
    model.zero_grad()
    return manager.get_gradient()


def config(case: str, projection: dict | None = None, **kwargs) -> HookManagerConfig:
    return HookManagerConfig(linear_io=CASES[case][5], projection_kwargs=projection, **kwargs)


# --------------------------------------------------------------------------- tests

CASE_OPT = [("mlp", "adamw"), ("mlp", "sgd"), ("gpt2", "adamw"), ("gpt2", "sgd")]


@pytest.mark.parametrize(("case", "kind"), CASE_OPT)
def test_unprojected_capture_is_precondition_of_per_sample_gradients(case, kind):
    model, opt = trained(case, kind)
    batch = CASES[case][1]()
    manager = HookManager(model, config=config(case), optimizer=opt)
    assert manager.supports_preconditioning and manager.precondition
    gradient = capture(case, model, manager, batch)
    expected = hand_precondition(case, model, opt, per_sample(case, model, batch))
    assert set(gradient.data) == set(expected)
    for name, want in expected.items():
        got = gradient.data[name]
        assert gradient.representation[name] == "materialized"
        assert gradient.indexing[name] == "batch"
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL)
    if kind == "adamw":  # the map changed the gradient (not an identity by accident)
        raw = per_sample(case, model, batch)
        assert not torch.allclose(gradient.data[next(iter(raw))], raw[next(iter(raw))])


@pytest.mark.parametrize(("case", "kind"), CASE_OPT)
def test_mask_capture_is_precondition_on_the_masked_coordinates(case, kind):
    model, opt = trained(case, kind)
    batch = CASES[case][1]()
    projector = DattriProjector(random_project)
    projection = {
        "__default__": {"style": "mask", "proj_dim": 7, "proj_seed": 3},
        "fc2": {"style": "mask", "proj_dim": 5, "proj_seed": 1},
    }
    manager = HookManager(
        model, config=config(case, projection, projector=random_project), optimizer=opt
    )
    gradient = capture(case, model, manager, batch)
    full = hand_precondition(case, model, opt, per_sample(case, model, batch))
    for name, want_full in full.items():
        idx = mask_coordinates(projection, name, want_full.shape[1], projector)
        torch.testing.assert_close(gradient.data[name], want_full[:, idx], **TOL)
        assert gradient.representation[name] == "materialized"


@pytest.mark.parametrize(("case", "kind"), CASE_OPT)
def test_dense_capture_preconditions_then_projects(case, kind):
    model, opt = trained(case, kind)
    batch = CASES[case][1]()
    projector = DattriProjector(random_project)
    projection = {"__default__": {"style": "dense", "proj_dim": 6, "proj_seed": 2}}
    manager = HookManager(
        model, config=config(case, projection, projector=random_project), optimizer=opt
    )
    gradient = capture(case, model, manager, batch)
    full = hand_precondition(case, model, opt, per_sample(case, model, batch))
    for name, want_full in full.items():
        matrix = projector.matrix(
            want_full.shape[1], proj_dim=6, proj_seed=2, device="cpu", dtype=torch.float32
        )
        torch.testing.assert_close(gradient.data[name], want_full @ matrix, **TOL)
        assert gradient.data[name].shape == (B, 6)


def test_dense_capture_without_bias_coordinates():
    model, opt = trained("mlp", "adamw")
    batch = mlp_batch()
    projector = DattriProjector(random_project)
    projection = {"fc1": {"style": "dense", "proj_dim": 4, "include_bias": False}}
    cfg = HookManagerConfig(hook_types={"fc1": "linear_io"}, projection_kwargs=projection)
    cfg.projector = random_project
    manager = HookManager(model, config=cfg, optimizer=opt)
    gradient = capture("mlp", model, manager, batch)
    grads = per_sample("mlp", model, batch)
    grads["fc1"] = grads["fc1"].reshape(B, 6, 6)[:, :, :5].reshape(B, -1)  # drop bias column
    state = opt.state[model.fc1.weight]
    want = precondition(
        grads["fc1"],
        {k: state[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")},
        optimizer_type="AdamW",
        step=int(state["step"]) + 1,
        betas=(0.8, 0.95),
        eps=1e-4,
    )
    matrix = projector.matrix(30, proj_dim=4, proj_seed=0, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(gradient.data["fc1"], want @ matrix, **TOL)


@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_precondition_false_captures_raw_per_sample_gradients(case):
    model, opt = trained(case, "adamw")
    batch = CASES[case][1]()
    manager = HookManager(model, config=config(case), optimizer=opt)
    manager.precondition = False
    assert manager.supports_preconditioning and not manager.precondition
    raw = capture(case, model, manager, batch)
    for name, want in per_sample(case, model, batch).items():
        got = materialize(raw.data[name], raw.layer_types[name])
        torch.testing.assert_close(got, want, **TOL)
    manager.precondition = True  # the same hooks precondition again
    again = capture(case, model, manager, batch)
    expected = hand_precondition(case, model, opt, per_sample(case, model, batch))
    for name, want in expected.items():
        torch.testing.assert_close(again.data[name], want, **TOL)


def test_precondition_false_mask_is_the_plain_mask_capture():
    model, opt = trained("mlp", "sgd")
    batch = mlp_batch()
    projection = {"__default__": {"style": "mask", "proj_dim": 5}}
    manager = HookManager(model, config=config("mlp", projection), optimizer=opt)
    manager.precondition = False
    gradient = capture("mlp", model, manager, batch)
    for name, want in per_sample("mlp", model, batch).items():
        idx = mask_coordinates(projection, name, want.shape[1], DattriProjector())
        torch.testing.assert_close(gradient.data[name], want[:, idx], **TOL)


@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_first_step_adam_direction_is_sign_like(case):
    """No state yet: Adam's first update is ``g / (|g| + eps)`` (bias correction at t=1)."""
    model = CASES[case][0]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    batch = CASES[case][1]()
    manager = HookManager(model, config=config(case), optimizer=opt)
    gradient = capture(case, model, manager, batch)
    for name, g in per_sample(case, model, batch).items():
        torch.testing.assert_close(gradient.data[name], g / (g.abs() + 1e-3), **TOL)


def test_first_step_sgd_momentum_is_the_gradient():
    """No momentum buffer yet: torch's first SGD step uses ``buf = g``."""
    model = CASES["mlp"][0]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    batch = mlp_batch()
    manager = HookManager(model, config=config("mlp"), optimizer=opt)
    gradient = capture("mlp", model, manager, batch)
    for name, g in per_sample("mlp", model, batch).items():
        torch.testing.assert_close(gradient.data[name], 1.9 * g, **TOL)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_one_sample_direction_is_the_optimizer_update(kind):
    """A one-sample batch's preconditioned gradient is the optimizer's own update / lr."""
    torch.manual_seed(0)
    model = MLP()
    lr = 1e-2
    if kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.7, 0.9))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.8, nesterov=True)
    for step in range(3):
        opt.zero_grad()
        mlp_loss(model, mlp_batch(seed=200 + step)).backward()
        opt.step()
    manager = HookManager(model, config=config("mlp"), optimizer=opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with manager.collect():
        opt.zero_grad()
        mlp_loss(model, mlp_batch(n=1, seed=7)).backward()
    opt.step()
    delta = {n: (before[n] - p.detach()) / lr for n, p in model.named_parameters()}
    gradient = manager.get_gradient()
    want_fc1 = layout("linear", delta["fc1.weight"][None], delta["fc1.bias"][None])
    torch.testing.assert_close(gradient.data["fc1"], want_fc1, rtol=1e-4, atol=1e-5)
    want_fc2 = layout("linear", delta["fc2.weight"][None], None)
    torch.testing.assert_close(gradient.data["fc2"], want_fc2, rtol=1e-4, atol=1e-5)


def test_optimizer_callable_is_resolved_on_first_use():
    model, opt = trained("mlp", "adamw")
    calls = []

    def source() -> torch.optim.Optimizer:
        calls.append(1)
        return opt

    manager = HookManager(model, config=config("mlp"), optimizer=source)
    assert calls == [] and manager.precondition
    batch = mlp_batch()
    gradient = capture("mlp", model, manager, batch)
    assert calls == [1]
    capture("mlp", model, manager, batch)
    assert calls == [1]
    expected = hand_precondition("mlp", model, opt, per_sample("mlp", model, batch))
    for name, want in expected.items():
        torch.testing.assert_close(gradient.data[name], want, **TOL)


def test_state_is_read_at_each_step():
    """Captures use the state before the coming update, so they follow the optimizer."""
    model, opt = trained("mlp", "adamw", steps=1)
    manager = HookManager(model, config=config("mlp"), optimizer=opt)
    for step in range(2):
        batch = mlp_batch(seed=300 + step)
        expected = hand_precondition("mlp", model, opt, per_sample("mlp", model, batch))
        with manager.collect():
            opt.zero_grad()
            mlp_loss(model, batch).backward()
        opt.step()
        for name, want in expected.items():
            torch.testing.assert_close(manager.get_gradient().data[name], want, **TOL)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "projection",
    [
        {"fc1": {"style": "logra", "proj_dim": 2}},
        {"__default__": {"proj_dim": 2}},  # style absent = logra
        {
            "unhooked_name": {"style": "logra", "proj_dim": 2},
            "fc1": {"style": "mask", "proj_dim": 2},
        },
    ],
)
def test_logra_projection_is_refused(projection):
    model, opt = trained("mlp", "adamw", steps=1)
    with pytest.raises(ValueError, match="no longer rank-structured") as err:
        HookManager(model, config=config("mlp", projection), optimizer=opt)
    assert "'mask' or 'dense' or no projection" in str(err.value)
    HookManager(model, config=config("mlp", projection))  # fine without an optimizer


def test_param_grad_layers_are_refused():
    model, opt = trained("mlp", "adamw", steps=1)
    cfg = HookManagerConfig(hook_types={"fc1": "linear_io", "fc2": "param_grad"})
    with pytest.raises(ValueError, match=r"\['fc2'\].*param_grad"):
        HookManager(model, config=cfg, optimizer=opt)

    class Scaled(nn.Module):  # the default config hooks the bare parameter as param_grad
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(2))

    with pytest.raises(ValueError, match="param_grad"):
        HookManager(Scaled(), optimizer=torch.optim.SGD(Scaled().parameters(), lr=0.1))


def test_optimizer_argument_errors():
    model = MLP()
    with pytest.raises(TypeError, match="optimizer"):
        HookManager(model, optimizer=object())
    with pytest.raises(NotImplementedError, match="LBFGS"):
        HookManager(model, optimizer=torch.optim.LBFGS(model.parameters()))
    plain = HookManager(model)
    assert not plain.supports_preconditioning and not plain.precondition
    plain.precondition = False
    with pytest.raises(ValueError, match="optimizer"):
        plain.precondition = True


# --------------------------------------------------------------------------- low level


def test_register_linear_io_hooks_with_preconditioner():
    model, opt = trained("mlp", "adamw")
    batch = mlp_batch()
    preconditioner = GradientPreconditioner(OptimizerSnapshot(model, opt))
    with pytest.raises(ValueError, match="no longer rank-structured"):
        register_linear_io_hooks(
            model, projection_kwargs={"fc1": {"proj_dim": 2}}, preconditioner=preconditioner
        )
    buffers, handles = register_linear_io_hooks(model, preconditioner=preconditioner)
    try:
        mlp_loss(model, batch).backward()
    finally:
        remove_hooks(handles)
    expected = hand_precondition("mlp", model, opt, per_sample("mlp", model, batch))
    for name, want in expected.items():
        (captured,) = buffers[name]["captures"]
        assert captured.representation == "materialized"
        torch.testing.assert_close(captured.data, want, **TOL)

"""OptimizerSnapshot layouts, GradientPreconditioner, optimizer_type and the state-dict helpers.

Expectations are built by hand from ``optimizer.state[param]`` (the materialize
layout written out per layer type), from materialized captured gradients, or
from the optimizer's own update on a one-sample batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.ops.materialize import materialize

optimizer_ops = pytest.importorskip("dattri_llm.gradient.ops.optimizer")
from dattri_llm.gradient.optimizer_state import (  # noqa: E402
    GradientPreconditioner,
    OptimizerSnapshot,
    hf_trainer_param_names,
    optimizer_from_state_dict,
    optimizer_type,
)

CONV1D = "transformers.pytorch_utils.Conv1D"
GPT2_KW = dict(
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


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def tiny_gpt2(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_KW))


def train_steps(model, optimizer, steps: int = 3, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 3, generator=gen)).pow(2).sum().backward()
        optimizer.step()


def gpt2_steps(model, optimizer, steps: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, GPT2_KW["vocab_size"], (2, 5), generator=gen)
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return ids


def linear_layout(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``(out, in [+1])`` row-major written out by hand."""
    rows = []
    for o in range(w.shape[0]):
        rows.append(w[o] if b is None else torch.cat([w[o], b[o : o + 1]]))
    return torch.cat(rows)


# --------------------------------------------------------------------------- optimizer_type


def test_optimizer_type_walks_the_mro_and_refuses_unknown_types():
    params = [nn.Parameter(torch.zeros(2))]

    class MyAdamW(torch.optim.AdamW):
        pass

    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    assert optimizer_type(torch.optim.AdamW(params)) == "AdamW"
    assert optimizer_type(torch.optim.SGD(params, lr=0.1)) == "SGD"
    assert optimizer_type(MyAdamW(params)) == "AdamW"
    with pytest.raises(NotImplementedError, match=r"Custom.*AdamW"):
        optimizer_type(Custom(params))


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_linear_state_with_and_without_bias(key):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, opt)
    snap = OptimizerSnapshot(model, opt)
    s1, s2 = opt.state[model.fc1.weight], opt.state[model.fc1.bias]
    with_bias = linear_layout(s1[key], s2[key])
    read = snap.read("fc1")
    assert read.step == 3 and read.lr == pytest.approx(1e-2)
    assert read.hyperparameters["betas"] == (0.9, 0.999)
    assert read.hyperparameters["weight_decay"] == pytest.approx(0.1)
    assert "lr" not in read.hyperparameters and "foreach" not in read.hyperparameters
    assert read.state[key].dtype == torch.float32 and read.state[key].device.type == "cpu"
    torch.testing.assert_close(read.state[key], with_bias, rtol=0, atol=0)
    torch.testing.assert_close(
        snap.read("fc1", include_bias=False).state[key], s1[key].reshape(-1), rtol=0, atol=0
    )
    # fc2 has no bias: include_bias is moot
    fc2 = linear_layout(opt.state[model.fc2.weight][key], None)
    torch.testing.assert_close(snap.read("fc2").state[key], fc2, rtol=0, atol=0)
    # a mask subset reads the same coordinates of the full layout (bias column included)
    idx = torch.tensor([0, 3, 4, 9, 14, 15])
    torch.testing.assert_close(
        snap.read("fc1", [key], coordinates=idx).state[key], with_bias[idx], rtol=0, atol=0
    )
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        snap.read("fc1", coordinates=torch.tensor([16]))
    assert snap.layer_width("fc1") == 16 and snap.layer_width("fc1", include_bias=False) == 12
    assert snap.read("fc1@2").state[key].equal(with_bias)  # use sites read their module


def test_missing_state_is_left_out_or_zero_and_step_zero():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    snap = OptimizerSnapshot(model, lambda: opt)  # a callable is resolved on first use
    read = snap.read("fc1")
    assert read.state == {} and read.step == 0
    zeros = snap.read("fc1", ["exp_avg"], zeros_for_missing=True).state["exp_avg"]
    assert zeros.equal(torch.zeros(16))
    masked = snap.read("fc1", ["exp_avg"], coordinates=torch.tensor([1, 2]), zeros_for_missing=True)
    assert masked.state["exp_avg"].equal(torch.zeros(2))


def test_gpt2_conv1d_embedding_and_layernorm_layouts():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gpt2_steps(model, opt)
    snap = OptimizerSnapshot(model, opt)
    attn = model.transformer.h[0].attn.c_attn
    assert snap.layer_type("transformer.h.0.attn.c_attn") == CONV1D
    w, b = opt.state[attn.weight]["exp_avg"], opt.state[attn.bias]["exp_avg"]
    expected = linear_layout(w.t(), b)  # Conv1D weight is (in, out): report (out, in)
    got = snap.read("transformer.h.0.attn.c_attn", ["exp_avg"]).state["exp_avg"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    wte = opt.state[model.transformer.wte.weight]["exp_avg_sq"]
    got = snap.read("transformer.wte", ["exp_avg_sq"]).state["exp_avg_sq"]
    torch.testing.assert_close(got, wte.reshape(-1), rtol=0, atol=0)
    ln = model.transformer.h[0].ln_1
    expected = torch.cat([opt.state[ln.weight]["exp_avg"], opt.state[ln.bias]["exp_avg"]])
    got = snap.read("transformer.h.0.ln_1", ["exp_avg"]).state["exp_avg"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Layer 'transformer.wpe' has batch size 1")
def test_layout_matches_captured_gradients():
    """SGD's first momentum buffer is the batch gradient = the sum of captured per-sample rows."""
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    cb = CaptureCallback()
    manager = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
    ids = torch.randint(
        0, GPT2_KW["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(0)
    )
    with manager.collect():
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    manager.remove()
    snap = OptimizerSnapshot(model, opt)
    gradient = cb.record.gradient
    layers = [
        "transformer.wte",
        "transformer.h.0.ln_1",
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.mlp.c_proj",
        "lm_head",
    ]
    for name in layers:
        rows = materialize(gradient.data[name], gradient.layer_types[name])
        buffer = snap.read(name, ["momentum_buffer"]).state["momentum_buffer"]
        torch.testing.assert_close(buffer, rows.sum(0), atol=1e-6, rtol=1e-5, msg=name)


def test_conv_layer_and_unsupported_types():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 2), nn.ConvTranspose2d(3, 2, 2), nn.Bilinear(2, 2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.randn_like(p)
    snap = OptimizerSnapshot(model, opt)
    w, b = (
        opt.state[model[0].weight]["momentum_buffer"],
        opt.state[model[0].bias]["momentum_buffer"],
    )
    expected = linear_layout(w.reshape(3, -1), b)
    torch.testing.assert_close(snap.read("0").state["momentum_buffer"], expected, rtol=0, atol=0)
    for name in ("1", "2"):
        with pytest.raises(NotImplementedError, match="supported types"):
            snap.read(name)
    with pytest.raises(KeyError, match="not a module"):
        snap.read("nope")


def test_fsdp_without_orig_params_is_refused():
    fsdp = type("FullyShardedDataParallel", (nn.Module,), {})
    wrapper = fsdp()
    wrapper._use_orig_params = False
    wrapper.module = mlp()
    with pytest.raises(NotImplementedError, match="use_orig_params=True"):
        OptimizerSnapshot(wrapper, torch.optim.AdamW(wrapper.parameters()))


# --------------------------------------------------------------------------- preconditioner


def _hand_state(model: MLP, opt, keys) -> dict:
    st_w, st_b = opt.state[model.fc1.weight], opt.state[model.fc1.bias]
    return {k: linear_layout(st_w[k], st_b[k]) for k in keys if k in st_w}


@pytest.mark.parametrize("amsgrad", [False, True])
def test_preconditioner_equals_precondition_by_hand(amsgrad):
    model = mlp()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, amsgrad=amsgrad
    )
    train_steps(model, opt)
    pre = GradientPreconditioner(OptimizerSnapshot(model, opt))
    g = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    state = _hand_state(model, opt, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    step = int(opt.state[model.fc1.weight]["step"]) + 1
    hp = dict(betas=(0.8, 0.99), eps=1e-6, amsgrad=amsgrad)
    expected = optimizer_ops.precondition(g, state, optimizer_type="AdamW", step=step, **hp)
    torch.testing.assert_close(pre("fc1", g), expected)
    # mask: the entries are the masked coordinates, the state is read on them
    proj = {"style": "mask", "proj_dim": 5, "proj_seed": 3}
    idx = pre.coordinates("fc1", proj)
    masked = {k: v[idx] for k, v in state.items()}
    expected = optimizer_ops.precondition(
        g[:, idx], masked, optimizer_type="AdamW", step=step, **hp
    )
    torch.testing.assert_close(pre("fc1", g[:, idx], proj), expected)
    # dense: the whole layer is mapped, then projected
    dense = {"style": "dense", "proj_dim": 4, "proj_seed": 1}
    full = optimizer_ops.precondition(g, state, optimizer_type="AdamW", step=step, **hp)
    expected = pre.projector.apply(full, proj_dim=4, proj_seed=1)
    torch.testing.assert_close(pre("fc1", g, dense), expected)
    # switched off: entries pass through (dense still projects)
    pre.enabled = False
    assert pre("fc1", g) is g
    torch.testing.assert_close(
        pre("fc1", g, dense), pre.projector.apply(g, proj_dim=4, proj_seed=1)
    )


def test_mask_coordinates_follow_the_spec_formula():
    model = mlp()
    pre = GradientPreconditioner(OptimizerSnapshot(model, torch.optim.Adam(model.parameters())))
    d, proj_dim, seed = 16, 5, 3
    mixed = ((seed * 1_000_003 + d) * 1_000_003 + proj_dim) & (2**63 - 1)
    expected = torch.randperm(d, generator=torch.Generator().manual_seed(mixed))[:proj_dim].sort()
    got = pre.coordinates("fc1", {"style": "mask", "proj_dim": proj_dim, "proj_seed": seed})
    assert got.equal(expected.values)
    no_bias = pre.coordinates("fc1", {"style": "mask", "proj_dim": 5, "include_bias": False})
    assert int(no_bias.max()) < 12


def test_preconditioned_one_sample_direction_is_the_optimizer_update():
    """For a one-sample batch the map's row is AdamW's own step (lr factored out, no decay)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    train_steps(model, opt, steps=2)
    pre = GradientPreconditioner(OptimizerSnapshot(model, opt))
    cb = CaptureCallback()
    manager = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
    x = torch.randn(1, 3, generator=torch.Generator().manual_seed(9))
    opt.zero_grad()
    with manager.collect():
        model(x).pow(2).sum().backward()
    manager.remove()
    before = linear_layout(model.fc1.weight.detach().clone(), model.fc1.bias.detach().clone())
    rows = materialize(cb.record.gradient.data["fc1"], "nn.Linear")
    direction = pre("fc1", rows)
    opt.step()
    after = linear_layout(model.fc1.weight.detach(), model.fc1.bias.detach())
    torch.testing.assert_close(direction[0], (before - after) / 1e-2, atol=1e-5, rtol=1e-4)


def test_preconditioner_errors():
    model = mlp()
    pre = GradientPreconditioner(OptimizerSnapshot(model, torch.optim.Adam(model.parameters())))
    with pytest.raises(ValueError, match="logra"):
        pre("fc1", torch.zeros(2, 16), {"proj_dim": 2})
    with pytest.raises(ValueError, match=r"\(B, 16\)"):
        pre("fc1", torch.zeros(2, 12))


# --------------------------------------------------------------------------- state dicts


def test_hf_trainer_param_names_puts_decayed_first():
    model = tiny_gpt2()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    norm = ("ln_1.", "ln_2.", "ln_f.")
    decayed = [n for n in names if not n.endswith("bias") and not any(s in n for s in norm)]
    assert "transformer.h.0.attn.c_attn.weight" in decayed and "lm_head.weight" in decayed
    rest = [n for n in names if n not in decayed]
    assert hf_trainer_param_names(model) == decayed + rest


def _hf_groups(model):
    params = dict(model.named_parameters())
    order = hf_trainer_param_names(model)
    n_decay = sum(1 for n in order if not n.endswith("bias") and ".ln_" not in n)
    return [
        {"params": [params[n] for n in order[:n_decay]], "weight_decay": 0.1},
        {"params": [params[n] for n in order[n_decay:]], "weight_decay": 0.0},
    ]


def test_optimizer_from_state_dict_restores_states_by_name(tmp_path):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(_hf_groups(model), lr=1e-3)
    gpt2_steps(model, opt)
    saved = opt.state_dict()
    torch.save(saved, tmp_path / "optimizer.pt")
    copy = tiny_gpt2()
    copy.load_state_dict(model.state_dict())
    for source in (saved, tmp_path / "optimizer.pt"):
        rebuilt = optimizer_from_state_dict(copy, source)
        assert isinstance(rebuilt, torch.optim.AdamW)
        assert [g["weight_decay"] for g in rebuilt.param_groups] == [0.1, 0.0]
        originals = dict(model.named_parameters())
        for name, param in copy.named_parameters():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(
                    rebuilt.state[param][key], opt.state[originals[name]][key], rtol=0, atol=0
                )
    with pytest.raises(ValueError, match="param_names has 1 entries"):
        optimizer_from_state_dict(copy, saved, ["transformer.wte.weight"])
    bad = ["missing"] * len(hf_trainer_param_names(copy))
    with pytest.raises(KeyError, match="missing"):
        optimizer_from_state_dict(copy, saved, bad)

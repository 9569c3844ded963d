"""``OptimizerSnapshot``'s reading methods against the raw optimizer state, and the
``GradientPreconditioner`` cache.

Expectations are written out by hand from ``optimizer.state[param]`` in the
materialize layout of each layer type (Linear ``(out, in [+1 bias column])``,
HF ``Conv1D`` transposed to ``(out, in)``, Embedding row-major, LayerNorm
``[weight, bias]``), for Adam, AdamW and SGD with momentum. The cache tests
count ``OptimizerSnapshot.states`` calls.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.gradient import base_layer_name
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.ops.optimizer import OPTIMIZER_STATE_KEYS
from dattri_llm.gradient.ops.optimizer import precondition as ops_precondition
from dattri_llm.gradient.optimizer_state import GradientPreconditioner, OptimizerSnapshot

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D

LAYERS = ("emb", "conv", "ln", "fc", "out")
OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2, betas=(0.8, 0.9), eps=1e-6),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, dampening=0.1),
}


class Zoo(nn.Module):
    """Embedding → HF Conv1D → LayerNorm → Linear (bias) → Linear (no bias), ``fc`` used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.conv = Conv1D(6, 4)  # weight (in=4, out=6)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.tanh(self.conv(self.emb(ids))))
        h = self.fc(torch.tanh(self.fc(h)))  # a second use site: fc@2
        return self.out(torch.tanh(h))


def zoo() -> Zoo:
    torch.manual_seed(0)
    return Zoo()


def ids(seed: int, n: int = 3) -> torch.Tensor:
    return torch.randint(0, 7, (n, 5), generator=torch.Generator().manual_seed(seed))


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).sum()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        loss(model, ids(step)).backward()
        optimizer.step()


def by_hand(model: Zoo, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Parameter-shaped ``weight`` / ``bias`` in materialize layout, written out per type."""
    w, b = tensors["weight"], tensors.get("bias")
    if name == "emb":
        return w.reshape(-1)
    if name == "ln":
        return w if b is None else torch.cat([w, b])
    matrix = w.t() if name == "conv" else w  # Conv1D weight is (in, out): report (out, in)
    rows = [
        matrix[o] if b is None else torch.cat([matrix[o], b[o : o + 1]]) for o in range(len(matrix))
    ]
    return torch.cat(rows)


def raw(model: Zoo, optimizer, name: str, key: str, include_bias: bool = True):
    """Layer state ``key`` from ``optimizer.state`` by hand (``None``: no parameter has it)."""
    module = getattr(model, name)
    roles = {"weight": module.weight}
    if include_bias and getattr(module, "bias", None) is not None:
        roles["bias"] = module.bias
    states = {role: optimizer.state[p].get(key) for role, p in roles.items()}
    if all(v is None for v in states.values()):
        return None
    return by_hand(
        model,
        name,
        {r: torch.zeros_like(roles[r]) if v is None else v for r, v in states.items()},
    )


@pytest.fixture(params=sorted(OPTIMIZERS))
def trained(request):
    """``(model, optimizer, snapshot)``: the snapshot is built before training (a live view)."""
    model = zoo()
    optimizer = OPTIMIZERS[request.param](model.parameters())
    snapshot = OptimizerSnapshot(model, optimizer)
    train(model, optimizer)
    return model, optimizer, snapshot


# --------------------------------------------------------------------------- layout members


def test_layer_members(trained):
    model, optimizer, snap = trained
    assert snap.optimizer is optimizer
    assert snap.optimizer_type == type(optimizer).__name__
    widths = {"emb": (28, 28), "conv": (30, 24), "ln": (12, 6), "fc": (42, 36), "out": (12, 12)}
    for name in LAYERS:
        module = getattr(model, name)
        assert snap.module(name) is module
        assert snap.width(name) == widths[name][0]
        assert snap.width(name, include_bias=False) == widths[name][1]
        expected = [("weight", module.weight)]
        if getattr(module, "bias", None) is not None:
            expected.append(("bias", module.bias))
        got = snap.parameters(name)
        assert [r for r, _ in got] == [r for r, _ in expected]
        assert all(p is q for (_, p), (_, q) in zip(got, expected, strict=True))
        assert [r for r, _ in snap.parameters(name, include_bias=False)] == ["weight"]
        assert snap.shapes(name) == [(r, p.shape) for r, p in expected]
        assert snap.bind(name) is None  # a no-op without FSDP
    assert snap.module("fc@2") is model.fc
    assert snap.parameters("fc@2")[0][1] is model.fc.weight


def test_flatten_is_the_materialize_layout():
    model = zoo()
    snap = OptimizerSnapshot(model, torch.optim.Adam(model.parameters()))
    gen = torch.Generator().manual_seed(4)
    for name in LAYERS:
        module = getattr(model, name)
        tensors = {"weight": torch.randn(module.weight.shape, generator=gen)}
        assert torch.equal(snap.flatten(name, tensors), by_hand(model, name, tensors))
        if getattr(module, "bias", None) is None:
            with pytest.raises(ValueError, match="no bias"):
                snap.flatten(name, {**tensors, "bias": torch.zeros(2)})
            continue
        tensors["bias"] = torch.randn(module.bias.shape, generator=gen)
        full = by_hand(model, name, tensors)
        assert torch.equal(snap.flatten(name, tensors), full)
        idx = torch.tensor([0, 3, snap.width(name) - 1, 5])
        assert torch.equal(snap.flatten(name, tensors, idx), full[idx])
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        snap.flatten("fc", {"weight": torch.zeros(3, 3)})


# --------------------------------------------------------------------------- groups and steps


def test_group_hyperparameters_and_step_count(trained):
    model, optimizer, snap = trained
    group = optimizer.param_groups[0]
    for name in LAYERS:
        assert snap.group(name) is group
        hyper = snap.hyperparameters(name)
        assert "params" not in hyper
        assert hyper == {k: v for k, v in group.items() if k not in ("params", "param_names")}
        assert hyper["lr"] == pytest.approx(1e-2)
        steps = 0 if isinstance(optimizer, torch.optim.SGD) else 3  # SGD keeps no step count
        assert snap.step_count(name) == steps
    fresh = zoo()
    snap = OptimizerSnapshot(fresh, type(optimizer)(fresh.parameters(), lr=1e-2))
    assert snap.step_count("fc") == 0
    assert snap.state("fc", snap.state_keys[0]) is None


def test_keyerror_names_the_layer():
    model = zoo()
    others = [p for n, p in model.named_parameters() if not n.startswith("fc.")]
    snap = OptimizerSnapshot(model, torch.optim.AdamW(others))
    for call in (
        lambda: snap.group("fc"),
        lambda: snap.hyperparameters("fc@2"),
        lambda: snap.state("fc", "exp_avg"),
        lambda: snap.states("fc"),
        lambda: snap.step_count("fc"),
        lambda: snap.precondition("fc", torch.zeros(1, 42)),
    ):
        with pytest.raises(KeyError, match=r"layer 'fc(@2)?'.*not in any param group"):
            call()
    assert snap.group("out")["params"] == others
    with pytest.raises(KeyError, match="'nope'"):
        snap.module("nope")


# --------------------------------------------------------------------------- state reads


def test_state_equals_the_raw_state(trained):
    model, optimizer, snap = trained
    keys = OPTIMIZER_STATE_KEYS[snap.optimizer_type]
    for name in LAYERS:
        width = snap.width(name)
        idx = torch.tensor([width - 1, 0, 2, 2, width // 2])  # unsorted, repeated, bias column
        states = snap.states(name)
        assert sorted(states) == sorted(keys)
        for key in keys:
            want = raw(model, optimizer, name, key)
            got = snap.state(name, key)
            if want is None:  # e.g. max_exp_avg_sq without amsgrad
                assert got is None and states[key] is None
                assert snap.state(name, key, idx) is None
                continue
            assert got.dtype == want.dtype and torch.equal(got, want), (name, key)
            assert torch.equal(states[key], want)
            assert torch.equal(snap.state(name, key, idx), want[idx])
            assert torch.equal(snap.states(name, idx)[key], want[idx])
            no_bias = raw(model, optimizer, name, key, include_bias=False)
            assert torch.equal(snap.state(name, key, include_bias=False), no_bias)
            assert torch.equal(snap.state(f"{name}@2", key), want)  # use sites read their module
            # a new tensor, not a view of the live state
            got.add_(1.0)
            assert torch.equal(snap.state(name, key), want)


def test_snapshot_is_a_live_view():
    model = zoo()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snap = OptimizerSnapshot(model, optimizer)
    assert snap.state("fc", "exp_avg") is None and snap.step_count("fc") == 0
    train(model, optimizer, steps=1)
    first = snap.state("fc", "exp_avg")
    assert torch.equal(first, raw(model, optimizer, "fc", "exp_avg"))
    train(model, optimizer, steps=1)
    assert snap.step_count("fc") == 2
    assert torch.equal(snap.state("fc", "exp_avg"), raw(model, optimizer, "fc", "exp_avg"))
    assert not torch.equal(snap.state("fc", "exp_avg"), first)


def test_missing_parameter_state_reads_as_zeros_and_scalars_are_0d():
    model = zoo()
    optimizer = torch.optim.NAdam(model.parameters(), lr=1e-2)
    train(model, optimizer, steps=2)
    snap = OptimizerSnapshot(model, optimizer)
    mu = snap.state("fc", "mu_product")
    assert mu.ndim == 0 and torch.equal(mu, optimizer.state[model.fc.weight]["mu_product"])
    optimizer.state.pop(model.fc.bias)  # the bias has no state, the weight has
    got = snap.state("fc", "exp_avg")
    w = optimizer.state[model.fc.weight]["exp_avg"]
    assert torch.equal(got, by_hand(model, "fc", {"weight": w, "bias": torch.zeros(6)}))
    assert snap.states("fc")["mu_product"].ndim == 0


def test_precondition_is_ops_precondition_of_the_state(trained):
    model, optimizer, snap = trained
    gen = torch.Generator().manual_seed(7)
    keys = OPTIMIZER_STATE_KEYS[snap.optimizer_type]
    for name in LAYERS:
        width = snap.width(name)
        g = torch.randn(4, width, generator=gen)
        step = snap.step_count(name) + 1
        state = {k: raw(model, optimizer, name, k) for k in keys}
        group = optimizer.param_groups[0]
        hyper = {k: v for k, v in group.items() if k != "params"}
        want = ops_precondition(g, state, optimizer_type=snap.optimizer_type, step=step, **hyper)
        assert torch.equal(snap.precondition(name, g), want), name
        idx = torch.tensor([1, width - 1, 3])
        masked = {k: None if v is None else v[idx] for k, v in state.items()}
        want = ops_precondition(
            g[:, idx], masked, optimizer_type=snap.optimizer_type, step=step, **hyper
        )
        assert torch.equal(snap.precondition(name, g[:, idx], idx), want), name


# --------------------------------------------------------------------------- the cache


class _Counter:
    """Wrap ``OptimizerSnapshot.states`` and count calls per (base) layer name."""

    def __init__(self, monkeypatch) -> None:
        self.calls: dict[str, int] = {}
        original = OptimizerSnapshot.states

        def states(snapshot, layer_name, *args, **kwargs):
            name = base_layer_name(layer_name)
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(snapshot, layer_name, *args, **kwargs)

        monkeypatch.setattr(OptimizerSnapshot, "states", states)


def test_preconditioner_reads_each_layer_once_per_optimizer_step(monkeypatch):
    model = zoo()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, steps=2)
    snap = OptimizerSnapshot(model, optimizer)  # its own precondition() is uncached
    pre = GradientPreconditioner(snap)
    counter = _Counter(monkeypatch)
    g = torch.randn(3, 42, generator=torch.Generator().manual_seed(1))
    mask = {"style": "mask", "proj_dim": 5, "proj_seed": 2}
    idx = pre.coordinates("fc", mask)
    for _ in range(3):  # one accumulation window: no step
        assert torch.equal(pre("fc", g), snap.precondition("fc", g))
        assert torch.equal(pre("fc@2", g), snap.precondition("fc", g))
        assert torch.equal(pre("fc", g[:, idx], mask), snap.precondition("fc", g[:, idx], idx))
    assert counter.calls == {"fc": 2}  # once per coordinates: all, and the mask
    train(model, optimizer, steps=1)
    assert torch.equal(pre("fc", g), snap.precondition("fc", g))
    assert counter.calls == {"fc": 3}  # re-read after the step
    state = optimizer.state_dict()
    train(model, optimizer, steps=1)
    pre("fc", g)
    optimizer.load_state_dict(state)  # a state load invalidates too
    assert torch.equal(pre("fc", g), snap.precondition("fc", g))
    assert counter.calls == {"fc": 5}
    pre.clear_cache()
    pre("fc", g)
    pre.cache = False  # read on every call
    pre("fc", g)
    pre("fc", g)
    assert counter.calls == {"fc": 8}


class _Rows(HookManagerCallback):
    """Every record's captures as dense rows, in order."""

    def __init__(self) -> None:
        self.rows: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, record) -> None:
        self.rows.append({n: v.clone() for n, v in record.gradient.materialize().data.items()})


def test_hook_manager_reads_the_state_once_per_layer_per_window(monkeypatch):
    """Several backwards without a step read each layer once; a step makes them read again.

    The cached captures equal the uncached map of the same batches' raw captures.
    """
    model = zoo()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, steps=2)
    mask = {"style": "mask", "proj_dim": 7, "proj_seed": 5}
    config = HookManagerConfig(linear_io=REGISTER_ALL, projection_kwargs={"conv": mask})
    rows = _Rows()
    manager = HookManager(model, config, [rows], optimizer=optimizer)
    counter = _Counter(monkeypatch)
    batches = [ids(10 + i, n=2) for i in range(3)]
    with manager.collect():
        for batch in batches:  # one accumulation window
            loss(model, batch).backward()
    assert counter.calls == {name: 1 for name in LAYERS}
    # the same batches captured raw, then mapped without cache
    manager.precondition = False
    with manager.collect():
        for batch in batches:
            loss(model, batch).backward()
    uncached = GradientPreconditioner(OptimizerSnapshot(model, optimizer))
    uncached.cache = False
    for mapped, raw_captures in zip(rows.rows[:3], rows.rows[3:], strict=True):
        assert sorted(mapped) == sorted([*LAYERS, "fc@2"])
        for name, value in raw_captures.items():
            proj = mask if name == "conv" else None
            assert torch.equal(mapped[name], uncached(name, value, proj)), name
    manager.precondition = True
    counter.calls.clear()
    with manager.collect():  # still the same window: the manager's cache holds
        loss(model, batches[0]).backward()
    assert counter.calls == {}
    optimizer.step()
    optimizer.zero_grad()
    with manager.collect():
        loss(model, batches[0]).backward()
    assert counter.calls == {name: 1 for name in LAYERS}  # re-read after the step
    manager.remove()

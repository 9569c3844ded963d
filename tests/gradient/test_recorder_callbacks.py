"""OptimizerStateCallback and ParameterSnapshotCallback around a real HookManager + AdamW loop.

Expectations are copies of ``optimizer.state[p]`` / the parameters taken by
hand before and after each ``optimizer.step()``, laid out by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.callbacks.optimizer_state_callback import (
    OptimizerStateCallback,
    assemble_dynamics,
)
from dattri_llm.gradient.callbacks.parameter_snapshot_callback import ParameterSnapshotCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.snapshots import LazyDynamics, TrajectorySnapshots

STEPS = 3
MASK = {"fc1": {"style": "mask", "proj_dim": 6, "proj_seed": 2}}
LR, BETAS, EPS, WD = 1e-2, (0.8, 0.95), 1e-7, 0.05


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def layout(model: MLP, name: str, tensors: dict) -> torch.Tensor:
    """``(out, in [+1])`` row-major of parameter-shaped tensors keyed by parameter."""
    layer = getattr(model, name)
    w = tensors[layer.weight]
    b = tensors.get(layer.bias) if layer.bias is not None else None
    return torch.cat(
        [torch.cat([w[o], b[o : o + 1]]) if b is not None else w[o] for o in range(len(w))]
    )


def moments_by_hand(model: MLP, opt) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for name in ("fc1", "fc2"):
        pair = []
        for key in ("exp_avg", "exp_avg_sq"):
            tensors = {
                p: opt.state[p][key].clone() if key in opt.state[p] else torch.zeros_like(p)
                for p in getattr(model, name).parameters()
            }
            pair.append(layout(model, name, tensors))
        out[name] = tuple(pair)
    return out


def mask_idx(d: int, proj_dim: int, seed: int) -> torch.Tensor:
    """The spec's mask coordinates, computed from its formula."""
    mixed = ((seed * 1_000_003 + d) * 1_000_003 + proj_dim) & (2**63 - 1)
    return (
        torch.randperm(d, generator=torch.Generator().manual_seed(mixed))[:proj_dim].sort().values
    )


def run(callbacks, projection=None, snapshots=None):
    """AdamW loop under a HookManager; returns hand copies (pre/post moments, parameters)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    cbs = [make(model, opt) for make in callbacks]
    config = HookManagerConfig(linear_io=REGISTER_ALL, projection_kwargs=projection)
    manager = HookManager(model, config, callbacks=cbs)
    gen = torch.Generator().manual_seed(1)
    hand = {"pre": {}, "post": {}, "params": {}}
    with manager.collect():
        for step in range(STEPS):
            x = torch.randn(5, 3, generator=gen)
            if snapshots is not None:
                snapshots.save_batch(step, {"x": x})
            hand["params"][step] = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            hand["pre"][step] = moments_by_hand(model, opt)
            opt.step()
            hand["post"][step] = moments_by_hand(model, opt)
            for cb in cbs:
                if isinstance(cb, OptimizerStateCallback):
                    cb.record_post(step)
    manager.remove()
    return model, opt, cbs, hand


def assert_entry(got: dict, expected: dict, idx: dict | None = None) -> None:
    assert set(got) == set(expected)
    for name, pair in expected.items():
        for g, e in zip(got[name], pair, strict=True):
            e = e if idx is None or name not in idx else e[idx[name]]
            assert g.dtype == torch.float32 and g.device.type == "cpu"
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_pre_and_post_moments_equal_the_optimizer_state():
    _, _, (rec,), hand = run([lambda m, o: OptimizerStateCallback(m, o)])
    assert sorted(rec.pre) == sorted(rec.post) == list(range(STEPS))
    for step in range(STEPS):
        assert_entry(rec.pre[step]["moments"], hand["pre"][step])
        assert_entry(rec.post[step]["moments"], hand["post"][step])
        assert rec.pre[step]["step"] == step and rec.post[step]["step"] == step + 1
    for m in rec.pre[0]["moments"]["fc1"]:  # no state before the first update: zeros
        assert m.equal(torch.zeros(16))
    dyn = rec.dynamics()
    assert type(dyn) is dict and list(dyn) == list(range(STEPS))
    for step, got in dyn.items():
        # the contract's keys, plus what the update applied (window, clip, every group's values)
        assert set(got) == {
            "pre", "post", "step", "lr", "betas", "eps", "weight_decay", "update", "layers",
        }  # fmt: skip
        assert got["step"] == step + 1
        assert got["lr"] == LR and got["betas"] == BETAS
        assert got["eps"] == EPS and got["weight_decay"] == WD
        assert_entry(got["pre"], hand["pre"][step])
        assert_entry(got["post"], hand["post"][step])


def test_mask_coordinates_from_projection_kwargs_match_the_capture():
    captured = CaptureCallback()
    _, _, (rec, _), hand = run(
        [lambda m, o: OptimizerStateCallback(m, o, projection_kwargs=MASK), lambda m, o: captured],
        projection=MASK,
    )
    idx = mask_idx(16, 6, 2)
    assert rec.coordinates("fc1").equal(idx) and rec.coordinates("fc2") is None
    for step in range(STEPS):
        assert_entry(rec.pre[step]["moments"], hand["pre"][step], {"fc1": idx})
        assert_entry(rec.post[step]["moments"], hand["post"][step], {"fc1": idx})
    # the captured masked gradient sits on the same coordinates as the recorded moments
    assert captured.record.gradient.data["fc1"].shape == (5, 6)


def test_mask_coordinates_agree_with_the_captured_gradient():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 3)
    grads = []
    for projection in (None, MASK):
        cb = CaptureCallback()
        manager = HookManager(
            model, HookManagerConfig(linear_io=["fc1"], projection_kwargs=projection), [cb]
        )
        with manager.collect():
            model(x).pow(2).sum().backward()
        manager.remove()
        grads.append(materialize(cb.record.gradient.data["fc1"], "nn.Linear"))
    rec = OptimizerStateCallback(
        model, torch.optim.Adam(model.parameters()), projection_kwargs=MASK
    )
    torch.testing.assert_close(grads[1], grads[0][:, rec.coordinates("fc1")])


def test_layers_filter_and_errors():
    _, opt, (rec,), hand = run([lambda m, o: OptimizerStateCallback(m, o, layers=["fc2"])])
    assert set(rec.pre[1]["moments"]) == {"fc2"}
    assert_entry(rec.post[1]["moments"], {"fc2": hand["post"][1]["fc2"]})
    with pytest.raises(KeyError, match="no pre-update entry for step 7"):
        rec.record_post(7)
    model = MLP()
    sgd = OptimizerStateCallback(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="Adam or AdamW"):
        sgd.snapshot  # noqa: B018
    assert isinstance(rec, HookManagerCallback)


def test_snapshots_store_receives_the_entries(tmp_path):
    store = TrajectorySnapshots(tmp_path / "snaps")
    _, _, (mem, disk), hand = run(
        [
            lambda m, o: OptimizerStateCallback(m, o),
            lambda m, o: OptimizerStateCallback(m, o, snapshots=store),
        ]
    )
    assert disk.pre == {} and disk.post == {}
    assert store.dynamics_steps() == list(range(STEPS))
    dyn = disk.dynamics()
    assert isinstance(dyn, LazyDynamics) and list(dyn) == list(range(STEPS))
    for step in range(STEPS):
        got, expected = dyn[step], mem.dynamics()[step]
        assert {k: v for k, v in got.items() if k not in ("pre", "post")} == {
            k: v for k, v in expected.items() if k not in ("pre", "post")
        }
        assert_entry(got["pre"], hand["pre"][step])
        assert_entry(got["post"], hand["post"][step])
        assert_entry(
            assemble_dynamics(store.load_dynamics(step, "pre"), store.load_dynamics(step, "post"))[
                "post"
            ],
            hand["post"][step],
        )
    # a callback that did not see the step (a restarted run) takes its layers from the store
    other = MLP()
    fresh = OptimizerStateCallback(other, torch.optim.AdamW(other.parameters()), snapshots=store)
    fresh.record_post(0)
    assert set(store.load_dynamics(0, "post")["moments"]) == {"fc1", "fc2"}
    with pytest.raises(KeyError):
        fresh.record_post(STEPS)


def test_parameter_snapshots_hold_the_parameters_gradients_were_taken_at(tmp_path):
    store = TrajectorySnapshots(tmp_path / "snaps")
    model, _, (cb,), hand = run([lambda m, o: ParameterSnapshotCallback(m, store)], snapshots=store)
    assert cb.snapshots is store
    assert store.steps() == list(range(STEPS))
    for step in range(STEPS):
        store.load_parameters(step, model)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), hand["params"][step][name], rtol=0, atol=0)
        assert set(store.load_batch(step)) == {"x"}
    # the steps differ (each snapshot was taken before that step's update)
    assert not hand["params"][0]["fc1.weight"].equal(hand["params"][1]["fc1.weight"])

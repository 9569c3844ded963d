"""A repeated backward over a retained graph inside collect() is discarded with a warning.

compat.md §8: each orphan backward fire of a factorized layer warns once (per
fire, per layer); nothing is buffered, ``on_layer_backward`` is not called, no
step completes (counter, ``on_step_end`` and ``get_gradient()`` unchanged, no
error), and the next normal step records exactly (checked against
``torch.func`` per-sample gradients), also with capture-time projection.
"""

from __future__ import annotations

import re
import warnings

import torch
from reference import call, per_sample_param_grads
from torch import nn

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager

B = 3
PROJ_DIM, PROJ_SEED = 2, 5
ORPHAN = re.compile(r"^Discarding a backward fire on layer '(\w+)'")


class Scale(nn.Module):
    """Elementwise scale: not linear_io-capable, so the default config hooks it as param_grad."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.scale = Scale(4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.scale(self.fc1(x))))


class Recorder(HookManagerCallback):
    """Counts per-layer backward events and completed steps."""

    def __init__(self) -> None:
        self.backwards: list[str] = []
        self.steps: list[int] = []

    def on_layer_backward(self, name, grad_output, layer_type, module_kwargs) -> None:
        self.backwards.append(name)

    def on_step_end(self, record) -> None:
        self.steps.append(record.step)


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, generator=gen), torch.randn(B, 2, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum()


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch.func per-sample gradients; Linear layers as ``(B, out, in + 1)`` (bias last)."""

    def one(m, p, sample):
        return ((call(m, p, sample[0]) - sample[1]) ** 2).sum()

    ref = per_sample_param_grads(model, one, (x, y))
    out = {
        n: torch.cat([ref[f"{n}.weight"], ref[f"{n}.bias"][..., None]], -1) for n in ("fc1", "fc2")
    }
    out["scale.s"] = ref["scale.s"].sum(0)  # param_grad: the batch gradient
    return out


def _matrix(d_in: int, proj_dim: int, proj_seed: int) -> torch.Tensor:
    return torch.randn(d_in, proj_dim, generator=torch.Generator().manual_seed(proj_seed))


def _projector(features, feature_batch_size, proj_dim, proj_seed, device, **kwargs):
    """A projection factory (dattri protocol) whose matrix the test rebuilds with `_matrix`."""
    matrix = _matrix(features.shape[1], proj_dim, proj_seed)
    return lambda x: x @ matrix.to(x)


def _per_sample(factors) -> torch.Tensor:
    """``(B, out, in)`` per-sample outer products of captured (final) factors."""
    a = factors.activation.reshape(B, -1, factors.activation.shape[-1])
    g = factors.pre_activation_grad.reshape(B, -1, factors.pre_activation_grad.shape[-1])
    return torch.einsum("bto,bti->boi", g, a)


def _orphan_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """Layer names of the orphan-fire warnings, checking each message's content."""
    names = []
    for w in caught:
        match = ORPHAN.match(str(w.message))
        if match is None:
            continue
        text = str(w.message)
        assert issubclass(w.category, UserWarning)
        assert "no matching forward capture" in text
        assert "repeated backward over a retained graph" in text
        assert "not a normal forward+backward step" in text
        names.append(match.group(1))
    return names


def _run(config: HookManagerConfig | None) -> tuple[dict, torch.Tensor, torch.Tensor, Net]:
    """Step 1, two repeated backwards over its retained graph, step 2; returns observations."""
    torch.manual_seed(0)
    model = Net()
    recorder = Recorder()
    manager = HookManager(model, config=config, callbacks=[recorder])
    (x1, y1), (x2, y2) = _data(1), _data(2)
    seen: dict = {}
    with manager.collect():
        loss = _loss(model, x1, y1)
        loss.backward(retain_graph=True)
        first = manager.get_gradient()
        backwards_after_step1 = list(recorder.backwards)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss.backward(retain_graph=True)
            loss.backward()
        seen["orphans"] = _orphan_warnings(caught)
        seen["backwards_added"] = recorder.backwards[len(backwards_after_step1) :]
        seen["steps_after_repeat"] = (manager.steps_collected, list(recorder.steps))
        seen["same_gradient"] = manager.get_gradient() is first
        _loss(model, x2, y2).backward()
        seen["record2"] = manager.get_gradient()
        seen["steps_final"] = (manager.steps_collected, list(recorder.steps))
        seen["backwards_step1"] = backwards_after_step1
    return seen, x2, y2, model


def _check_discarded(seen: dict) -> None:
    assert sorted(seen["orphans"]) == ["fc1", "fc1", "fc2", "fc2"]  # once per fire, per layer
    assert seen["backwards_added"] == []  # on_layer_backward not called for orphan fires
    assert seen["steps_after_repeat"] == (1, [0])
    assert seen["same_gradient"]
    assert seen["steps_final"] == (2, [0, 1])
    assert sorted(seen["backwards_step1"]) == ["fc1", "fc2"]


def test_repeated_backward_is_discarded_and_next_step_is_exact():
    seen, x2, y2, model = _run(None)
    _check_discarded(seen)
    gradient = seen["record2"]
    ref = _reference(model, x2, y2)
    assert set(gradient.layer_names) == {"fc1", "fc2", "scale.s"}
    for name in ("fc1", "fc2"):
        f = gradient.data[name]
        a = torch.cat([f.activation, torch.ones(B, 1)], -1)  # bias column
        got = torch.einsum("bo,bi->boi", f.pre_activation_grad, a)
        torch.testing.assert_close(got, ref[name], rtol=1e-5, atol=1e-6)
    # the param_grad layer holds step 2's gradient only, nothing of the discarded passes
    torch.testing.assert_close(gradient.data["scale.s"], ref["scale.s"], rtol=1e-5, atol=1e-6)


def test_repeated_backward_is_discarded_on_the_projected_path():
    config = HookManagerConfig(
        projection_kwargs={"__default__": {"proj_dim": PROJ_DIM, "proj_seed": PROJ_SEED}},
        projector=_projector,
    )
    seen, x2, y2, model = _run(config)
    _check_discarded(seen)
    gradient = seen["record2"]
    ref = _reference(model, x2, y2)
    for name, layer in (("fc1", model.fc1), ("fc2", model.fc2)):
        assert gradient.data[name].module_kwargs is None  # final (projected) factors
        mg = _matrix(layer.out_features, PROJ_DIM, PROJ_SEED)
        ma = _matrix(layer.in_features + 1, PROJ_DIM, PROJ_SEED + 1)
        expected = mg.T @ ref[name] @ ma  # (B, k_g, k_a)
        torch.testing.assert_close(_per_sample(gradient.data[name]), expected, rtol=1e-5, atol=1e-5)


def test_repeated_backward_between_a_forward_and_its_backward_keeps_the_step():
    """Linear-only model: the orphan pass raises nothing and leaves step 2's forward pending."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    manager = HookManager(model)
    (x1, y1), (x2, y2) = _data(1), _data(2)
    with manager.collect():
        old = _loss(model, x1, y1)
        old.backward(retain_graph=True)
        new = _loss(model, x2, y2)  # step 2 forward, then the old graph again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old.backward()
        assert sorted(_orphan_warnings(caught)) == ["0", "2"]
        assert manager.steps_collected == 1
        new.backward()
        gradient = manager.get_gradient()
    assert manager.steps_collected == 2

    def one(m, p, sample):
        return ((call(m, p, sample[0]) - sample[1]) ** 2).sum()

    ref = per_sample_param_grads(model, one, (x2, y2))
    for name in ("0", "2"):
        f = gradient.data[name]
        torch.testing.assert_close(
            torch.einsum("bo,bi->boi", f.pre_activation_grad, f.activation),
            ref[f"{name}.weight"],
            rtol=1e-5,
            atol=1e-6,
        )

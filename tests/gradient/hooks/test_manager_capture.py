import warnings

import pytest
import torch
from capture_helpers import dense
from reference import call, per_sample_param_grads
from torch import nn

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.hooks import register_linear_param_hooks, register_param_grad_hooks
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.utils.hashing import hash_batch

B, T = 4, 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.norm = nn.LayerNorm(6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return MLP().to(dtype)


def batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(B, T, 5, generator=gen).to(dtype), torch.randn(B, T, 2, generator=gen).to(
        dtype
    )


def loss_fn(out, y, reduction):
    sq = (out - y) ** 2
    return sq.sum() if reduction == "sum" else sq.mean()


def reference(model, x, y, reduction):
    """torch.func per-sample shares of the batch loss, flattened per layer (materialize layout)."""
    scale = 1.0 if reduction == "sum" else 1.0 / y.numel()

    def one(m, p, s):
        return ((call(m, p, s[0]) - s[1]) ** 2).sum() * scale

    ref = per_sample_param_grads(model, one, (x, y))
    fc = {
        n: torch.cat([ref[f"{n}.weight"], ref[f"{n}.bias"][..., None]], -1).reshape(B, -1)
        for n in ("fc1", "fc2")
    }
    fc["norm"] = torch.cat([ref["norm.weight"], ref["norm.bias"]], -1)
    return fc


def capture_step(model, x, y, reduction="sum", **kwargs):
    cb = CaptureCallback()
    manager = HookManager(model, callbacks=[cb], **kwargs)
    with manager.collect():
        loss_fn(model(x), y, reduction).backward()
    return cb.record, manager


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_mlp_loop_matches_torch_func(dtype, rtol, reduction):
    model = mlp(dtype)
    x, y = batch(dtype)
    ref = reference(model, x, y, reduction)
    record, manager = capture_step(model, x, y, reduction)
    gradient = record.gradient
    assert set(gradient.layer_names) == {"fc1", "norm", "fc2"}
    assert gradient.representation["fc1"] == "factorized"
    assert gradient.indexing["fc1"] == "batch_token"
    assert gradient.layer_types == {"fc1": "nn.Linear", "norm": "nn.LayerNorm", "fc2": "nn.Linear"}
    for name, expected in ref.items():
        torch.testing.assert_close(dense(gradient, name), expected, rtol=rtol, atol=rtol * 1e-2)
    assert record.step == 0 and manager.steps_collected == 1
    assert record.input_hash == hash_batch({"_arg0": x}, B)
    assert manager.get_gradient() is gradient
    # the captured shares sum to the batch gradient autograd wrote
    weight_grad = dense(gradient, "fc2").sum(0).reshape(2, 7)[:, :6]
    torch.testing.assert_close(weight_grad, model.fc2.weight.grad, rtol=rtol, atol=rtol * 1e-2)


def test_mlp_bf16_loose():
    model = mlp()
    x, y = batch()
    ref = reference(model, x, y, "sum")
    record, _ = capture_step(mlp(torch.bfloat16), *batch(torch.bfloat16))
    for name, expected in ref.items():
        got = dense(record.gradient, name).float()
        assert got.dtype == torch.float32 and record.gradient.dtype == torch.bfloat16
        # bf16 forward/backward: relative Frobenius error below 5e-2
        assert (got - expected).norm() / expected.norm() < 5e-2


@pytest.mark.parametrize("style", ["materialized", "auto"])
def test_capture_styles_equal_factorized(style):
    x, y = batch()
    raw, _ = capture_step(mlp(), x, y)
    record, _ = capture_step(mlp(), x, y, config=HookManagerConfig(capture_style=style))
    gradient = record.gradient
    for name in ("fc1", "norm", "fc2"):
        if style == "materialized":
            assert gradient.representation[name] == "materialized"
            assert gradient.indexing[name] == "batch"
        torch.testing.assert_close(dense(gradient, name), dense(raw.gradient, name))


def test_logra_capture_matches_post_hoc_projection():
    proj = {"__default__": {"proj_dim": 3, "proj_seed": 7}}
    x, y = batch()
    raw, _ = capture_step(mlp(), x, y, config=HookManagerConfig(linear_io=["fc"]))
    cfg = HookManagerConfig(linear_io=["fc"], projection_kwargs=proj)
    record, manager = capture_step(mlp(), x, y, config=cfg)
    post = raw.gradient.project(manager._projector, proj)
    for name in ("fc1", "fc2"):
        f = record.gradient.data[name]
        assert record.gradient.layer_types[name] == "nn.Linear" and f.module_kwargs is None
        assert f.activation.shape == (B, T, 3) and f.pre_activation_grad.shape == (B, T, 3)
        torch.testing.assert_close(dense(record.gradient, name), dense(post, name))


def test_dense_projection_at_capture_is_materialized():
    proj = {"norm": {"proj_dim": 4, "style": "mask"}}
    x, y = batch()
    raw, _ = capture_step(mlp(), x, y)
    cfg = HookManagerConfig(linear_io=["norm"], projection_kwargs=proj)
    record, manager = capture_step(mlp(), x, y, config=cfg)
    got = record.gradient.data["norm"]
    assert record.gradient.representation["norm"] == "materialized" and got.shape == (B, 4)
    post = raw.gradient.select_layers(["norm"]).project(manager._projector, proj)
    torch.testing.assert_close(got, post.data["norm"])


def test_param_grad_family_records_batch_gradient():
    model = mlp()
    x, y = batch()
    cfg = HookManagerConfig(linear_io=["fc1"], param_grad=["fc2"])
    record, manager = capture_step(model, x, y, config=cfg)
    assert manager.param_layer_names == ["fc2"]
    assert record.gradient.layer_types["fc2.weight"] == "param_grad_layers"
    torch.testing.assert_close(record.gradient.data["fc2.weight"], model.fc2.weight.grad)
    torch.testing.assert_close(record.gradient.data["fc2.bias"], model.fc2.bias.grad)


def test_no_grad_forward_ignored_and_gradient_released():
    model = mlp()
    x, y = batch()
    cb = CaptureCallback()
    manager = HookManager(model, callbacks=[cb])
    with pytest.raises(RuntimeError, match="No gradient available"):
        manager.get_gradient()
    with manager.collect():
        loss_fn(model(x), y, "sum").backward()
        with torch.no_grad():
            model(x)
        assert manager.get_gradient() is cb.record.gradient
        model(x)  # a grad-enabled forward releases it
        with pytest.raises(RuntimeError):
            manager.get_gradient()
    assert manager.steps_collected == 1


def test_backward_outside_collect_is_not_captured():
    model = mlp()
    x, y = batch()
    record, manager = capture_step(model, x, y)
    loss_fn(model(x), y, "sum").backward()
    assert manager.steps_collected == 1


def test_repeated_invocations_become_virtual_layers():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    x = torch.randn(B, 3)
    manager = HookManager(lin)
    with manager.collect():
        lin(torch.tanh(lin(x))).sum().backward()
    gradient = manager.get_gradient()
    assert set(gradient.layer_names) == {"", "@2"}
    # each use site against the per-sample gradient of that site alone (the other site frozen)
    h = torch.tanh(lin(x)).detach()
    ones = torch.ones(B, 3)
    torch.testing.assert_close(gradient.data["@2"].activation, h)
    torch.testing.assert_close(gradient.data["@2"].pre_activation_grad, ones)
    torch.testing.assert_close(gradient.data[""].activation, x)
    g1 = (1 - h**2) * (ones @ lin.weight)
    torch.testing.assert_close(gradient.data[""].pre_activation_grad, g1)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.spare = nn.Parameter(torch.zeros(3))

    def forward(self, x, use_b):
        h = self.a(x)
        return self.b(h) if use_b else h


def test_skipped_layer_and_gradless_param_layer_do_not_stall_steps():
    model = Branchy()
    cfg = HookManagerConfig(linear_io=["a", "b"], hook_types={"": "param_grad"})
    cb = CaptureCallback()
    manager = HookManager(model, cfg, callbacks=[cb])
    seen = []
    with manager.collect():
        for step in range(4):
            model(torch.randn(B, 3), use_b=step % 2 == 1).sum().backward()
            seen.append(set(cb.record.gradient.layer_names))
    assert manager.steps_collected == 4
    assert seen == [{"a"}, {"a", "b"}, {"a"}, {"a", "b"}]


def test_gradient_accumulation_each_micro_batch_is_a_step():
    model = mlp()
    x, y = batch()
    steps = []

    class Collect(HookManagerCallback):
        def on_step_end(self, record):
            steps.append(record)

    manager = HookManager(model, callbacks=[Collect()])
    with manager.collect():
        for half in (slice(0, 2), slice(2, 4)):
            (loss_fn(model(x[half]), y[half], "sum") / 2).backward()
    assert [r.step for r in steps] == [0, 1]
    ref = reference(model, x, y, "sum")
    for record, half in zip(steps, (slice(0, 2), slice(2, 4))):
        assert record.input_hash == hash_batch({"_arg0": x[half]})
        for name, expected in ref.items():
            torch.testing.assert_close(dense(record.gradient, name), expected[half] / 2)


def test_validation_backward_inside_on_step_end_leaves_training_record_unchanged():
    model = mlp()
    x, y = batch()
    baseline, _ = capture_step(mlp(), x, y)
    records = []

    class Validate(HookManagerCallback):
        def on_register(self, manager):
            self.manager = manager
            self.val = None

        def on_step_end(self, record):
            records.append(record)
            if self.val is not None:
                return
            state = self.manager.save_state()
            self.manager.clear_state()
            with torch.enable_grad():
                self.val = True
                loss_fn(model(x[:2] * 2), y[:2], "sum").backward()
            self.manager.load_state(state)

    manager = HookManager(model, callbacks=[Validate()])
    with manager.collect():
        loss_fn(model(x), y, "sum").backward()
    train, val = records
    assert val.gradient.batch_size == 2 and train.gradient.batch_size == B
    assert manager.steps_collected == 1 and manager.get_gradient() is train.gradient
    assert train.input_hash == baseline.input_hash
    for name in ("fc1", "norm", "fc2"):
        torch.testing.assert_close(dense(train.gradient, name), dense(baseline.gradient, name))


def test_reset_steps_and_counter_not_reset_by_collect():
    model = mlp()
    x, y = batch()
    cb = CaptureCallback()
    manager = HookManager(model, callbacks=[cb])
    for _ in range(2):
        with manager.collect():
            loss_fn(model(x), y, "sum").backward()
    assert cb.record.step == 1
    manager.reset_steps(10)
    with manager.collect():
        loss_fn(model(x), y, "sum").backward()
    assert cb.record.step == 10 and manager.steps_collected == 11


def test_invasive_capture_equals_linear_io_and_leaves_weight_grad_none():
    x, y = batch()
    raw, _ = capture_step(mlp(), x, y)
    model = mlp().eval()
    cfg = HookManagerConfig(invasive_linear_io=["fc"], linear_io=["norm"])
    record, manager = capture_step(model, x, y, config=cfg)
    assert model.fc1.weight.grad is None and model.fc2.bias.grad is None
    assert model.norm.weight.grad is not None
    for name in ("fc1", "norm", "fc2"):
        torch.testing.assert_close(dense(record.gradient, name), dense(raw.gradient, name))
    manager.remove()
    assert "forward" not in vars(model.fc1)
    loss_fn(model(x), y, "sum").backward()
    assert model.fc1.weight.grad is not None


def test_invasive_in_training_mode_warns():
    manager = HookManager(mlp().train(), HookManagerConfig(invasive_linear_io=["fc1"]))
    with pytest.warns(UserWarning, match="optimizer step over them raises"), manager.collect():
        pass


def test_invasive_refuses_optimizer_step_while_collecting():
    model = mlp().eval()
    x, y = batch()
    manager = HookManager(model, HookManagerConfig(invasive_linear_io=["fc1"], linear_io=["fc2"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with manager.collect():
        loss_fn(model(x), y, "sum").backward()
        with pytest.raises(RuntimeError, match=r"SGD\.step\(\).*\['fc1'\].*'linear_io'"):
            opt.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, before[name], rtol=0, atol=0)
    opt.step()  # the guard ends with the collection
    assert not torch.equal(model.fc2.weight, before["fc2.weight"])
    model.fc2.load_state_dict({"weight": before["fc2.weight"], "bias": before["fc2.bias"]})
    # An optimizer without invasive parameters may step inside collect().
    fc2_opt = torch.optim.SGD(model.fc2.parameters(), lr=0.1)
    with manager.collect():
        loss_fn(model(x), y, "sum").backward()
        fc2_opt.step()
    assert not torch.equal(model.fc2.weight, before["fc2.weight"])


def test_invasive_allows_optimizer_step_outside_collect_and_frozen_probe():
    model = mlp().eval()
    x, y = batch()
    cb = CaptureCallback()
    manager = HookManager(model, HookManagerConfig(invasive_linear_io=["fc1"]), callbacks=[cb])
    with manager.collect():  # frozen probe: no optimizer involved
        loss_fn(model(x), y, "sum").backward()
    assert cb.record is not None and model.fc1.weight.grad is None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.fc1.weight.detach().clone()
    opt.zero_grad()
    loss_fn(model(x), y, "sum").backward()  # outside collect(): the original forward runs
    opt.step()
    assert model.fc1.weight.grad is not None
    assert not torch.equal(model.fc1.weight, before)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_a = nn.Linear(5, 2)
        self.head_b = nn.Linear(5, 2)

    def forward(self, x, use_a=True):
        return self.head_a(x) if use_a else self.head_b(x)


def test_backward_reaching_no_hooked_layer_raises():
    torch.manual_seed(0)
    model = TwoHeads()
    x, _ = batch()
    manager = HookManager(model, HookManagerConfig(linear_io=["head_a"]))
    with manager.collect():
        with pytest.raises(
            RuntimeError, match=r"reached none of the hooked layers \(\['head_a'\]\)"
        ):
            model(x, use_a=False).sum().backward()
        model(x).sum().backward()  # the manager recovers: the next step captures head_a
    assert set(manager.get_gradient().layer_names) == {"head_a"}
    assert manager.steps_collected == 1


def test_remove_is_idempotent_and_detaches():
    model = mlp()
    x, y = batch()
    record, manager = capture_step(model, x, y, config=HookManagerConfig(linear_io=["fc"]))
    manager.remove()
    manager.remove()
    assert not model._forward_hooks and not model.fc1._forward_hooks
    with pytest.raises(RuntimeError):
        manager.get_gradient()
    with manager.collect(deregister_on_exit=True):  # re-registers
        loss_fn(model(x), y, "sum").backward()
    assert not model.fc1._forward_hooks
    assert set(manager.get_gradient().layer_names) == {"fc1", "fc2"}


def test_context_end_and_layer_callbacks_order():
    events = []

    class Spy(HookManagerCallback):
        def on_layer_forward(self, name, activation, layer_type, kwargs):
            events.append(("f", name, layer_type))

        def on_layer_backward(self, name, grad, layer_type, kwargs):
            events.append(("b", name, tuple(grad.shape)))

        def on_step_end(self, record):
            assert not torch.is_grad_enabled()
            events.append(("step", record.step))

        def on_context_end(self):
            events.append(("end",))

    model = mlp()
    x, y = batch()
    manager = HookManager(model, HookManagerConfig(linear_io=["fc"]), callbacks=[Spy()])
    with manager.collect():
        loss_fn(model(x), y, "sum").backward()
    assert events == [
        ("f", "fc1", "nn.Linear"),
        ("f", "fc2", "nn.Linear"),
        ("b", "fc2", (B, T, 2)),
        ("b", "fc1", (B, T, 6)),
        ("step", 0),
        ("end",),
    ]


def test_no_hooked_layer_got_gradient_raises():
    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.offset = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return self.fc(x).detach() + self.offset

    model = Detached()
    manager = HookManager(model, HookManagerConfig(linear_io=["fc"]))
    with manager.collect(), pytest.raises(RuntimeError, match=r"\['fc'\] ran forward"):
        model(torch.randn(2, 3)).sum().backward()


def test_sample_id_key_and_hash_fields():
    model = mlp()
    x, y = batch()

    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, idx=None, note=None):
            return self.inner(x)

    keyed = Keyed()
    cb = CaptureCallback()
    manager = HookManager(keyed, callbacks=[cb], sample_id_key="idx")
    with manager.collect():
        loss_fn(keyed(x, idx=torch.tensor([5, 6, 7, 8])), y, "sum").backward()
        assert cb.record.input_hash == ["5", "6", "7", "8"] and cb.record.sample_id_key == "idx"
        with pytest.raises(KeyError, match="idx"):
            loss_fn(keyed(x), y, "sum").backward()
        with pytest.raises(ValueError, match="3 values"):
            loss_fn(keyed(x, idx=[1, 2, 3]), y, "sum").backward()
    manager.remove()
    manager = HookManager(keyed, callbacks=[cb], sample_hash_fields=["note"])
    with manager.collect():
        loss_fn(keyed(x, note=[1, 2, 3, 4]), y, "sum").backward()
        assert cb.record.input_hash == hash_batch({"note": [1, 2, 3, 4]}, B)
        with pytest.raises(KeyError, match="note"):
            loss_fn(keyed(x), y, "sum").backward()


def test_offload_to_cpu_and_non_batch_first():
    x, y = batch()
    raw, _ = capture_step(mlp(), x, y)
    with pytest.warns(UserWarning, match=r"non_batch_first_layers.*\['nope'\]"):
        record, _ = capture_step(
            mlp(),
            x.transpose(0, 1),
            y.transpose(0, 1),
            offload_to_cpu=True,
            non_batch_first_layers=["fc1", "norm", "fc2", "nope"],
        )
    assert record.gradient.data["fc1"].batch_first is False
    assert record.gradient.device == torch.device("cpu")
    for name in ("fc1", "norm", "fc2"):
        torch.testing.assert_close(dense(record.gradient, name), dense(raw.gradient, name))


def test_low_level_param_hooks():
    model = mlp()
    x, y = batch()
    seen = []
    buffers, handles = register_param_grad_hooks(model, ["fc2"], lambda *a: seen.append(a[:2]))
    n, post = register_linear_param_hooks(model, ["fc1"], lambda *a: seen.append(a[:2]))
    loss_fn(model(x), y, "sum").backward()
    assert n == 2 and sorted(buffers["fc2"]) == ["bias", "weight"]
    torch.testing.assert_close(buffers["fc2"]["weight"], model.fc2.weight.grad)
    assert sorted(seen) == [("fc1", "bias"), ("fc1", "weight"), ("fc2", "bias"), ("fc2", "weight")]
    from dattri_llm.gradient.hooks.hooks import remove_hooks

    remove_hooks(handles)
    remove_hooks(post)
    assert handles == [] and post == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model(x), y, "sum").backward()
    assert len(seen) == 4


@pytest.mark.parametrize("style", ["factorized", "materialized"])
def test_broadcast_layer_warns_in_every_capture_style(style):
    """A positional embedding called on ``arange(T)`` has batch 1: summed over the batch.

    The warning must not depend on the representation (a materialized capture is a
    dense ``(1, d)`` row); the record's row must equal the layer's ``.grad``.
    """

    class Positional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(9, 4), nn.Embedding(6, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (B, T)
            return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))[None]

    torch.manual_seed(0)
    model = Positional()
    ids, r = torch.randint(0, 9, (3, 5)), torch.randn(3, 5, 4)
    manager = HookManager(model, HookManagerConfig(linear_io=["tok", "pos"], capture_style=style))
    try:
        with pytest.warns(UserWarning, match="'pos' has batch size 1"), manager.collect():
            (model(ids) * r).sum().backward()
        gradient = manager.get_gradient()
    finally:
        manager.remove()
    torch.testing.assert_close(dense(gradient, "pos"), model.pos.weight.grad.reshape(1, -1))


def test_sequence_first_unbatched_positional_ids_are_one_broadcast_row():
    """A sequence-first layer called on unbatched ids ``(T,)`` (positional embedding).

    Its output ``(T, E)`` is broadcast over the batch, so only the batch-summed gradient
    exists: like the batch-first case it must become one broadcast row ``(T, 1)`` /
    ``(T, 1, E)``, equal to the layer's ``.grad``, not factors that fail validation.
    """

    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(9, 4), nn.Embedding(6, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (T, B)
            return self.tok(ids) + self.pos(torch.arange(ids.shape[0]))[:, None]

    torch.manual_seed(0)
    model = SeqFirst()
    ids, r = torch.randint(0, 9, (5, 3)), torch.randn(5, 3, 4)
    manager = HookManager(
        model, HookManagerConfig(linear_io=["tok", "pos"]), non_batch_first_layers=["tok", "pos"]
    )
    try:
        with pytest.warns(UserWarning, match="'pos' has batch size 1"), manager.collect():
            (model(ids) * r).sum().backward()
        gradient = manager.get_gradient()
    finally:
        manager.remove()
    pos = gradient.data["pos"]
    assert pos.batch_first is False and tuple(pos.activation.shape) == (5, 1)
    torch.testing.assert_close(dense(gradient, "pos"), model.pos.weight.grad.reshape(1, -1))
    ref = per_sample_param_grads(
        model.tok, lambda m, p, s: (call(m, p, s[0]) * s[1]).sum(), (ids.T, r.transpose(0, 1))
    )["weight"]
    torch.testing.assert_close(dense(gradient, "tok"), ref.reshape(3, -1), rtol=1e-5, atol=1e-6)

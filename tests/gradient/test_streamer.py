"""GradientStreamer: frozen probes and training trajectories against hand-written references."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import call, per_sample_param_grads
from torch import nn

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.ops.optimizer import precondition
from dattri_llm.gradient.stream.wrapping import fsdp_wrap_kwargs, unscale_gradient
from dattri_llm.gradient.streaming import GradientStreamer
from dattri_llm.utils.hashing import hash_sample

N_SAMPLES = 10
LAYERS = ("0", "2")


def make_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)


def make_data(dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 3, generator=gen, dtype=dtype)
    y = torch.randn(N_SAMPLES, 2, generator=gen, dtype=dtype)
    return [{"x": x[i], "y": y[i]} for i in range(N_SAMPLES)]


def sum_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def make_args(tmp_path, **kwargs) -> AttributionArguments:
    return AttributionArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def flat_reference(net: nn.Module, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-sample ``(B, out*(in+1))`` gradients of ``sum_loss`` in the materialize layout."""

    def loss_of_sample(module, params, sample):
        x, y = sample
        return ((call(module, params, x) - y) ** 2).sum()

    batch = (torch.stack([r["x"] for r in rows]), torch.stack([r["y"] for r in rows]))
    grads = per_sample_param_grads(net, loss_of_sample, batch)
    return {
        name: torch.cat([grads[f"{name}.weight"], grads[f"{name}.bias"][..., None]], -1).flatten(1)
        for name in LAYERS
    }


def materialized(block) -> dict[str, torch.Tensor]:
    return {name: value for name, value in block.materialize().data.items()}


def index_of(data: list[dict[str, torch.Tensor]]) -> dict[str, int]:
    """Identifier → dataset row; the net is called positionally, so the key is ``_arg0``."""
    return {hash_sample({"_arg0": row["x"]}): i for i, row in enumerate(data)}


# ------------------------------------------------------------------ frozen probe


@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"), [(torch.float32, 1e-5, 1e-6), (torch.float64, 1e-10, 1e-12)]
)
def test_probe_blocks_equal_per_sample_reference(tmp_path, dtype, rtol, atol):
    net, data = make_net(dtype), make_data(dtype)
    ref_net = copy.deepcopy(net)  # unhooked twin: the reference must not fire capture hooks
    streamer = GradientStreamer(
        net, data, make_args(tmp_path), batch_size=4, loss_fn=sum_loss, checkpoint_step=7
    )
    assert streamer.reusable and len(streamer) == 3
    rows = index_of(data)
    seen = []
    with streamer:
        for step, block, ids in streamer:
            assert step == 7
            order = [rows[i] for i in ids]
            seen += order
            expected = flat_reference(ref_net, [data[i] for i in order])
            got = materialized(block)
            assert set(got) == set(LAYERS)
            for name in LAYERS:
                torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol)
    assert seen == list(range(N_SAMPLES))  # dataset order, no shuffle


def test_probe_bf16_autocast_is_close_to_fp32_reference(tmp_path):
    net, data = make_net(), make_data()
    expected = flat_reference(net, data)
    streamer = GradientStreamer(
        net, data, make_args(tmp_path, bf16=True), batch_size=5, loss_fn=sum_loss
    )
    with streamer:
        raw = [block for _, block, _ in streamer]
    assert raw[0].data["2"].pre_activation_grad.dtype == torch.bfloat16  # autocast was on
    blocks = [materialized(block) for block in raw]
    for name in LAYERS:
        got = torch.cat([b[name] for b in blocks]).float()
        torch.testing.assert_close(got, expected[name], rtol=5e-2, atol=5e-2)


def test_probe_reiterates_identically_and_restores_state(tmp_path):
    net, data = make_net(), make_data()
    net.train()
    net[1].eval()  # a mixed mode pattern that must come back as it was
    pre_grads = [torch.full_like(p, 3.0) for p in net.parameters()]
    for p, g in zip(net.parameters(), pre_grads):
        p.grad = g.clone()
    modes_seen = []

    def loss_recording_mode(model, batch):
        modes_seen.append(model.training)
        torch.rand(1)  # consume global RNG inside the pass
        return sum_loss(model, batch)

    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    streamer = GradientStreamer(
        net, data, make_args(tmp_path), batch_size=3, loss_fn=loss_recording_mode
    )
    with streamer:
        torch.set_rng_state(rng_before)
        first = [(s, materialized(b), ids) for s, b, ids in streamer]
        assert torch.equal(torch.get_rng_state(), rng_before)
        second = [(s, materialized(b), ids) for s, b, ids in streamer]
    assert modes_seen and not any(modes_seen)  # eval() during the pass
    assert net.training and net[0].training and not net[1].training
    for p, g in zip(net.parameters(), pre_grads):
        assert torch.equal(p.grad, g)
    assert len(first) == len(second) == 4
    for (s1, b1, i1), (s2, b2, i2) in zip(first, second):
        assert s1 == s2 == 0 and i1 == i2
        for name in LAYERS:
            assert torch.equal(b1[name], b2[name])


def test_probe_restores_state_when_the_pass_is_abandoned(tmp_path):
    net, data = make_net(), make_data()
    net.train()
    streamer = GradientStreamer(net, data, make_args(tmp_path), batch_size=3, loss_fn=sum_loss)
    with streamer:
        iterator = iter(streamer)
        next(iterator)
        iterator.close()
    assert net.training
    assert all(p.grad is None for p in net.parameters())


def attach_low_precision_views(net: nn.Module) -> torch.Tensor:
    """Give ``net``'s fp32 parameters bf16 ``.grad`` views of one flat buffer, as FSDP does.

    FSDP ``keep_low_precision_grads`` sets them through ``.data`` of a placeholder
    (a plain ``.grad =`` refuses the dtype). Returns the buffer.
    """
    params = list(net.parameters())
    buffer = torch.randn(sum(p.numel() for p in params) + 3, dtype=torch.bfloat16)
    offset = 0
    for p in params:
        p.grad = torch.empty_like(p)
        p.grad.data = buffer[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    return buffer


class QueryLossError(Exception):
    pass


def test_probe_hands_back_low_precision_gradients_when_the_query_loss_raises(tmp_path):
    net, data = make_net(), make_data()
    net.train()
    buffer = attach_low_precision_views(net)
    expected = buffer.clone()
    pointers = [p.grad.data_ptr() for p in net.parameters()]

    def failing_loss(model, batch):
        raise QueryLossError("query loss failed")

    streamer = GradientStreamer(net, data, make_args(tmp_path), batch_size=3, loss_fn=failing_loss)
    with streamer, pytest.raises(QueryLossError, match="query loss failed"):
        list(streamer)
    assert net.training
    assert torch.equal(buffer, expected)
    for p, pointer in zip(net.parameters(), pointers):
        assert p.grad.dtype == torch.bfloat16 and p.grad.shape == p.shape
        assert p.grad.data_ptr() == pointer  # still a view of the wrapper's buffer


def test_gradient_stash_restores_storage_dtype_and_values():
    from dattri_llm.gradient.stream.training import restore_gradients, stash_gradients

    viewed, standalone = make_net(), make_net()
    buffer = attach_low_precision_views(viewed)
    expected = buffer.clone()
    pointers = [p.grad.data_ptr() for p in viewed.parameters()]
    own = [torch.randn_like(p) for p in standalone.parameters()]
    for p, g in zip(standalone.parameters(), own):
        p.grad = g
    params = [*viewed.parameters(), *standalone.parameters()]
    stash = stash_gradients(params)
    # The views stay attached, zeroed in place; the standalone gradients are taken off.
    assert all(p.grad is not None and not p.grad.any() for p in viewed.parameters())
    assert torch.equal(buffer[-3:], expected[-3:])  # bytes outside every view untouched
    assert all(p.grad is None for p in standalone.parameters())
    buffer.fill_(7.0)  # the probe's backward rewrites the wrapper's buffer ...
    next(viewed.parameters()).grad = None  # ... and one gradient is dropped altogether
    restore_gradients(stash)
    assert torch.equal(buffer[:-3], expected[:-3])
    for p, pointer in zip(viewed.parameters(), pointers):
        assert p.grad.dtype == torch.bfloat16 and p.grad.shape == p.shape
        assert p.grad.data_ptr() == pointer
    assert all(p.grad is g for p, g in zip(standalone.parameters(), own))


def test_gradient_stash_sets_a_sparse_gradient_aside():
    from dattri_llm.gradient.stream.training import restore_gradients, stash_gradients

    embedding = nn.Embedding(5, 2, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    grad = embedding.weight.grad
    assert grad.layout == torch.sparse_coo
    stash = stash_gradients([embedding.weight])
    assert embedding.weight.grad is None
    restore_gradients(stash)
    assert embedding.weight.grad is grad


# -------------------------------------------------------------------- trajectory


def linear_schedule(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def reference_trajectory(net, data, order, *, batch_size, accumulation, args):
    """Hand-written HF-Trainer-style loop over batches in ``order``: loss/N, clip, AdamW, LR."""
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 and not n.endswith(".bias")]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2 or n.endswith(".bias")]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    windows = -(-len(batches) // accumulation)
    lrs, update = {}, 0
    for index, rows in enumerate(batches):
        if index % accumulation == 0:
            opt.zero_grad(set_to_none=True)
        lr = args.learning_rate * linear_schedule(update, args.warmup_steps, windows)
        lrs[index] = lr
        batch = {k: torch.stack([data[i][k] for i in rows]) for k in ("x", "y")}
        (sum_loss(net, batch) / accumulation).backward()
        if (index + 1) % accumulation == 0 or index == len(batches) - 1:
            nn.utils.clip_grad_norm_(list(net.parameters()), args.max_grad_norm)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            update += 1
    return lrs


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_trajectory_matches_hand_written_loop(tmp_path, optim):
    net, data = make_net(), make_data()
    ref_net, initial = copy.deepcopy(net), copy.deepcopy(net)
    args = make_args(
        tmp_path,
        learning_rate=0.05,
        weight_decay=0.1,
        warmup_steps=1,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        optim=optim,
        data_seed=5,
    )
    streamer = GradientStreamer(net, data, args, batch_size=2, loss_fn=sum_loss, enable_update=True)
    assert not streamer.reusable and len(streamer) == 5
    rows = index_of(data)
    steps, order, first_block = [], [], None
    with streamer:
        for step, block, ids in streamer:
            steps.append(step)
            order += [rows[i] for i in ids]
            if first_block is None:
                first_block = materialized(block)
    assert steps == [0, 1, 2, 3, 4]
    assert sorted(order) == list(range(N_SAMPLES)) and order != list(range(N_SAMPLES))
    # The first block is taken at the initial parameters, with the loss divided by N=2.
    expected = flat_reference(initial, [data[i] for i in order[:2]])
    for name in LAYERS:
        torch.testing.assert_close(first_block[name], expected[name] / 2, rtol=1e-5, atol=1e-6)

    if optim == "sgd":
        ref_lrs = reference_trajectory_sgd(ref_net, data, order, args=args)
    else:
        ref_lrs = reference_trajectory(
            ref_net, data, order, batch_size=2, accumulation=2, args=args
        )
    for p, q in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert streamer.learning_rates.keys() == ref_lrs.keys()
    for k, lr in ref_lrs.items():
        assert streamer.learning_rates[k] == pytest.approx(lr, rel=1e-12, abs=1e-15)


def reference_trajectory_sgd(net, data, order, *, args):
    """Plain SGD with L2 decay, loss/2, clipping and the linear LR, batch 2, accumulation 2."""
    batches = [order[i : i + 2] for i in range(0, len(order), 2)]
    windows = -(-len(batches) // 2)
    lrs, update = {}, 0
    for index, rows in enumerate(batches):
        if index % 2 == 0:
            for p in net.parameters():
                p.grad = None
        lr = args.learning_rate * linear_schedule(update, args.warmup_steps, windows)
        lrs[index] = lr
        batch = {k: torch.stack([data[i][k] for i in rows]) for k in ("x", "y")}
        (sum_loss(net, batch) / 2).backward()
        if index % 2 == 1 or index == len(batches) - 1:
            nn.utils.clip_grad_norm_(list(net.parameters()), args.max_grad_norm)
            with torch.no_grad():  # SGD's L2 decay, only on matrices (not biases)
                for p in net.parameters():
                    decay = args.weight_decay if p.ndim >= 2 else 0.0
                    p -= lr * (p.grad + decay * p)
            update += 1
    return lrs


def trajectory_order(tmp_path, data_seed):
    net, data = make_net(), make_data()
    args = make_args(tmp_path, data_seed=data_seed)
    rows = index_of(data)
    streamer = GradientStreamer(net, data, args, batch_size=3, loss_fn=sum_loss, enable_update=True)
    with streamer:
        return [rows[i] for _, _, ids in streamer for i in ids]


def test_trajectory_shuffle_is_seeded_by_data_seed(tmp_path):
    assert trajectory_order(tmp_path, 3) == trajectory_order(tmp_path, 3)
    assert trajectory_order(tmp_path, 3) != trajectory_order(tmp_path, 4)


def test_trajectory_iterates_once(tmp_path):
    net, data = make_net(), make_data()
    streamer = GradientStreamer(
        net, data, make_args(tmp_path), batch_size=4, loss_fn=sum_loss, enable_update=True
    )
    with streamer:
        list(streamer)
        with pytest.raises(RuntimeError, match="only once"):
            iter(streamer)


def test_defer_update_yields_before_the_update(tmp_path):
    net, data = make_net(), make_data()
    args = make_args(tmp_path, learning_rate=0.1, optim="sgd")
    streamer = GradientStreamer(
        net, data, args, batch_size=4, loss_fn=sum_loss, enable_update=True, defer_update=True
    )
    with streamer:
        iterator = iter(streamer)
        before = [p.detach().clone() for p in net.parameters()]
        next(iterator)
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
        assert all(p.grad is not None for p in net.parameters())
        next(iterator)  # the pending update is applied on this request
        moved = [p.detach().clone() for p in net.parameters()]
        assert not all(torch.equal(p, b) for p, b in zip(moved, before))
    # exiting applies the update deferred for the second block
    assert not all(torch.equal(p, m) for p, m in zip(net.parameters(), moved))


def test_deferred_trajectory_ends_where_the_eager_one_does(tmp_path):
    finals = []
    for defer in (False, True):
        net, data = make_net(), make_data()
        args = make_args(tmp_path, learning_rate=0.1)
        streamer = GradientStreamer(
            net,
            data,
            args,
            batch_size=3,
            loss_fn=sum_loss,
            enable_update=True,
            defer_update=defer,
        )
        with streamer:
            list(streamer)
        finals.append([p.detach().clone() for p in net.parameters()])
    for p, q in zip(*finals):
        assert torch.equal(p, q)


def test_shared_probe_inside_a_trajectory_keeps_its_gradients(tmp_path):
    net, data = make_net(), make_data()
    ref_net = copy.deepcopy(net)
    args = make_args(tmp_path, gradient_accumulation_steps=2, optim="sgd")
    train = GradientStreamer(net, data, args, batch_size=5, loss_fn=sum_loss, enable_update=True)
    probe = GradientStreamer(
        net, data[:4], args, batch_size=4, loss_fn=sum_loss, hook_manager=train.hook_manager
    )
    with train, probe:
        iterator = iter(train)
        _, _, ids = next(iterator)  # first micro-batch: gradients accumulated, no update yet
        grads = [p.grad.clone() for p in net.parameters()]
        ((_, block, probe_ids),) = list(probe)
        assert len(probe_ids) == 4
        ref_net.load_state_dict(net.state_dict())
        expected = flat_reference(ref_net, data[:4])
        for name in LAYERS:
            torch.testing.assert_close(materialized(block)[name], expected[name])
        assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))
        assert net.training
        list(iterator)


# ------------------------------------------------------------------ lifecycle and errors


def test_iterating_without_entering_raises(tmp_path):
    streamer = GradientStreamer(
        make_net(), make_data(), make_args(tmp_path), batch_size=4, loss_fn=sum_loss
    )
    with pytest.raises(RuntimeError, match="entered"):
        iter(streamer)


def test_reentering_an_active_streamer_raises(tmp_path):
    streamer = GradientStreamer(
        make_net(), make_data(), make_args(tmp_path), batch_size=4, loss_fn=sum_loss
    )
    with streamer:
        with pytest.raises(RuntimeError, match="already active"):
            streamer.__enter__()


def test_exit_removes_owned_hooks(tmp_path):
    class Counter(HookManagerCallback):
        calls = 0

        def on_layer_forward(self, *args):
            Counter.calls += 1

    net = make_net()
    streamer = GradientStreamer(
        net, make_data(), make_args(tmp_path), batch_size=4, loss_fn=sum_loss
    )
    streamer.hook_manager.add_callback(Counter())
    with streamer:
        list(streamer)
    calls = Counter.calls
    assert calls > 0
    net(torch.randn(2, 3)).sum().backward()
    assert Counter.calls == calls


def test_optimizer_property(tmp_path):
    net, data, args = make_net(), make_data(), make_args(tmp_path, weight_decay=0.3)
    probe = GradientStreamer(net, data, args, batch_size=4, loss_fn=sum_loss)
    with pytest.raises(RuntimeError, match="no optimizer"):
        _ = probe.optimizer
    assert probe.learning_rates == {}
    train = GradientStreamer(net, data, args, batch_size=4, loss_fn=sum_loss, enable_update=True)
    groups = train.optimizer.param_groups
    assert isinstance(train.optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert [len(g["params"]) for g in groups] == [2, 2]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": 2, "precondition": True}, ValueError, "needs optimizer="),
        ({"batch_size": 2, "snapshots": "snaps"}, ValueError, "enable_update"),
    ],
)
def test_invalid_options(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientStreamer(make_net(), make_data(), make_args(tmp_path), loss_fn=sum_loss, **kwargs)


def test_unknown_optim_raises(tmp_path):
    streamer = GradientStreamer(
        make_net(),
        make_data(),
        make_args(tmp_path, optim="adafactor"),
        batch_size=2,
        loss_fn=sum_loss,
        enable_update=True,
    )
    with pytest.raises(ValueError, match="adafactor"):
        _ = streamer.optimizer


def test_deepspeed_is_not_implemented(tmp_path):
    with pytest.raises(NotImplementedError, match="DeepSpeed"):
        GradientStreamer(
            make_net(),
            make_data(),
            make_args(tmp_path, deepspeed={"a": 1}),
            batch_size=2,
            loss_fn=sum_loss,
        )


def test_shared_manager_without_capture_callback_raises(tmp_path):
    net = make_net()
    manager = HookManager(net, config=HookManagerConfig(linear_io=REGISTER_ALL))
    with pytest.raises(ValueError, match="CaptureCallback"):
        GradientStreamer(
            net,
            make_data(),
            make_args(tmp_path),
            batch_size=2,
            loss_fn=sum_loss,
            hook_manager=manager,
        )
    manager.remove()


def run_once(tmp_path, loss_fn, data=None):
    streamer = GradientStreamer(
        make_net(), data or make_data(), make_args(tmp_path), batch_size=4, loss_fn=loss_fn
    )
    with streamer:
        list(streamer)


def test_non_scalar_loss_names_the_batch(tmp_path):
    def per_sample(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum(1)

    with pytest.raises(ValueError, match=r"\(4,\) for training batch 0") as error:
        run_once(tmp_path, per_sample)
    message = str(error.value)
    assert ".sum()" in message and "B times smaller" in message
    assert "or .mean()" not in message  # the mean is not an equivalent reduction


def test_loss_errors_name_a_query_batch(tmp_path):
    def nan_on_second(model, batch):
        loss = sum_loss(model, batch)
        return loss * float("nan") if batch["x"][0, 0] == make_data()[4]["x"][0] else loss

    streamer = GradientStreamer(
        make_net(), make_data(), make_args(tmp_path), batch_size=4, loss_fn=nan_on_second
    )
    streamer.role = "query"
    with streamer, pytest.raises(ValueError, match="non-finite.*for query batch 1"):
        list(streamer)


def _nonscalar(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(1)


@pytest.mark.parametrize(
    ("train_loss", "query_loss", "expected"),
    [(_nonscalar, sum_loss, "training batch 0"), (sum_loss, _nonscalar, "query batch 0")],
)
def test_attributor_loss_error_says_training_or_query(tmp_path, train_loss, query_loss, expected):
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.task import AttributionTask

    args = make_args(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=4)
    task = AttributionTask(train_loss, make_net(), target_func=query_loss)
    with pytest.raises(ValueError, match=rf"\(4,\) for {expected};"):
        TracInAttributor(args, task=task).attribute(make_data(), make_data()[:4])


def test_non_finite_loss_names_the_batch(tmp_path):
    def nan_on_second(model, batch):
        loss = sum_loss(model, batch)
        return loss * float("nan") if batch["x"][0, 0] == make_data()[4]["x"][0] else loss

    with pytest.raises(ValueError, match="non-finite.*batch 1"):
        run_once(tmp_path, nan_on_second)


def test_default_loss_needs_dict_batch(tmp_path):
    # Dict samples (the accepted kind) that a collate turns into a tuple batch.
    streamer = GradientStreamer(
        make_net(),
        make_data(),
        make_args(tmp_path),
        batch_size=4,
        collate_fn=lambda rows: (torch.stack([r["x"] for r in rows]),),
    )
    with streamer, pytest.raises(TypeError, match="dict batch"):
        list(streamer)


def test_batch_without_record_raises(tmp_path):
    def no_forward(model, batch):
        return sum(p.sum() for p in model.parameters())

    with pytest.raises(RuntimeError, match="no gradient record"):
        run_once(tmp_path, no_forward)


def test_two_steps_per_batch_is_a_step_desync(tmp_path):
    def double_step(model, batch):
        sum_loss(model, batch).backward()
        return sum_loss(model, batch)

    with pytest.raises(RuntimeError, match="step desync"):
        run_once(tmp_path, double_step)


def test_unscale_gradient_divides_output_gradients_and_dense_layers(tmp_path):
    net, data = make_net(), make_data()
    streamer = GradientStreamer(net, data, make_args(tmp_path), batch_size=4, loss_fn=sum_loss)
    with streamer:
        _, block, _ = next(iter(streamer))
    dense = block.materialize()
    halved = unscale_gradient(block, 2.0).materialize()
    for name in LAYERS:
        torch.testing.assert_close(halved.data[name], dense.data[name] / 2)
        torch.testing.assert_close(unscale_gradient(dense, 4.0).data[name], dense.data[name] / 4)


# ------------------------------------------------------------------------ distributed


def _ddp_probe_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        net, data = make_net(), make_data()
        streamer = GradientStreamer(net, data, make_args(out_dir), batch_size=2, loss_fn=sum_loss)
        assert isinstance(streamer.forward_model, nn.parallel.DistributedDataParallel)
        with streamer:
            blocks = [(ids, materialized(block)) for _, block, ids in streamer]
        torch.save(blocks, f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_probe_shards_the_dataset_and_matches_the_reference(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_ddp_probe_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    data = make_data()
    rows, expected = index_of(data), flat_reference(make_net(), data)
    seen = []
    for rank in range(2):
        for ids, block in torch.load(tmp_path / f"rank{rank}.pt"):
            order = [rows[i] for i in ids]
            seen += order
            for name in LAYERS:
                torch.testing.assert_close(block[name], expected[name][order])
    assert sorted(seen) == list(range(N_SAMPLES))  # each sample on exactly one rank


# ------------------------------------------------------------------------------ FSDP


def fsdp_kwargs(tmp_path, net=None, **arg_kwargs):
    return fsdp_wrap_kwargs(net or make_net(), make_args(tmp_path, **arg_kwargs))


@pytest.mark.parametrize(
    ("fsdp", "strategy", "offload"),
    [
        ("full_shard", "FULL_SHARD", False),
        ("shard_grad_op", "SHARD_GRAD_OP", False),
        ("shard_grad_op offload", "SHARD_GRAD_OP", True),
        ("offload", "FULL_SHARD", True),
    ],
)
def test_fsdp_tokens_become_wrapper_arguments(tmp_path, monkeypatch, fsdp, strategy, offload):
    monkeypatch.setattr(AttributionArguments, "device", property(lambda self: torch.device("cuda")))
    kwargs = fsdp_kwargs(tmp_path, fsdp=fsdp)
    assert kwargs["use_orig_params"] is True
    assert kwargs["sharding_strategy"].name == strategy
    assert kwargs["auto_wrap_policy"] is None  # no fsdp_config: only the root is wrapped
    assert ("cpu_offload" in kwargs) == offload
    if offload:
        assert kwargs["cpu_offload"].offload_params is True


def test_fsdp_offload_is_ignored_on_cpu(tmp_path):
    with pytest.warns(UserWarning, match="'offload' has no effect on a CPU device"):
        kwargs = fsdp_kwargs(tmp_path, fsdp="full_shard offload")
    assert "cpu_offload" not in kwargs


def wraps(policy, module: nn.Module, unwrapped_numel: int = 0) -> bool:
    return policy(module=module, recurse=False, nonwrapped_numel=unwrapped_numel)


def test_fsdp_layer_class_policy_wraps_exactly_those_classes(tmp_path):
    net = make_net()
    for names in (["Linear"], "Linear"):
        config = {"transformer_layer_cls_to_wrap": names}
        policy = fsdp_kwargs(tmp_path, net, fsdp="full_shard", fsdp_config=config)[
            "auto_wrap_policy"
        ]
        assert wraps(policy, net[0]) and wraps(policy, net[2])
        assert not wraps(policy, net[1]) and not wraps(policy, net)


def test_fsdp_size_policy_wraps_modules_over_the_threshold(tmp_path):
    # HF-style ``fsdp_`` prefixed key; Linear(3, 4) holds 16 parameters, Linear(4, 2) 10.
    config = {"fsdp_min_num_params": 12}
    policy = fsdp_kwargs(tmp_path, fsdp="full_shard", fsdp_config=config)["auto_wrap_policy"]
    net = make_net()
    assert wraps(policy, net[0], unwrapped_numel=16)
    assert not wraps(policy, net[2], unwrapped_numel=10)


def test_build_auto_wrap_policy_contract():
    # The name user code imports from streaming.py: pops its keys, both → error, an explicit
    # policy or neither key → None.
    from dattri_llm.gradient.streaming import _build_auto_wrap_policy

    net = make_net()
    config = {"transformer_layer_cls_to_wrap": "Linear", "sync_module_states": True}
    policy = _build_auto_wrap_policy(net, config)
    assert wraps(policy, net[0]) and not wraps(policy, net[1])
    assert config == {"sync_module_states": True}
    config = {"min_num_params": 12}
    assert wraps(_build_auto_wrap_policy(net, config), net[0], unwrapped_numel=16)
    assert config == {}
    assert _build_auto_wrap_policy(net, {}) is None
    explicit = {"auto_wrap_policy": object(), "min_num_params": 12}
    assert _build_auto_wrap_policy(net, explicit) is None and "min_num_params" not in explicit
    both = {"transformer_layer_cls_to_wrap": ["Linear"], "min_num_params": 5}
    with pytest.raises(ValueError, match="set one of them, not both"):
        _build_auto_wrap_policy(net, both)
    with pytest.raises(ValueError, match="GPT2Block"):
        _build_auto_wrap_policy(net, {"transformer_layer_cls_to_wrap": ["GPT2Block"]})


class NoSplit(nn.Sequential):
    """A model declaring Hugging Face style ``_no_split_modules``."""

    _no_split_modules = ["Linear", "NotInThisModel"]


def test_fsdp_auto_wrap_token_wraps_no_split_modules(tmp_path):
    net = NoSplit(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    policy = fsdp_kwargs(tmp_path, net, fsdp="full_shard auto_wrap")["auto_wrap_policy"]
    assert wraps(policy, net[0]) and not wraps(policy, net[1])
    with pytest.raises(ValueError, match="_no_split_modules.*transformer_layer_cls_to_wrap"):
        fsdp_kwargs(tmp_path, make_net(), fsdp="auto_wrap")


@pytest.mark.parametrize(
    ("arg_kwargs", "error", "match"),
    [
        (
            {"fsdp_config": {"transformer_layer_cls_to_wrap": ["Linear"], "min_num_params": 5}},
            ValueError,
            "both transformer_layer_cls_to_wrap and min_num_params",
        ),
        (
            {"fsdp_config": {"transformer_layer_cls_to_wrap": ["Linear", "GPT2Block"]}},
            ValueError,
            r"\['GPT2Block'\].*classes present: \['Linear', 'Sequential', 'Tanh'\]",
        ),
        ({"fsdp_config": {"min_num_params": 0}}, ValueError, "min_num_params must be a positive"),
        ({"fsdp_config": {"min_num_params": "9"}}, ValueError, "min_num_params must be a positive"),
        ({"fsdp_config": "not-a-file"}, TypeError, "fsdp_config must be a dict"),
        ({"fsdp": "full_shard shard_grad_op"}, ValueError, "two sharding strategies"),
    ],
)
def test_bad_fsdp_options_raise_before_wrapping(tmp_path, arg_kwargs, error, match):
    arg_kwargs = {"fsdp": "full_shard", **arg_kwargs}
    net = make_net()
    with pytest.raises(error, match=match):
        GradientStreamer(net, make_data(), make_args(tmp_path, **arg_kwargs), batch_size=2)
    assert all(not m._forward_hooks for m in net.modules())  # the failed build left no hooks


def test_fsdp_config_ignored_keys_warn(tmp_path):
    config = {"min_num_params": 12, "backward_prefetch": "backward_pre"}
    with pytest.warns(UserWarning, match=r"ignores fsdp_config keys \['backward_prefetch'\]"):
        fsdp_kwargs(tmp_path, fsdp="full_shard", fsdp_config=config)


def test_fsdp_in_a_single_process_runs_unwrapped_with_a_warning(tmp_path):
    net = make_net()
    with pytest.warns(UserWarning, match="single process.*unwrapped"):
        streamer = GradientStreamer(
            net, make_data(), make_args(tmp_path, fsdp="full_shard"), batch_size=4, loss_fn=sum_loss
        )
    assert streamer.forward_model is net
    with streamer:
        assert len(list(streamer)) == 3


def test_fsdp_with_world_size_but_no_process_group_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    net = make_net()
    with pytest.raises(RuntimeError, match="world_size is 2.*init_process_group"):
        GradientStreamer(net, make_data(), make_args(tmp_path, fsdp="full_shard"), batch_size=2)
    assert all(not m._forward_hooks for m in net.modules())


FSDP_LR, FSDP_MAX_NORM = 0.1, 0.5
FSDP_RUNS = [
    ("root", {"fsdp": "full_shard"}, {}),
    (
        "classes",
        {"fsdp": "shard_grad_op", "fsdp_config": {"transformer_layer_cls_to_wrap": ["Linear"]}},
        {},
    ),
    ("size", {"fsdp": "full_shard", "fsdp_config": {"min_num_params": 12}}, {}),
    (
        "train",
        {
            "fsdp": "full_shard",
            "optim": "sgd",
            "learning_rate": FSDP_LR,
            "max_grad_norm": FSDP_MAX_NORM,
            "lr_scheduler_type": "constant",
            "weight_decay": 0.0,
        },
        {"enable_update": True},
    ),
]
FSDP_UNITS = {"root": [""], "classes": ["", "0", "2"], "size": ["", "0"], "train": [""]}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Run every ``FSDP_RUNS`` entry on 2 forked gloo ranks; ``label -> [rank 0, rank 1]``."""
    import socket

    import torch.distributed.fsdp  # noqa: F401  (imported before the fork, not in each rank)
    import torch.multiprocessing as mp
    import transformers  # noqa: F401
    from fsdp_helpers import WORLD, fsdp_stream_worker

    out = tmp_path_factory.mktemp("fsdp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(
        fsdp_stream_worker,
        args=(f"tcp://127.0.0.1:{port}", str(out), FSDP_RUNS, make_net, make_data(), sum_loss),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    return {
        label: [torch.load(out / f"{label}_rank{r}.pt") for r in range(WORLD)]
        for label, _, _ in FSDP_RUNS
    }


@pytest.mark.parametrize("label", ["root", "classes", "size"])
def test_fsdp_probe_shards_parameters_and_matches_the_reference(fsdp_runs, label):
    ranks = fsdp_runs[label]
    total = sum(p.numel() for p in make_net().parameters())
    data = make_data()
    rows, expected = index_of(data), flat_reference(make_net(), data)
    seen = []
    for saved in ranks:
        assert saved["wrapper"] == "FullyShardedDataParallel"
        assert saved["units"] == FSDP_UNITS[label]
        assert saved["local_numel"] < total  # this rank holds a shard, not the model
        for step, ids, block in saved["blocks"]:
            assert step == 0
            order = [rows[i] for i in ids]
            seen += order
            for name in LAYERS:
                torch.testing.assert_close(block[name], expected[name][order], rtol=1e-5, atol=1e-6)
    assert sum(saved["local_numel"] for saved in ranks) == total
    assert sorted(seen) == list(range(N_SAMPLES))  # each sample on exactly one rank


def clip_(grads: list[torch.Tensor], max_norm: float) -> float:
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    for g in grads:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def test_fsdp_trajectory_steps_on_the_rank_mean_with_global_clipping(fsdp_runs):
    ranks = fsdp_runs["train"]
    # Weights decay, biases do not: split by the shapes before FSDP flattened them.
    assert all(saved["groups"] == [(0.0, 2), (0.0, 2)] for saved in ranks)
    data = make_data()
    rows = index_of(data)
    net = make_net()
    steps = len(ranks[0]["blocks"])
    assert steps == 3 and all(len(saved["blocks"]) == steps for saved in ranks)
    norms = []
    for k in range(steps):
        batches = []
        for saved in ranks:
            step, ids, block = saved["blocks"][k]
            assert step == k
            order = [rows[i] for i in ids]
            batches.append(order)
            expected = flat_reference(net, [data[i] for i in order])
            for name in LAYERS:
                torch.testing.assert_close(block[name], expected[name], rtol=1e-5, atol=1e-6)
        # FSDP averages the ranks' gradients; the clip norm spans every shard.
        net.zero_grad()
        for order in batches:
            loss = sum(sum_loss(net, data[i]) for i in order) / len(batches)
            loss.backward()
        norms.append(clip_([p.grad for p in net.parameters()], FSDP_MAX_NORM))
        with torch.no_grad():
            for p in net.parameters():
                p -= FSDP_LR * p.grad
    assert max(norms) > FSDP_MAX_NORM  # clipping took effect, so the test checks it
    for saved in ranks:
        for name, param in net.named_parameters():
            torch.testing.assert_close(saved["params"][name], param, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ preconditioned capture


def layer_state(opt: torch.optim.Optimizer, net: nn.Module, name: str) -> tuple[dict, int]:
    """A layer's AdamW moments in the materialize layout ``[W | b]`` flattened, and its step."""
    layer = net.get_submodule(name)
    weight, bias = opt.state.get(layer.weight, {}), opt.state.get(layer.bias, {})
    state = {
        key: torch.cat([weight[key], bias[key][:, None]], dim=1).flatten()
        for key in ("exp_avg", "exp_avg_sq")
        if key in weight
    }
    return state, int(weight.get("step", 0))


def preconditioned_reference(net, opt, rows) -> dict[str, torch.Tensor]:
    """``ops.precondition`` of the torch.func per-sample gradients with ``opt``'s current state."""
    group = opt.param_groups[0]
    raw = flat_reference(net, rows)
    out = {}
    for name in LAYERS:
        state, step = layer_state(opt, net, name)
        out[name] = precondition(
            raw[name],
            state,
            optimizer_type="AdamW",
            step=step + 1,
            betas=group["betas"],
            eps=group["eps"],
        )
    return out


def train_a_few_steps(net: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        opt.zero_grad()
        sum_loss(
            net, {"x": torch.randn(4, 3, generator=gen), "y": torch.randn(4, 2, generator=gen)}
        ).backward()
        opt.step()


@pytest.mark.parametrize("warm_steps", [0, 3])
def test_probe_precondition_maps_with_the_given_optimizer(tmp_path, warm_steps):
    net, data = make_net(), make_data()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    train_a_few_steps(net, opt, warm_steps)
    ref_net = copy.deepcopy(net)
    ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    ref_opt.load_state_dict(opt.state_dict())
    streamer = GradientStreamer(
        net,
        data,
        make_args(tmp_path),
        batch_size=4,
        loss_fn=sum_loss,
        optimizer=opt,
        precondition=True,
    )
    with streamer:
        blocks = list(streamer)
    start = 0
    for _, block, ids in blocks:
        rows = data[start : start + len(ids)]
        start += len(ids)
        expected = preconditioned_reference(ref_net, ref_opt, rows)
        got = materialized(block)
        for name in LAYERS:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_trajectory_precondition_uses_the_state_before_each_update(tmp_path):
    net, data = make_net(), make_data()
    ref_net = copy.deepcopy(net)
    args = make_args(
        tmp_path, learning_rate=0.05, weight_decay=0.1, lr_scheduler_type="constant", data_seed=2
    )
    streamer = GradientStreamer(
        net, data, args, batch_size=2, loss_fn=sum_loss, enable_update=True, precondition=True
    )
    rows = index_of(data)
    with streamer:
        blocks = [(materialized(block), [rows[i] for i in ids]) for _, block, ids in streamer]
    assert len(blocks) == 5
    # A hand-written AdamW loop over the same batches: the expectation before its t-th update.
    decay = [p for p in ref_net.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref_net.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.05,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    for got, order in blocks:
        batch = [data[i] for i in order]
        expected = preconditioned_reference(ref_net, ref_opt, batch)
        for name in LAYERS:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)
        ref_opt.zero_grad(set_to_none=True)
        stacked = {k: torch.stack([r[k] for r in batch]) for k in ("x", "y")}
        sum_loss(ref_net, stacked).backward()
        nn.utils.clip_grad_norm_(list(ref_net.parameters()), args.max_grad_norm)
        ref_opt.step()
    for p, q in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_raw_probe_shares_a_preconditioned_trajectorys_hooks(tmp_path):
    net, data = make_net(), make_data()
    ref_net = copy.deepcopy(net)
    args = make_args(tmp_path, optim="adamw")
    train = GradientStreamer(
        net, data, args, batch_size=5, loss_fn=sum_loss, enable_update=True, precondition=True
    )
    probe = GradientStreamer(
        net, data[:4], args, batch_size=4, loss_fn=sum_loss, hook_manager=train.hook_manager
    )
    assert train.hook_manager.supports_preconditioning
    with train, probe:
        iterator = iter(train)
        next(iterator)  # one update taken: the optimizer now has state
        ((_, block, _),) = list(probe)
        ref_net.load_state_dict(net.state_dict())
        expected = flat_reference(ref_net, data[:4])
        for name in LAYERS:
            torch.testing.assert_close(materialized(block)[name], expected[name])
        assert train.hook_manager.precondition  # the probe switched it back after its batch
        list(iterator)


def test_precondition_needs_a_preconditioning_shared_manager(tmp_path):
    net = make_net()
    manager = HookManager(
        net, config=HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[CaptureCallback()]
    )
    with pytest.raises(ValueError, match="supports preconditioning"):
        GradientStreamer(
            net,
            make_data(),
            make_args(tmp_path),
            batch_size=2,
            loss_fn=sum_loss,
            hook_manager=manager,
            optimizer=torch.optim.AdamW(net.parameters()),
            precondition=True,
        )
    manager.remove()

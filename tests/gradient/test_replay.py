"""ReplayGradientSource: blocks recomputed from a trajectory's snapshots.

References: the blocks the trajectory yielded live, and per-sample gradients
from ``torch.func`` at the parameters of a hand-written AdamW loop.
"""

from __future__ import annotations

import copy

import pytest
import torch
from capture_helpers import tiny_gpt2
from reference import call, per_sample_param_grads
from torch import nn

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.gradient.streaming import GradientStreamer, ReplayGradientSource
from dattri_llm.utils.hashing import hash_sample

N_SAMPLES, BATCH = 10, 2
LAYERS = ("0", "2")


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def make_data() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N_SAMPLES, 3, generator=gen), torch.randn(N_SAMPLES, 2, generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(N_SAMPLES)]


def sum_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def make_args(tmp_path, **kwargs) -> AttributionArguments:
    defaults = dict(
        learning_rate=0.05,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=None,
        data_seed=3,
    )
    return AttributionArguments(output_dir=str(tmp_path), use_cpu=True, **{**defaults, **kwargs})


def dense(block) -> dict[str, torch.Tensor]:
    return dict(block.materialize().data)


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


def row_of(data) -> dict[str, int]:
    return {hash_sample({"_arg0": row["x"]}): i for i, row in enumerate(data)}


def record_trajectory(tmp_path, accumulation: int = 1):
    """A short AdamW trajectory with snapshots; ``(net, data, args, dir, {step: (dense, ids)})``."""
    net, data = make_net(), make_data()
    args = make_args(tmp_path, gradient_accumulation_steps=accumulation)
    directory = tmp_path / "snapshots"
    streamer = GradientStreamer(
        net,
        data,
        args,
        batch_size=BATCH,
        loss_fn=sum_loss,
        enable_update=True,
        snapshots=str(directory),
    )
    with streamer:
        live = {step: (dense(block), ids) for step, block, ids in streamer}
    return net, data, args, directory, live


def reference_blocks(data, order, args, accumulation):
    """Hand-written AdamW loop: per batch, per-sample gradients (loss / N) before its update."""
    net = make_net()
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay}],
        lr=args.learning_rate,
        weight_decay=0.0,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    expected = {}
    for index, rows in enumerate(batches):
        if index % accumulation == 0:
            opt.zero_grad(set_to_none=True)
        batch = [data[i] for i in rows]
        expected[index] = {
            name: value / accumulation for name, value in flat_reference(net, batch).items()
        }
        stacked = {k: torch.stack([r[k] for r in batch]) for k in ("x", "y")}
        (sum_loss(net, stacked) / accumulation).backward()
        if (index + 1) % accumulation == 0 or index == len(batches) - 1:
            opt.step()
    return expected


def assert_blocks_equal(got: dict, expected: dict, rtol=1e-6, atol=1e-7) -> None:
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_replay_equals_live_blocks_and_the_reference_trajectory(tmp_path, accumulation):
    net, data, args, directory, live = record_trajectory(tmp_path, accumulation)
    final = [p.detach().clone() for p in net.parameters()]
    rows = row_of(data)
    order = [rows[i] for step in sorted(live) for i in live[step][1]]
    expected = reference_blocks(data, order, args, accumulation)

    with ReplayGradientSource(net, args, str(directory), loss_fn=sum_loss) as source:
        assert source.reusable and source.steps == [0, 1, 2, 3, 4] and len(source) == 5
        replayed = list(source)
    assert [step for step, _, _ in replayed] == [0, 1, 2, 3, 4]
    for step, block, ids in replayed:
        assert ids == live[step][1]
        assert_blocks_equal(dense(block), live[step][0])
        assert_blocks_equal(dense(block), expected[step], rtol=1e-5, atol=1e-6)
    for p, q in zip(net.parameters(), final):
        assert torch.equal(p, q)  # close() put the trajectory's final parameters back


def test_replay_follows_the_requested_step_order_and_views(tmp_path):
    net, _, args, directory, live = record_trajectory(tmp_path)
    source = ReplayGradientSource(net, args, directory, loss_fn=sum_loss, steps=[3, 0, 99, 3, 1])
    assert source.steps == [3, 0, 1]  # 99 has no snapshot, the repeat is dropped
    with source:
        assert [step for step, _, _ in source] == [3, 0, 1]
        full = ReplayGradientSource(net, args, TrajectorySnapshots(directory), loss_fn=sum_loss)
        view = full.for_steps([4, 2, 7])
        assert view.steps == [4, 2] and len(view) == 2 and full.steps == [0, 1, 2, 3, 4]
        for step, block, _ in view:
            assert_blocks_equal(dense(block), live[step][0])
        view.close()  # a view does not own the hooks
        assert [step for step, _, _ in view] == [4, 2]
        with pytest.raises(ValueError, match="no replayable step"):
            source.for_steps([2])
        full.close()
        with pytest.raises(RuntimeError, match="closed"):
            iter(view)
    with pytest.raises(RuntimeError, match="closed"):
        iter(source)


def test_replay_passes_repeat_and_hand_back_rng_modes_and_gradients(tmp_path):
    net, _, args, directory, _ = record_trajectory(tmp_path)
    net.eval()
    before = [p.detach().clone() for p in net.parameters()]
    grads = [torch.full_like(p, 3.0) for p in net.parameters()]
    for p, g in zip(net.parameters(), grads):
        p.grad = g.clone()
    modes = []

    def loss_recording_mode(model, batch):
        modes.append(model.training)
        return sum_loss(model, batch)

    source = ReplayGradientSource(net, args, directory, loss_fn=loss_recording_mode, steps=[1, 2])
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    first = [(s, dense(b)) for s, b, _ in source]
    assert torch.equal(torch.get_rng_state(), rng)
    second = [(s, dense(b)) for s, b, _ in source]
    assert modes == [True] * 4 and not net.training
    for p, g in zip(net.parameters(), grads):
        assert torch.equal(p.grad, g)
    for (s1, b1), (s2, b2) in zip(first, second):
        assert s1 == s2
        assert_blocks_equal(b1, b2, rtol=0, atol=0)
    source.close()
    for p, q in zip(net.parameters(), before):
        assert torch.equal(p, q)
    assert all(not m._forward_hooks for m in net.modules())


def test_replay_in_eval_mode_and_layer_filter(tmp_path):
    net, _, args, directory, live = record_trajectory(tmp_path)
    modes = []

    def loss_recording_mode(model, batch):
        modes.append(model.training)
        return sum_loss(model, batch)

    with ReplayGradientSource(
        net, args, directory, loss_fn=loss_recording_mode, layer_name="0", train_mode=False
    ) as source:
        assert source.layer_name == ["0"]
        ((step, block, _),) = list(source.for_steps([2]))
    assert step == 2 and modes == [False]
    assert_blocks_equal(dense(block), {"0": live[2][0]["0"]})
    with ReplayGradientSource(net, args, directory, loss_fn=sum_loss, layer_name="nope") as source:
        with pytest.raises(KeyError, match="nope"):
            list(source)


def test_replay_errors(tmp_path, monkeypatch):
    net, _, args, directory, _ = record_trajectory(tmp_path)
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match="not a snapshot directory"):
        ReplayGradientSource(net, args, str(missing))
    assert not missing.exists()
    with pytest.raises(ValueError, match="no replayable step"):
        ReplayGradientSource(net, args, TrajectorySnapshots(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"no replayable step for the requested steps \[7, 8\]"):
        ReplayGradientSource(net, args, directory, steps=[7, 8])

    def detached_loss(model, batch):
        return (torch.ones((), requires_grad=True) * 2.0).sum()

    with ReplayGradientSource(net, args, directory, loss_fn=detached_loss) as source:
        with pytest.raises(RuntimeError, match="replayed step 0 produced no gradient record"):
            list(source)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NotImplementedError, match="single process"):
        ReplayGradientSource(net, args, directory)


@pytest.mark.filterwarnings("ignore:Layer 'transformer.wpe' has batch size 1")
def test_gpt2_replay_equals_live_blocks(tmp_path):
    model = tiny_gpt2()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (6, 8), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = make_args(tmp_path, learning_rate=1e-2)
    directory = tmp_path / "gpt2_snapshots"
    streamer = GradientStreamer(
        model, data, args, batch_size=2, enable_update=True, snapshots=directory
    )
    with streamer:
        live = {step: (dense(block), ids) for step, block, ids in streamer}
    assert len(live) == 3
    initial = tiny_gpt2()
    final = copy.deepcopy(model.state_dict())
    with ReplayGradientSource(model, args, str(directory), steps=[2, 0, 1]) as source:
        replayed = [(step, dense(block), ids) for step, block, ids in source]
        # the first block is taken at the initial weights, the later ones at updated weights
        stored = TrajectorySnapshots(directory)
        stored.load_parameters(0, model)
        for name, p in model.named_parameters():
            assert torch.equal(p, initial.state_dict()[name])
    assert [step for step, _, _ in replayed] == [2, 0, 1]
    for step, blocks, identifiers in replayed:
        assert identifiers == live[step][1]
        assert_blocks_equal(blocks, live[step][0], rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[name])

"""GradientStreamer(snapshots=...): each step's parameters and batch, stored as it runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.gradient.streaming import GradientStreamer
from dattri_llm.utils.hashing import hash_sample


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def make_data() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 3, generator=gen), torch.randn(10, 2, generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(10)]


def sum_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def make_args(tmp_path, **kwargs) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path), use_cpu=True, learning_rate=0.1, data_seed=4, **kwargs
    )


def streamer(tmp_path, snapshots, **kwargs) -> GradientStreamer:
    args = make_args(tmp_path, **kwargs)
    return GradientStreamer(
        make_net(),
        make_data(),
        args,
        batch_size=3,
        loss_fn=sum_loss,
        enable_update=True,
        defer_update=True,  # at each yield the model still holds the block's parameters
        snapshots=snapshots,
    )


@pytest.mark.parametrize("as_path", [True, False])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_step_stores_its_parameters_and_batch(tmp_path, as_path, accumulation):
    directory = tmp_path / "snaps"
    source = streamer(
        tmp_path,
        str(directory) if as_path else TrajectorySnapshots(directory),
        gradient_accumulation_steps=accumulation,
    )
    taken_at, identifiers = {}, {}
    with source:
        for step, _, ids in source:
            taken_at[step] = {n: p.detach().clone() for n, p in source.model.named_parameters()}
            identifiers[step] = ids
    assert sorted(taken_at) == [0, 1, 2, 3]

    reopened = TrajectorySnapshots(directory)  # a fresh reader over what the run left on disk
    assert reopened.steps() == [0, 1, 2, 3]
    assert repr(reopened) == f"TrajectorySnapshots('{directory}', steps=4)"
    stored_files = sorted(p.name for p in directory.glob("parameters_*.pt"))
    assert len(stored_files) == 4 // accumulation  # micro-batches point to the window start
    probe = make_net()
    for step, expected in taken_at.items():
        reopened.load_parameters(step, probe)
        for name, value in probe.named_parameters():
            assert torch.equal(value, expected[name])
        batch = reopened.load_batch(step)
        assert [hash_sample({"_arg0": row}) for row in batch["x"]] == identifiers[step]
        assert set(batch) == {"x", "y"}


def test_an_abandoned_trajectory_leaves_its_completed_steps_readable(tmp_path):
    directory = tmp_path / "snaps"
    source = streamer(tmp_path, directory)
    with source:
        for step, _, _ in source:
            if step == 1:
                break
    reopened = TrajectorySnapshots(directory)
    assert reopened.steps() == [0, 1]
    reopened.load_parameters(1, make_net())


def test_snapshot_option_errors(tmp_path):
    directory = tmp_path / "snaps"
    with pytest.raises(ValueError, match="enable_update=True"):
        GradientStreamer(
            make_net(), make_data(), make_args(tmp_path), batch_size=2, snapshots=directory
        )
    with pytest.raises(NotImplementedError, match="FSDP"):
        streamer(tmp_path, str(directory), fsdp="full_shard")
    with pytest.raises(TypeError, match="TrajectorySnapshots or a directory path"):
        streamer(tmp_path, 3)
    assert not directory.exists()  # nothing is created before the options are accepted

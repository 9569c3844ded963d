"""A trajectory visits the samples in the order of a seeded, shuffling ``DataLoader``.

The reference is what Hugging Face-style training draws:
``DataLoader(dataset, batch_size, shuffle=True,
generator=torch.Generator().manual_seed(data_seed))``, iterated once per epoch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.streaming import GradientStreamer
from dattri_llm.utils.hashing import hash_sample

N_SAMPLES = 11


def make_data() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(3, generator=gen)} for _ in range(N_SAMPLES)]


def square_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["x"]).pow(2).sum()


def make_streamer(tmp_path, data, *, batch_size: int, **arg_overrides) -> GradientStreamer:
    torch.manual_seed(0)
    args = AttributionArguments(output_dir=str(tmp_path), use_cpu=True, **arg_overrides)
    return GradientStreamer(
        nn.Linear(3, 2), data, args, batch_size=batch_size, loss_fn=square_loss, enable_update=True
    )


def reference_epochs(seed: int, batch_size: int, epochs: int) -> list[list[int]]:
    """Sample indices per epoch of one seeded shuffling ``DataLoader`` iterated ``epochs`` times."""
    loader = DataLoader(
        list(range(N_SAMPLES)),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    return [[int(i) for batch in loader for i in batch] for _ in range(epochs)]


def visited_order(streamer: GradientStreamer, data) -> list[int]:
    """Dataset indices in the order the trajectory's blocks carry them (through the hashes)."""
    row_of = {hash_sample({"_arg0": row["x"]}): i for i, row in enumerate(data)}
    with streamer:
        return [row_of[h] for _, _, ids in streamer for h in ids]


@pytest.mark.parametrize(("data_seed", "batch_size"), [(5, 4), (123, 3), (0, 2)])
def test_trajectory_order_is_the_seeded_dataloader_order(tmp_path, data_seed, batch_size):
    data = make_data()
    streamer = make_streamer(tmp_path, data, batch_size=batch_size, data_seed=data_seed, seed=99)
    assert visited_order(streamer, data) == reference_epochs(data_seed, batch_size, 1)[0]


def test_trajectory_order_falls_back_to_seed(tmp_path):
    data = make_data()
    streamer = make_streamer(tmp_path, data, batch_size=4, seed=17)
    assert visited_order(streamer, data) == reference_epochs(17, 4, 1)[0]


def test_trajectory_loader_gives_the_dataloader_order_over_two_epochs(tmp_path):
    # A trajectory pass is one epoch; the loader it builds, iterated once per epoch, must
    # draw the reference DataLoader's per-epoch permutations (epoch 2 differs from epoch 1).
    data = make_data()
    row_of = {tuple(row["x"].tolist()): i for i, row in enumerate(data)}
    loader = make_streamer(tmp_path, data, batch_size=4, data_seed=5)._make_loader(shuffle=True)
    epochs = [[row_of[tuple(x.tolist())] for batch in loader for x in batch["x"]] for _ in range(2)]
    expected = reference_epochs(5, 4, 2)
    assert epochs == expected and expected[0] != expected[1]

"""What a streamed dataset may be: accepted kinds stream, anything else fails at once.

Accepted: a list of dicts, a map-style ``torch`` ``Dataset`` of dicts, a Hugging
Face ``datasets.Dataset``. Refused with a ``TypeError`` naming the accepted
kinds and what was given (instead of ``KeyError: 0`` from the ``DataLoader``):
a dict of columns, a bare tensor, a list of tensors, an iterable-style dataset.
Tuple items (a ``TensorDataset``) stream for a loss function that reads
positional fields, as dattri-style tasks do.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.streaming import GradientStreamer
from dattri_llm.task import AttributionTask

N_SAMPLES = 6
ACCEPTED = "must be a list of dicts, a torch.utils.data.Dataset whose items are dicts"

_gen = torch.Generator().manual_seed(3)
X = torch.randn(N_SAMPLES, 3, generator=_gen)
Y = torch.randn(N_SAMPLES, 2, generator=_gen)


def rows() -> list[dict[str, torch.Tensor]]:
    return [{"x": X[i], "y": Y[i]} for i in range(N_SAMPLES)]


def sum_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def make_args(tmp_path) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
    )


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def probe_gradients(tmp_path, dataset) -> dict[str, torch.Tensor]:
    """Per-sample dense gradients of a frozen probe, rows in dataset order."""
    streamer = GradientStreamer(
        make_net(), dataset, make_args(tmp_path), batch_size=4, loss_fn=sum_loss
    )
    with streamer:
        blocks = [dict(block.materialize().data) for _, block, _ in streamer]
    return {name: torch.cat([b[name] for b in blocks]) for name in blocks[0]}


def assert_streams_like_a_list_of_dicts(tmp_path, dataset) -> None:
    expected = probe_gradients(tmp_path / "list", rows())
    actual = probe_gradients(tmp_path / "other", dataset)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name])


# ------------------------------------------------------------------------ accepted kinds


class DictDataset(Dataset):
    """A map-style torch Dataset whose items are dicts."""

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": X[index], "y": Y[index]}


def test_list_of_dicts_streams(tmp_path):
    assert_streams_like_a_list_of_dicts(tmp_path, rows())


def test_tuple_of_dicts_streams(tmp_path):
    assert_streams_like_a_list_of_dicts(tmp_path, tuple(rows()))


def test_torch_dataset_of_dicts_streams(tmp_path):
    assert_streams_like_a_list_of_dicts(tmp_path, DictDataset())


def test_torch_subset_of_dicts_streams(tmp_path):
    assert_streams_like_a_list_of_dicts(tmp_path, Subset(DictDataset(), range(N_SAMPLES)))


def test_hugging_face_dataset_streams(tmp_path):
    hf = pytest.importorskip("datasets")
    dataset = hf.Dataset.from_dict({"x": X.tolist(), "y": Y.tolist()}).with_format("torch")
    assert_streams_like_a_list_of_dicts(tmp_path, dataset)


def test_attributor_accepts_a_hugging_face_dataset(tmp_path):
    hf = pytest.importorskip("datasets")
    dataset = hf.Dataset.from_dict({"x": X.tolist(), "y": Y.tolist()}).with_format("torch")
    attributor = TracInAttributor(make_args(tmp_path), task=AttributionTask(sum_loss, make_net()))
    from_hf = attributor.attribute(dataset, dataset).scores
    from_rows = attributor.attribute(rows(), rows()).scores
    torch.testing.assert_close(from_hf, from_rows)


def test_tensor_dataset_streams_for_a_positional_loss(tmp_path):
    def tuple_loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).sum()

    def dict_loss(model, batch):
        return tuple_loss(model, (batch["x"], batch["y"]))

    net = make_net()
    from_tuples = TracInAttributor(make_args(tmp_path / "t"), task=AttributionTask(tuple_loss, net))
    from_dicts = TracInAttributor(make_args(tmp_path / "d"), task=AttributionTask(dict_loss, net))
    tuples = TensorDataset(X, Y)
    torch.testing.assert_close(
        from_tuples.attribute(tuples, tuples).scores, from_dicts.attribute(rows(), rows()).scores
    )


# ------------------------------------------------------------------------- refused kinds


class SampleStream(IterableDataset):
    """An iterable-style dataset of dicts."""

    def __iter__(self):
        return iter(rows())


def refused_kinds() -> list[tuple[str, object, str]]:
    """``(id, dataset, what the message must say was given)``."""
    return [
        ("dict-of-columns", {"x": X, "y": Y}, r"got dict \(keys \['x', 'y'\]\)"),
        ("bare-tensor", X, r"got torch\.Tensor of shape \(6, 3\)"),
        ("list-of-tensors", [X[i] for i in range(N_SAMPLES)], "whose item 0 is a torch.Tensor"),
        ("iterable-dataset", SampleStream(), "SampleStream; iterable-style"),
        ("string", "train.jsonl", "got str"),
    ]


KINDS = refused_kinds()


@pytest.mark.parametrize(("dataset", "given"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_streamer_refuses(tmp_path, dataset, given):
    net = make_net()
    with pytest.raises(TypeError, match=ACCEPTED) as error:
        GradientStreamer(net, dataset, make_args(tmp_path), batch_size=4, loss_fn=sum_loss)
    assert "Hugging Face datasets.Dataset" in str(error.value)
    assert re.search(given, str(error.value)), str(error.value)
    assert not net[0]._forward_hooks and not net[0]._forward_pre_hooks  # refused before hooking


@pytest.mark.parametrize(("dataset", "given"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("side", ["training", "test"])
def test_attribute_refuses(tmp_path, dataset, given, side):
    attributor = TracInAttributor(make_args(tmp_path), task=AttributionTask(sum_loss, make_net()))
    train, test = (dataset, rows()) if side == "training" else (rows(), dataset)
    with pytest.raises(TypeError, match=f"the {side} dataset {ACCEPTED}"):
        attributor.attribute(train, test)


def test_cache_refuses_a_bad_train_dataset_before_collecting_queries(tmp_path):
    attributor = TracInAttributor(make_args(tmp_path), task=AttributionTask(sum_loss, make_net()))
    cache_dir = tmp_path / "cache"
    with pytest.raises(TypeError, match=f"the training dataset {ACCEPTED}"):
        attributor.cache({"x": X, "y": Y}, rows(), cache_dir=str(cache_dir))
    assert not cache_dir.exists()  # nothing was collected, not even the queries

"""Live scoring drops each captured train block before the next batch runs (peak memory)."""

from __future__ import annotations

import weakref

import pytest
import torch
from attribution_helpers import MLP

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.streaming import GradientStreamer
from dattri_llm.task import AttributionTask

pytest.importorskip("transformers")


def _rows(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 4, generator=gen), torch.randn(n, 3, 3, generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def _factor_refs(block) -> list[weakref.ref]:
    """Weak references to the captured output-gradient factors of ``block``."""
    return [
        weakref.ref(value.pre_activation_grad)
        for name, value in block.data.items()
        if block.representation[name] == "factorized"
    ]


class _Watch:
    """A loss that records, after each forward (before its backward), how many factors of
    earlier blocks are still alive."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.alive_at_call: list[int] = []

    def loss(self, model, batch):
        out = model(batch["x"])
        self.alive_at_call.append(sum(ref() is not None for ref in self.refs))
        return ((out - batch["y"]) ** 2).sum()


def _args(tmp_path, eval_batch: int = 2) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=eval_batch,
    )


@pytest.mark.parametrize("enable_update", [False, True])
def test_streamer_does_not_hold_a_yielded_block(tmp_path, enable_update):
    torch.manual_seed(0)
    watch = _Watch()
    streamer = GradientStreamer(
        MLP(),
        _rows(6, 1),
        _args(tmp_path),
        batch_size=2,
        loss_fn=watch.loss,
        enable_update=enable_update,
    )
    with streamer:
        for _step, block, _ids in streamer:
            watch.refs += _factor_refs(block)
            del block
    assert len(watch.alive_at_call) == 3 and watch.refs
    assert watch.alive_at_call == [0, 0, 0]


@pytest.mark.parametrize("eval_batch", [2, 4])  # several held test blocks, and one
def test_live_scoring_drops_each_train_block(tmp_path, eval_batch):
    torch.manual_seed(0)
    watch = _Watch()

    class Recording(TracInAttributor):
        def inner_product(self, train_rep, test_rep, *, dense_cache=None):
            watch.refs += _factor_refs(train_rep)
            return super().inner_product(train_rep, test_rep, dense_cache=dense_cache)

    model = MLP()
    attributor = Recording(_args(tmp_path, eval_batch), task=AttributionTask(watch.loss, model))
    score = attributor.attribute(_rows(6, 1), _rows(3, 2))
    assert score.scores.shape == (6, 3)
    assert watch.refs  # the train blocks were scored as factors
    assert watch.alive_at_call == [0] * len(watch.alive_at_call)

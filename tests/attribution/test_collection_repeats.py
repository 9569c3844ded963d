"""A sample collected twice at one step: the store keeps it once, and the run says so."""

from __future__ import annotations

import warnings

import pytest
import torch
from attribution_helpers import MLP, mlp_data, mlp_loss

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.task import AttributionTask

REPEAT = "repeat a sample already collected at the same step"


def _data(duplicate: bool) -> tuple[list[dict], list[dict]]:
    x, y = mlp_data(7, 1)
    train = [{"x": x[i], "y": y[i]} for i in range(7)]
    if duplicate:  # sample 2 again, in the second batch of 4
        train.append({k: v.clone() for k, v in train[2].items()})
    xq, yq = mlp_data(3, 2)
    return train, [{"x": xq[i], "y": yq[i]} for i in range(3)]


def _attributor(tmp_path) -> TracInAttributor:
    torch.manual_seed(0)
    task = AttributionTask(lambda m, b: mlp_loss(m, (b["x"], b["y"])), MLP())
    args = AttributionArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, learning_rate=0.05
    )
    return TracInAttributor(args, task=task)


def _repeat_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if REPEAT in str(w.message)]


@pytest.mark.parametrize("residency", ["memory", "disk"])
def test_a_repeated_sample_is_stored_once_with_a_warning(tmp_path, residency):
    train, test = _data(duplicate=True)
    with pytest.warns(UserWarning, match=f"^1 training row\\(s\\) {REPEAT}"):
        stored = _attributor(tmp_path / "s").attribute(
            train, test, gradient_cache_residency=residency
        )
    live = _attributor(tmp_path / "l").attribute(train, test)
    assert live.num_rows == 8 and stored.num_rows == 7  # what the warning is about
    assert stored.num_train == live.num_train == 7


def test_a_repeat_inside_one_batch_is_kept_without_a_warning(tmp_path):
    train, test = _data(duplicate=False)
    train[3] = {k: v.clone() for k, v in train[2].items()}  # same batch of 4: one group
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stored = _attributor(tmp_path).attribute(train, test, gradient_cache_residency="memory")
    assert not _repeat_warnings(caught)
    assert stored.num_rows == 7  # both rows kept


def test_no_warning_without_repeats_or_across_steps(tmp_path):
    train, test = _data(duplicate=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _attributor(tmp_path / "a").attribute(train, test, gradient_cache_residency="memory")
    assert not _repeat_warnings(caught)
    train, test = _data(duplicate=True)  # a training run: the copy is at another step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _attributor(tmp_path / "b").cache(train, test, enable_update=True)
    assert not _repeat_warnings(caught)
    with pytest.warns(UserWarning, match=REPEAT):  # the same set without updates: one step
        _attributor(tmp_path / "c").cache(train, test)

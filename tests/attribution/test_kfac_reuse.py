"""K-FAC / EK-FAC fit every call from its own inputs (issue 8, items 1 and 9).

Covariances recorded at capture belong to the store they were recorded for and
to the steps, rows and projection they cover; an attributor reused over several
stores scores each one as a fresh attributor would. References are explicit
dense operators built from plain hooks and single-sample backwards
(``kfac_helpers.linear_kronecker_scores``).
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, append_store, mlp_data, mlp_loss, write_store
from kfac_helpers import dict_loss, dict_samples, linear_kronecker_scores

from dattri_llm.attribution.algorithm.kronecker import (
    COVARIANCES_FILE,
    FISHER_FILE,
    EKFACAttributor,
    KFACAttributor,
)
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.task import AttributionTask

pytest.importorskip("transformers")

DAMPING = 0.05
METHODS = [(KFACAttributor, "kfac"), (EKFACAttributor, "ekfac")]


def _args(path):
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
    )


def _reference(model, train, test, method):
    """Float64 dense scores ``(n_train, n_test)`` with covariances over all of ``train``."""
    model64 = copy.deepcopy(model).double()
    return linear_kronecker_scores(
        model64,
        MLP_LAYERS,
        mlp_loss,
        tuple(t.double() for t in train),
        tuple(t.double() for t in test),
        method,
        DAMPING,
    )


def _assert_scores(got, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4 * scale)


def _cat(*parts):
    return tuple(torch.cat(ts) for ts in zip(*parts))


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = MLP()
    first = mlp_data(6, 1)
    second = (3.0 * mlp_data(6, 3)[0] + 1.0, mlp_data(6, 3)[1])  # other curvature
    test = mlp_data(3, 2)
    return model, first, second, test


@pytest.mark.parametrize(("cls", "method"), METHODS)
def test_one_attributor_over_two_stores_equals_fresh_attributors(setup, tmp_path, cls, method):
    model, first, second, test = setup
    task = AttributionTask(dict_loss, model)
    reused = cls(_args(tmp_path / "reused"), task=task)
    (pair1,) = reused.cache(dict_samples(first), dict_samples(test), cache_dir=tmp_path / "c1")
    (pair2,) = reused.cache(dict_samples(second), dict_samples(test), cache_dir=tmp_path / "c2")
    # a third store written by hand: no covariance file beside it
    hand = write_store(tmp_path / "hand", model, MLP_LAYERS, mlp_loss, second, batch_sizes=[6])
    for data, (train_dir, test_dir) in (
        (first, pair1),
        (second, pair2),
        (second, (hand, pair2[1])),
    ):
        got = reused.attribute_from_cache(train_dir, test_dir, damping=DAMPING)
        fresh = cls(_args(tmp_path / "fresh")).attribute_from_cache(
            train_dir, test_dir, damping=DAMPING
        )
        torch.testing.assert_close(got.scores, fresh.scores, rtol=1e-5, atol=1e-6)
        _assert_scores(got.scores, _reference(model, data, test, method))


@pytest.mark.parametrize(("cls", "method"), METHODS)
def test_covariance_file_of_other_steps_is_refit(setup, tmp_path, cls, method):
    model, first, second, test = setup
    task = AttributionTask(dict_loss, model)
    ((train_dir, test_dir),) = cls(_args(tmp_path / "o"), task=task).cache(
        dict_samples(first), dict_samples(test), cache_dir=tmp_path / "c"
    )
    assert (tmp_path / "c" / "ckpt_0" / "train_grads" / COVARIANCES_FILE).is_file()
    append_store(  # step 1 appended after the file was written for step 0
        GradientStorageManager(train_dir),
        model,
        MLP_LAYERS,
        mlp_loss,
        second,
        batch_sizes=[6],
        step=1,
    )
    attributor = cls(_args(tmp_path / "a"))
    every = attributor.attribute_from_cache(train_dir, test_dir, damping=DAMPING)
    _assert_scores(every.scores, _reference(model, _cat(first, second), test, method))
    only_new = attributor.attribute_from_cache(
        train_dir, test_dir, damping=DAMPING, selected_training_steps=[1]
    )
    _assert_scores(only_new.scores, _reference(model, second, test, method))
    only_old = attributor.attribute_from_cache(  # the file's own steps: adopted, same scores
        train_dir, test_dir, damping=DAMPING, selected_training_steps=[0]
    )
    _assert_scores(only_old.scores, _reference(model, first, test, method))


@pytest.mark.parametrize(("cls", "method"), METHODS)
def test_covariance_file_of_a_layer_subset_is_completed_from_the_store(
    setup, tmp_path, cls, method
):
    model, first, _, test = setup
    task = AttributionTask(dict_loss, model)
    pinned = HookManagerConfig(linear_io=["fc1"])
    cls(_args(tmp_path / "p"), task=task).cache(
        dict_samples(first), dict_samples(test), cache_dir=tmp_path / "fc1", hook_config=pinned
    )
    ((train_dir, test_dir),) = cls(_args(tmp_path / "o"), task=task).cache(
        dict_samples(first), dict_samples(test), cache_dir=tmp_path / "all"
    )
    shutil.copy(tmp_path / "fc1" / "ckpt_0" / "train_grads" / COVARIANCES_FILE, train_dir)
    score = cls(_args(tmp_path / "a")).attribute_from_cache(train_dir, test_dir, damping=DAMPING)
    _assert_scores(score.scores, _reference(model, first, test, method))


@pytest.mark.parametrize(("cls", "method"), METHODS)
def test_covariance_file_without_metadata_is_refit(setup, tmp_path, cls, method):
    model, first, _, test = setup
    tr = write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, first, batch_sizes=[4, 2])
    te = write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3])
    stale = {"fc1": (torch.eye(5), torch.eye(5)), "fc2": (torch.eye(6), torch.eye(3))}
    torch.save(stale, tr.save_dir / COVARIANCES_FILE)  # an older, unlabelled file
    score = cls(_args(tmp_path / "a")).attribute_from_cache(
        tr.save_dir, te.save_dir, damping=DAMPING
    )
    _assert_scores(score.scores, _reference(model, first, test, method))


def test_dense_store_with_covariances_of_other_steps_raises(setup, tmp_path):
    model, first, second, test = setup
    task = AttributionTask(dict_loss, model)
    pinned = HookManagerConfig(linear_io=list(MLP_LAYERS), capture_style="materialized")
    ((train_dir, test_dir),) = KFACAttributor(_args(tmp_path / "o"), task=task).cache(
        dict_samples(first), dict_samples(test), cache_dir=tmp_path / "c", hook_config=pinned
    )
    append_store(
        GradientStorageManager(train_dir),
        model,
        MLP_LAYERS,
        mlp_loss,
        second,
        batch_sizes=[6],
        step=1,
        materialize=True,
    )
    attributor = KFACAttributor(_args(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"layer 'fc1'.*recorded for steps=\[0\].*steps=\[0, 1\]"):
        attributor.attribute_from_cache(train_dir, test_dir, damping=DAMPING)
    score = attributor.attribute_from_cache(  # the recorded steps: covariances adopted
        train_dir, test_dir, damping=DAMPING, selected_training_steps=[0]
    )
    _assert_scores(score.scores, _reference(model, first, test, "kfac"))


def _written_path(f) -> str:
    """The file a ``torch.save`` target writes to (a path, or an open file via /proc)."""
    if isinstance(f, (str, os.PathLike)):
        return str(f)
    return os.readlink(f"/proc/self/fd/{f.fileno()}")


def _kill_torch_save_mid_write(monkeypatch, name):
    """``torch.save`` into a file whose name contains ``name`` dies half-way (a killed process)."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if name not in os.path.basename(_written_path(f)):
            return original(obj, f, *args, **kwargs)
        fh = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f  # noqa: SIM115
        fh.write(b"PK\x03\x04 half a file")
        fh.flush()
        raise OSError("killed mid-write")

    monkeypatch.setattr(torch, "save", save)


def test_fisher_file_killed_mid_write_keeps_the_previous_fit(setup, tmp_path, monkeypatch):
    model, first, second, _ = setup
    tr = write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, first, batch_sizes=[6])
    other = write_store(tmp_path / "other", model, MLP_LAYERS, mlp_loss, second, batch_sizes=[6])
    attributor = KFACAttributor(_args(tmp_path / "a"))
    fisher_dir = attributor.fit(tr.save_dir)
    before = torch.load(fisher_dir / FISHER_FILE, weights_only=True)
    with monkeypatch.context() as patch:
        _kill_torch_save_mid_write(patch, FISHER_FILE)
        with pytest.raises(OSError, match="killed mid-write"):
            attributor.fit(other.save_dir, fisher_dir)
    after = torch.load(fisher_dir / FISHER_FILE, weights_only=True)
    for name in MLP_LAYERS:
        for kept, written in zip(after["factors"][name], before["factors"][name]):
            assert torch.equal(kept, written)
    assert sorted(os.listdir(fisher_dir)) == [FISHER_FILE]


def test_covariance_file_killed_mid_write_leaves_no_file(setup, tmp_path, monkeypatch):
    model, first, _, test = setup
    task = AttributionTask(dict_loss, model)
    with monkeypatch.context() as patch:
        _kill_torch_save_mid_write(patch, COVARIANCES_FILE)
        with pytest.raises(OSError, match="killed mid-write"):
            KFACAttributor(_args(tmp_path / "o"), task=task).cache(
                dict_samples(first), dict_samples(test), cache_dir=tmp_path / "c"
            )
    train_dir = tmp_path / "c" / "ckpt_0" / "train_grads"
    assert not any(COVARIANCES_FILE in name for name in os.listdir(train_dir))
    score = KFACAttributor(_args(tmp_path / "a")).attribute_from_cache(
        train_dir, tmp_path / "c" / "ckpt_0" / "test_grads", damping=DAMPING
    )
    _assert_scores(score.scores, _reference(model, first, test, "kfac"))

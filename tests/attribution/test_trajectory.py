"""TrajectoryAttributor: the shared base of the trajectory methods."""

from __future__ import annotations

import copy

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, dense_reference, mlp_data, mlp_loss, write_store

from dattri_llm.attribution.algorithm.trajectory import TrajectoryAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.utils import read_lr_schedule, write_lr_schedule
from dattri_llm.gradient.callbacks import HookManagerCallback
from dattri_llm.gradient.datasets import DiskGradientSource
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.streaming import ReplayGradientSource
from dattri_llm.task import AttributionTask
from dattri_llm.utils.hashing import hash_batch

N_TRAIN, N_TEST = 6, 3


def make_args(tmp_path, **kwargs) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=0.05,
        max_grad_norm=None,
        **kwargs,
    )


def as_dicts(data):
    x, y = data
    return [{"x": x[i], "y": y[i]} for i in range(x.shape[0])]


def dict_loss(model, batch):
    return mlp_loss(model, (batch["x"], batch["y"]))


# ---------------------------------------------------------------------------- static helpers
def test_validate_propagation():
    TrajectoryAttributor.validate_propagation("train", False)
    TrajectoryAttributor.validate_propagation("test", True)
    with pytest.raises(ValueError, match=r"propagation must be one of \['train', 'test'\]"):
        TrajectoryAttributor.validate_propagation("both", False)
    with pytest.raises(ValueError, match="loop_over_test.*propagation='test'"):
        TrajectoryAttributor.validate_propagation("train", True)


def test_resolve_steps_latest_first():
    resolve = TrajectoryAttributor.resolve_steps
    assert resolve([0, 2, 1, 3], None, None) == ([3, 2, 1, 0], [3, 2, 1, 0], 4)
    assert resolve([0, 1, 2, 3], [0, 2, 9], 3) == ([2, 1, 0], [2, 0], 3)
    with pytest.raises(ValueError, match="no recorded step before final_step=0"):
        resolve([0, 1], None, 0)
    with pytest.raises(ValueError, match=r"selected_training_steps \[5\] match none"):
        resolve([0, 1], [5], None)


def test_checkpoints_and_recompute(tmp_path):
    model = MLP()
    task = AttributionTask(dict_loss, model, checkpoints=[None, None])
    attributor = TrajectoryAttributor(make_args(tmp_path), task=task)
    assert attributor.algorithm == "Trajectory"
    with pytest.warns(UserWarning, match="first checkpoint only"):
        assert attributor.checkpoints() == [0]
    assert attributor.recompute is False
    assert TrajectoryAttributor(make_args(tmp_path, recompute_gradients=True)).recompute is True


@pytest.fixture
def store(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    train = GradientStorageManager(str(tmp_path / "train"))
    for step in range(3):
        data = mlp_data(2, step)
        write_store(train.save_dir, model, MLP_LAYERS, mlp_loss, data, batch_sizes=[2], step=step)
    test = write_store(
        tmp_path / "test", model, MLP_LAYERS, mlp_loss, mlp_data(N_TEST, 9), batch_sizes=[2, 1]
    )
    return {"model": model, "train": tmp_path / "train", "test": test}


def test_store_sources_and_their_metadata(store, tmp_path):
    attributor = TrajectoryAttributor(make_args(tmp_path))
    source = attributor.open_train_source(store["train"], steps=[0, 2], layer_name="fc1")
    assert isinstance(source, DiskGradientSource)
    assert source.steps == [0, 2] and source.layer_name == ["fc1"]
    assert [step for step, _block, _ids in source] == [0, 2]
    assert TrajectoryAttributor.available_steps(store["train"]) == [0, 1, 2]
    assert TrajectoryAttributor.available_steps(source) == [0, 2]
    assert TrajectoryAttributor.train_dir_of(source) == store["train"]
    assert TrajectoryAttributor.train_dir_of(str(store["train"])) == store["train"]
    assert TrajectoryAttributor.recorded_lr_of(source) is None
    write_lr_schedule(store["train"], {0: 0.1, 1: 0.2, 2: 0.3})
    assert TrajectoryAttributor.recorded_lr_of(store["train"]) == {0: 0.1, 1: 0.2, 2: 0.3}
    TrajectoryAttributor.close_source(source)  # a store source holds nothing to release
    assert attributor.source_meta(source, store["test"]) == {
        "train_source": "gradients",
        "sample_id_key": {"train": None, "test": None},
    }
    with pytest.raises(ValueError, match="needs a task"):
        attributor.open_train_source(_snapshot_dir(tmp_path))


def _snapshot_dir(tmp_path):
    from dattri_llm.gradient.snapshots import TrajectorySnapshots

    snapshots = TrajectorySnapshots(tmp_path / "snaps")
    return snapshots.root


def test_collect_test_matrix_and_column_order(store, tmp_path):
    attributor = TrajectoryAttributor(make_args(tmp_path))
    source = attributor.load_test_rep(store["test"])
    ids, matrices = attributor.collect_test_matrix(source)
    data = mlp_data(N_TEST, 9)
    assert ids == hash_batch({"x": data[0]}, N_TEST) == attributor.test_column_order(source)
    want = dense_reference(store["model"], MLP_LAYERS, mlp_loss, data)
    assert list(matrices) == sorted(MLP_LAYERS)
    for name in MLP_LAYERS:
        torch.testing.assert_close(matrices[name], want[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- live collection
class Recorder(TrajectoryAttributor):
    """Counts the subclass hooks."""

    def __init__(self, args, *, task=None):
        super().__init__(args, task=task)
        self.after_update, self.finished, self.step_ends = [], [], []

    def trajectory_callbacks(self, model, streamer, snapshots):
        recorder = self

        class StepEnd(HookManagerCallback):
            def on_step_end(self, record):
                recorder.step_ends.append(record.step)

        return [StepEnd()]

    def on_trajectory_block(self):
        self.after_update.append(self.task.model.fc1.weight.detach().clone())

    def finish_trajectory(self, train_target):
        self.finished.append(train_target)


def run_cache(tmp_path, name, **arg_kwargs):
    torch.manual_seed(0)
    model = MLP()
    initial = copy.deepcopy(model)
    task = AttributionTask(dict_loss, model)
    attributor = Recorder(make_args(tmp_path / name, **arg_kwargs), task=task)
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    pairs = attributor.cache(as_dicts(train), as_dicts(test), cache_dir=str(tmp_path / name))
    return attributor, initial, model, pairs, train, test


def test_cache_records_run_schedule_and_final_queries(tmp_path):
    attributor, initial, final, pairs, train, test = run_cache(tmp_path, "grads")
    ((train_dir, test_dir),) = pairs
    assert train_dir == str(tmp_path / "grads" / "train_grads")
    lrs = read_lr_schedule(train_dir)
    assert sorted(lrs) == [0, 1, 2]
    assert lrs[0] == pytest.approx(0.05) and lrs[2] < lrs[1] < lrs[0]  # linear schedule
    assert GradientStorageManager(train_dir).available_steps() == [0, 1, 2]
    assert attributor.step_ends == [0, 1, 2] and len(attributor.after_update) == 3
    assert not torch.equal(attributor.after_update[0], initial.fc1.weight)  # after the update
    assert len(attributor.finished) == 1
    test_source = attributor.load_test_rep(test_dir)
    ((step, block, ids),) = [(s, b, i) for s, b, i in test_source][:1]
    assert step == 3 and ids == hash_batch({"_arg0": test[0]}, N_TEST)[:2]
    want = dense_reference(final, MLP_LAYERS, mlp_loss, test)  # queries at θ_T
    dense = block.materialize()
    for name in MLP_LAYERS:
        torch.testing.assert_close(dense.data[name], want[name][:2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="already holds records"):
        attributor.cache(as_dicts(train), as_dicts(test), cache_dir=str(tmp_path / "grads"))


def test_recompute_replays_the_recorded_gradients(tmp_path):
    stored, *_ = run_cache(tmp_path, "grads")
    replayed, _initial, _final, pairs, *_ = run_cache(tmp_path, "snaps", recompute_gradients=True)
    ((snap_dir, _test_dir),) = pairs
    assert snap_dir == str(tmp_path / "snaps" / "train_snapshots")
    assert read_lr_schedule(snap_dir) == read_lr_schedule(tmp_path / "grads" / "train_grads")
    assert TrajectoryAttributor.available_steps(snap_dir) == [0, 1, 2]
    assert TrajectoryAttributor.recorded_lr_of(snap_dir) == read_lr_schedule(snap_dir)
    source = replayed.open_train_source(snap_dir)
    assert isinstance(source, ReplayGradientSource)
    assert replayed.source_meta(source, GradientStorageManager(_test_dir))["train_source"] == (
        "snapshots"
    )
    reference = stored.open_train_source(tmp_path / "grads" / "train_grads")
    try:
        for (s1, b1, i1), (s2, b2, i2) in zip(source, reference, strict=True):
            assert (s1, i1) == (s2, i2)
            for name in MLP_LAYERS:
                torch.testing.assert_close(
                    b1.materialize().data[name], b2.materialize().data[name], rtol=1e-5, atol=1e-6
                )
    finally:
        TrajectoryAttributor.close_source(source)


def test_collect_test_matrix_sums_token_axes_of_dense_layers(tmp_path):
    """A dense ``batch_token`` query layer ``(B, T, d)`` is the sample's gradient summed over T."""
    from dattri_llm.gradient.gradient import Gradient

    tokens = torch.randn(2, 3, 4)
    block = Gradient(
        representation={"lin": "materialized"},
        data={"lin": tokens},
        layer_types={"lin": "nn.Linear"},
        indexing={"lin": "batch_token"},
    )
    attributor = TrajectoryAttributor(make_args(tmp_path))
    ids, matrices = attributor.collect_test_matrix([(0, block, ["a", "b"])])
    assert ids == ["a", "b"]
    torch.testing.assert_close(matrices["lin"], tokens.sum(dim=1))

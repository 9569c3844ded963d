"""``training_dynamics.json``: written atomically (a write killed midway leaves the previous
file whole), read without executing anything, other formats refused."""

from __future__ import annotations

import json

import pytest

from dattri_llm.gradient.callbacks import training_dynamics_callback as dynamics

UPDATE = {"steps": [0, 1], "rows": [2, 2], "clip_coef": 0.5, "row_scale": 1.0, "groups": []}
LAYERS = {"fc": {"weight_group": 0, "bias_group": 1, "bias_index": [4, 9], "width": 10}}


def test_round_trip(tmp_path):
    dynamics.save_training_dynamics(tmp_path, {1: UPDATE}, LAYERS, skipped_steps=[3])
    loaded = dynamics.load_training_dynamics(tmp_path)
    assert loaded == {"layers": LAYERS, "updates": {1: UPDATE}, "skipped_steps": [3]}
    assert dynamics.load_training_dynamics(tmp_path / "missing") is None


def test_a_write_killed_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    dynamics.save_training_dynamics(tmp_path, {1: UPDATE}, LAYERS)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies between the write and the rename

    monkeypatch.setattr("dattri_llm.utils.atomic.os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        dynamics.save_training_dynamics(tmp_path, {1: UPDATE, 3: UPDATE}, LAYERS)
    assert dynamics.load_training_dynamics(tmp_path)["updates"] == {1: UPDATE}
    assert [p.name for p in tmp_path.iterdir()] == [dynamics.TRAINING_DYNAMICS_FILE]


def test_another_format_is_refused(tmp_path):
    (tmp_path / dynamics.TRAINING_DYNAMICS_FILE).write_text(json.dumps({"format": 2}))
    with pytest.raises(ValueError, match="format 2; this version reads format 1"):
        dynamics.load_training_dynamics(tmp_path)


def test_parameter_groups_round_trip_and_older_files_load_without_them(tmp_path):
    groups = {"fc.weight": 0, "fc.bias": 1}
    dynamics.save_training_dynamics(tmp_path, {1: UPDATE}, LAYERS, parameter_groups=groups)
    assert dynamics.load_training_dynamics(tmp_path)["parameter_groups"] == groups
    dynamics.save_training_dynamics(tmp_path / "old", {1: UPDATE}, LAYERS)
    assert "parameter_groups" not in dynamics.load_training_dynamics(tmp_path / "old")

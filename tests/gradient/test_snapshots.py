"""TrajectorySnapshots round trips, crash safety, safe loading, and LazyDynamics."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from dattri_llm.gradient.snapshots import MANIFEST_FILE, LazyDynamics, TrajectorySnapshots

REPO = Path(__file__).resolve().parents[2]


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).double())
    net[1].bias.requires_grad_(False)
    return net


def entry(step: int, scale: float) -> dict:
    m = torch.full((3,), scale)
    return {
        "moments": {"fc": (m, m * 2)},
        "step": step,
        "lr": 0.1 * scale,
        "betas": (0.9, 0.99),
        "eps": 1e-8,
        "weight_decay": 0.01,
    }


def test_parameters_round_trip_exactly(tmp_path):
    store = TrajectorySnapshots(tmp_path / "snaps")
    src = model(0)
    store.save_parameters(0, src)
    store.save_parameters(1, src, same_as=0)
    dst = model(1)
    frozen_before = dst[1].bias.detach().clone()
    store.load_parameters(1, dst)
    assert dst[0].weight.equal(src[0].weight) and dst[0].bias.equal(src[0].bias)
    assert dst[1].weight.dtype == torch.float64 and dst[1].weight.equal(src[1].weight)
    assert dst[1].bias.equal(frozen_before)  # frozen parameters are not stored
    stored = torch.load(tmp_path / "snaps" / "parameters_00000000.pt", weights_only=True)
    assert set(stored) == {"0.weight", "0.bias", "1.weight"}
    assert stored["1.weight"].dtype == torch.float64
    with pytest.raises(KeyError, match="step 5"):
        store.load_parameters(5, dst)
    with pytest.raises(KeyError, match="same_as=3"):
        store.save_parameters(2, src, same_as=3)
    with pytest.raises(KeyError, match="does not have"):
        store.load_parameters(0, nn.Linear(3, 4))
    with pytest.raises(ValueError, match="int >= 0"):
        store.save_parameters(-1, src)


def test_parameters_saved_from_a_wrapper_use_inner_names(tmp_path):
    store = TrajectorySnapshots(tmp_path)
    inner = model(0)
    wrapper = nn.Module()
    wrapper.module = inner
    store.save_parameters(0, wrapper)
    dst = model(1)
    store.load_parameters(0, dst)
    assert dst[0].weight.equal(inner[0].weight)


def test_batches_round_trip(tmp_path):
    store = TrajectorySnapshots(tmp_path)
    pair = namedtuple("pair", "x y")
    batch = OrderedDict(input_ids=torch.arange(6).reshape(2, 3), meta=[1, "a", None, 2.5])
    store.save_batch(3, batch)
    store.save_batch(4, pair(torch.ones(2), (torch.zeros(1),)))
    got = store.load_batch(3)
    assert type(got) is dict and got["input_ids"].equal(batch["input_ids"])
    assert got["meta"] == [1, "a", None, 2.5]
    x, (y,) = store.load_batch(4)
    assert x.equal(torch.ones(2)) and y.equal(torch.zeros(1))
    with pytest.raises(KeyError, match="no batches stored for step 0"):
        store.load_batch(0)
    with pytest.raises(TypeError, match=r"batch\['bad'\] is a object"):
        store.save_batch(5, {"bad": object()})


def test_dynamics_steps_repr_and_reopen(tmp_path):
    root = tmp_path / "s"
    store = TrajectorySnapshots(root)
    assert TrajectorySnapshots.is_snapshot_dir(root) and not TrajectorySnapshots.is_snapshot_dir(
        tmp_path
    )
    net = model()
    for step in (2, 0, 1):
        store.save_parameters(step, net)
    store.save_batch(0, torch.zeros(1))
    store.save_batch(2, torch.zeros(1))
    store.save_dynamics(0, "pre", entry(0, 1.0))
    store.save_dynamics(0, "post", entry(1, 2.0))
    store.save_dynamics(1, "pre", entry(1, 3.0))
    with pytest.raises(ValueError, match="'pre' or 'post'"):
        store.save_dynamics(1, "mid", entry(1, 3.0))
    with pytest.raises(ValueError, match="'pre' or 'post'"):
        store.load_dynamics(1, "mid")
    assert store.steps() == [0, 2]
    assert store.dynamics_steps() == [0]
    assert store.load_dynamics(1, "post") is None
    got = store.load_dynamics(0, "post")
    assert got["step"] == 1 and got["betas"] == (0.9, 0.99)
    assert got["moments"]["fc"][1].equal(torch.full((3,), 4.0))
    assert repr(store) == f"TrajectorySnapshots('{root}', steps=2)"
    reopened = TrajectorySnapshots(root)
    assert reopened.steps() == [0, 2] and reopened.dynamics_steps() == [0]
    assert reopened.load_batch(2).equal(torch.zeros(1))


def test_lazy_dynamics_assembles_each_step(tmp_path):
    store = TrajectorySnapshots(tmp_path)
    for step in (0, 1):
        store.save_dynamics(step, "pre", entry(step, 1.0 + step))
        store.save_dynamics(step, "post", entry(step + 1, 5.0 + step))
    store.save_dynamics(2, "pre", entry(2, 9.0))
    lazy = LazyDynamics(store)
    assert list(lazy) == [0, 1] and len(lazy) == 2 and 1 in lazy and 2 not in lazy
    got = lazy[1]
    pre, post = entry(1, 2.0), entry(2, 6.0)
    assert set(got) == {"pre", "post", "step", "lr", "betas", "eps", "weight_decay"}
    assert got["step"] == 2 and got["lr"] == pytest.approx(0.2)
    assert got["betas"] == (0.9, 0.99) and got["eps"] == 1e-8 and got["weight_decay"] == 0.01
    assert got["pre"]["fc"][0].equal(pre["moments"]["fc"][0])
    assert got["post"]["fc"][1].equal(post["moments"]["fc"][1])
    with pytest.raises(KeyError):
        lazy[2]
    with pytest.raises(TypeError):
        lazy[0] = {}  # read-only


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_file_is_refused(tmp_path):
    store = TrajectorySnapshots(tmp_path / "s")
    store.save_parameters(0, model())
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = marker
    # replace the data file with a pickle that runs a command when unpickled
    torch.save({"0.weight": exploit}, tmp_path / "s" / "parameters_00000000.pt")
    with pytest.raises(pickle.UnpicklingError):
        store.load_parameters(0, model())
    (tmp_path / "s" / "batch_00000000.pt").write_bytes(pickle.dumps(exploit, protocol=2))
    manifest = json.loads((tmp_path / "s" / MANIFEST_FILE).read_text())
    manifest["batches"]["0"] = "batch_00000000.pt"
    (tmp_path / "s" / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(pickle.UnpicklingError):
        TrajectorySnapshots(tmp_path / "s").load_batch(0)
    assert not marker.exists()


WRITER = """
import torch
from torch import nn
from dattri_llm.gradient.snapshots import TrajectorySnapshots
store = TrajectorySnapshots({root!r})
net = nn.Linear(64, 64)
step = 0
while True:
    with torch.no_grad():
        net.weight.fill_(step)
        net.bias.fill_(-step)
    store.save_parameters(step, net)
    store.save_batch(step, {{"x": torch.full((8, 64), float(step))}})
    m = torch.full((4160,), float(step))
    store.save_dynamics(step, "pre", {{"moments": {{"fc": (m, m)}}, "step": step}})
    step += 1
"""


def test_killed_writer_leaves_every_listed_snapshot_readable(tmp_path):
    root = tmp_path / "snaps"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for delay in (0.0, 0.003, 0.011):
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WRITER.format(root=str(root)))], env=env
        )
        try:
            deadline = time.monotonic() + 120
            while (
                not TrajectorySnapshots.is_snapshot_dir(root)
                or len(TrajectorySnapshots(root).steps()) < 3
            ):
                assert proc.poll() is None, "writer died on its own"
                assert time.monotonic() < deadline, "writer too slow"
                time.sleep(0.005)
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        store = TrajectorySnapshots(root)
        steps = store.steps()
        assert steps == list(range(len(steps))) and len(steps) >= 3
        net = nn.Linear(64, 64)
        for step in steps:
            store.load_parameters(step, net)
            assert net.weight.eq(step).all() and net.bias.eq(-step).all()
            assert store.load_batch(step)["x"].eq(step).all()
        for step in range(max(steps) + 2):
            pre = store.load_dynamics(step, "pre")
            assert pre is None or (pre["step"] == step and pre["moments"]["fc"][0].eq(step).all())

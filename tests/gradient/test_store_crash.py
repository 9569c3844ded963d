from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from store_helpers import assert_records_equal, crash_record

from dattri_llm.gradient.storage_manager import INDEX_FILE, GradientStorageManager

TESTS_DIR = Path(__file__).resolve().parents[1]

WRITER = """
from dattri_llm.gradient.storage_manager import GradientStorageManager
from store_helpers import crash_record
store = GradientStorageManager({root!r}, disk_format={fmt!r})
step = 0
while True:
    store.save_bulk([crash_record(step)])
    step += 1
"""


def index_lines(root: Path) -> int:
    try:
        return (root / INDEX_FILE).read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def kill_writer_midway(root: Path, fmt: str, min_lines: int, extra_delay: float) -> None:
    """Start a writer loop in another process and SIGKILL it once ``min_lines`` are indexed."""
    code = WRITER.format(root=str(root), fmt=fmt)
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env)
    try:
        deadline = time.monotonic() + 120
        while index_lines(root) < min_lines:
            assert proc.poll() is None, "writer died on its own"
            assert time.monotonic() < deadline, "writer too slow"
            time.sleep(0.005)
        time.sleep(extra_delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def check_store(root: Path) -> int:
    """Every indexed record loads completely and equals its deterministic content."""
    store = GradientStorageManager(root)
    steps = store.available_steps()
    assert steps == list(range(len(steps)))
    for location in store.locations():
        [got] = store.load_records(location)
        assert_records_equal(got, crash_record(got.step))
    return len(steps)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["memmap", "pickle"])
def test_sigkill_mid_offload_leaves_a_readable_store(tmp_path, fmt):
    root = tmp_path / "store"
    kill_writer_midway(root, fmt, min_lines=3, extra_delay=random.Random(fmt).uniform(0, 0.05))
    assert check_store(root) >= 3
    # the store stays appendable: numbering continues after any orphan file
    store = GradientStorageManager(root)
    n = len(store.available_steps())
    store.save_bulk([crash_record(n)])
    assert check_store(root) == n + 1


def test_truncated_last_log_line_is_ignored_with_warning(tmp_path):
    root = tmp_path / "store"
    store = GradientStorageManager(root)
    for step in range(3):
        store.save_bulk([crash_record(step)])
    log = root / INDEX_FILE
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 15])  # cut into the last line
    (root / ".batch_000009.mmap.bin.abc.tmp").write_bytes(b"partial")  # an interrupted write
    with pytest.warns(UserWarning, match="truncated last line"):
        reopened = GradientStorageManager(root)
    assert reopened.available_steps() == [0, 1]
    for location in reopened.locations():
        [got] = reopened.load_records(location)
        assert_records_equal(got, crash_record(got.step))
    # appending repairs the tail; the orphaned group file is never reused
    assert reopened.save_bulk([crash_record(2)]) == "batch_000003.mmap"
    assert check_store(root) == 3


def test_undecodable_line_stops_reading_that_log_with_warning(tmp_path):
    """compat.md §1: a line that fails to decode warns and stops the reading of that log."""
    root = tmp_path / "store"
    store = GradientStorageManager(root)
    for step in range(3):
        store.save_bulk([crash_record(step)])
    log = root / INDEX_FILE
    lines = log.read_bytes().split(b"\n")
    log.write_bytes(b"\n".join([lines[0], b"{not json", *lines[1:]]))
    with pytest.warns(UserWarning, match="ignoring line 2 and anything after it"):
        reopened = GradientStorageManager(root)
    assert reopened.available_steps() == [0]

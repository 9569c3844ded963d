"""TensorCache loses nothing on a failed spill, budgets its own entries once, loads safely."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from dattri_llm.utils import cache as cache_mod
from dattri_llm.utils.cache import CacheBudget, TensorCache


def _t(n_floats: int, value: float = 1.0) -> torch.Tensor:
    """A float32 tensor of ``4·n_floats`` bytes."""
    return torch.full((n_floats,), value, dtype=torch.float32)


class _FlakyWriter:
    """Writes half a file at the given path, then raises, while ``failing`` is set."""

    def __init__(self) -> None:
        self.failing = True
        self.calls = 0

    def __call__(self, path: Path, value: object) -> None:
        self.calls += 1
        if self.failing:
            path.write_bytes(b"PK\x03\x04 truncated")
            raise OSError("disk full")
        torch.save(value, path)


# --------------------------------------------------------------------------- failed spills


def test_failed_spill_keeps_the_evicted_entry_and_propagates(tmp_path):
    writer = _FlakyWriter()
    cache = TensorCache("tiered", budget=32, spill_dir=tmp_path, writer=writer)
    a, b = _t(4, 1.0), _t(4, 2.0)
    cache.put("a", a)
    cache.put("b", b)
    with pytest.raises(OSError, match="disk full"):
        cache.put("c", _t(4, 3.0))  # needs room: "a" must spill, and the spill fails
    assert writer.calls == 1
    assert cache.get("a") is a and cache.get("b") is b
    assert cache.location("a") is None and cache.nbytes == 32
    assert cache.keys() == ["a", "b"] and "c" not in cache
    assert list(tmp_path.iterdir()) == []  # the half-written file is gone, never indexed

    writer.failing = False
    assert cache.put("c", _t(4, 3.0))
    assert cache.location("a") is not None and torch.equal(cache.get("a"), a)
    assert cache.keys() == ["b", "c", "a"] and cache.nbytes == 32


def test_failed_spill_after_earlier_successes_keeps_every_entry(tmp_path):
    writes = []

    def writer(path: Path, value: object) -> None:
        if len(writes) == 1:
            raise OSError("second spill fails")
        torch.save(value, path)
        writes.append(path)

    cache = TensorCache("tiered", budget=48, spill_dir=tmp_path, writer=writer)
    values = {k: _t(4, float(i)) for i, k in enumerate("abc")}  # 16 bytes each
    for key, value in values.items():
        cache.put(key, value)
    with pytest.raises(OSError, match="second spill"):
        cache.put("big", _t(8))  # needs 32 bytes: "a" spills, then "b" fails
    assert cache.location("a") == writes[0] and cache.location("b") is None
    for key, value in values.items():
        assert torch.equal(cache.get(key), value)
    assert cache.nbytes == 32 and len(cache) == 3


def test_default_writer_leaves_no_partial_spill_file(tmp_path, monkeypatch):
    def failing_save(obj, f, *args, **kwargs):
        f.write(b"half a pickle")
        raise OSError("killed mid-write")

    monkeypatch.setattr(torch, "save", failing_save)
    cache = TensorCache("disk", spill_dir=tmp_path)
    with pytest.raises(OSError, match="mid-write"):
        cache.put("k", _t(4))
    assert "k" not in cache and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- budget accounting


@pytest.mark.parametrize("residency", ["memory", "tiered"])
def test_fraction_budget_counts_own_entries_once(monkeypatch, tmp_path, residency):
    """Host memory 1000 bytes, fraction 0.5: the cache holds 500 bytes of its own entries.

    The simulated free memory shrinks by what the cache holds, as real free
    memory does; counting the entries again against it would stop at 300.
    """
    holder: dict[str, TensorCache] = {}

    def free_host_bytes() -> int:
        return 1000 - (holder["cache"].nbytes if holder else 0)

    monkeypatch.setattr(cache_mod, "available_host_bytes", free_host_bytes)
    cache = TensorCache(
        residency,
        budget=CacheBudget(fraction=0.5),
        spill_dir=tmp_path,
        nbytes_fn=lambda value: 100,
    )
    holder["cache"] = cache
    for i in range(5):
        assert cache.put(i, _t(1))
    assert cache.nbytes == 500 and all(cache.location(i) is None for i in range(5))
    stored = cache.put(5, _t(1))
    if residency == "memory":
        assert not stored and 5 not in cache
    else:  # the oldest entry spills for the sixth
        assert cache.location(0) is not None and cache.location(5) is None
    assert cache.nbytes == 500


def test_budget_is_measured_once_at_creation(monkeypatch):
    free = {"bytes": 1000}
    monkeypatch.setattr(cache_mod, "available_host_bytes", lambda: free["bytes"])
    budget = CacheBudget(fraction=0.5)
    free["bytes"] = 100
    assert budget.total() == 500
    assert budget.fits(200, held=300) and not budget.fits(201, held=300)


# --------------------------------------------------------------------------- safe loads


class _CreatesMarker:
    """Unpickling this object creates ``marker`` (``open(marker, "w")``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_spill_file_fails_to_load_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    cache = TensorCache("disk", spill_dir=tmp_path / "spill")
    cache.put("k", _t(2))
    path = cache.location("k")
    # someone replaces the spill file with a pickle that runs code when unpickled
    torch.save({"weights": _t(2), "payload": _CreatesMarker(marker)}, path)
    with pytest.raises(pickle.UnpicklingError, match="refusing to load spill file"):
        cache.get("k")
    assert not marker.exists()


def test_crafted_file_is_really_malicious(tmp_path):
    """Guard for the test above: a full unpickle of the same file does create the marker."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"payload": _CreatesMarker(marker)}, path)
    loaded = torch.load(path, weights_only=False)
    loaded["payload"].close()
    assert marker.exists()


@dataclasses.dataclass
class _Box:
    tensor: torch.Tensor


@pytest.mark.parametrize("residency", ["disk", "tiered"])
def test_default_writer_refuses_values_a_safe_load_cannot_rebuild(tmp_path, residency):
    cache = TensorCache(residency, budget=8, spill_dir=tmp_path)
    cache.put("k", _t(1))
    with pytest.raises(TypeError, match=r"value\['box'\] \(_Box\)"):
        cache.put("k", {"ok": [_t(1), (1, "s", None)], "box": _Box(_t(1))})
    assert torch.equal(cache.get("k"), _t(1))  # a refused put changes nothing
    nested = {"a": [_t(1), (2, 3.5, "s", None)], "b": torch.Size([2]), "c": torch.float16}
    cache.put("nested", nested)
    cache.put("big", _t(10))  # tiered: straight to disk
    back = cache.get("nested")
    assert torch.equal(back["a"][0], _t(1)) and back["a"][1] == (2, 3.5, "s", None)
    assert back["b"] == torch.Size([2]) and back["c"] == torch.float16


def test_memory_residency_and_custom_writers_accept_any_object(tmp_path):
    box = _Box(_t(1))
    memory = TensorCache("memory")
    assert memory.put("box", box) and memory.get("box") is box
    custom = TensorCache(
        "disk",
        spill_dir=tmp_path,
        writer=lambda path, value: torch.save(value, path),
        reader=lambda path: torch.load(path, weights_only=False),
    )
    custom.put("box", box)
    assert torch.equal(custom.get("box").tensor, box.tensor)

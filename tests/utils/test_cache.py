"""Tests for dattri_llm.utils.cache: budgets, residencies, spill directory lifecycle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dattri_llm.utils import cache as cache_mod
from dattri_llm.utils.cache import (
    CACHE_RESIDENCIES,
    DEFAULT_CACHE_FRACTION,
    CacheBudget,
    TensorCache,
    available_host_bytes,
    tensor_nbytes,
)

KB = 1024


def _t(n_floats: int, value: float = 1.0) -> torch.Tensor:
    """A float32 tensor of ``4·n_floats`` bytes."""
    return torch.full((n_floats,), value, dtype=torch.float32)


# --------------------------------------------------------------------------- sizes and budgets


def test_constants():
    assert CACHE_RESIDENCIES == ("disk", "memory", "tiered")
    assert DEFAULT_CACHE_FRACTION == 0.35


def test_tensor_nbytes_tensors_containers_and_objects():
    class WithNbytes:
        nbytes = 123

    assert tensor_nbytes(torch.zeros(3, 5, dtype=torch.float64)) == 120
    assert tensor_nbytes(torch.zeros(4, dtype=torch.bfloat16)) == 8
    nested = {"a": _t(2), "b": [_t(3), (_t(1), "text")], "c": None}
    assert tensor_nbytes(nested) == 4 * 6
    assert tensor_nbytes(WithNbytes()) == 123
    assert tensor_nbytes("string") == 0
    assert tensor_nbytes(7) == 0


def test_available_host_bytes_reads_meminfo_and_falls_back(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:  2048 kB\n")
    monkeypatch.setattr(cache_mod, "_MEMINFO", str(meminfo))
    assert available_host_bytes() == 2048 * 1024
    monkeypatch.setattr(cache_mod, "_MEMINFO", str(tmp_path / "missing"))
    assert available_host_bytes() == 16 * 1024**3


def test_cache_budget_limit_fraction_and_fits(monkeypatch):
    fixed = CacheBudget(limit_bytes=100)
    assert fixed.total() == 100 and fixed.device is None
    assert fixed.fits(60, held=40) and not fixed.fits(61, held=40)
    monkeypatch.setattr(cache_mod, "available_host_bytes", lambda: 1000)
    host = CacheBudget()
    assert host.total() == int(0.35 * 1000)
    assert CacheBudget(fraction=0.5).total() == 500
    # measured once, at creation: later changes of free memory do not move it
    monkeypatch.setattr(cache_mod, "available_host_bytes", lambda: 2000)
    assert host.total() == 350
    assert CacheBudget().total() == 700
    assert CacheBudget("cpu").device == torch.device("cpu")


@pytest.mark.parametrize("kwargs", [{"fraction": 0.0}, {"fraction": 1.5}, {"limit_bytes": -1}])
def test_cache_budget_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="CacheBudget"):
        CacheBudget(**kwargs)


def test_invalid_residency_and_budget_type():
    with pytest.raises(ValueError, match="residency"):
        TensorCache("gpu")
    with pytest.raises(TypeError, match="budget"):
        TensorCache("memory", budget=1.5)


# --------------------------------------------------------------------------- memory


def test_memory_put_get_replace_discard_clear():
    cache = TensorCache("memory")
    x, y = _t(4, 1.0), _t(8, 2.0)
    assert cache.put("x", x) and cache.put(("tuple", 1), y)
    assert cache.get("x") is x and cache.get(("tuple", 1)) is y
    assert len(cache) == 2 and "x" in cache and "z" not in cache
    assert cache.get("z", "default") == "default"
    assert cache.nbytes == 48 and cache.keys() == ["x", ("tuple", 1)]
    assert cache.location("x") is None and cache.spill_dir is None
    assert cache.put("x", _t(1))  # replacement frees the old entry's bytes
    assert cache.nbytes == 4 + 32
    cache.discard("x")
    cache.discard("never-there")
    assert "x" not in cache and cache.nbytes == 32
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_memory_budget_refuses_entries_that_do_not_fit():
    cache = TensorCache("memory", budget=40)  # int budget = byte cap
    assert cache.put("a", _t(6))  # 24 bytes
    assert not cache.put("b", _t(5))  # 24 + 20 > 40
    assert "b" not in cache and cache.nbytes == 24
    assert cache.put("c", _t(4))  # 24 + 16 == 40 fits exactly
    # a failed replacement drops the stale entry instead of keeping it
    assert not cache.put("a", _t(100))
    assert "a" not in cache and cache.nbytes == 16


def test_memory_budget_object_and_custom_nbytes_fn():
    cache = TensorCache("memory", budget=CacheBudget(limit_bytes=10), nbytes_fn=lambda v: v["n"])
    assert cache.put("small", {"n": 10})
    assert not cache.put("big", {"n": 1})
    assert cache.nbytes == 10


def test_get_or_compute_computes_once_and_returns_unretained_values():
    calls = []

    def compute():
        calls.append(1)
        return _t(4)

    cache = TensorCache("memory")
    first = cache.get_or_compute("k", compute)
    assert cache.get_or_compute("k", compute) is first and len(calls) == 1
    tiny = TensorCache("memory", budget=1)
    value = tiny.get_or_compute("k", compute)
    assert torch.equal(value, _t(4)) and "k" not in tiny and len(calls) == 2


# --------------------------------------------------------------------------- disk


def test_disk_writes_every_entry_and_reads_back(tmp_path):
    cache = TensorCache("disk", spill_dir=tmp_path / "spill")
    x = torch.randn(3, 4)
    assert cache.put("x", x)
    path = cache.location("x")
    assert path is not None and path.exists() and path.parent == tmp_path / "spill"
    assert cache.nbytes == 0
    back = cache.get("x")
    assert torch.equal(back, x) and back is not x
    nested = {"a": torch.arange(3), "b": [torch.ones(2)]}
    cache.put("nested", nested)
    got = cache.get("nested")
    assert torch.equal(got["a"], nested["a"]) and torch.equal(got["b"][0], nested["b"][0])
    cache.put("x", torch.zeros(2))  # replacement deletes the old file
    assert not path.exists() and torch.equal(cache.get("x"), torch.zeros(2))
    new_path = cache.location("x")
    cache.discard("x")
    assert not new_path.exists() and "x" not in cache


def test_disk_custom_writer_reader_and_on_spill(tmp_path):
    written, spilled = [], []

    def writer(path: Path, value):
        target = path.with_suffix(".custom")
        torch.save(value * 2, target)
        written.append(target)
        return target

    def reader(path: Path):
        return torch.load(path) + 1

    cache = TensorCache(
        "disk",
        spill_dir=tmp_path,
        writer=writer,
        reader=reader,
        on_spill=lambda k, p: spilled.append((k, p)),
    )
    cache.put("k", torch.ones(2))
    assert cache.location("k") == written[0] and spilled == [("k", written[0])]
    assert torch.equal(cache.get("k"), torch.full((2,), 3.0))


# --------------------------------------------------------------------------- tiered


def test_tiered_spills_oldest_first_and_large_entries_go_to_disk(tmp_path):
    spilled = []
    cache = TensorCache(
        "tiered",
        budget=48,
        spill_dir=tmp_path,
        on_spill=lambda k, p: spilled.append(k),
    )
    values = {k: _t(4, float(i)) for i, k in enumerate("abcd")}  # 16 bytes each
    for k in "abc":
        assert cache.put(k, values[k])
    assert spilled == [] and cache.nbytes == 48
    cache.put("d", values["d"])  # oldest ("a") spills
    assert spilled == ["a"] and cache.location("a") is not None
    assert cache.nbytes == 48 and cache.keys() == ["b", "c", "d", "a"]
    cache.put("e", _t(8))  # 32 bytes: two more oldest spill
    assert spilled == ["a", "b", "c"] and cache.keys() == ["d", "e", "a", "b", "c"]
    cache.put("huge", _t(100))  # larger than the whole budget: straight to disk
    assert spilled[-1] == "huge" and cache.location("d") is None and cache.nbytes == 48
    for k in "abcd":
        assert torch.equal(cache.get(k), values[k])
    a_path = cache.location("a")
    cache.put("a", _t(1))  # replacing a spilled key removes its file; "d" spills for room
    assert cache.location("a") is None and not a_path.exists()
    assert spilled[-1] == "d" and sorted(cache.keys()[:2]) == ["a", "e"]
    assert len(list(tmp_path.iterdir())) == 4


def test_tiered_without_budget_stays_in_memory():
    cache = TensorCache("tiered")
    for i in range(5):
        cache.put(i, _t(1000))
    assert cache.spill_dir is None and all(cache.location(i) is None for i in range(5))


# --------------------------------------------------------------------------- lifecycle


def test_private_spill_dir_is_lazy_and_removed_on_close():
    cache = TensorCache("tiered", budget=8)
    cache.put("small", _t(1))
    assert cache.spill_dir is None
    cache.put("big", _t(10))
    spill = cache.spill_dir
    assert spill is not None and spill.is_dir() and cache.location("big").exists()
    cache.close()
    assert not spill.exists() and len(cache) == 0
    cache.close()  # idempotent


def test_callable_spill_dir_is_called_lazily_and_removed(tmp_path):
    calls = []

    def make() -> Path:
        calls.append(1)
        return tmp_path / "lazy"

    with TensorCache("disk", spill_dir=make) as cache:
        assert calls == []
        cache.put("a", _t(1))
        cache.put("b", _t(1))
        assert calls == [1] and cache.spill_dir == tmp_path / "lazy"
    assert not (tmp_path / "lazy").exists()


def test_given_spill_dir_is_kept_on_close_with_files(tmp_path):
    target = tmp_path / "given"
    cache = TensorCache("disk", spill_dir=target)
    assert cache.spill_dir == target and not target.exists()
    cache.put("a", _t(2))
    path = cache.location("a")
    cache.close()
    assert target.is_dir() and path.exists()
    assert "a" not in cache and cache.get("a") is None


def test_put_after_close_raises_and_clear_keeps_cache_usable(tmp_path):
    cache = TensorCache("disk", spill_dir=tmp_path)
    cache.put("a", _t(1))
    path = cache.location("a")
    cache.clear()
    assert not path.exists() and cache.put("b", _t(1))
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.put("c", _t(1))
    with TensorCache() as ctx:
        ctx.put("x", _t(1))
    with pytest.raises(RuntimeError, match="closed"):
        ctx.put("y", _t(1))


def test_two_caches_sharing_a_spill_dir_do_not_collide(tmp_path):
    first = TensorCache("disk", spill_dir=tmp_path)
    second = TensorCache("disk", spill_dir=tmp_path)
    first.put("k", torch.zeros(1))
    second.put("k", torch.ones(1))
    assert torch.equal(first.get("k"), torch.zeros(1))
    assert torch.equal(second.get("k"), torch.ones(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_tracks_free_device_memory():
    budget = CacheBudget("cuda", fraction=0.5)
    free, _ = torch.cuda.mem_get_info()
    assert budget.device.type == "cuda" and 0 < budget.total() <= free

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from store_helpers import (
    KINDS,
    assert_gradients_equal,
    assert_records_equal,
    build_gradient,
    dataset_rows,
    make_gradient,
    make_records,
    sample_gradient,
    shuffled_records,
)

import dattri_llm.gradient.storage_manager as sm
from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import (
    DISK_FORMATS,
    GradientStorageManager,
    projection_record,
)
from dattri_llm.gradient.store import format as store_format
from dattri_llm.utils.hashing import hash_sample

TESTS_DIR = Path(__file__).resolve().parents[1]
CASES = [(fmt, kind, per) for fmt in DISK_FORMATS for kind in KINDS for per in (False, True)]


def run_python(code: str) -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR / "gradient")])
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def write_all_cases(root: Path) -> None:
    for fmt, kind, per in CASES:
        store = GradientStorageManager(case_dir(root, fmt, kind, per), disk_format=fmt)
        for group in make_records(kind, per):
            store.save_bulk(group)


@pytest.fixture(scope="module")
def written_stores(tmp_path_factory) -> Path:
    """All format × kind × record-type stores (written in this process)."""
    root = tmp_path_factory.mktemp("stores")
    write_all_cases(root)
    return root


def case_dir(root: Path, fmt: str, kind: str, per: bool) -> Path:
    return root / f"{fmt}_{kind}_{per}"


def check_round_trip(root: Path, fmt: str, kind: str, per: bool) -> None:
    store = GradientStorageManager(case_dir(root, fmt, kind, per))
    groups = make_records(kind, per)
    assert store.locations() == [
        f"batch_{k:06d}{'.mmap' if fmt == 'memmap' else '.pt'}" for k in range(3)
    ]
    for location, group in zip(store.locations(), groups):
        loaded = store.load_records(location)
        assert len(loaded) == len(group)
        for got, want in zip(loaded, group):
            assert_records_equal(got, want)
    assert store.available_steps() == [0, 1, 2, 3, 4, 5]
    assert store.sample_id_key is None
    assert store.gradient_accumulation_steps == 1


@pytest.mark.parametrize(("fmt", "kind", "per"), CASES)
def test_round_trip(written_stores, fmt, kind, per):
    check_round_trip(written_stores, fmt, kind, per)


@pytest.mark.slow
def test_round_trip_across_processes(tmp_path):
    run_python(
        f"""
        from pathlib import Path
        from test_storage_manager import write_all_cases
        write_all_cases(Path(r"{tmp_path}"))
        """
    )
    for case in CASES:
        check_round_trip(tmp_path, *case)


@pytest.mark.parametrize("fmt", DISK_FORMATS)
def test_lookup_and_load_semantics(written_stores, fmt):
    store = GradientStorageManager(case_dir(written_stores, fmt, "mixed", False))
    groups = make_records("mixed", False)
    record = groups[1][1]  # step 3, batch 3
    assert store.lookup_by_hash("id3_2") == [(3, 2)]
    assert store.index["id3_2"] == [
        {"file": store.locations()[1], "idx": 1, "step": 3, "sample_idx": 2}
    ]
    one = store.load_sample_by_hash("id3_2", 3, 2)
    assert one.batch_size == 1
    assert_gradients_equal(one, record.gradient.slice("batch", 2))
    [whole] = store.load_all_by_hash("id3_2")
    assert_records_equal(whole, record)
    with pytest.raises(KeyError, match=r"available \(step, sample_idx\): \[\(3, 2\)\]"):
        store.load_sample_by_hash("id3_2", 3, 0)
    with pytest.raises(KeyError, match="'nope' not in index"):
        store.lookup_by_hash("nope")
    with pytest.raises(KeyError):
        store.load_all_by_hash("nope")
    assert store.iter_steps([5, 0, 1, 99]) == [
        (store.locations()[0], {0: [0], 1: [1]}),
        (store.locations()[2], {5: [1]}),
    ]
    assert store.iter_steps(2) == [(store.locations()[1], {2: [0]})]


def test_per_sample_records_index(written_stores):
    store = GradientStorageManager(case_dir(written_stores, "memmap", "dense", True))
    assert store.lookup_by_hash("id1_2") == [(1, 0)]
    entry = store.index["id1_2"][0]
    assert (entry["idx"], entry["sample_idx"]) == (4, 0)  # group 0: 2 samples of step 0, then 3
    want = make_records("dense", True)[0][4]
    assert_gradients_equal(store.load_sample_by_hash("id1_2", 1, 0), want.gradient)


def test_load_all_sorted_by_step_and_repeated_samples(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    for step in (4, 1, 7):
        store.save_bulk([GradientRecord(step, ["a", "b"], make_gradient("dense", step, 2))])
    store.save(GradientRecord(0, "a", make_gradient("dense", 9, 1)))
    assert store.lookup_by_hash("a") == [(0, 0), (1, 0), (4, 0), (7, 0)]
    assert [r.step for r in store.load_all_by_hash("a")] == [0, 1, 4, 7]
    assert store.available_steps() == [0, 1, 4, 7]


@pytest.mark.parametrize("fmt", DISK_FORMATS)
def test_shuffled_order_gives_same_gradient_per_hash(tmp_path, fmt):
    n = dataset_rows().shape[0]
    order_a = list(range(n))
    order_b = order_a[:]
    random.Random(0).shuffle(order_b)
    stores = []
    for name, order, batch in (("a", order_a, 4), ("b", order_b, 3)):
        store = GradientStorageManager(tmp_path / name, disk_format=fmt)
        store.save_bulk(shuffled_records(order, batch))
        stores.append(GradientStorageManager(tmp_path / name))
    rows = dataset_rows()
    for i in range(n):
        h = hash_sample({"input_ids": rows[i]})
        got = [s.load_sample_by_hash(h, *s.lookup_by_hash(h)[0]) for s in stores]
        assert_gradients_equal(got[0], got[1])
        assert_gradients_equal(got[0], sample_gradient(rows[i : i + 1]))
        # lookup from the inputs themselves
        assert stores[1].lookup({"input_ids": rows[i]}) == stores[1].lookup_by_hash(h)
        assert_gradients_equal(
            stores[1].load_sample({"input_ids": rows[i]}, *stores[1].lookup_by_hash(h)[0]), got[0]
        )
        assert len(stores[0].load_all({"input_ids": rows[i]})) == 1


def test_memmap_reads_are_copy_on_write_views(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    location = store.save_bulk([GradientRecord(0, ["a", "b"], make_gradient("dense", 0, 2))])
    first = store.load_records(location)[0].gradient.data["dense"]
    before = first.clone()
    first.add_(1)  # private copy-on-write page: the file is unchanged
    again = store.load_records(location)[0].gradient.data["dense"]
    assert torch.equal(again, before)


def test_module_kwargs_with_dtypes_stay_memmap(tmp_path):
    """The ``.mmap.meta`` file is a weights-only ``torch.save``: dtypes and tuples round-trip."""
    kwargs = {"dtype": torch.float16, "kernel_size": (2, 2)}
    g = Gradient(
        {"lin": "factorized"},
        {"lin": Factorized(torch.ones(2, 3), torch.ones(2, 4), kwargs)},
        {"lin": "nn.Linear"},
    )
    store = GradientStorageManager(tmp_path / "s")
    location = store.save_bulk([GradientRecord(0, ["a", "b"], g)])
    assert location.endswith(".mmap")
    [got] = GradientStorageManager(tmp_path / "s").load_records(location)
    assert got.gradient.data["lin"].module_kwargs == kwargs


def test_sample_id_key_lookups(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    store.save_bulk([GradientRecord(0, ["7", "8"], make_gradient("dense", 0, 2), "uid")])
    reopened = GradientStorageManager(tmp_path / "s")
    assert reopened.sample_id_key == "uid"
    assert reopened.lookup({"uid": torch.tensor(8), "input_ids": torch.ones(3)}) == [(0, 1)]
    assert reopened.lookup_by_hash(7) == [(0, 0)]
    with pytest.raises(KeyError, match="sample_id_key='uid' is missing"):
        reopened.lookup({"input_ids": torch.ones(3)})
    positional = GradientStorageManager(tmp_path / "p")
    positional.save_bulk([GradientRecord(0, ["x", "y"], make_gradient("dense", 0, 2), 1)])
    assert positional.lookup({"_arg1": "y"}) == [(0, 1)]
    assert positional.lookup(("ignored", "x")) == [(0, 0)]
    with pytest.raises(KeyError, match="_arg1"):
        positional.lookup({"_arg0": "x"})


def test_rank_directories_are_merged(tmp_path, monkeypatch):
    root = tmp_path / "s"
    GradientStorageManager(root).save_bulk([GradientRecord(0, ["a"], make_gradient("dense", 0, 1))])
    for rank in (1, 0):
        monkeypatch.setattr(sm, "dist_rank", lambda rank=rank: rank)
        store = GradientStorageManager(root)
        assert store._backend.write_dir is None  # resolved at the first save, not at construction
        location = store.save_bulk(
            [GradientRecord(10 + rank, [f"r{rank}"], make_gradient("dense", rank, 1))]
        )
        assert location == f"rank_{rank}/batch_000000.mmap"
    monkeypatch.setattr(sm, "dist_rank", lambda: None)
    merged = GradientStorageManager(root)
    assert merged.locations() == [
        "batch_000000.mmap",
        "rank_0/batch_000000.mmap",
        "rank_1/batch_000000.mmap",
    ]
    assert merged.available_steps() == [0, 10, 11]
    assert_gradients_equal(merged.load_sample_by_hash("r1", 11, 0), make_gradient("dense", 1, 1))


def test_reopen_and_append_continues_numbering(tmp_path):
    root = tmp_path / "s"
    GradientStorageManager(root).save_bulk([GradientRecord(0, "a", make_gradient("dense", 0, 1))])
    store = GradientStorageManager(root)
    record = GradientRecord(1, "b", make_gradient("dense", 1, 1))
    assert store.save_bulk([record]) == "batch_000001.mmap"
    assert GradientStorageManager(root).available_steps() == [0, 1]


# ------------------------------------------------------------------------------------ errors


def test_save_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="is an existing file"):
        GradientStorageManager(path)


def test_other_memmap_format_is_rejected(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    location = store.save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
    meta_path = store.save_dir / (location + ".meta")
    meta = torch.load(meta_path, weights_only=True)
    torch.save({**meta, "format": 3}, meta_path)
    with pytest.raises(
        ValueError, match=r"\.mmap\.meta has format 3.*reads memmap groups of format 2"
    ):
        store.load_records(location)


def test_list_hash_must_match_batch_size(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    with pytest.raises(ValueError, match="2 identifiers but its gradient has batch size 3"):
        store.save_bulk([GradientRecord(0, ["a", "b"], make_gradient("dense", 0, 3))])
    assert store.index == {}


@pytest.mark.parametrize("residency", ["disk", "memory"])
def test_single_identifier_record_may_hold_a_batch(tmp_path, residency):
    """compat.md §1: one string identifier with batch size > 1 is indexed once and read whole."""
    store = GradientStorageManager(tmp_path / "s", residency=residency)
    whole = make_gradient("dense", 0, 3)
    store.save(GradientRecord(4, "a", whole))
    store.save_bulk(
        [GradientRecord(5, "b", make_gradient("dense", 1, 1)), GradientRecord(5, "c", whole)]
    )
    assert store.lookup_by_hash("a") == [(4, 0)] and store.lookup_by_hash("c") == [(5, 0)]
    [record] = store.load_all_by_hash("a")
    assert record.input_hash == "a"
    assert_gradients_equal(record.gradient, whole)
    assert_gradients_equal(store.load_sample_by_hash("a", 4, 0), whole.slice("batch", 0))
    if residency == "disk":
        [reopened] = GradientStorageManager(tmp_path / "s").load_all_by_hash("c")
        assert_gradients_equal(reopened.gradient, whole)


def test_save_rejects_list_hash_and_empty_bulk(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    with pytest.raises(TypeError, match="save_bulk"):
        store.save(GradientRecord(0, ["a"], make_gradient("dense", 0, 1)))
    with pytest.raises(ValueError, match="no records"):
        store.save_bulk([])


def test_conflicting_sample_id_key(tmp_path):
    root = tmp_path / "s"
    store = GradientStorageManager(root)
    with pytest.raises(ValueError, match="mix sample_id_key"):
        store.save_bulk(
            [
                GradientRecord(0, "a", make_gradient("dense", 0, 1), "uid"),
                GradientRecord(0, "b", make_gradient("dense", 0, 1)),
            ]
        )
    store.save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
    with pytest.raises(ValueError, match="sample_id_key=None.*sample_id_key='uid'"):
        store.save(GradientRecord(1, "b", make_gradient("dense", 0, 1), "uid"))
    with pytest.raises(ValueError, match="sample_id_key"):
        GradientStorageManager(root).save(GradientRecord(1, "b", make_gradient("dense", 0, 1), 0))


def test_gradient_accumulation_declarations(tmp_path):
    root = tmp_path / "s"
    store = GradientStorageManager(root)
    assert store.gradient_accumulation_steps == 1
    with pytest.raises(ValueError, match=">= 1"):
        store.declare_gradient_accumulation_steps(0)
    store.declare_gradient_accumulation_steps(2)
    store.declare_gradient_accumulation_steps(2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2; cannot declare 4"):
        store.declare_gradient_accumulation_steps(4)
    store.save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
    with pytest.raises(ValueError, match="cannot declare 1"):
        GradientStorageManager(root).declare_gradient_accumulation_steps(1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"residency": "ssd"}, r"unknown residency 'ssd'; it must be one of \['disk'"),
        ({"disk_format": "npz"}, r"disk_format 'npz'; it must be one of \['pickle', 'memmap'\]"),
        ({"budget_bytes": -1}, "budget_bytes"),
    ],
)
def test_invalid_options(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientStorageManager(tmp_path, **kwargs)


def test_unknown_location(tmp_path):
    with pytest.raises(KeyError, match="no group 'group_9'"):
        GradientStorageManager(tmp_path).load_records("group_9")


# ---------------------------------------------------------------------------- RAM residencies


def test_memory_residency(tmp_path):
    (tmp_path / "index.jsonl").write_text("garbage that a memory store must ignore\n")
    group = make_records("mixed", False)[0]
    with GradientStorageManager(tmp_path, residency="memory") as store:
        location = store.save_bulk(group)
        assert location.startswith("mem_") and len(location) == len("mem_") + 8
        assert store.resident_bytes == sum(r.gradient.nbytes for r in group)
        loaded = store.load_records(location)
        for got, want in zip(loaded, group):
            assert_records_equal(got, want)
        # blocks handed out are independent of the stored group
        loaded[0].gradient.data.pop("dense")
        assert "dense" in store.load_records(location)[0].gradient.data
        assert sorted(os.listdir(tmp_path)) == ["index.jsonl"]  # nothing written
    with pytest.raises(RuntimeError, match="closed"):
        store.load_records(location)
    store.close()  # idempotent


def test_memory_budget_overflow_is_not_indexed(tmp_path):
    records = [GradientRecord(0, ["a", "b"], make_gradient("dense", 0, 2))]
    store = GradientStorageManager(
        tmp_path, residency="memory", budget_bytes=records[0].gradient.nbytes
    )
    store.save_bulk(records)
    with pytest.raises(MemoryError, match="budget"):
        store.save_bulk([GradientRecord(1, ["c"], make_gradient("dense", 1, 1))])
    assert "c" not in store.index and store.available_steps() == [0]


@pytest.mark.parametrize("fmt", DISK_FORMATS)
def test_tiered_residency_spills_oldest_and_cleans_up(tmp_path, fmt):
    groups = make_records("factorized", False)
    nbytes = sum(r.gradient.nbytes for r in groups[2])
    root = tmp_path / "s"
    store = GradientStorageManager(root, residency="tiered", budget_bytes=nbytes, disk_format=fmt)
    locations = [store.save_bulk(g) for g in groups]
    assert store.resident_bytes <= nbytes
    [spill] = [p for p in root.iterdir() if p.name.startswith("tiered_spill_")]
    suffix = ".mmap" if fmt == "memmap" else ".pt"
    # the two oldest groups spilled as entry_<seq>, their index entries re-pointed there
    assert store.locations() == [f"{spill.name}/entry_{k:08d}{suffix}" for k in (0, 1)] + [
        "mem_00000002"
    ]
    assert store.index["id0_0"][0]["file"] == f"{spill.name}/entry_00000000{suffix}"
    locations = store.locations()
    for location, group in zip(locations, groups):
        for got, want in zip(store.load_records(location), group):
            assert_records_equal(got, want)
    store.close()
    assert not root.exists()  # created only for the spill


def test_tiered_default_budget_is_half_total_ram(tmp_path):
    with open("/proc/meminfo") as fh:
        total_kib = next(int(line.split()[1]) for line in fh if line.startswith("MemTotal:"))
    budget = GradientStorageManager(tmp_path, residency="tiered").budget_bytes
    # MemTotal excludes a little firmware/kernel memory that the page count includes
    assert total_kib * 1024 // 2 <= budget <= total_kib * 1024 // 2 * 1.1


def test_two_managers_on_one_directory_never_overwrite(tmp_path):
    first = GradientStorageManager(tmp_path / "s")
    first.save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
    second = GradientStorageManager(tmp_path / "s")
    second.save(GradientRecord(1, "b", make_gradient("dense", 1, 1)))
    first.save(GradientRecord(2, "c", make_gradient("dense", 2, 1)))
    merged = GradientStorageManager(tmp_path / "s")
    assert len(merged.locations()) == 3
    for h, step in (("a", 0), ("b", 1), ("c", 2)):
        assert_gradients_equal(
            merged.load_sample_by_hash(h, step, 0), make_gradient("dense", step, 1)
        )


# ---------------------------------------------------------------------------- projection record

LOGRA = {"__default__": {"style": "logra", "proj_dim": 4, "proj_seed": 0}}


def custom_factory(feature, feature_batch_size, proj_dim, **kwargs):
    """A stand-in projection factory (only its identity is recorded)."""
    raise AssertionError("not called")


BUILTIN = "dattri_llm.gradient.ops.projection.random_project"


def test_projection_record_resolves_defaults():
    from dattri_llm.gradient.ops.projection import DattriProjector, random_project

    assert projection_record(None) == {} and projection_record({}) == {}
    proj = {
        "style": "dense",
        "proj_dim": np.int64(8),
        "device": "cpu",
        "proj_max_batch_size": 16,
        "dtype": torch.float32,  # not JSON-able: dropped
    }
    record = projection_record({"fc1": proj, "__default__": {"proj_dim": 4}})
    assert record == {
        "fc1": {
            "style": "dense",
            "proj_dim": 8,
            "proj_seed": 0,
            "include_bias": True,
            "proj_max_batch_size": 16,
            "projector": BUILTIN,
            "proj_type": "normal",
        },
        "__default__": {
            "style": "logra",
            "proj_dim": 4,
            "proj_seed": 0,
            "include_bias": True,
            "projector": BUILTIN,
            "proj_type": "normal",
        },
    }
    assert type(record["fc1"]["proj_dim"]) is int
    mask = projection_record({"__default__": {"style": "mask", "proj_dim": 3, "proj_seed": 2}})
    assert mask == {
        "__default__": {"style": "mask", "proj_dim": 3, "proj_seed": 2, "include_bias": True}
    }
    # dattri is not installed: the default factory (bare or wrapped) is the built-in one
    for default in (random_project, DattriProjector(), DattriProjector(random_project)):
        assert projection_record(LOGRA, default) == projection_record(LOGRA)
    custom = projection_record(LOGRA, DattriProjector(custom_factory))
    assert custom["__default__"]["projector"] == f"{__name__}.custom_factory"
    assert "proj_type" not in custom["__default__"]
    assert projection_record(mask, custom_factory) == mask  # masks use no projector
    for resolved in (record, mask, custom):
        assert projection_record(resolved) == resolved  # idempotent


def test_projection_declaration_persisted_and_reopened(tmp_path):
    root = tmp_path / "s"
    store = GradientStorageManager(root)
    assert store.projection is None  # never declared: unknown
    store.declare_projection(LOGRA)
    store.declare_projection(dict(LOGRA))  # same settings: no-op
    assert store.projection == projection_record(LOGRA)
    assert not root.exists()  # written with the first save
    store.save_bulk([GradientRecord(0, ["a", "b"], make_gradient("dense", 0, 2))])
    assert json.loads((root / "projection.json").read_text()) == projection_record(LOGRA)
    reopened = GradientStorageManager(root)
    assert reopened.projection == projection_record(LOGRA)
    other = {"__default__": {**LOGRA["__default__"], "proj_seed": 1}}
    with pytest.raises(ValueError, match=r"'proj_seed': 0.*cannot declare.*'proj_seed': 1"):
        reopened.declare_projection(other)
    with pytest.raises(ValueError, match=r"cannot declare \{\}"):
        reopened.declare_projection(None)
    with pytest.raises(ValueError, match="cannot declare"):
        reopened.declare_projection(LOGRA, custom_factory)
    assert GradientStorageManager(root).projection == projection_record(LOGRA)  # unchanged


def test_unprojected_declaration(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    store.declare_projection(None)
    store.save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
    assert GradientStorageManager(tmp_path / "s").projection == {}
    with pytest.raises(ValueError, match="projection \\{\\}; cannot declare"):
        GradientStorageManager(tmp_path / "s").declare_projection(LOGRA)


def test_conflicting_rank_projections(tmp_path):
    for rank, seed in ((0, 0), (1, 1)):
        directory = tmp_path / f"rank_{rank}"
        directory.mkdir()
        (directory / "index.jsonl").write_text("")
        (directory / "index_meta.json").write_text(json.dumps({"sample_id_key": None}))
        record = projection_record({"__default__": {"proj_dim": 4, "proj_seed": seed}})
        (directory / "projection.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"rank_1.*declares projection.*'proj_seed': 1"):
        GradientStorageManager(tmp_path)


@pytest.mark.parametrize("residency", ["memory", "tiered"])
def test_projection_declaration_in_ram(tmp_path, residency):
    with GradientStorageManager(tmp_path, residency=residency, budget_bytes=1 << 20) as store:
        store.declare_projection(LOGRA)
        store.save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
        assert store.projection == projection_record(LOGRA)
        with pytest.raises(ValueError, match="cannot declare"):
            store.declare_projection(None)
        assert not (tmp_path / "projection.json").exists()


def test_projection_factory_in_use_is_recorded_and_mismatch_refused(tmp_path, monkeypatch):
    """Stores made with the built-in and with dattri's default factory do not score together."""
    import types

    import dattri_llm.gradient.ops.projection as projection
    import dattri_llm.gradient.ops.projector as projector
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.arguments import AttributionArguments

    stand_in = types.ModuleType("dattri.func.projection")  # dattri is not installed here
    exec("def random_project(*args, **kwargs):\n    raise AssertionError", stand_in.__dict__)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for name, factory in (
        ("builtin", projection.random_project),
        ("dattri", stand_in.random_project),
    ):
        monkeypatch.setattr(projector, "_default_factory", lambda factory=factory: factory)
        store = GradientStorageManager(tmp_path / name)
        store.declare_projection(LOGRA)  # projector=None: the default factory in use
        layers = {"lin": ("materialized", "nn.Linear", "batch", x)}
        store.save_bulk([GradientRecord(0, ["a", "b"], build_gradient(layers))])
    assert GradientStorageManager(tmp_path / "builtin").projection["__default__"]["projector"] == (
        BUILTIN
    )
    assert GradientStorageManager(tmp_path / "dattri").projection["__default__"]["projector"] == (
        "dattri.func.projection.random_project"
    )
    attributor = TracInAttributor(AttributionArguments(output_dir=str(tmp_path), use_cpu=True))
    with pytest.raises(
        ValueError,
        match=r"layer 'lin'.*projector='dattri_llm\.gradient\.ops\.projection\.random_project'"
        r".*projector='dattri\.func\.projection\.random_project'",
    ):
        attributor.attribute_from_cache(tmp_path / "builtin", tmp_path / "dattri")
    attributor.attribute_from_cache(tmp_path / "builtin", tmp_path / "builtin")


# ------------------------------------------------------------------------ one occurrence per pair


def capture_twice(root: Path, residency: str = "disk", reopen: bool = True):
    """Save the same three groups twice (second run with other data); return the store."""
    store = GradientStorageManager(root, residency=residency)
    for seed in (0, 1):
        if reopen and residency == "disk":
            store = GradientStorageManager(root)
        for group in make_records("mixed", False, seed=seed):
            store.save_bulk(group)
    return store


@pytest.mark.parametrize(
    ("residency", "reopen"), [("disk", True), ("disk", False), ("memory", False)]
)
def test_recapture_replaces_earlier_occurrences(tmp_path, residency, reopen):
    root = tmp_path / "s"
    store = capture_twice(root, residency, reopen)
    stores = [store] + ([GradientStorageManager(root)] if residency == "disk" else [])
    newest = make_records("mixed", False, seed=1)
    for s in stores:
        assert s.lookup_by_hash("id3_2") == [(3, 2)]  # once, not twice
        assert len(s.index["id3_2"]) == 1
        assert_gradients_equal(
            s.load_sample_by_hash("id3_2", 3, 2), newest[1][1].gradient.slice("batch", 2)
        )
        [whole] = s.load_all_by_hash("id3_2")
        assert_records_equal(whole, newest[1][1])
        # readers see one copy: the newest groups only
        assert s.available_steps() == [0, 1, 2, 3, 4, 5]
        plan = s.iter_steps(range(6))
        assert [loc for loc, _ in plan] == s.locations() and len(plan) == 3
        blocks = [r for loc, _ in plan for r in s.load_records(loc)]
        for got, want in zip(blocks, [r for g in newest for r in g]):
            assert_records_equal(got, want)
    if residency == "memory":
        assert store.resident_bytes == sum(r.gradient.nbytes for g in newest for r in g)


def test_recapture_leaves_scores_unchanged(tmp_path):
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.attribution.arguments import AttributionArguments

    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))

    def capture(root: Path) -> None:
        store = GradientStorageManager(root)
        for start in (0, 2, 4):
            rows = x[start : start + 2]
            layers = {"lin": ("materialized", "nn.Linear", "batch", rows)}
            ids = [f"s{start + i}" for i in range(rows.shape[0])]
            store.save_bulk([GradientRecord(start, ids, build_gradient(layers))])

    for _ in range(2):
        capture(tmp_path / "train")
    capture(tmp_path / "test")
    attributor = TracInAttributor(AttributionArguments(output_dir=str(tmp_path), use_cpu=True))
    score = attributor.attribute_from_cache(tmp_path / "train", tmp_path / "test")
    assert score.row_train_ids == [f"s{i}" for i in range(5)]
    torch.testing.assert_close(score.scores, x @ x.T)  # not doubled


def test_save_of_the_same_pair_replaces_in_place(tmp_path):
    root = tmp_path / "s"
    first, second = make_gradient("dense", 0, 1), make_gradient("dense", 1, 1)
    assert GradientStorageManager(root).save(GradientRecord(2, "k", first)) == "step_000002_k.mmap"
    store = GradientStorageManager(root)
    assert store.save(GradientRecord(2, "k", second)) == "step_000002_k.mmap"
    store.save(GradientRecord(3, "k", first))  # a new step is appended
    for s in (store, GradientStorageManager(root)):
        assert s.lookup_by_hash("k") == [(2, 0), (3, 0)]
        assert_gradients_equal(s.load_sample_by_hash("k", 2, 0), second)
        assert len(s.locations()) == 2


def test_resaving_part_of_a_batch_keeps_the_other_samples_once(tmp_path):
    root = tmp_path / "s"
    old, new = make_gradient("dense", 0, 3), make_gradient("dense", 1, 2)
    store = GradientStorageManager(root)
    old_location = store.save_bulk([GradientRecord(0, ["a", "b", "c"], old)])
    store.save_bulk([GradientRecord(0, ["b", "d"], new)])
    for s in (store, GradientStorageManager(root)):
        assert s.lookup_by_hash("b") == [(0, 0)]
        [kept] = s.load_records(old_location)
        assert kept.input_hash == ["a", "c"]
        assert_gradients_equal(kept.gradient, old.slice("batch", [0, 2]))
        rows = [h for loc, _ in s.iter_steps(0) for r in s.load_records(loc) for h in r.input_hash]
        assert sorted(rows) == ["a", "b", "c", "d"]
        assert_gradients_equal(s.load_sample_by_hash("b", 0, 0), new.slice("batch", 0))


def test_unknown_identifier_message_lists_the_index(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    store.save_bulk([GradientRecord(1, ["a", "b"], make_gradient("dense", 0, 2))])
    with pytest.raises(KeyError, match=r"'zz' not in index.*e\.g\. \['a', 'b'\].*steps \[1\]"):
        store.load_sample_by_hash("zz", 1, 0)
    with pytest.raises(
        KeyError, match=r"not in index; available \(step, sample_idx\): \[\(1, 0\)\]"
    ):
        store.load_sample_by_hash("a", 2, 0)


def test_identifiers_are_made_file_system_safe_only_in_names(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    names = ["../up", "a/b", "a%2Fb", "ü"]
    locations = [
        store.save(GradientRecord(0, n, make_gradient("dense", k, 1))) for k, n in enumerate(names)
    ]
    assert len(set(locations)) == 4 and all("/" not in loc for loc in locations)
    assert not (tmp_path / "up.mmap.bin").exists()
    reopened = GradientStorageManager(tmp_path / "s")
    for k, n in enumerate(names):
        assert_gradients_equal(reopened.load_sample_by_hash(n, 0, 0), make_gradient("dense", k, 1))


# ---------------------------------------------------------------------------- concurrent writers


def test_writer_racing_another_one_never_overwrites_its_group(tmp_path, monkeypatch):
    """B saves while A writes its first group: both groups survive (names claimed exclusively)."""
    root = tmp_path / "s"
    a, b = GradientStorageManager(root), GradientStorageManager(root)
    real_write = store_format.atomic_write
    raced = []

    def racing_write(path, write):
        if not raced and Path(path).name.startswith(("batch_", "group_")):
            # A has picked its group file name and is writing it: B saves now
            raced.append(path)
            b.save_bulk([GradientRecord(1, ["b"], make_gradient("dense", 1, 1))])
        return real_write(path, write)

    monkeypatch.setattr(store_format, "atomic_write", racing_write)
    a.save_bulk([GradientRecord(0, ["a"], make_gradient("dense", 0, 1))])
    merged = GradientStorageManager(root)
    assert len(merged.locations()) == 2
    for h, step in (("a", 0), ("b", 1)):
        assert_gradients_equal(
            merged.load_sample_by_hash(h, step, 0), make_gradient("dense", step, 1)
        )


@pytest.mark.slow
def test_two_processes_writing_one_directory(tmp_path):
    root = tmp_path / "s"
    code = """
        from dattri_llm.gradient.gradient import GradientRecord
        from dattri_llm.gradient.storage_manager import GradientStorageManager
        from store_helpers import make_gradient
        store = GradientStorageManager(r"{root}", disk_format="{fmt}")
        for step in range({start}, {start} + 25):
            store.save_bulk([GradientRecord(step, [f"s{{step}}"], make_gradient("dense", step, 1))])
    """
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code.format(root=root, fmt=fmt, start=start))],
            env=env,
        )
        for fmt, start in (("memmap", 0), ("pickle", 100))
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    merged = GradientStorageManager(root)
    steps = list(range(25)) + list(range(100, 125))
    assert merged.available_steps() == steps and len(merged.locations()) == 50
    for step in steps:
        assert_gradients_equal(
            merged.load_sample_by_hash(f"s{step}", step, 0), make_gradient("dense", step, 1)
        )

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
    FORMAT_VERSION,
    GradientStorageManager,
    load_group_file,
    projection_record,
)
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
        f"group_{k:08d}{'.mmap' if fmt == 'memmap' else '.pt'}" for k in range(3)
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
    with pytest.raises(KeyError, match="not in gradient store"):
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


def test_non_json_module_kwargs_fall_back_to_pickle(tmp_path):
    g = Gradient(
        {"lin": "factorized"},
        {"lin": Factorized(torch.ones(2, 3), torch.ones(2, 4), {"dtype": torch.float16})},
        {"lin": "nn.Linear"},
    )
    store = GradientStorageManager(tmp_path / "s")
    location = store.save_bulk([GradientRecord(0, ["a", "b"], g)])
    assert location.endswith(".pt")
    [got] = GradientStorageManager(tmp_path / "s").load_records(location)
    assert got.gradient.data["lin"].module_kwargs == {"dtype": torch.float16}


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
    import dattri_llm.utils.distributed as dist

    root = tmp_path / "s"
    GradientStorageManager(root).save_bulk([GradientRecord(0, ["a"], make_gradient("dense", 0, 1))])
    for rank in (1, 0):
        monkeypatch.setattr(dist, "dist_rank", lambda rank=rank: rank)
        store = GradientStorageManager(root)
        assert store._write_dir is None  # resolved at the first save, not at construction
        location = store.save_bulk(
            [GradientRecord(10 + rank, [f"r{rank}"], make_gradient("dense", rank, 1))]
        )
        assert location == f"rank_{rank}/group_00000000.mmap"
    monkeypatch.setattr(dist, "dist_rank", lambda: None)
    merged = GradientStorageManager(root)
    assert merged.locations() == [
        "group_00000000.mmap",
        "rank_0/group_00000000.mmap",
        "rank_1/group_00000000.mmap",
    ]
    assert merged.available_steps() == [0, 10, 11]
    assert_gradients_equal(merged.load_sample_by_hash("r1", 11, 0), make_gradient("dense", 1, 1))


def test_reopen_and_append_continues_numbering(tmp_path):
    root = tmp_path / "s"
    GradientStorageManager(root).save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
    store = GradientStorageManager(root)
    assert store.save(GradientRecord(1, "b", make_gradient("dense", 1, 1))) == "group_00000001.mmap"
    assert GradientStorageManager(root).available_steps() == [0, 1]


def test_sidecar_and_log_contents(tmp_path):
    root = tmp_path / "s"
    store = GradientStorageManager(root)
    store.declare_gradient_accumulation_steps(3)
    assert not root.exists()  # created on the first save
    store.save_bulk([GradientRecord(5, ["a", "b"], make_gradient("dense", 0, 2))])
    sidecar = json.loads((root / "store.json").read_text())
    assert sidecar == {
        "format_version": FORMAT_VERSION,
        "sample_id_key": None,
        "gradient_accumulation_steps": 3,
    }
    [line] = (root / "index.jsonl").read_text().splitlines()
    assert json.loads(line) == {
        "file": "group_00000000.mmap",
        "records": [{"idx": 0, "step": 5, "ids": ["a", "b"]}],
    }
    assert GradientStorageManager(root).gradient_accumulation_steps == 3


# ------------------------------------------------------------------------------------ errors


def test_save_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="is an existing file"):
        GradientStorageManager(path)


def test_other_format_version_is_rejected(tmp_path, monkeypatch):
    root = tmp_path / "s"
    monkeypatch.setattr(sm, "FORMAT_VERSION", FORMAT_VERSION + 1)
    location = GradientStorageManager(root).save(
        GradientRecord(0, "a", make_gradient("dense", 0, 1))
    )
    monkeypatch.setattr(sm, "FORMAT_VERSION", FORMAT_VERSION)
    with pytest.raises(ValueError, match=rf"store\.json.*version {FORMAT_VERSION + 1}.*version "):
        GradientStorageManager(root)
    group = root / location
    with pytest.raises(ValueError, match=rf"{group.name}.*version {FORMAT_VERSION + 1}"):
        load_group_file(group)


def test_pickle_group_header_mismatch_is_detected(tmp_path):
    store = GradientStorageManager(tmp_path / "s", disk_format="pickle")
    location = store.save(GradientRecord(0, "a", make_gradient("dense", 0, 1)))
    path = store.save_dir / location
    payload = torch.load(path, weights_only=False)
    payload["tensors"][0] = torch.zeros(2, 6)
    torch.save(payload, path)
    with pytest.raises(ValueError, match="layer 'dense'.*corrupt"):
        store.load_records(location)


def test_list_hash_must_match_batch_size(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    with pytest.raises(ValueError, match="2 identifiers but its gradient has batch size 3"):
        store.save_bulk([GradientRecord(0, ["a", "b"], make_gradient("dense", 0, 3))])
    assert store.index == {}


@pytest.mark.parametrize("residency", ["disk", "memory"])
def test_single_identifier_record_must_hold_one_sample(tmp_path, residency):
    store = GradientStorageManager(tmp_path / "s", residency=residency)
    record = GradientRecord(4, "a", make_gradient("dense", 0, 3))
    with pytest.raises(ValueError, match=r"records\[0\] \(step 4\).*'a'.*batch size 3.*list"):
        store.save(record)
    with pytest.raises(ValueError, match="one identifier per sample"):
        store.save_bulk([GradientRecord(4, "b", make_gradient("dense", 0, 1)), record])
    assert store.index == {}
    assert store.available_steps() == []


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
        ({"residency": "ssd"}, "unknown residency 'ssd'"),
        ({"disk_format": "npz"}, "unknown disk_format 'npz'"),
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
    spilled = [p for p in root.iterdir() if p.name.startswith(".spill_")]
    assert len(spilled) == 1 and len(list(spilled[0].iterdir())) >= 2
    for location, group in zip(locations, groups):
        for got, want in zip(store.load_records(location), group):
            assert_records_equal(got, want)
    store.close()
    assert not root.exists()  # created only for the spill


def test_tiered_default_budget_is_half_available_ram(tmp_path, monkeypatch):
    monkeypatch.setattr(sm, "available_host_bytes", lambda: 1000)
    assert GradientStorageManager(tmp_path, residency="tiered").budget_bytes == 500


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
            "proj_type": "normal",
        },
        "__default__": {
            "style": "logra",
            "proj_dim": 4,
            "proj_seed": 0,
            "include_bias": True,
            "proj_type": "normal",
        },
    }
    assert type(record["fc1"]["proj_dim"]) is int
    mask = projection_record({"__default__": {"style": "mask", "proj_dim": 3, "proj_seed": 2}})
    assert mask == {
        "__default__": {"style": "mask", "proj_dim": 3, "proj_seed": 2, "include_bias": True}
    }
    # the default factory (bare or wrapped) is not recorded; another factory is, by name
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
    sidecar = json.loads((root / "store.json").read_text())
    assert sidecar["projection"] == projection_record(LOGRA)
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
        (tmp_path / f"rank_{rank}").mkdir()
        settings = {
            "format_version": FORMAT_VERSION,
            "projection": projection_record({"__default__": {"proj_dim": 4, "proj_seed": seed}}),
        }
        (tmp_path / f"rank_{rank}" / "store.json").write_text(json.dumps(settings))
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
        assert not (tmp_path / "store.json").exists()

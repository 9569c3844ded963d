"""Store format of compat.md §1: stores laid out by hand open in ours, ours match the layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from store_helpers import assert_gradients_equal, assert_records_equal, build_gradient

import dattri_llm.gradient.storage_manager as sm
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.gradient import Factorized, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager

META = {"format": 2, "sample_id_key": None, "gradient_accumulation_steps": 1}


# ----------------------------------------------------------------- the format, written by hand


def dense_gradient(x: torch.Tensor):
    return build_gradient({"lin": ("materialized", "nn.Linear", "batch", x)})


def mixed_gradient(seed: int, batch: int):
    gen = torch.Generator().manual_seed(seed)
    fac = Factorized(
        torch.randn(batch, 2, 4, generator=gen).to(torch.bfloat16),
        torch.randn(batch, 2, 3, generator=gen, dtype=torch.float64),
        module_kwargs={"has_bias": True, "kernel_size": (1, 1)},
    )
    layers = {
        "lin": ("materialized", "nn.Linear", "batch", torch.randn(batch, 3, generator=gen)),
        "fac": ("factorized", "nn.Linear", "batch_token", fac),
        "ids": ("materialized", "nn.Linear", "batch", torch.zeros(batch, 0)),
    }
    return build_gradient(layers)


def tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def layout_memmap(records: list[GradientRecord]) -> tuple[dict, bytes]:
    """``(.mmap.meta dict, .mmap.bin bytes)`` of ``records`` as compat.md §1 documents them."""
    data = bytearray()

    def part(t: torch.Tensor) -> dict:
        raw = tensor_bytes(t)
        spec = {
            "byte_off": len(data),
            "nbytes": len(raw),
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
        }
        data.extend(raw + b"\0" * (-len(raw) % 8))
        return spec

    entries = []
    for r in records:
        g = r.gradient
        layers = {}
        for name, value in g.data.items():
            if isinstance(value, Factorized):
                parts = {"activation": part(value.activation)}
                parts["pre_activation_grad"] = part(value.pre_activation_grad)
                layers[name] = {
                    "kind": "factorized",
                    "parts": parts,
                    "module_kwargs": value.module_kwargs,
                    "batch_first": value.batch_first,
                }
            else:
                layers[name] = {"kind": "dense", "parts": {"data": part(value)}}
        entries.append(
            {
                "step": r.step,
                "input_hash": r.input_hash,
                "sample_id_key": r.sample_id_key,
                "representation": dict(g.representation),
                "layer_types": dict(g.layer_types),
                "indexing": dict(g.indexing),
                "layers": layers,
            }
        )
    return {"format": 2, "records": entries}, bytes(data)


def log_line(handle: str, records: list[GradientRecord]) -> str:
    described = [
        {
            "idx": i,
            "step": r.step,
            "hashes": [r.input_hash] if isinstance(r.input_hash, str) else list(r.input_hash),
        }
        for i, r in enumerate(records)
    ]
    return json.dumps({"file": handle, "records": described}, separators=(",", ":"))


def lay_out_group(root: Path, handle: str, records: list[GradientRecord]) -> None:
    path = root / handle
    if handle.endswith(".mmap"):
        meta, data = layout_memmap(records)
        Path(str(path) + ".bin").write_bytes(data)
        torch.save(meta, str(path) + ".meta")
    else:
        torch.save(records, path)


def lay_out_store(root: Path, groups: dict[str, list[list[GradientRecord]]]) -> None:
    """``{write dir: [(handle, records), ...]}`` laid out by hand (index, sidecar, groups)."""
    for directory, entries in groups.items():
        (root / directory).mkdir(parents=True, exist_ok=True)
        (root / directory / "index_meta.json").write_text(json.dumps(META))
        lines = []
        for handle, records in entries:
            lay_out_group(root, handle, records)
            lines.append(log_line(handle, records))
        (root / directory / "index.jsonl").write_text("".join(line + "\n" for line in lines))


def reference_groups() -> dict:
    """Root: a memmap bulk group; rank_0: a pickle group; rank_1: two save() groups."""
    return {
        ".": [("batch_000000.mmap", [GradientRecord(0, ["r0", "r1"], mixed_gradient(0, 2))])],
        "rank_0": [
            (
                "rank_0/batch_000000.pt",
                [
                    GradientRecord(1, ["p0", "p1"], mixed_gradient(1, 2)),
                    GradientRecord(1, "p2", mixed_gradient(2, 1)),
                ],
            )
        ],
        "rank_1": [
            ("rank_1/step_000002_q0.mmap", [GradientRecord(2, "q0", mixed_gradient(3, 1))]),
            ("rank_1/step_000003_q1.pt", [GradientRecord(3, "q1", mixed_gradient(4, 3))]),
        ],
    }


def test_hand_laid_store_opens_merges_and_reads_back(tmp_path):
    groups = reference_groups()
    lay_out_store(tmp_path, groups)
    store = GradientStorageManager(tmp_path)
    handles = [h for entries in groups.values() for h, _ in entries]
    assert store.locations() == handles
    assert store.available_steps() == [0, 1, 2, 3]
    assert store.sample_id_key is None and store.gradient_accumulation_steps == 1
    assert store.projection is None  # the reference design records no projection: unknown
    for entries in groups.values():
        for handle, records in entries:
            loaded = store.load_records(handle)
            assert len(loaded) == len(records)
            for got, want in zip(loaded, records):
                assert_records_equal(got, want)
    assert store.lookup_by_hash("r1") == [(0, 1)]
    assert store.index["p2"] == [
        {"file": "rank_0/batch_000000.pt", "idx": 1, "step": 1, "sample_idx": 0}
    ]
    want = groups["rank_0"][0][1][0].gradient.slice("batch", 1)
    assert_gradients_equal(store.load_sample_by_hash("p1", 1, 1), want)
    # a single identifier over a batch of 3: indexed once, read back whole
    assert store.lookup_by_hash("q1") == [(3, 0)]
    [whole] = store.load_all_by_hash("q1")
    assert_gradients_equal(whole.gradient, groups["rank_1"][1][1][0].gradient)


def test_hand_laid_store_with_duplicate_entries_keeps_the_newest(tmp_path):
    """The reference appends duplicates: save() twice (same file) and save_bulk twice."""
    old, new = mixed_gradient(5, 2), mixed_gradient(6, 2)
    lay_out_store(
        tmp_path,
        {
            ".": [
                ("step_000004_s.mmap", [GradientRecord(4, "s", mixed_gradient(7, 1))]),
                ("batch_000000.mmap", [GradientRecord(0, ["a", "b"], old)]),
                ("step_000004_s.mmap", [GradientRecord(4, "s", mixed_gradient(7, 1))]),
                ("batch_000001.mmap", [GradientRecord(0, ["a", "b"], new)]),
            ]
        },
    )
    store = GradientStorageManager(tmp_path)
    assert store.lookup_by_hash("a") == [(0, 0)] and store.lookup_by_hash("s") == [(4, 0)]
    assert_gradients_equal(store.load_sample_by_hash("b", 0, 1), new.slice("batch", 1))
    assert [r.step for r in store.load_all_by_hash("a")] == [0]
    assert store.locations() == ["batch_000001.mmap", "step_000004_s.mmap"]
    assert store.iter_steps([0, 4]) == [
        ("batch_000001.mmap", {0: [0]}),
        ("step_000004_s.mmap", {4: [0]}),
    ]


def test_hand_laid_store_scores(tmp_path):
    """A reference-layout train store (root + two rank dirs) scores against one of ours."""
    gen = torch.Generator().manual_seed(0)
    x_train, x_test = torch.randn(5, 3, generator=gen), torch.randn(2, 3, generator=gen)
    lay_out_store(
        tmp_path / "train",
        {
            ".": [
                (
                    "batch_000000.mmap",
                    [GradientRecord(0, ["t0", "t1"], dense_gradient(x_train[:2]))],
                )
            ],
            "rank_0": [
                (
                    "rank_0/batch_000000.pt",
                    [GradientRecord(0, ["t2"], dense_gradient(x_train[2:3]))],
                )
            ],
            "rank_1": [
                (
                    "rank_1/batch_000000.mmap",
                    [GradientRecord(0, ["t3", "t4"], dense_gradient(x_train[3:]))],
                )
            ],
        },
    )
    ours = GradientStorageManager(tmp_path / "test")
    ours.save_bulk([GradientRecord(0, ["e0", "e1"], dense_gradient(x_test))])
    args = AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True)
    score = TracInAttributor(args).attribute_from_cache(tmp_path / "train", tmp_path / "test")
    assert score.row_train_ids == ["t0", "t1", "t2", "t3", "t4"]
    torch.testing.assert_close(score.scores, x_train @ x_test.T)


# ----------------------------------------------------------------- the files our store writes


def test_written_files_match_the_documented_layout(tmp_path):
    root = tmp_path / "s"
    store = GradientStorageManager(root)
    store.declare_gradient_accumulation_steps(2)
    bulk = [
        GradientRecord(5, ["a", "b"], mixed_gradient(0, 2)),
        GradientRecord(6, "c", mixed_gradient(1, 3)),
    ]
    single = GradientRecord(7, "x/y z", mixed_gradient(2, 1))
    assert store.save_bulk(bulk) == "batch_000000.mmap"
    assert store.save(single) == "step_000007_x%2Fy%20z.mmap"  # identifier made file-safe
    assert store.save_bulk(bulk[:1]) == "batch_000001.mmap"
    assert sorted(p.name for p in root.iterdir()) == [
        "batch_000000.mmap.bin",
        "batch_000000.mmap.meta",
        "batch_000001.mmap.bin",
        "batch_000001.mmap.meta",
        "index.jsonl",
        "index_meta.json",
        "step_000007_x%2Fy%20z.mmap.bin",
        "step_000007_x%2Fy%20z.mmap.meta",
    ]
    assert json.loads((root / "index_meta.json").read_text()) == {
        "format": 2,
        "sample_id_key": None,
        "gradient_accumulation_steps": 2,
    }
    assert (root / "index.jsonl").read_text() == (
        log_line("batch_000000.mmap", bulk)
        + "\n"
        + log_line("step_000007_x%2Fy%20z.mmap", [single])
        + "\n"
        + log_line("batch_000001.mmap", bulk[:1])
        + "\n"
    )
    for base, records in (("batch_000000", bulk), ("step_000007_x%2Fy%20z", [single])):
        want_meta, want_bin = layout_memmap(records)
        assert (root / f"{base}.mmap.bin").read_bytes() == want_bin
        meta = torch.load(root / f"{base}.mmap.meta", weights_only=True)
        assert meta == want_meta


def test_written_pickle_group_is_a_list_of_records(tmp_path):
    store = GradientStorageManager(tmp_path, disk_format="pickle")
    record = GradientRecord(3, "solo", mixed_gradient(0, 1))
    assert store.save(record) == "step_000003_solo.pt"
    [loaded] = torch.load(tmp_path / "step_000003_solo.pt", weights_only=False)
    assert_records_equal(loaded, record)


def test_rank_directory_resolved_at_first_write_through_module_dist_rank(tmp_path, monkeypatch):
    store = GradientStorageManager(tmp_path)
    monkeypatch.setattr(sm, "dist_rank", lambda: 3)  # looked up when the first group is written
    location = store.save_bulk([GradientRecord(0, ["a"], mixed_gradient(0, 1))])
    assert location == "rank_3/batch_000000.mmap"
    monkeypatch.setattr(sm, "dist_rank", lambda: 4)  # frozen after the first write
    assert (
        store.save_bulk([GradientRecord(1, ["b"], mixed_gradient(1, 1))])
        == "rank_3/batch_000001.mmap"
    )
    [line, _] = (tmp_path / "rank_3" / "index.jsonl").read_text().splitlines()
    assert json.loads(line)["file"] == "rank_3/batch_000000.mmap"  # root-relative handle
    assert not (tmp_path / "index.jsonl").exists()


def test_batch_counter_starts_after_the_highest_existing_id(tmp_path):
    (tmp_path / "batch_000041.pt").write_bytes(b"")  # e.g. an orphan of an interrupted run
    (tmp_path / "batch_7.mmap.bin").write_bytes(b"")
    store = GradientStorageManager(tmp_path)
    assert store.save_bulk([GradientRecord(0, ["a"], mixed_gradient(0, 1))]) == "batch_000042.mmap"


def test_list_length_is_checked_before_any_file_is_written(tmp_path):
    store = GradientStorageManager(tmp_path / "s")
    with pytest.raises(ValueError, match="2 identifiers but its gradient has batch size 3"):
        store.save_bulk([GradientRecord(0, ["a", "b"], mixed_gradient(0, 3))])
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").glob("batch_*"))

"""Opening a store never runs code from its files (issue 8 item 11)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from store_helpers import make_gradient

from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager, load_group_file


class Payload:
    """Unpickling this object would create ``marker`` (what a malicious file would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def write_store(root: Path, disk_format: str) -> str:
    store = GradientStorageManager(root, disk_format=disk_format)
    return store.save_bulk([GradientRecord(0, ["a", "b"], make_gradient("dense", 0, 2))])


def test_malicious_pickle_group_is_refused_without_running_code(tmp_path):
    root, marker = tmp_path / "s", tmp_path / "pwned"
    location = write_store(root, "pickle")
    torch.save([Payload(marker)], root / location)  # same name, crafted content
    store = GradientStorageManager(root)
    with pytest.raises(ValueError, match=r"batch_000000\.pt was refused.*weights_only=True"):
        store.load_records(location)
    with pytest.raises(ValueError, match="was refused"):
        load_group_file(root / location)
    assert not marker.exists()


def test_malicious_memmap_meta_is_refused_without_running_code(tmp_path):
    root, marker = tmp_path / "s", tmp_path / "pwned"
    location = write_store(root, "memmap")
    meta_path = root / (location + ".meta")
    meta = torch.load(meta_path, weights_only=True)
    meta["records"][0]["sample_id_key"] = Payload(marker)
    torch.save(meta, meta_path)
    store = GradientStorageManager(root)
    with pytest.raises(ValueError, match=r"batch_000000\.mmap\.meta was refused"):
        store.load_sample_by_hash("a", 0, 0)
    assert not marker.exists()

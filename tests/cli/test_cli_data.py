"""The data files the command reads: JSON lines, text, parquet and saved datasets."""

from __future__ import annotations

import sys

import pytest
from cli_helpers import TRAIN, write_jsonl

from dattri_llm.cli.data import load_records
from dattri_llm.cli.errors import CLIError

ROWS = [{"text": t} for t in TRAIN[:4]]


def test_every_format_gives_the_same_records(tmp_path):
    datasets = pytest.importorskip("datasets")
    assert load_records(str(write_jsonl(tmp_path / "a.jsonl", ROWS))) == ROWS
    (tmp_path / "a.txt").write_text("\n".join(r["text"] for r in ROWS) + "\n\n")
    assert load_records(str(tmp_path / "a.txt")) == ROWS
    dataset = datasets.Dataset.from_list(ROWS)
    dataset.to_parquet(str(tmp_path / "a.parquet"))
    assert load_records(str(tmp_path / "a.parquet")) == ROWS
    dataset.save_to_disk(str(tmp_path / "saved"))
    assert load_records(str(tmp_path / "saved")) == ROWS
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(CLIError, match=r"DatasetDict with splits \['train'\]; point at one"):
        load_records(str(tmp_path / "splits"))


def test_jsonl_and_text_need_no_datasets_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now fails
    assert load_records(str(write_jsonl(tmp_path / "a.jsonl", ROWS))) == ROWS
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    with pytest.raises(CLIError, match="needs the datasets package"):
        load_records(str(tmp_path / "a.parquet"))
    with pytest.raises(CLIError, match="unknown data format '.csv'"):
        load_records(str(write_jsonl(tmp_path / "a.csv", ROWS)))

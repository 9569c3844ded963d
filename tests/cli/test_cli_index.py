"""``dattri-llm top-k --index``: a FAISS index of the capture's train store, built once."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import fails

from dattri_llm.cli import main

pytest.importorskip("faiss")


def _top(store, out, *extra):
    argv = ["top-k", "--store", str(store), "--k", "3", "--use_cpu", "--quiet",
            "--format", "json", "--output_dir", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "top_k.json").read_text())


def _pairs(table):
    return {q["id"]: [(r["train_id"], r["score"]) for r in q["top"]] for q in table["queries"]}


@pytest.mark.parametrize("method", ["graddot", "gradcos"])
def test_flat_index_equals_the_exact_top_k(workspace, tmp_path, method):
    store = tmp_path / "capture"
    shutil.copytree(workspace["capture"], store)
    for opponents in ([], ["--opponents"]):
        exact = _pairs(_top(store, tmp_path / f"exact{len(opponents)}", "--method", method,
                            *opponents))  # fmt: skip
        found = _top(store, tmp_path / f"index{len(opponents)}", "--method", method,
                     "--index", "flat", *opponents)  # fmt: skip
        got = _pairs(found)
        assert got.keys() == exact.keys()
        for query, pairs in exact.items():
            assert [t for t, _ in got[query]] == [t for t, _ in pairs]
            assert [s for _, s in got[query]] == pytest.approx([s for _, s in pairs], rel=1e-4)
        assert all(r["text"] for q in found["queries"] for r in q["top"])  # texts looked up
    suffix = "_cos" if method == "gradcos" else ""
    index_dir = store / "ckpt_0" / "train_grads" / f"attribution_index_flat{suffix}"
    assert (index_dir / "index.json").is_file()
    built = (index_dir / "index.json").stat().st_mtime_ns
    _top(store, tmp_path / "again", "--method", method, "--index", "flat")
    assert (index_dir / "index.json").stat().st_mtime_ns == built  # loaded, not rebuilt


def test_index_refuses_fit_methods_and_bad_kinds(workspace, tmp_path, capsys):
    common = ["top-k", "--store", str(workspace["capture"]), "--output_dir", str(tmp_path / "o")]
    err = fails([*common, "--method", "kfac", "--index", "flat"], capsys)
    assert "--index serves graddot, tracin, gradcos" in err and "drop --index" in err
    assert "--index must be one of" in fails([*common, "--index", "lsh"], capsys, code=2)
    assert not (tmp_path / "o").exists()

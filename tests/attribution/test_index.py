"""AttributionIndex: FAISS top-k against the exact scores of attribute_from_cache."""

from __future__ import annotations

import hashlib
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, append_store, mlp_data, mlp_loss, write_store

from dattri_llm.attribution.algorithm.kronecker.ekfac import EKFACAttributor
from dattri_llm.attribution.algorithm.kronecker.kfac import KFACAttributor
from dattri_llm.attribution.algorithm.lorif import LoRIFAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.index import (
    INDEX_DIR,
    SIDECAR_FILE,
    AttributionIndex,
    StaleIndexError,
)
from dattri_llm.attribution.index import core as index_module
from dattri_llm.attribution.index.vectors import fill_matrix, layout_of, normalize_parts
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.streaming import DiskGradientSource

LAYERS = {"b_layer": 5, "a_layer": 3}  # indexed in sorted order: a_layer, then b_layer


def dense_block(rows: dict[str, torch.Tensor]) -> Gradient:
    return Gradient(
        representation={n: "materialized" for n in rows},
        data=dict(rows),
        layer_types={n: "nn.Linear" for n in rows},
    )


def random_rows(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(n, width, generator=gen) for name, width in LAYERS.items()}


def save_rows(store, step, ids, rows, batch=4):
    for start in range(0, len(ids), batch):
        part = {n: t[start : start + batch] for n, t in rows.items()}
        store.save_bulk([GradientRecord(step, list(ids[start : start + batch]), dense_block(part))])


def flat(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([rows[n] for n in sorted(rows)], dim=1)


def exact_scores(tmp_path, train, test, normalized=False):
    args = AttributionArguments(output_dir=str(tmp_path / "scores"), use_cpu=True)
    return TracInAttributor(args).attribute_from_cache(train, test, normalized_grad=normalized)


@pytest.fixture
def stores(tmp_path):
    """A two-step train store (20 samples; one sample missing at step 1) and a query store."""
    train = GradientStorageManager(tmp_path / "train")
    ids = [f"t{i}" for i in range(20)]
    steps_rows = {0: random_rows(20, 0), 1: random_rows(19, 1)}
    save_rows(train, 0, ids, steps_rows[0])
    save_rows(train, 1, ids[:19], steps_rows[1])
    test = GradientStorageManager(tmp_path / "test")
    query_rows = random_rows(6, 2)
    save_rows(test, 0, [f"q{j}" for j in range(6)], query_rows, batch=3)
    return {"train": train, "test": test, "ids": ids, "rows": steps_rows, "query": query_rows}


def as_pairs(result, query):
    return [(h, pytest.approx(s, rel=1e-4, abs=1e-4)) for h, s in result.as_dict()[query]]


# ---------------------------------------------------------------------- without faiss
def test_without_faiss_the_library_works_and_the_index_names_the_extra(monkeypatch, stores):
    monkeypatch.setitem(sys.modules, "faiss", None)
    assert index_module.AttributionIndex.__name__ == "AttributionIndex"
    with pytest.raises(ImportError, match=r'pip install "dattri_llm\[index\]"'):
        index_module.AttributionIndex.build(stores["train"], save=False)
    with pytest.raises(ImportError, match="dattri_llm\\[index\\]"):
        index_module.AttributionIndex.load(stores["train"])


def test_importing_the_index_module_does_not_import_faiss():
    code = (
        "import sys\n"
        "sys.modules['faiss'] = None\n"
        "import dattri_llm, dattri_llm.attribution.index\n"
        "from dattri_llm.attribution.index import AttributionIndex\n"
        "dattri_llm.TracInAttributor\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vectors_sum_the_per_step_inner_products(stores):
    """The pure-torch part: <u_i, v_j> over the layout equals the summed per-step products."""
    source = DiskGradientSource(stores["train"], None)
    block = next(iter(source))[1]
    layout = layout_of(block, source.steps)
    assert layout.layers == (("a_layer", 3), ("b_layer", 5)) and layout.steps == (0, 1)
    u = fill_matrix(source, stores["ids"], layout, "train")
    assert u.shape == (20, 16)
    q = flat(stores["query"]).numpy()
    v = np.concatenate([q, q], axis=1)
    expected = sum(
        np.pad(flat(stores["rows"][s]).numpy(), ((0, 20 - n), (0, 0))) @ q.T
        for s, n in ((0, 20), (1, 19))
    )
    np.testing.assert_allclose(u @ v.T, expected, rtol=1e-5, atol=1e-5)
    assert not u[19, 8:].any()  # no record at step 1: zeros
    normalize_parts(u, layout)
    norms = np.linalg.norm(u.reshape(20, 2, 8), axis=2)
    np.testing.assert_allclose(norms[:19], 1.0, rtol=1e-6)
    assert norms[19, 1] == 0


# ---------------------------------------------------------------------- with faiss
faiss_needed = pytest.mark.usefixtures("faiss_module")


@pytest.fixture
def faiss_module():
    return pytest.importorskip("faiss")


@faiss_needed
@pytest.mark.parametrize("normalized", [False, True])
def test_flat_index_equals_exact_top_k(stores, tmp_path, normalized):
    exact = exact_scores(tmp_path, stores["train"], stores["test"], normalized)
    index = AttributionIndex.build(stores["train"], normalize=normalized)
    assert len(index) == 20 and index.dim == 16
    for proponents in (True, False):
        got = index.search(stores["test"], 5, proponents=proponents)
        want = exact.top_k(5, proponents=proponents)
        assert got.test_ids == exact.test_ids
        for query in exact.test_ids:
            assert [h for h, _ in want[query]] == [h for h, _ in got.as_dict()[query]]
            assert as_pairs(got, query) == want[query]
    everything = index.search(stores["test"], 50)  # k larger than N: every sample
    assert all(len(ids) == 20 for ids in everything.train_ids)


@faiss_needed
def test_queries_as_tensor_block_or_per_step_blocks(stores, tmp_path):
    index = AttributionIndex.build(stores["train"], save=False)
    block = dense_block(stores["query"])
    by_store = index.search(stores["test"], 4)
    by_block = index.search(block, 4, query_ids=by_store.test_ids)
    q = flat(stores["query"])
    by_tensor = index.search(torch.cat([q, q], dim=1), 4, query_ids=by_store.test_ids)
    by_steps = index.search({0: block, 1: block}, 4, query_ids=by_store.test_ids)
    for other in (by_block, by_tensor, by_steps):
        assert other.train_ids == by_store.train_ids
        np.testing.assert_allclose(other.scores, by_store.scores, rtol=1e-6)
    with pytest.raises(ValueError, match=r"shape \(M, 16\)"):
        index.search(q, 3)


@faiss_needed
def test_query_preconditioning_goes_into_the_query_vector(stores):
    """K-FAC-style <g, P q>: one raw index, the preconditioner applied to the queries."""
    index = AttributionIndex.build(stores["train"], save=False)
    scale = {"a_layer": torch.tensor([2.0, -1.0, 0.5]), "b_layer": torch.linspace(-1, 1, 5)}

    def precondition(block: Gradient) -> Gradient:
        return dense_block({n: block.data[n] * scale[n] for n in block.data})

    got = index.search(stores["test"], 3, transform=precondition)
    pq = flat({n: stores["query"][n] * scale[n] for n in scale})
    train = [
        np.pad(flat(stores["rows"][s]).numpy(), ((0, 20 - n), (0, 0)))
        for s, n in ((0, 20), (1, 19))
    ]
    dense = (train[0] + train[1]) @ pq.numpy().T  # (20, 6)
    for j in range(len(got.test_ids)):
        order = np.argsort(-dense[:, j], kind="stable")[:3]
        assert got.train_ids[j] == [stores["ids"][i] for i in order]
        np.testing.assert_allclose(got.scores[j], dense[order, j], rtol=1e-4, atol=1e-4)


@faiss_needed
def test_flat_index_over_factorized_records_matches_tracin(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, mlp_data(9, 1), batch_sizes=[4, 5])
    write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, mlp_data(3, 2), batch_sizes=[3])
    exact = exact_scores(tmp_path, tmp_path / "tr", tmp_path / "te")
    got = AttributionIndex.build(tmp_path / "tr").search(tmp_path / "te", 4)
    want = exact.top_k(4)
    for query in exact.test_ids:
        assert as_pairs(got, query) == want[query]


def _recall(got, exact, k):
    hits = [
        len(set(ids) & {h for h, _ in exact[q]}) / k for q, ids in zip(got.test_ids, got.train_ids)
    ]
    return sum(hits) / len(hits)


@faiss_needed
@pytest.mark.parametrize(
    ("kind", "options", "good", "bad"),
    [
        ("ivf", {"nlist": 16}, {"nprobe": 16}, {"nprobe": 1}),
        ("hnsw", {"hnsw_m": 16, "ef_construction": 64}, {"ef_search": 128}, {"ef_search": 1}),
    ],
)
def test_approximate_recall_above_a_bound_a_broken_index_fails(tmp_path, kind, options, good, bad):
    n, k = 2000, 10
    gen = torch.Generator().manual_seed(3)
    centers = torch.randn(40, 8, generator=gen) * 3
    rows = centers[torch.randint(0, 40, (n,), generator=gen)] + torch.randn(n, 8, generator=gen)
    train = GradientStorageManager(tmp_path / "train")
    save_rows(train, 0, [f"t{i}" for i in range(n)], {"a": rows}, batch=500)
    test = GradientStorageManager(tmp_path / "test")
    save_rows(test, 0, [f"q{j}" for j in range(20)], {"a": torch.randn(20, 8, generator=gen) * 3})
    exact = exact_scores(tmp_path, train, test).top_k(k)
    index = AttributionIndex.build(train, kind=kind, save=False, **options)
    index.set_search_params(**good)
    assert _recall(index.search(test, k), exact, k) >= 0.95
    index.set_search_params(**bad)
    weak = _recall(index.search(test, k), exact, k)
    # The bound can fail: a search that sees a fraction of the data misses neighbours.
    assert weak < 0.95
    # A broken index (vectors shuffled against their ids) fails the same bound.
    index.set_search_params(**good)
    rng = np.random.default_rng(0)
    index._ids = [index._ids[i] for i in rng.permutation(n)]
    assert _recall(index.search(test, k), exact, k) < 0.2


@faiss_needed
def test_saved_index_loads_and_searches_the_same(stores):
    built = AttributionIndex.build(stores["train"], kind="hnsw", ef_search=32)
    loaded = AttributionIndex.load(stores["train"].save_dir)
    assert loaded.directory == stores["train"].save_dir / INDEX_DIR
    assert loaded.ids == built.ids and loaded.settings == built.settings
    a, b = built.search(stores["test"], 5), loaded.search(stores["test"], 5)
    assert a.train_ids == b.train_ids and a.scores == b.scores
    # The index files do not disturb the store.
    assert GradientStorageManager(stores["train"].save_dir).available_steps() == [0, 1]


@faiss_needed
def test_stale_index_is_refused_then_updated(stores, tmp_path):
    index = AttributionIndex.build(stores["train"])
    extra = {0: random_rows(3, 7), 1: random_rows(3, 8)}
    new_ids = ["n0", "n1", "n2"]
    for step, rows in extra.items():
        save_rows(stores["train"], step, new_ids, rows)
    with pytest.raises(StaleIndexError, match=r"gained 6 record\(s\).*index.update\(\)"):
        index.search(stores["test"], 3)
    with pytest.raises(StaleIndexError, match="update"):
        AttributionIndex.load(stores["train"].save_dir)
    assert index.update() == 3 and len(index) == 23
    exact = exact_scores(tmp_path, stores["train"], stores["test"])
    for query, want in exact.top_k(23).items():
        assert as_pairs(index.search(stores["test"], 23), query) == want
    index.save()
    reloaded = AttributionIndex.load(stores["train"].save_dir)
    assert reloaded.ids[-3:] == new_ids
    # load(update=True) adds and saves in one go
    save_rows(stores["train"], 0, ["n3"], random_rows(1, 9))
    save_rows(stores["train"], 1, ["n3"], random_rows(1, 10))
    assert len(AttributionIndex.load(stores["train"].save_dir, update=True)) == 24
    assert len(AttributionIndex.load(stores["train"].save_dir)) == 24


@faiss_needed
def test_changes_an_update_cannot_follow_ask_for_a_rebuild(stores):
    index = AttributionIndex.build(stores["train"], save=False)
    # t19 had no record at step 1: a new record changes its vector
    save_rows(stores["train"], 1, ["t19"], random_rows(1, 11))
    with pytest.raises(StaleIndexError, match="rebuild"):
        index.update()
    index = AttributionIndex.build(stores["train"], save=False)
    save_rows(stores["train"], 0, ["t3"], random_rows(1, 12))  # replaces t3 at step 0
    with pytest.raises(StaleIndexError, match="replaced or dropped.*rebuild"):
        index.check()
    index = AttributionIndex.build(stores["train"], save=False)
    save_rows(stores["train"], 2, ["t0"], random_rows(1, 13))  # a new step
    with pytest.raises(StaleIndexError, match=r"steps \[2\].*rebuild"):
        index.update()
    only_first = AttributionIndex.build(stores["train"], steps=[0, 1], save=False)
    save_rows(stores["train"], 3, ["t1"], random_rows(1, 14))  # a step it does not index
    only_first.check()


@faiss_needed
def test_crafted_or_truncated_index_files_execute_nothing(stores, tmp_path):
    AttributionIndex.build(stores["train"])
    directory = stores["train"].save_dir / "attribution_index"
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    crafted = pickle.dumps(Payload())
    sidecar = json.loads((directory / SIDECAR_FILE).read_text())
    index_file = directory / sidecar["index_file"]["name"]
    original = index_file.read_bytes()
    # truncated: refused against the sidecar before FAISS reads it
    index_file.write_bytes(original[: len(original) // 2])
    with pytest.raises(ValueError, match="truncated or was replaced"):
        AttributionIndex.load(stores["train"].save_dir)
    # crafted, with a sidecar that vouches for it: FAISS refuses to parse it
    index_file.write_bytes(crafted)
    sidecar["index_file"] = {
        "name": index_file.name,
        "bytes": len(crafted),
        "sha256": hashlib.sha256(crafted).hexdigest(),
    }
    (directory / SIDECAR_FILE).write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match="does not hold a readable attribution index"):
        AttributionIndex.load(stores["train"].save_dir)
    assert not marker.exists()
    # a sidecar that is not JSON
    (directory / SIDECAR_FILE).write_bytes(crafted)
    with pytest.raises(ValueError, match="not valid JSON"):
        AttributionIndex.load(stores["train"].save_dir)
    assert not marker.exists()


@faiss_needed
def test_bad_arguments_name_the_argument(stores):
    with pytest.raises(ValueError, match="kind must be one of"):
        AttributionIndex.build(stores["train"], kind="lsh", save=False)
    with pytest.raises(ValueError, match="nprobe must be an int >= 1"):
        AttributionIndex.build(stores["train"], nprobe=0, save=False)
    ram = GradientStorageManager(stores["train"].save_dir / "ram", residency="memory")
    save_rows(ram, 0, ["a", "b"], random_rows(2, 0))
    with pytest.raises(ValueError, match="pass path="):
        AttributionIndex.build(ram)
    index = AttributionIndex.build(ram, save=False)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        index.search(stores["test"], 0)
    with pytest.raises(ValueError, match="holds no records"):
        (stores["train"].save_dir / "empty").mkdir()
        AttributionIndex.build(GradientStorageManager(stores["train"].save_dir / "empty"))


@faiss_needed
def test_index_of_chosen_steps_matches_the_scores_of_those_steps(stores, tmp_path):
    source = DiskGradientSource(stores["train"], None, steps=[1])
    index = AttributionIndex.build(source, save=False)
    assert index.layout.steps == (1,) and len(index) == 19
    assert not index.settings["all_steps"]
    exact = exact_scores(tmp_path, source, stores["test"]).top_k(4)
    got = index.search(stores["test"], 4)
    for query, want in exact.items():
        assert as_pairs(got, query) == want
    save_rows(stores["train"], 0, ["n0"], random_rows(1, 5))  # a step it does not index
    index.check()


@faiss_needed
@pytest.mark.parametrize("cls", [KFACAttributor, EKFACAttributor, LoRIFAttributor])
def test_one_raw_index_serves_preconditioned_methods(tmp_path, cls):
    """The fitted method's query transform in search() equals its top-k from the store."""
    torch.manual_seed(0)
    model, data = MLP(), mlp_data(12, 1)
    low_rank = 1 if cls is LoRIFAttributor else None  # LoRIF scores rank-1 records
    train = GradientStorageManager(tmp_path / "tr", low_rank=low_rank)
    append_store(train, model, MLP_LAYERS, mlp_loss, data, batch_sizes=[4, 4, 4])
    test = write_store(
        tmp_path / "te", model, MLP_LAYERS, mlp_loss, mlp_data(3, 2), batch_sizes=[3]
    )
    index = AttributionIndex.build(train, save=False)
    attributor = cls(AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True))
    want = attributor.attribute_from_cache(train.save_dir, test.save_dir).top_k(5)
    got = index.search(test, 5, transform=attributor.transform_test_rep)
    for query, pairs in want.items():
        assert as_pairs(got, query) == pairs
    raw = index.search(test, 5)  # without the preconditioner the answer differs
    assert any(raw.as_dict()[q] != got.as_dict()[q] for q in want)


@faiss_needed
def test_a_save_killed_before_its_sidecar_leaves_the_previous_index_loadable(stores, monkeypatch):
    from dattri_llm.attribution.index import files

    index = AttributionIndex.build(stores["train"])
    before_ids = AttributionIndex.load(stores["train"].save_dir).ids
    save_rows(stores["train"], 0, ["n0"], random_rows(1, 11))
    save_rows(stores["train"], 1, ["n0"], random_rows(1, 12))
    real = files.atomic_write

    def killed_at_sidecar(path, write):
        if path.name == SIDECAR_FILE:
            raise KeyboardInterrupt("killed")
        return real(path, write)

    assert index.update() == 1
    monkeypatch.setattr(files, "atomic_write", killed_at_sidecar)
    with pytest.raises(KeyboardInterrupt):
        index.save()  # killed between the new index file and its sidecar
    monkeypatch.setattr(files, "atomic_write", real)
    directory = stores["train"].save_dir / "attribution_index"
    assert len(list(directory.glob("index-*.faiss"))) == 2  # the new file, written in full
    with pytest.raises(StaleIndexError, match="update"):  # the old pair, intact and checked
        AttributionIndex.load(stores["train"].save_dir)
    old = AttributionIndex.load(stores["train"].save_dir, update=True)
    assert len(old) == len(before_ids) + 1 and len(list(directory.glob("index-*.faiss"))) == 1
    assert AttributionIndex.load(stores["train"].save_dir).ids == old.ids
    assert old.ids[-1] == "n0" and "n0" not in before_ids


@faiss_needed
def test_searches_hash_the_store_state_again_only_after_the_store_changed(stores, monkeypatch):
    from dattri_llm.attribution.index import core

    index = AttributionIndex.build(stores["train"], save=False)
    calls = []
    real = core.store_state
    monkeypatch.setattr(core, "store_state", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        index.search(stores["test"], 3)
    assert len(calls) == 1
    save_rows(stores["train"], 0, ["n0"], random_rows(1, 13))
    save_rows(stores["train"], 1, ["n0"], random_rows(1, 14))
    with pytest.raises(StaleIndexError, match="update"):
        index.search(stores["test"], 3)
    assert len(calls) == 2

"""`AttributionIndex`: approximate (or exact) top-k training samples through FAISS.

The index holds one float32 vector per training sample of a store (see
:mod:`dattri_llm.attribution.index.vectors`) under the inner-product metric, so
a query vector's best matches are the training samples with the largest summed
inner product. Which index serves which method:

* Grad-Dot / TracIn over one or several checkpoints: ``normalize=False``, raw queries;
* Grad-Cos: ``normalize=True`` (both sides normalised per step);
* K-FAC / EK-FAC / LoRIF (and any method whose score is ``<g_i, P q_j>``): the
  ``normalize=False`` index of the raw store, with ``transform=`` the method's
  query-side preconditioner ``q → P q`` in :meth:`AttributionIndex.search` (a
  fitted attributor's ``transform_test_rep``). LoRIF with ``rank=c`` scores a
  low-rank store's records as stored: index that store.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dattri_llm.attribution.index.files import (
    FORMAT,
    default_directory,
    read_index_files,
    require_faiss,
    store_state,
    write_index_files,
)
from dattri_llm.attribution.index.queries import query_matrix
from dattri_llm.attribution.index.vectors import (
    Transform,
    VectorLayout,
    fill_matrix,
    iter_rows,
    layout_of,
    normalize_parts,
)
from dattri_llm.attribution.sources import disk_source, resolve_store
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.stream.readers import GroupBlockDataset

IndexKind = Literal["flat", "ivf", "hnsw"]
INDEX_KINDS = ("flat", "ivf", "hnsw")


class StaleIndexError(ValueError):
    """The store changed since the index was built in a way the index cannot follow."""


@dataclass
class IndexTopK:
    """The best training samples of each query, best first.

    Attributes:
        test_ids: the queries, in the order given (as ``TopK.test_ids``).
        train_ids: per query, up to ``k`` training ids (fewer when the index holds
            fewer samples, or an approximate search found fewer).
        scores: per query, the inner products of those samples (as the method
            defines the score, whatever ``proponents`` was).
    """

    test_ids: list[str]
    train_ids: list[list[str]]
    scores: list[list[float]]

    def as_dict(self) -> dict[str, list[tuple[str, float]]]:
        """``{query_id: [(train_id, score), ...]}``, the form of ``AttributionScore.top_k``."""
        return {
            q: list(zip(ids, scores))
            for q, ids, scores in zip(self.test_ids, self.train_ids, self.scores)
        }


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class AttributionIndex:
    """A FAISS inner-product index over the training samples of a gradient store.

    Build it with :meth:`build`, open a saved one with :meth:`load`, ask it with
    :meth:`search`. The index remembers the store state it was built from:
    records added since are either added by :meth:`update` or refused
    (:class:`StaleIndexError`), never silently missed. Needs ``faiss``
    (``pip install "dattri_llm[index]"``); without it every entry point raises
    ``ImportError`` naming that extra.
    """

    def __init__(
        self,
        index: Any,
        ids: list[str],
        layout: VectorLayout,
        settings: dict[str, Any],
        state: dict[str, Any],
        *,
        store: GradientStorageManager | None = None,
        directory: Path | None = None,
    ) -> None:
        self._faiss = require_faiss()
        self._index = index
        self._ids = list(ids)
        self.layout = layout
        self.settings = dict(settings)
        self.state = dict(state)
        self.store = store
        self.directory = directory
        # the attached store's state, cached by (store, revision): searches skip re-hashing it
        self._state_of: tuple[GradientStorageManager | None, int] = (None, -1)
        self._current_state: dict[str, Any] = {}
        self._apply_search_settings()

    # ----------------------------------------------------------------- properties
    @property
    def ids(self) -> list[str]:
        """Training ids in index order."""
        return list(self._ids)

    @property
    def kind(self) -> str:
        """``"flat"`` (exact), ``"ivf"`` or ``"hnsw"``."""
        return self.settings["kind"]

    @property
    def normalize(self) -> bool:
        """Whether vectors are normalised per step (the Grad-Cos index)."""
        return bool(self.settings["normalize"])

    @property
    def dim(self) -> int:
        """Vector width: steps × the summed layer widths."""
        return self.layout.dim

    def __len__(self) -> int:
        """Number of indexed training samples."""
        return int(self._index.ntotal)

    def __repr__(self) -> str:
        """Kind, size, width and steps."""
        return (
            f"AttributionIndex(kind={self.kind!r}, samples={len(self)}, dim={self.dim}, "
            f"steps={list(self.layout.steps)}, normalize={self.normalize})"
        )

    def set_search_params(self, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Change ``nprobe`` (IVF) or ``ef_search`` (HNSW) for later searches."""
        if nprobe is not None:
            self.settings["nprobe"] = _check_positive("nprobe", nprobe)
        if ef_search is not None:
            self.settings["ef_search"] = _check_positive("ef_search", ef_search)
        self._apply_search_settings()

    def _apply_search_settings(self) -> None:
        if self.kind == "ivf":
            self._index.nprobe = int(self.settings["nprobe"])
        elif self.kind == "hnsw":
            self._index.hnsw.efSearch = int(self.settings["ef_search"])

    # ----------------------------------------------------------------- building
    @classmethod
    def build(
        cls,
        store: object,
        *,
        kind: IndexKind = "flat",
        normalize: bool = False,
        steps: Sequence[int] | None = None,
        layer_name: str | list[str] | None = None,
        nlist: int | None = None,
        nprobe: int = 8,
        hnsw_m: int = 32,
        ef_construction: int = 64,
        ef_search: int = 64,
        seed: int = 0,
        path: str | Path | None = None,
        save: bool = True,
        verbose: bool = False,
    ) -> AttributionIndex:
        """Read ``store`` once and index one vector per training sample.

        Args:
            store: a store directory, `GradientStorageManager` or `DiskGradientSource`
                (whose steps and layers are kept unless ``steps`` / ``layer_name`` are given).
            kind: ``"flat"`` (exact search), ``"ivf"`` (``nlist`` clusters,
                ``nprobe`` searched) or ``"hnsw"`` (graph of ``hnsw_m`` links,
                ``ef_construction`` / ``ef_search`` candidate lists).
            normalize: normalise each step's part of every vector (Grad-Cos).
            steps: stored steps to index (``None``: all; records of new steps
                added later are then refused as stale, while an index over chosen
                steps ignores records of other steps).
            layer_name: layers to index (``None``: every per-sample layer).
            nlist: IVF clusters (``None``: ``4·sqrt(N)``, at most ``N/39``).
            seed: IVF training sample and clustering seed.
            path: directory of the index files (``None``: ``<store>/attribution_index``).
            save: write the files (see :meth:`save`).
            verbose: show a progress bar over the store's blocks.

        Raises:
            ImportError: faiss is not installed (names the ``index`` extra).
            ValueError: an unknown ``kind``, bad settings, an empty store, or blocks
                whose layers differ in width between steps.
        """
        faiss = require_faiss()
        if kind not in INDEX_KINDS:
            raise ValueError(f"kind must be one of {INDEX_KINDS}, got {kind!r}")
        for name, value in (
            ("nprobe", nprobe),
            ("hnsw_m", hnsw_m),
            ("ef_construction", ef_construction),
            ("ef_search", ef_search),
        ):
            _check_positive(name, value)
        if nlist is not None:
            _check_positive("nlist", nlist)
        manager = resolve_store(store)
        if save and path is None:
            default_directory(manager)  # refuse a RAM store before the work, not after
        source = disk_source(
            store,
            None,
            steps=steps,
            layer_name=layer_name,
            desc="AttributionIndex: reading the store",
            verbose=verbose,
        )
        every_step = source.steps == manager.available_steps()
        plan = manager.iter_steps(source.steps)[:1]
        first = GroupBlockDataset.for_store(manager, plan, source.layer_name)[0][0][1]
        layout = layout_of(first, source.steps)
        where = f"gradient store {manager.save_dir}"
        n = len(_ids_at(manager, layout.steps))
        if nlist is None:
            nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))
        settings = {
            "kind": kind,
            "normalize": bool(normalize),
            "all_steps": steps is None and every_step,
            "layer_name": source.layer_name,
            "nlist": min(int(nlist), n),
            "nprobe": nprobe,
            "hnsw_m": hnsw_m,
            "ef_construction": ef_construction,
            "ef_search": ef_search,
            "seed": seed,
        }
        if len(layout.steps) == 1 and kind != "ivf":
            # One step, no training: each block goes straight into the index.
            index, ids = _new_index(faiss, layout.dim, settings, None), []
            for block_ids, rows in iter_rows(source, layout, where):
                if normalize:
                    normalize_parts(rows, layout)
                index.add(rows)
                ids.extend(block_ids)
        else:
            # A sample's vector spans its steps (or IVF trains on a sample of all rows).
            ids = _ids_at(manager, layout.steps)
            matrix = fill_matrix(source, ids, layout, where)
            if normalize:
                normalize_parts(matrix, layout)
            index = _new_index(faiss, layout.dim, settings, matrix)
            index.add(matrix)
            del matrix
        built = cls(
            index,
            ids,
            layout,
            settings,
            store_state(manager, layout.steps),
            store=manager,
            directory=None if path is None and not save else _directory(manager, path),
        )
        if save:
            built.save()
        return built

    # ----------------------------------------------------------------- persistence
    def save(self, path: str | Path | None = None) -> Path:
        """Write the index file and ``index.json`` into ``path`` (default: where it was built)."""
        directory = Path(path).expanduser() if path is not None else self.directory
        if directory is None:
            if self.store is None:
                raise ValueError("AttributionIndex.save: pass path= (a directory)")
            directory = default_directory(self.store)
        sidecar = {
            "format": FORMAT,
            "settings": self.settings,
            "layout": self.layout.to_json(),
            "ids": self._ids,
            "store": self.state,
        }
        data = self._faiss.serialize_index(self._index).tobytes()
        self.directory = write_index_files(directory, data, sidecar)
        return self.directory

    @classmethod
    def load(
        cls, store: object, *, path: str | Path | None = None, update: bool = False
    ) -> AttributionIndex:
        """Open the index saved for ``store`` and check it against the store's records.

        Nothing in the files is executed: the index is FAISS data checked
        against the size and SHA-256 its JSON sidecar records, the ids are JSON.

        Args:
            store: the store the index was built from (directory, store or source).
            path: the index directory (``None``: ``<store>/attribution_index``).
            update: add the samples the store gained since the build (and save);
                ``False`` refuses a stale index.

        Raises:
            ImportError: faiss is not installed (names the ``index`` extra).
            FileNotFoundError: no index files at ``path``.
            ValueError: files that do not match each other or that FAISS cannot read.
            StaleIndexError: the store changed since the build (see :meth:`check`).
        """
        faiss = require_faiss()
        manager = resolve_store(store)
        directory = _directory(manager, path)
        data, sidecar = read_index_files(directory)
        try:
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8).copy())
            layout = VectorLayout.from_json(sidecar["layout"])
            ids = [str(h) for h in sidecar["ids"]]
            settings, state = dict(sidecar["settings"]), dict(sidecar["store"])
        except (RuntimeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{directory} does not hold a readable attribution index ({err}); rebuild it."
            ) from err
        if (
            index.ntotal != len(ids)
            or index.d != layout.dim
            or settings.get("kind") not in (INDEX_KINDS)
        ):
            raise ValueError(
                f"{directory}: the index holds {index.ntotal} vectors of width {index.d} but its "
                f"sidecar describes {len(ids)} samples of width {layout.dim}; rebuild it."
            )
        if index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError(f"{directory}: the index does not use the inner-product metric")
        loaded = cls(index, ids, layout, settings, state, store=manager, directory=directory)
        if update:
            if loaded.update():
                loaded.save()
        else:
            loaded.check()
        return loaded

    # ----------------------------------------------------------------- staleness
    def _store_state(self) -> dict[str, Any]:
        """:func:`store_state` of the attached store, recomputed only after the store changed."""
        cached_for, revision = self._state_of
        if cached_for is not self.store or revision != self.store.revision:
            self._current_state = store_state(self.store, self.layout.steps)
            self._state_of = (self.store, self.store.revision)
        return self._current_state

    def _changes(self) -> tuple[dict[str, Any], list[str]]:
        """The store's current state and the groups added since the build.

        Raises ``StaleIndexError`` for changes :meth:`update` cannot follow.
        """
        if self.store is None:
            raise ValueError("this AttributionIndex is not attached to a store")
        state = self._store_state()
        rebuild = "rebuild it with AttributionIndex.build(store)"
        new_steps = sorted(set(state["store_steps"]) - set(self.state["store_steps"]))
        if self.settings["all_steps"] and new_steps:
            raise StaleIndexError(
                f"the store {self.store.save_dir} holds steps {new_steps} that the index (built "
                f"over every stored step, {list(self.layout.steps)}) lacks; {rebuild}."
            )
        if state["digest"] == self.state["digest"]:
            return state, []
        old, now = self.state["groups"], state["groups"]
        changed = sorted(g for g, n in old.items() if now.get(g) != n)
        if changed:
            raise StaleIndexError(
                f"the store {self.store.save_dir} replaced or dropped records of {len(changed)} "
                f"indexed group(s) since the index was built (e.g. {changed[0]!r}); {rebuild}."
            )
        added = sorted(g for g in now if g not in old)
        return state, added

    def check(self) -> None:
        """Raise `StaleIndexError` unless the store's records are those the index was built from.

        The message says whether :meth:`update` can add what is new (new
        samples only) or the index must be rebuilt (records replaced or
        dropped, new steps for an index over all steps).
        """
        state, added = self._changes()
        if added:
            gained = state["entries"] - self.state["entries"]
            raise StaleIndexError(
                f"the store {self.store.save_dir} gained {gained} record(s) in {len(added)} "
                "group(s) since the index was built; call index.update() to add them (or "
                "AttributionIndex.load(store, update=True)), or rebuild the index."
            )

    def update(self) -> int:
        """Add the samples the store gained since the build; return how many.

        Only new samples can be added: a new record of a sample already indexed
        (at an indexed step) changes its vector, and raises `StaleIndexError`
        asking for a rebuild. An IVF index keeps its clusters (trained at the
        build); rebuild it after the store has grown a lot. Call :meth:`save` to
        keep the result.
        """
        state, added = self._changes()
        if not added:
            return 0
        known, fresh = set(self._ids), set(added)
        plan = [p for p in self.store.iter_steps(self.layout.steps) if p[0] in fresh]
        groups = GroupBlockDataset.for_store(self.store, plan, self.settings["layer_name"])
        blocks = [block for i in range(len(groups)) for block in groups[i]]  # new groups only
        new_ids = [str(h) for _, _, ids in blocks for h in ids]
        again = sorted({h for h in new_ids if h in known})
        if again:
            raise StaleIndexError(
                f"the store {self.store.save_dir} gained records of {len(again)} indexed "
                f"sample(s) (e.g. {again[0]!r}), which change their vectors; rebuild the index "
                "with AttributionIndex.build(store)."
            )
        new_ids = list(dict.fromkeys(new_ids))
        matrix = fill_matrix(blocks, new_ids, self.layout, f"store {self.store.save_dir}")
        if self.normalize:
            normalize_parts(matrix, self.layout)
        self._index.add(matrix)
        self._ids.extend(new_ids)
        self.state = state
        return len(new_ids)

    # ----------------------------------------------------------------- search
    def search(
        self,
        queries: object,
        k: int,
        *,
        proponents: bool = True,
        query_ids: Sequence[str] | None = None,
        transform: Transform | None = None,
        check_store: bool = True,
    ) -> IndexTopK:
        """The ``k`` training samples with the largest (or smallest) inner product per query.

        Args:
            queries: a ``(M, dim)`` tensor / array in the index's layout; a `Gradient`
                block of one step (taken at every indexed step); ``{step: Gradient}``
                over the index's steps; or a query store (directory, store or
                `DiskGradientSource`) holding one step (taken at every indexed step)
                or exactly the index's steps (paired step by step).
            k: samples per query (``int >= 1``; more than the index holds returns all).
            proponents: ``True``: largest scores first; ``False``: smallest first.
            query_ids: names of tensor / `Gradient` queries (default ``"0"``, ``"1"``, ...).
            transform: applied to every query block before it becomes a vector: the
                method's query-side preconditioner (K-FAC, EK-FAC, LoRIF). Not for tensors.
            check_store: refuse a stale index first (:meth:`check`).

        Raises:
            StaleIndexError: ``check_store`` and the store changed since the build.
            ValueError: ``k``, or queries of another width or layout.
        """
        _check_positive("k", k)
        if check_store and self.store is not None:
            self.check()
        names, matrix = query_matrix(
            queries, self.layout, self.settings["layer_name"], query_ids, transform
        )
        if self.normalize:
            normalize_parts(matrix, self.layout)
        if not proponents:
            matrix = -matrix
        take = min(k, len(self))
        if take == 0 or matrix.shape[0] == 0:
            return IndexTopK(names, [[] for _ in names], [[] for _ in names])
        distances, labels = self._index.search(np.ascontiguousarray(matrix), take)
        sign = 1.0 if proponents else -1.0
        train_ids, scores = [], []
        for row_d, row_l in zip(distances, labels):
            found = row_l >= 0
            train_ids.append([self._ids[i] for i in row_l[found]])
            scores.append([sign * float(d) for d in row_d[found]])
        return IndexTopK(names, train_ids, scores)


def _ids_at(store: GradientStorageManager, steps: Sequence[int]) -> list[str]:
    """Training ids with a record at one of ``steps``, in the store's index order."""
    return list(dict.fromkeys(identifier for identifier, *_ in store.index_rows(steps)))


def _directory(store: GradientStorageManager, path: str | Path | None) -> Path:
    return default_directory(store) if path is None else Path(path).expanduser()


def _new_index(faiss: Any, dim: int, settings: dict[str, Any], matrix: np.ndarray | None) -> Any:
    """An empty FAISS inner-product index of ``settings["kind"]`` (IVF: trained on ``matrix``)."""
    metric = faiss.METRIC_INNER_PRODUCT
    if settings["kind"] == "flat":
        return faiss.IndexFlatIP(dim)
    if settings["kind"] == "hnsw":
        index = faiss.IndexHNSWFlat(dim, int(settings["hnsw_m"]), metric)
        index.hnsw.efConstruction = int(settings["ef_construction"])
        return index
    nlist = int(settings["nlist"])
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, metric)
    index.cp.seed = int(settings["seed"])
    limit = 256 * nlist
    sample = matrix
    if matrix.shape[0] > limit:
        rng = np.random.default_rng(settings["seed"])
        sample = matrix[np.sort(rng.choice(matrix.shape[0], limit, replace=False))]
    index.train(sample)
    return index

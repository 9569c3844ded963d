"""Approximate (or exact) top-k training samples through a FAISS index over a gradient store.

``AttributionIndex.build(store)`` reads the store once and indexes one vector per
training sample; ``index.search(queries, k)`` returns each query's best training
ids and scores (an `IndexTopK`). Needs the ``index`` extra
(``pip install "dattri_llm[index]"``, i.e. ``faiss-cpu``); importing this module
does not. The modules: ``vectors`` (blocks → vectors, their layout), ``queries``
(what `search` accepts, as vectors), ``files``
(the index files, the store state, the FAISS import) and ``core`` (the class).
"""

from dattri_llm.attribution.index.core import (
    INDEX_KINDS,
    AttributionIndex,
    IndexTopK,
    StaleIndexError,
)
from dattri_llm.attribution.index.files import INDEX_DIR, SIDECAR_FILE
from dattri_llm.attribution.index.vectors import VectorLayout

__all__ = [
    "INDEX_DIR",
    "INDEX_KINDS",
    "SIDECAR_FILE",
    "AttributionIndex",
    "IndexTopK",
    "StaleIndexError",
    "VectorLayout",
]

"""Gradient store (spec path): re-exports `dattri_llm.gradient.store`.

The store's code and its on-disk layout are documented in
``dattri_llm/gradient/store/`` (`GradientStorageManager` in ``store/manager.py``,
the group file codec in ``store/format.py``, the index log in ``store/index.py``,
the sidecars and `projection_record` in ``store/sidecars.py``, rank directories
in ``store/ranks.py``, RAM and disk residency in ``store/residency.py``).
"""

from __future__ import annotations

from dattri_llm.gradient.store.format import (
    DISK_FORMATS,
    FORMAT_VERSION,
    load_group_file,
    write_group_file,
)
from dattri_llm.gradient.store.index import INDEX_FILE
from dattri_llm.gradient.store.manager import GradientStorageManager
from dattri_llm.gradient.store.ranks import RANKS_FILE
from dattri_llm.gradient.store.residency import TIERED_BUDGET_FRACTION
from dattri_llm.gradient.store.sidecars import PROJECTION_FILE, SIDECAR_FILE, projection_record

__all__ = [
    "DISK_FORMATS",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "PROJECTION_FILE",
    "RANKS_FILE",
    "SIDECAR_FILE",
    "TIERED_BUDGET_FRACTION",
    "GradientStorageManager",
    "load_group_file",
    "projection_record",
    "write_group_file",
]

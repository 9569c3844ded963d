"""The attributors' shared helpers, at their public path.

Re-exports only; each name lives in the module of its job:
:mod:`.sources` (``normalize_layer_names``), :mod:`.collection`
(``collect_gradients``), :mod:`.schedule` (the ``lr_schedule.json`` file),
:mod:`.blocks` (``finalize_factors``) and :mod:`.scoring` (the engine,
``score_sources``).
"""

from __future__ import annotations

from dattri_llm.attribution.blocks import finalize_factors as finalize_factors
from dattri_llm.attribution.collection import collect_gradients as collect_gradients
from dattri_llm.attribution.schedule import LR_SCHEDULE_FILE as LR_SCHEDULE_FILE
from dattri_llm.attribution.schedule import read_lr_schedule as read_lr_schedule
from dattri_llm.attribution.schedule import write_lr_schedule as write_lr_schedule
from dattri_llm.attribution.scoring import score_sources as score_sources
from dattri_llm.attribution.sources import normalize_layer_names as normalize_layer_names

"""The attributors' shared helpers, at the path the API contract gives them.

Re-exports only; each name lives in the module of its job:
:mod:`.sources` (``normalize_layer_names``), :mod:`.collection`
(``collect_gradients``), :mod:`.schedule` (the ``lr_schedule.json`` file),
:mod:`.blocks` (``finalize_factors`` and the per-block helpers),
:mod:`.checks` (layer compatibility) and :mod:`.scoring` (the engine,
``score_sources``).
"""

from __future__ import annotations

from dattri_llm.attribution.blocks import finalize_factors as finalize_factors
from dattri_llm.attribution.blocks import per_sample_layers as per_sample_layers
from dattri_llm.attribution.blocks import scale_rows as scale_rows
from dattri_llm.attribution.checks import check_layer_compatibility as check_layer_compatibility
from dattri_llm.attribution.checks import source_projection as source_projection
from dattri_llm.attribution.collection import collect_gradients as collect_gradients
from dattri_llm.attribution.schedule import LR_SCHEDULE_FILE as LR_SCHEDULE_FILE
from dattri_llm.attribution.schedule import read_lr_schedule as read_lr_schedule
from dattri_llm.attribution.schedule import write_lr_schedule as write_lr_schedule
from dattri_llm.attribution.scoring import ATTRIBUTION_GRANULARITIES as ATTRIBUTION_GRANULARITIES
from dattri_llm.attribution.scoring import ScoreResult as ScoreResult
from dattri_llm.attribution.scoring import check_granularity as check_granularity
from dattri_llm.attribution.scoring import score_sources as score_sources
from dattri_llm.attribution.sources import normalize_layer_names as normalize_layer_names

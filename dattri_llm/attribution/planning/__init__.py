"""The run plan: what an attribution run will cost before it starts.

``plan_run`` reads the model (or only its config, built on the ``meta``
device) and predicts, per hooked layer, the capture route and bytes per
record, then the stores' sizes, the fit's and the scoring's memory, the
passes over the training gradients and, with a probe, the time.

Modules: ``layers`` (per-layer capture, from a meta forward), ``costs`` (the
arithmetic: stores, memory, the pass plan), ``probe`` (measured seconds per
record), ``run`` (``plan_run`` and ``RunPlan``).
"""

from dattri_llm.attribution.planning.costs import (
    STORE_GROUP_OVERHEAD_BYTES as STORE_GROUP_OVERHEAD_BYTES,
)
from dattri_llm.attribution.planning.costs import (
    STORE_LAYER_OVERHEAD_BYTES as STORE_LAYER_OVERHEAD_BYTES,
)
from dattri_llm.attribution.planning.costs import (
    STORE_RECORD_OVERHEAD_BYTES as STORE_RECORD_OVERHEAD_BYTES,
)
from dattri_llm.attribution.planning.costs import PassPlan as PassPlan
from dattri_llm.attribution.planning.layers import LayerPlan as LayerPlan
from dattri_llm.attribution.planning.probe import (
    measure_capture_seconds as measure_capture_seconds,
)
from dattri_llm.attribution.planning.run import RunPlan as RunPlan
from dattri_llm.attribution.planning.run import format_bytes as format_bytes
from dattri_llm.attribution.planning.run import meta_model as meta_model
from dattri_llm.attribution.planning.run import plan_run as plan_run

__all__ = [
    "STORE_GROUP_OVERHEAD_BYTES",
    "STORE_LAYER_OVERHEAD_BYTES",
    "STORE_RECORD_OVERHEAD_BYTES",
    "LayerPlan",
    "PassPlan",
    "RunPlan",
    "format_bytes",
    "meta_model",
    "measure_capture_seconds",
    "plan_run",
]

"""``dattri-llm attribute``: the full score of one method from a capture's stores.

Writes the ``AttributionScore`` (``scores.pt``, ``metadata.json``, re-read by
``AttributionScore.load``) and whatever fit the method keeps into the output
directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.cli.arguments import MethodArguments, StoreArguments
from dattri_llm.cli.methods import build_attributor
from dattri_llm.cli.stores import capture_stores

__all__ = ["run_attribute"]


def run_attribute(
    staging: Path,
    args: AttributionArguments,
    store_args: StoreArguments,
    method_args: MethodArguments,
    *,
    quiet: bool,
) -> dict[str, Any]:
    """Score the stores into ``staging``; return a short summary."""
    train_dir, query_dir = capture_stores(store_args.store)
    attributor, options = build_attributor(
        dataclasses.replace(args, output_dir=str(staging)), method_args
    )
    score = attributor.attribute_from_cache(train_dir, query_dir, verbose=not quiet, **options)
    score.save(staging)
    rows, queries = score.scores.shape[:2]
    return {"algorithm": score.algorithm, "rows": rows, "queries": queries}

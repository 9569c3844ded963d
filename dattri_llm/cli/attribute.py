"""``dattri-llm attribute``: the full score of one method from a capture's stores.

Writes the ``AttributionScore`` (``scores.pt``, ``metadata.json``, re-read by
``AttributionScore.load``), whatever fit the method keeps and the run plan
(``plan.txt``, ``plan.json``) into the output directory. ``--fit`` reuses the
fit of ``dattri-llm fit`` (the same scores as fitting here, bit for bit).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.cli.arguments import MethodArguments, StoreArguments
from dattri_llm.cli.methods import build_attributor
from dattri_llm.cli.plan import store_preflight
from dattri_llm.cli.stores import capture_stores

__all__ = ["run_attribute"]


def run_attribute(
    staging: Path,
    args: AttributionArguments,
    store_args: StoreArguments,
    method_args: MethodArguments,
    *,
    quiet: bool,
    force: bool = False,
    final: Path | None = None,
) -> dict[str, Any]:
    """Score the stores into ``staging``; return a short summary.

    The run plan comes first (:func:`~dattri_llm.cli.plan.store_preflight`):
    ``CLIError`` when the fit and scoring would not fit the free memory, or
    the scores the free disk, unless ``force``.
    """
    train_dir, query_dir = capture_stores(store_args.store)
    attributor, options = build_attributor(
        dataclasses.replace(args, output_dir=str(staging)), method_args
    )
    store_preflight(
        "attribute",
        store_args.store,
        method_args,
        args,
        final or staging,
        staging,
        force=force,
        quiet=quiet,
    )
    score = attributor.attribute_from_cache(train_dir, query_dir, verbose=not quiet, **options)
    score.save(staging)
    rows, queries = score.scores.shape[:2]
    return {"algorithm": score.algorithm, "rows": rows, "queries": queries}

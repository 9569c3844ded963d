"""``dattri-llm fit``: the damping-free curvature of K-FAC / EK-FAC / LoRIF, persisted.

Fits over the training store of a capture (``KroneckerAttributor.fit`` /
``LoRIFAttributor.fit``) and writes the fit file (``fisher_factors.pt`` or
``lorif_fit.pt``) to the output directory; ``attribute`` / ``top-k`` /
``report --fit <dir>`` read it back instead of fitting again (the same scores,
bit for bit; only the damping may differ).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.cli.arguments import StoreArguments
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.method_arguments import MethodArguments
from dattri_llm.cli.methods import build_attributor, check_fit_method, check_not_stride, fit_file
from dattri_llm.cli.plan import store_preflight
from dattri_llm.cli.stores import capture_stores

__all__ = ["run_fit"]


def run_fit(
    staging: Path,
    args: AttributionArguments,
    store_args: StoreArguments,
    method_args: MethodArguments,
    *,
    quiet: bool,
    force: bool = False,
    final: Path | None = None,
) -> dict[str, Any]:
    """Fit over the capture's training store into ``staging``; return a short summary.

    The run plan comes first: ``CLIError`` when the fit would not fit the free
    memory or disk, unless ``force``.
    """
    check_not_stride(method_args.method, "fit")
    check_fit_method(method_args.method, "fit")
    if method_args.fit is not None:
        raise CLIError("--fit names a fit to reuse; `dattri-llm fit` writes one (drop --fit)")
    train_dir, _query_dir = capture_stores(store_args.store)
    attributor, _options = build_attributor(
        dataclasses.replace(args, output_dir=str(staging)), method_args
    )
    store_preflight(
        "fit",
        store_args.store,
        method_args,
        args,
        final or staging,
        staging,
        force=force,
        quiet=quiet,
    )
    attributor.fit(train_dir, fit_dir=str(staging), verbose=not quiet)
    return {"algorithm": attributor.algorithm, "file": fit_file(method_args.method)}

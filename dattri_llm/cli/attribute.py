"""``dattri-llm attribute``: the full score of one method, from a capture's stores or live.

From a capture (``--store``): writes the ``AttributionScore`` (``scores.pt``,
``metadata.json``, re-read by ``AttributionScore.load``), whatever fit the
method keeps and the run plan (``plan.txt``, ``plan.json``) into the output
directory. ``--fit`` reuses the fit of ``dattri-llm fit`` (the same scores as
fitting here, bit for bit). The trajectory methods need a trained capture
(``capture --train``), less a ``capture --train --less``.

Live (``--model``, ``--train_data`` and ``--query_data`` instead of
``--store``): loads the model and data as ``capture`` does and runs the
method's ``attribute(train, test)`` (Grad-Dot, Grad-Cos, K-FAC, EK-FAC), no
store written; the same score as ``capture`` + ``attribute --store``. TRAK,
DataInf and the exact-Hessian influence functions run live only (TRAK's
``1 − p`` weights come from the training forward; DataInf and the influence
functions collect the gradients in memory first, the influence Hessian being
that of the mean training loss over the training samples). TrackStar runs
live only with the trained model's optimizer state (``--optimizer_state``).
The metagradient runs live only: it trains the loaded model one epoch with
the optimizer options (dropout set to 0, so that the run replays exactly),
records the run in a temporary directory inside the staged output, and
differentiates each query's loss at the trained weights through every update.

STRIDE (``--method stride``) runs live only: it captures no gradients, so it
reads no store, makes no run plan and takes no layer selection; its
``--stride_*`` options make its ``StrideConfig``. Its output is the same
``AttributionScore`` files as any other method's, rows and queries named by the
same sample identifiers.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from dattri_llm.attribution.algorithm.metagradient import MetagradientAttributor
from dattri_llm.attribution.algorithm.stride import StrideAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli.arguments import (
    AttributeStoreArguments,
    CaptureArguments,
    LiveDataArguments,
    LiveModelArguments,
)
from dattri_llm.cli.capture import input_plan, load_inputs
from dattri_llm.cli.data import TokenizedSet
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.method_arguments import (
    LIVE_METHODS,
    METAGRADIENT_METHOD,
    STRIDE_METHOD,
    MethodArguments,
)
from dattri_llm.cli.methods import build_attributor, check_live_options, check_not_stride
from dattri_llm.cli.model import causal_lm_loss, disable_dropout
from dattri_llm.cli.plan import check_metagradient_disk, preflight, store_preflight
from dattri_llm.cli.stores import capture_stores
from dattri_llm.task import AttributionTask

__all__ = ["check_source", "check_stride_options", "run_attribute"]

_CAPTURE_FLAGS = {"lorif": "", "less": " --train --less"}  # the capture a stored method needs


def check_source(
    store_args: AttributeStoreArguments,
    model_args: LiveModelArguments,
    data_args: LiveDataArguments,
    method_args: MethodArguments,
) -> bool:
    """Whether the run is live; ``CLIError`` unless it has one source, and a method it serves.

    A capture is ``--store``; a live run is ``--model`` with ``--train_data``
    and ``--query_data``.
    """
    live = {
        "--model": model_args.model,
        "--train_data": data_args.train_data,
        "--query_data": data_args.query_data,
    }
    given = [flag for flag, value in live.items() if value is not None]
    if store_args.store is not None:
        check_not_stride(method_args.method, "attribute")
        if given:
            raise CLIError(
                f"--store scores a capture and {', '.join(given)} a live run; give one of them"
            )
        return False
    if not given:
        raise CLIError("give --store (a capture), or --model, --train_data and --query_data (live)")
    missing = [flag for flag in live if flag not in given]
    if missing:
        raise CLIError(f"live attribute (no --store) also needs {', '.join(missing)}")
    if method_args.method not in LIVE_METHODS:
        raise CLIError(
            f"live attribute serves {', '.join(LIVE_METHODS)}; for {method_args.method}, "
            f"run `dattri-llm capture{_CAPTURE_FLAGS.get(method_args.method, ' --train')}` "
            "and `attribute --store`"
        )
    return True


def check_stride_options(capture_args: CaptureArguments, method_args: MethodArguments) -> None:
    """``CLIError`` for options a STRIDE run cannot use: a layer selection or ``--fit``."""
    if method_args.fit is not None:
        raise CLIError(
            "stride fits its operators within the attribute run; `dattri-llm fit` and --fit "
            "serve kfac, ekfac and lorif (drop --fit)"
        )
    default = CaptureArguments()
    selection = [
        f"--{name}"
        for name in ("linear_io", "param_grad", "capture_style", "proj_dim", "proj_style")
        if getattr(capture_args, name) != getattr(default, name)
    ]
    if selection:
        raise CLIError(
            f"stride captures no gradients: drop {', '.join(selection)} "
            "(--stride_layer picks the module its operators read)"
        )


def run_attribute(
    staging: Path,
    args: AttributionArguments,
    store_args: AttributeStoreArguments,
    model_args: LiveModelArguments,
    data_args: LiveDataArguments,
    capture_args: CaptureArguments,
    method_args: MethodArguments,
    *,
    quiet: bool,
    force: bool = False,
    final: Path | None = None,
) -> dict[str, Any]:
    """Score the stores (or live) into ``staging``; return a short summary.

    The run plan comes first (:func:`~dattri_llm.cli.plan.store_preflight`
    from a capture, the loaded model and data live): ``CLIError`` when the fit
    and scoring would not fit the free memory, or the scores the free disk,
    unless ``force``.
    """
    run_args = dataclasses.replace(args, output_dir=str(staging))
    if check_source(store_args, model_args, data_args, method_args):
        score = _live_score(
            staging, run_args, model_args, data_args, capture_args, method_args, quiet, force, final
        )
    else:
        train_dir, query_dir = capture_stores(store_args.store)
        attributor, options = build_attributor(run_args, method_args, store_args.store)
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


def _live_score(
    staging: Path,
    args: AttributionArguments,
    model_args: LiveModelArguments,
    data_args: LiveDataArguments,
    capture_args: CaptureArguments,
    method_args: MethodArguments,
    quiet: bool,
    force: bool,
    final: Path | None,
) -> AttributionScore:
    """The method's live ``attribute(train, test)`` over the model and data (no store)."""
    if method_args.method == STRIDE_METHOD:
        check_stride_options(capture_args, method_args)
    check_live_options(method_args, capture_args)
    model, _tokenizer, _layers, sets = load_inputs(model_args, data_args, capture_args, quiet=quiet)
    if method_args.method == "influence" and hasattr(model, "set_attn_implementation"):
        # The Hessian-vector products use forward-mode AD, which fused attention kernels
        # (scaled_dot_product_attention) do not implement: the plain attention computes the same.
        model.set_attn_implementation("eager")
    if method_args.method == METAGRADIENT_METHOD:
        _deterministic(model)
    task = AttributionTask(loss_func=causal_lm_loss, model=model)
    if method_args.method == STRIDE_METHOD:
        return _stride_score(args, task, sets, method_args, quiet)
    plan = input_plan(model, sets, capture_args, method_args.method, args)
    preflight(
        "attribute",
        plan,
        method_args.method,
        final or staging,
        staging,
        force=force,
        quiet=quiet,
        reuses_fit=method_args.fit is not None,
    )
    attributor, options = build_attributor(
        args, method_args, task=task, train_samples=sets["train"].samples
    )
    if method_args.method == METAGRADIENT_METHOD:
        num_train = len(sets["train"].samples)
        check_metagradient_disk(model, num_train, args, final or staging, force=force)
        return _metagradient_score(staging, attributor, sets, capture_args, options, quiet)
    return attributor.attribute(
        sets["train"].samples,
        sets["query"].samples,
        hook_config=capture_args.hook_config(),
        verbose=not quiet,
        **options,
    )


def _deterministic(model: torch.nn.Module) -> None:
    """Set the model's dropout to 0, warning with the rates that were not.

    The metagradient is the derivative of the replayed run, which equals the
    recorded one only when the forward is deterministic; the training and the
    replay run the model in ``train()`` mode, where dropout would draw fresh
    masks each time.
    """
    dropped = disable_dropout(model)
    if dropped:
        warnings.warn(
            "metagradient: the model's dropout is set to 0 for the recorded run and its replay "
            f"(an exact metagradient needs a deterministic run): {', '.join(dropped)}",
            UserWarning,
            stacklevel=2,
        )


def _metagradient_score(
    staging: Path,
    attributor: MetagradientAttributor,
    sets: dict[str, TokenizedSet],
    capture_args: CaptureArguments,
    options: dict[str, Any],
    quiet: bool,
) -> AttributionScore:
    """Train one epoch from the loaded model recording the run, then its exact metagradients.

    The recorded run
    (parameter snapshots of every step) and the replay's per-update moments
    live in a temporary directory inside ``staging``, deleted after scoring;
    the output directory holds the score only.
    """
    with tempfile.TemporaryDirectory(prefix=".metagradient-run-", dir=staging) as run_dir:
        return attributor.attribute(
            sets["train"].samples,
            sets["query"].samples,
            hook_config=capture_args.hook_config(),
            verbose=not quiet,
            cache_dir=run_dir,
            scratch_dir=run_dir,
            **options,
        )


def _stride_score(
    args: AttributionArguments,
    task: AttributionTask,
    sets: dict[str, TokenizedSet],
    method_args: MethodArguments,
    quiet: bool,
) -> AttributionScore:
    """STRIDE's live score; the library names its rows and queries as the other methods do."""
    attributor = StrideAttributor(args, task=task, config=method_args.stride_config())
    return attributor.attribute(sets["train"].samples, sets["query"].samples, verbose=not quiet)

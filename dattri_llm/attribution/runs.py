"""How the entry points run, through the attributor's hooks.

``attribute`` runs the model over the task's checkpoints: each checkpoint is
scored live (a train streamer and a test probe sharing its hooks, through
``score_sources``) or collected into stores of a residency and scored from
them (``attribute_from_cache``); the per-checkpoint rows are concatenated,
test columns aligned to the first checkpoint's order (the TracIn checkpoint
ensemble). ``attribute_from_cache`` scores two stores (:func:`score_stores`).
The functions take the ``BaseInnerProductAttributor`` whose hooks run (typed
``Any``: this module does not import ``base``, which imports it).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.attribution.collection import collect_checkpoint
from dattri_llm.attribution.scoring import ScoreResult
from dattri_llm.attribution.sources import (
    _require_records,
    normalize_layer_names,
    open_store_directory,
)
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.cache import CACHE_RESIDENCIES
from dattri_llm.utils.distributed import dist_barrier, dist_world_size

if TYPE_CHECKING:
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig


def check_residency(residency: str | None, enable_update: bool, loop_over_test: bool) -> None:
    """``ValueError`` for an unknown ``gradient_cache_residency``, or a collected run
    (``residency`` not ``None``) asked to re-take the queries at every ``θ_t``."""
    if residency is not None and residency not in (CACHE_RESIDENCIES):
        raise ValueError(
            f"gradient_cache_residency must be one of {[None, *CACHE_RESIDENCIES]}, got "
            f"{residency!r}"
        )
    if residency is not None and enable_update and loop_over_test:
        raise ValueError(
            "enable_update with loop_over_test re-takes the queries at every θ_t, which needs "
            "live scoring; use gradient_cache_residency=None"
        )


def ensemble_indices(attributor: Any, enable_update: bool) -> list[int]:
    """Checkpoint indices to run; a trajectory uses the first one only (``UserWarning``)."""
    indices = attributor.checkpoints()
    if enable_update and len(indices) > 1:
        warnings.warn(
            f"enable_update=True trains from the first checkpoint only; checkpoints "
            f"{indices[1:]} are ignored",
            UserWarning,
            stacklevel=3,
        )
        return indices[:1]
    return indices


def check_single_fsdp_wrap(attributor: Any, checkpoints: int, *, collected: bool) -> None:
    """``ValueError`` when ``args.fsdp`` would have to wrap the task's model more than once.

    With ``args.fsdp`` set, each streamer wraps the task's (unwrapped) model in
    ``FullyShardedDataParallel``, which shards its parameters in place over the
    ranks and cannot be undone: a second streamer over the model would find
    1-D shards (a collected call runs a query streamer, then a training one;
    the next checkpoint of an ensemble cannot even be loaded into it). A call
    doing that is refused here, before any work, rather than failing half-way
    (`wrap_fsdp` guards other second wraps). One live checkpoint wraps once
    (the query probe runs through the training streamer's wrapper). A task
    given a wrapper is never re-wrapped; one rank shards nothing.
    """
    task = attributor.task
    args = attributor.args
    if not args.fsdp or task is None or task.is_wrapped or dist_world_size() <= 1:
        return
    if checkpoints <= 1 and not collected:
        return
    what = (
        "collecting gradients (gradient_cache_residency / cache()) streams the queries and "
        "the training set with separate streamers"
        if collected
        else f"an ensemble of {checkpoints} checkpoints wraps it once per checkpoint"
    )
    raise ValueError(
        f"args.fsdp={args.fsdp!r} wraps the task's model in FullyShardedDataParallel, which "
        "shards its parameters in place and cannot be undone, so one call can wrap it only "
        f"once, but {what}. Score live (gradient_cache_residency=None) one checkpoint per "
        "call, each on a freshly built model; or wrap the model yourself and pass the "
        "wrapper, AttributionTask(loss, FullyShardedDataParallel(model, use_orig_params=True), "
        "checkpoints, checkpoints_load_func=...) with a loader that loads inside "
        "FullyShardedDataParallel.summon_full_params(wrapper, writeback=True); or use DDP "
        "(unset args.fsdp)"
    )


def score_live(
    attributor: Any,
    train_dataset: object,
    test_dataset: object,
    *,
    hook_config: HookManagerConfig | None,
    verbose: bool,
    loop_over_test: bool,
    enable_update: bool,
    attribution_granularity: str,
) -> tuple[list[ScoreResult], list[str]]:
    """Score each checkpoint live; return the per-checkpoint results and hooked layers."""
    results, layers = [], []
    indices = ensemble_indices(attributor, enable_update)
    check_single_fsdp_wrap(attributor, len(indices), collected=False)
    attributor._verbose = verbose
    try:
        for k in indices:
            attributor.load_checkpoint(k)
            train = attributor.generate_train_rep(
                train_dataset,
                checkpoint_step=k,
                enable_update=enable_update,
                hook_config=hook_config,
            )
            test = attributor.generate_test_rep(
                test_dataset,
                checkpoint_step=k,
                hook_config=hook_config,
                hook_manager=train.hook_manager,
                forward_model=train.forward_model,
                shard=False,
            )
            train.defer_update = enable_update and loop_over_test
            with train, test:
                layers = list(train.hook_manager.layer_names)
                results.append(
                    attributor.score_sources(
                        train,
                        test,
                        loop_over_test=loop_over_test,
                        attribution_granularity=attribution_granularity,
                    )
                )
    finally:
        attributor._verbose = False
        attributor._forget_loaded_checkpoint(enable_update)
    return results, layers


def score_collected(
    attributor: Any,
    train_dataset: object,
    test_dataset: object,
    residency: str,
    attribution_kwargs: dict[str, Any],
    *,
    hook_config: HookManagerConfig | None,
    verbose: bool,
    loop_over_test: bool,
    enable_update: bool,
    attribution_granularity: str,
) -> tuple[list[ScoreResult], list[str]]:
    """Collect each side into stores of ``residency``, then score them from the cache.

    ``"disk"`` collects through the attributor's ``cache`` (stores under
    ``args.output_dir``); another residency into temporary stores.
    """
    score_kwargs = {
        "verbose": verbose,
        "loop_over_test": loop_over_test,
        "attribution_granularity": attribution_granularity,
        **attribution_kwargs,
    }
    results: list[ScoreResult] = []
    layers: list[str] = []
    if residency == "disk":
        for train_dir, test_dir in attributor.cache(
            train_dataset, test_dataset, hook_config=hook_config, enable_update=enable_update
        ):
            dist_barrier()  # a shared store is read once every rank has written its shard
            score = attributor.attribute_from_cache(train_dir, test_dir, **score_kwargs)
            results.append(score_result(score))
        return results, list(attributor._hooked_layers)
    indices = ensemble_indices(attributor, enable_update)
    check_single_fsdp_wrap(attributor, len(indices), collected=True)
    for k in indices:
        attributor.load_checkpoint(k)
        with tempfile.TemporaryDirectory(prefix="dattri_llm_cache_") as tmp:
            train_store = GradientStorageManager(f"{tmp}/train", residency=residency)
            test_store = GradientStorageManager(f"{tmp}/test", residency=residency)
            with train_store, test_store:
                layers = collect_checkpoint(
                    attributor,
                    k,
                    train_dataset,
                    test_dataset,
                    train_store,
                    test_store,
                    hook_config=hook_config,
                    enable_update=enable_update,
                )
                score = attributor.attribute_from_cache(train_store, test_store, **score_kwargs)
                results.append(score_result(score))
    return results, layers


def score_stores(
    attributor: Any,
    train_source: object,
    test_source: object,
    *,
    selected_training_steps: Iterable[int] | None,
    layer_name: str | list[str] | None,
    verbose: bool,
    loop_over_test: bool,
    algorithm_meta: dict[str, Any] | None,
    attribution_granularity: str,
    attribution_kwargs: dict[str, Any],
) -> AttributionScore:
    """Score every train record against every test record of two stores; build the score.

    Both stores must hold records; the sources come from the attributor's
    ``load_train_rep`` (only ``selected_training_steps``) and
    ``load_test_rep``, restricted to ``layer_name``. A store directory is opened
    once for the whole call (:func:`~.sources.open_store_directory`).
    """
    layers = normalize_layer_names(layer_name)
    steps = None if selected_training_steps is None else sorted(set(selected_training_steps))
    train_source = open_store_directory(train_source)
    test_source = open_store_directory(test_source)
    train_store = attributor.resolve_store(train_source)
    test_store = attributor.resolve_store(test_source)
    _require_records(train_store, "training")
    _require_records(test_store, "test")
    attributor._verbose = verbose
    try:
        train = attributor.load_train_rep(train_source, steps=steps, layer_name=layers)
        test = attributor.load_test_rep(test_source, layer_name=layers)
        scores, row_ids, row_steps, test_ids, row_tokens = attributor.score_sources(
            train,
            test,
            loop_over_test=loop_over_test,
            attribution_granularity=attribution_granularity,
        )
    finally:
        attributor._verbose = False
    meta = {
        "selected_training_steps": steps,
        **attributor.stores_meta(train_store, test_store),
        "attribution_granularity": attribution_granularity,
        **(algorithm_meta or {}),
        **attribution_kwargs,
    }
    return attributor.build_score(
        scores,
        row_ids,
        row_steps,
        test_ids,
        algorithm_meta=meta,
        layer_name=layers if layers is not None else list(attributor.scored_layers),
        row_token_ids=row_tokens,
    )


def query_at(enable_update: bool, loop_over_test: bool) -> str:
    """Parameters the queries are taken at: ``checkpoint``, ``theta_0`` or ``theta_t``."""
    if not enable_update:
        return "checkpoint"
    return "theta_t" if loop_over_test else "theta_0"


def score_result(score: AttributionScore) -> ScoreResult:
    """The raw tuple of a built score."""
    return (
        score.scores,
        score.row_train_ids,
        score.row_steps,
        score.test_ids,
        score.row_token_ids,
    )


def concat_results(results: list[ScoreResult]) -> ScoreResult:
    """Concatenate per-checkpoint rows, aligning test columns to the first result's order."""
    first_ids = results[0][3]
    matrices, row_ids, row_steps = [], [], []
    row_tokens: list[int] | None = [] if results[0][4] is not None else None
    for scores, ids, steps, test_ids, tokens in results:
        if set(test_ids) != set(first_ids):
            raise ValueError("checkpoints produced different test samples; cannot ensemble them")
        position = {h: i for i, h in enumerate(test_ids)}
        matrices.append(scores[:, [position[h] for h in first_ids]])
        row_ids.extend(ids)
        row_steps.extend(steps)
        if row_tokens is not None:
            row_tokens.extend(tokens or [])
    return torch.cat(matrices, dim=0), row_ids, row_steps, list(first_ids), row_tokens

"""The two sides' gradient sources: live streamers over the task, or stores on disk.

An attributor reads training and test gradients from a
:class:`~dattri_llm.gradient.streaming.GradientSource`: a ``GradientStreamer``
running the task's model (train side: the train loss and batch size; test
side: a frozen probe with the target function) or a ``DiskGradientSource``
over a gradient store. Here: building those sources, resolving what a user
passes as a store (a directory, an open store, a disk source) and as
``layer_name``, opening fresh stores for a collection, and the checks on
datasets and stores that run before any work starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.stream.inputs import check_dataset
from dattri_llm.gradient.stream.readers import DiskGradientSource
from dattri_llm.gradient.stream.streamer import GradientStreamer

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager


def _check_dataset(dataset: object, side: str) -> None:
    """Check a ``train_dataset`` / ``test_dataset`` argument before any work starts.

    ``TypeError`` unless it is a kind `check_dataset` accepts (the streamer
    checks the same); ``ValueError`` for a dataset of length 0.
    """
    check_dataset(dataset, f"the {side} dataset")
    if len(dataset) == 0:
        raise ValueError(f"the {side} dataset is empty; pass at least one {side} sample")


def normalize_layer_names(x: str | Iterable[str] | None) -> list[str] | None:
    """``None`` → ``None``; a name → ``[name]``; an iterable → list of names (non-empty)."""
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    names = list(x)
    if not names:
        raise ValueError("layer_name is empty; pass None to keep every layer")
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise TypeError(f"layer names must be strings, got {bad}")
    return names


# ---------------------------------------------------------------------------- live sources
def train_streamer(
    attributor: Any,
    train_dataset: object,
    method: str,
    *,
    forward_model: nn.Module | None = None,
    **streamer_options: Any,
) -> GradientStreamer:
    """A train-side ``GradientStreamer`` over the task model with the train loss.

    ``attributor`` is the ``BaseInnerProductAttributor`` (its task, settings
    and ``train_loss_fn``); ``method`` names the caller when there is no task.
    ``streamer_options`` go to the streamer (``enable_update``, ``config``,
    ``optimizer``, ``precondition``, ...); the forward model defaults to the
    task's wrapper and the batch size is ``per_device_train_batch_size``.
    """
    task = attributor.require_task(method)
    return GradientStreamer(
        task.model,
        train_dataset,
        attributor.args,
        batch_size=attributor.args.per_device_train_batch_size,
        loss_fn=attributor.train_loss_fn(),
        forward_model=forward_model if forward_model is not None else task.forward_model,
        **streamer_options,
    )


def query_streamer(
    attributor: Any,
    test_dataset: object,
    *,
    checkpoint_step: int,
    hook_config: HookManagerConfig | None,
    hook_manager: HookManager | None,
    forward_model: nn.Module | None,
    shard: bool,
    **streamer_options: Any,
) -> GradientStreamer:
    """A frozen test probe (batch ``per_device_eval_batch_size``, the target function).

    Its ``role`` is ``"query"``: loss errors name the failing query batch.
    ``streamer_options`` go to the streamer (e.g. ``optimizer``, ``precondition``).
    """
    task = attributor.require_task("generate_test_rep")
    streamer = GradientStreamer(
        task.model,
        test_dataset,
        attributor.args,
        batch_size=attributor.args.per_device_eval_batch_size,
        loss_fn=attributor.test_loss_fn(),
        config=hook_config,
        checkpoint_step=checkpoint_step,
        hook_manager=hook_manager,
        forward_model=forward_model if forward_model is not None else task.forward_model,
        shard=shard,
        **streamer_options,
    )
    streamer.role = "query"
    return streamer


# ---------------------------------------------------------------------------- stores
def disk_source(
    source: object,
    args: AttributionArguments,
    *,
    steps: Iterable[int] | None,
    layer_name: str | list[str] | None,
    verbose: bool,
    desc: str | None,
) -> DiskGradientSource:
    """A ``DiskGradientSource`` over the store of ``source`` (see :func:`resolve_store`).

    A ``DiskGradientSource`` passed in keeps its steps and layers unless
    ``steps`` / ``layer_name`` are given.
    """
    if isinstance(source, DiskGradientSource):
        steps = source.steps if steps is None else steps
        layer_name = source.layer_name if layer_name is None else layer_name
    return DiskGradientSource(
        resolve_store(source),
        args,
        steps=steps,
        layer_name=layer_name,
        desc=desc,
        verbose=verbose,
    )


def resolve_store(source: object) -> GradientStorageManager:
    """A directory → a new store on it; a store → itself; a ``DiskGradientSource`` → its store.

    A missing directory raises ``FileNotFoundError``; other types ``TypeError``.
    """
    if isinstance(source, GradientStorageManager):
        return source
    if isinstance(source, DiskGradientSource):
        return source.file_manager
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"gradient cache directory {str(path)!r} does not exist; write it with "
                "OffloadCallback or attributor.cache(...) first"
            )
        return GradientStorageManager(str(path))
    raise TypeError(
        "expected a gradient store directory, a GradientStorageManager or a "
        f"DiskGradientSource, got {type(source).__name__}"
    )


def open_store_directory(source: object) -> object:
    """``source`` with a store directory opened, once, for a call that reads it several times.

    A directory becomes its store (:func:`resolve_store`), so the steps of one
    call (checks, fit, the scoring pass, the score's metadata) share one store
    and one identifier index in memory instead of each opening the directory
    again. Any other source (an open store, a ``DiskGradientSource``, a path
    that is not a directory, which the call refuses later as before) is
    returned unchanged.
    """
    if isinstance(source, (str, Path)) and Path(source).expanduser().is_dir():
        return resolve_store(source)
    return source


def stores_meta(
    train_store: GradientStorageManager, test_store: GradientStorageManager
) -> dict[str, dict[str, object]]:
    """``{"sample_id_key": {"train": k1, "test": k2}}`` of two stores."""
    return {"sample_id_key": {"train": train_store.sample_id_key, "test": test_store.sample_id_key}}


def fresh_store(path: str | Path) -> GradientStorageManager:
    """A disk store on ``path`` for a new collection; ``ValueError`` if it already holds records."""
    store = GradientStorageManager(str(path))
    if store.index:
        raise ValueError(
            f"gradient cache {store.save_dir} already holds records; remove it or choose "
            "another cache_dir"
        )
    return store


def _require_records(store: GradientStorageManager, side: str) -> None:
    """Raise ``ValueError`` when ``store`` holds no record."""
    if not store.index:
        raise ValueError(
            f"the {side} gradient store {str(store.save_dir)!r} holds no records; capture "
            f"{side} gradients into it first"
        )

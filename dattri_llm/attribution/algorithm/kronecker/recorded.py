"""Covariances recorded at capture: recorded while a train store is collected, adopted later.

A collection run by :meth:`~CaptureTimeCovariances.cache` or a collected
``attribute`` records each K-FAC layer's ``(A, G)`` with a
``KroneckerCovarianceCallback``, reduces them over the ranks and binds them to
the store (``kronecker_covariances.pt`` beside a disk store, with the steps,
row count and projection they cover). A later call adopts them only for that
store and a selection of the same rows.
"""

from __future__ import annotations

import json
import pickle
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.gradient.callbacks.kronecker_covariance_callback import (
    KroneckerCovarianceCallback,
)
from dattri_llm.utils.atomic import atomic_torch_save
from dattri_llm.utils.distributed import all_reduce_sum
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.attribution.algorithm.kronecker.covariances import Covariances
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.gradient.stream.streamer import GradientStreamer

COVARIANCES_FILE = "kronecker_covariances.pt"


def _store_selection(
    store: GradientStorageManager, steps: Iterable[int] | None = None
) -> dict[str, Any]:
    """``{"steps", "rows", "projection"}`` of the store rows a call reads.

    ``steps`` (``None`` = all) filters the stored steps; ``rows`` counts the
    indexed (identifier, step) rows of the kept steps; ``projection`` is the
    store's declared projection as canonical JSON.
    """
    counts: dict[int, int] = {}
    for _, step, _, _, _ in store.index_rows():
        counts[step] = counts.get(step, 0) + 1
    kept = sorted(counts) if steps is None else sorted(set(counts) & set(steps))
    return {
        "steps": kept,
        "rows": sum(counts[step] for step in kept),
        "projection": json.dumps(store.projection, sort_keys=True),
    }


def _recorded_meta(store: GradientStorageManager, covariances: Covariances) -> dict[str, Any]:
    """What covariances recorded while collecting ``store`` cover (rows summed over ranks)."""
    meta = _store_selection(store)
    rows = torch.tensor([float(meta["rows"])], dtype=torch.float64)
    meta["rows"] = int(all_reduce_sum(rows).item())
    meta["layers"] = sorted(covariances)
    return meta


def _covariance_mismatch(
    payload: Any, store: GradientStorageManager, steps: Iterable[int] | None
) -> str | None:
    """Why recorded covariances do not cover the rows a call reads from ``store`` (``None``: ok)."""
    if isinstance(payload, Mapping) and "unreadable" in payload:
        return payload["unreadable"]
    meta = payload.get("meta") if isinstance(payload, Mapping) else None
    if not isinstance(meta, Mapping) or not isinstance(payload.get("covariances"), Mapping):
        return "records no steps, rows or projection (written by an older version)"
    selected = _store_selection(store, steps)
    for key in ("steps", "rows", "projection"):
        if meta.get(key) != selected[key]:
            return (
                f"was recorded for {key}={meta.get(key)!r} while this call reads "
                f"{key}={selected[key]!r} from the store"
            )
    return None


@dataclass(frozen=True)
class _RecordedCovariances:
    """Covariances recorded while collecting one train store, bound to that store.

    ``payload`` is ``{"meta": ..., "covariances": {layer: (A, G)}}`` as written
    to ``kronecker_covariances.pt``. The store is held weakly (a memory store
    is not kept alive); a disk store also matches by directory.
    """

    store: weakref.ref
    save_dir: Path
    residency: str
    payload: dict[str, Any]

    @classmethod
    def of(cls, store: GradientStorageManager, payload: dict[str, Any]) -> _RecordedCovariances:
        """Bind ``payload`` to ``store``."""
        return cls(weakref.ref(store), _resolved(store.save_dir), store.residency, payload)

    def belongs_to(self, store: GradientStorageManager) -> bool:
        """Whether ``store`` is the store (or the disk directory) these were recorded for."""
        if self.store() is store:
            return True
        return (
            self.residency == "disk" == store.residency
            and _resolved(store.save_dir) == self.save_dir
        )


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


class CaptureTimeCovariances:
    """Mixin of :class:`KroneckerAttributor`: record covariances at capture, adopt them later.

    State: ``_collect_covariances`` (record during the running collection),
    ``_recorder`` (its callback), ``_recorded`` (the payload bound to the store
    it was recorded for), and for the running call ``_capture_time_covariances``
    (adopted) or ``_unusable_covariances`` (why the recorded ones do not fit).
    """

    def _use_store_covariances(self, train_source: object) -> None:
        """Adopt the covariances recorded at capture for this train store, if they fit the call.

        The candidate is the payload this attributor recorded while collecting
        the same store (a memory store inside :meth:`attribute`, or a disk store
        on a rank that writes no files), else ``kronecker_covariances.pt``
        beside a disk store. It is used only when the steps, row count and
        projection it was recorded for equal this call's selection of the store
        (covariances are per layer, so a layer selection needs no match);
        otherwise factorized layers are refit from the store and a dense
        eligible layer raises ``ValueError`` (:meth:`fisher_layers`). Supplied
        covariances (``fit(covariances=...)``) replace them entirely.
        """
        self._capture_time_covariances = {}
        self._unusable_covariances = None
        if not self.covariances_at_capture or self.covariances is not None:
            return
        try:
            store = self.resolve_store(train_source)
        except (TypeError, FileNotFoundError):
            return
        candidate = self._recorded_for(store)
        if candidate is None:
            return
        origin, payload = candidate
        steps = self._fit_settings["selected_training_steps"]
        reason = _covariance_mismatch(payload, store, steps)
        if reason is None:
            self._capture_time_covariances = dict(payload["covariances"])
        else:
            self._unusable_covariances = f"{origin} {reason}"

    def _recorded_for(self, store: GradientStorageManager) -> tuple[str, Any] | None:
        """``(origin, payload)`` of the covariances recorded for ``store``, if any."""
        if self._recorded is not None and self._recorded.belongs_to(store):
            return "the covariances recorded while capturing it", self._recorded.payload
        path = Path(store.save_dir) / COVARIANCES_FILE
        if store.residency != "disk" or not path.is_file():
            return None
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
            return str(path), {"unreadable": f"cannot be read ({error})"}
        return str(path), payload

    def generate_train_rep(
        self,
        train_dataset: object,
        *,
        checkpoint_step: int = 0,
        enable_update: bool = False,
        hook_config: HookManagerConfig | None = None,
        snapshots: object | None = None,
        forward_model: nn.Module | None = None,
    ) -> GradientStreamer:
        """Base train streamer; records covariances at capture during a collection."""
        streamer = super().generate_train_rep(
            train_dataset,
            checkpoint_step=checkpoint_step,
            enable_update=enable_update,
            hook_config=hook_config,
            snapshots=snapshots,
            forward_model=forward_model,
        )
        if self._collect_covariances:
            self._recorder = KroneckerCovarianceCallback()
            streamer.hook_manager.add_callback(self._recorder)
        return streamer

    def collect_gradients(
        self,
        streamer: GradientStreamer,
        store: GradientStorageManager,
        *,
        offload_interval: int = 1,
        on_block: Callable[[int, Gradient, list[str]], None] | None = None,
    ) -> GradientStorageManager:
        """Base collection; a train collection's covariances are recorded for its store.

        They are held bound to ``store`` and, for a disk store, written beside it
        as ``kronecker_covariances.pt`` with the steps, row count and projection
        they cover (crash-safe write).
        """
        recorder = self._recorder if streamer.hook_manager is not None else None
        result = super().collect_gradients(
            streamer, store, offload_interval=offload_interval, on_block=on_block
        )
        if recorder is not None and recorder in streamer.hook_manager.callbacks:
            self._recorder = None
            recorder.all_reduce()
            covariances = {k: (a.cpu(), g.cpu()) for k, (a, g) in recorder.result().items()}
            payload = {"meta": _recorded_meta(store, covariances), "covariances": covariances}
            self._recorded = _RecordedCovariances.of(store, payload)
            if store.residency == "disk" and self.args.should_log:
                atomic_torch_save(payload, Path(store.save_dir) / COVARIANCES_FILE)
        return result

    @keywords(extra=("cache_dir", "hook_config", "enable_update", "on_train_block"))
    def cache(  # noqa: D417 - documented in docs/API.md
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        covariances_at_capture: bool | None = None,
        **kwargs: Any,
    ) -> list[tuple[str, str]]:
        """Collect gradients; with ``covariances_at_capture`` also ``kronecker_covariances.pt``.

        ``None`` keeps the current setting.
        """
        previous = self._collect_covariances
        self._recorder = None
        if covariances_at_capture is not None:
            self._collect_covariances = covariances_at_capture
        elif not previous:
            self._collect_covariances = self.covariances_at_capture
        try:
            return super().cache(train_dataset, test_dataset, **kwargs)
        finally:
            self._collect_covariances = previous

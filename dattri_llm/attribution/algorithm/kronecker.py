"""Curvature-based influence: K-FAC and EK-FAC (and the dense empirical Fisher).

``score[i, j] = Σ_l vec(dW_tr,i)ᵀ F_l⁻¹ vec(dW_te,j)``: the inverse curvature is
applied once to the test side (:meth:`KroneckerAttributor.transform_test_rep`)
and scored against raw train gradients with the inner-product machinery of
:class:`~dattri_llm.attribution.base.BaseInnerProductAttributor`.

* **K-FAC**: ``F_l ≈ A ⊗ G`` with the token-row covariances of the
  preprocessed factors (``ops.kfac_factors``, bias column included);
  ``A⁻¹ = (A + λ_A I)⁻¹``, ``G⁻¹ = (G + λ_G I)⁻¹``; a test layer becomes
  ``G⁻¹·dW·A⁻¹``, kept factorized as final factors ``(a·A⁻¹, g·G⁻¹)`` or
  computed densely for a dense block.
* **EK-FAC**: eigenbases ``U_A, U_G`` of ``A, G`` and the eigenvalue correction
  ``Λ = mean_i (U_Gᵀ dW_i U_A)²`` over the training samples (second pass); a
  test layer becomes ``U_G((U_Gᵀ dW U_A)/(Λ+λ))U_Aᵀ``.
* **Dense Fisher** (``F = Σ g gᵀ / n``, ``(F + λI)⁻¹``) for dense K-FAC layers
  without covariances (``UserWarning``) and, with
  ``non_kfac_strategy="direct"``, for normalization layers.

Damping ``λ_X = damping``, or ``damping · mean eigenvalue of X`` with
``relative_damping=True`` (EK-FAC: ``damping · mean(Λ)``). A fit is
damping-free and can be persisted (``fit_dir``) and re-damped later.

Tied weights are scored per use site: each hooked module contributes its own
term and the cross-site terms are dropped.
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm._ekfac_eigenbasis import (
    eigenbasis_mode,
    precondition_in_eigenbasis,
    rotated_block,
)
from dattri_llm.attribution.algorithm._kfac_plan import (
    DEFAULT_KEPT_GRADIENT_BUDGET as DEFAULT_KEPT_GRADIENT_BUDGET,
)
from dattri_llm.attribution.algorithm._kfac_plan import (
    KeptPasses,
    resolve_kept_budget,
)
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.utils import normalize_layer_names
from dattri_llm.gradient.callbacks.kronecker_covariance_callback import (
    KroneckerCovarianceCallback,
)
from dattri_llm.gradient.gradient import Factorized
from dattri_llm.gradient.lowrank import require_raw_factors
from dattri_llm.gradient.ops.dot import effective_dims
from dattri_llm.gradient.ops.kronecker import (
    FisherAccumulator,
    KroneckerAccumulator,
    checked_spd_inverse,
    damping_for,
    ekfac_materialize,
    ekfac_precondition,
    ekfac_rotation_prefers_factors,
    kfac_eigh,
    kfac_precondition,
    kfac_precondition_materialized,
    kfac_rows,
)
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import (
    is_conv_transpose,
    is_embedding,
    is_kfac_eligible,
    is_norm,
)
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.atomic import atomic_torch_save
from dattri_llm.utils.cache import CACHE_RESIDENCIES, TensorCache
from dattri_llm.utils.distributed import (
    all_gather_objects,
    all_reduce_named_sums,
    all_reduce_sum,
)
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.gradient import Gradient
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.streaming import GradientSource, GradientStreamer
    from dattri_llm.options import EKFACMode

FISHER_FILE = "fisher_factors.pt"
COVARIANCES_FILE = "kronecker_covariances.pt"
NON_KFAC_STRATEGIES = ("ignore", "direct")
EKFAC_MODES = ("exact", "approx")

Covariances = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def _token_summed_rows(value: torch.Tensor) -> torch.Tensor:
    """A dense payload as ``(B, d)`` rows (``(B, T, d)`` summed over tokens)."""
    return value.sum(dim=1) if value.dim() == 3 else value.reshape(value.shape[0], -1)


def _layer_error(name: str, error: ValueError) -> ValueError:
    """``error`` re-raised with the layer name in front."""
    return ValueError(f"layer {name!r}: {error}")


def _store_selection(
    store: GradientStorageManager, steps: Iterable[int] | None = None
) -> dict[str, Any]:
    """``{"steps", "rows", "projection"}`` of the store rows a call reads.

    ``steps`` (``None`` = all) filters the stored steps; ``rows`` counts the
    indexed (identifier, step) rows of the kept steps; ``projection`` is the
    store's declared projection as canonical JSON.
    """
    counts: dict[int, int] = {}
    for occurrences in store.index.values():
        for entry in occurrences:
            step = int(entry["step"])
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


def _union_layer_types(local: dict[str, str]) -> dict[str, str]:
    """``{layer: type}`` seen on any rank (this rank's first, then the others' in rank order)."""
    union = dict(local)
    for seen in all_gather_objects(local):
        for name, layer_type in seen.items():
            union.setdefault(name, layer_type)
    return union


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


class KroneckerAttributor(BaseInnerProductAttributor):
    """Base of the curvature attributors: fit, damping, persistence and test preconditioning.

    Subclasses implement :meth:`fit_factors` (damping-free per-layer factors),
    :meth:`damp` and :meth:`precondition_test_layer`. A single checkpoint is
    used (``checkpoints() -> [0]``; more → ``UserWarning``); the train source
    must be ``reusable`` for the fit pass(es).
    """

    algorithm: ClassVar[str] = "Kronecker"

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)
        self.damping = 1e-3
        self.relative_damping = False
        self.non_kfac_strategy = "ignore"
        self.direct_fim_max_params = 4096
        self.factor_cache_residency: str | None = None
        self.covariances_at_capture = True
        self.covariances: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.raw_fit: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self._fit_settings: dict[str, Any] = {"layer_name": None, "selected_training_steps": None}
        self._fisher_dir_to_write: Path | None = None
        self._factors: Any = None
        self._fisher_inverse: Any = None
        self._fitted_layer_types: dict[str, str] = {}
        self._identity_test = False
        self._capture_callback: Any = None
        self._warned: set[str] = set()
        # covariances recorded while attribute()/cache() collect the train side
        # covariances recorded while attribute()/cache() collect the train side: the
        # callback of the running collection, then its payload bound to the store it
        # was recorded for (never adopted for another store)
        self._collect_covariances = False
        self._recorder: KroneckerCovarianceCallback | None = None
        self._recorded: _RecordedCovariances | None = None
        # capture-time covariances adopted by the running call after validation, or why
        # the ones recorded for its train store do not fit it
        self._capture_time_covariances: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._unusable_covariances: str | None = None
        # pass plan of the running call: bytes of first-pass blocks a live train source may
        # keep (0 for stores and outside attribute), and the plan the last scoring pass ran
        self._kept_budget = 0
        self._pass_plan: dict[str, int] | None = None
        # EK-FAC: how this scoring pass's kept train blocks were rotated (None: not at all)
        self._test_eigenbasis_mode: str | None = None
        self._score_granularity = "instance"  # of the scoring pass under way

    # ------------------------------------------------------------------ options
    def configure(
        self,
        *,
        damping: float = 1e-3,
        non_kfac_strategy: str = "ignore",
        direct_fim_max_params: int = 4096,
        relative_damping: bool = False,
        factor_cache_residency: str | None = None,
        covariances_at_capture: bool = True,
    ) -> None:
        """Validate and set the options of the coming call (``ValueError`` on a bad value)."""
        if not math.isfinite(damping) or damping < 0:
            raise ValueError(f"damping must be a finite float >= 0, got {damping}.")
        if non_kfac_strategy not in NON_KFAC_STRATEGIES:
            raise ValueError(
                f"non_kfac_strategy must be one of {NON_KFAC_STRATEGIES}, got "
                f"{non_kfac_strategy!r}."
            )
        if direct_fim_max_params <= 0:
            raise ValueError(f"direct_fim_max_params must be > 0, got {direct_fim_max_params}.")
        if factor_cache_residency is not None and factor_cache_residency not in CACHE_RESIDENCIES:
            raise ValueError(
                f"factor_cache_residency must be one of {[None, *CACHE_RESIDENCIES]}, got "
                f"{factor_cache_residency!r}."
            )
        self.damping = float(damping)
        self.non_kfac_strategy = non_kfac_strategy
        self.direct_fim_max_params = int(direct_fim_max_params)
        self.relative_damping = bool(relative_damping)
        self.factor_cache_residency = factor_cache_residency
        self.covariances_at_capture = bool(covariances_at_capture)

    def checkpoints(self) -> list[int]:
        """``[0]``: curvature methods use one checkpoint (``UserWarning`` if the task has more)."""
        return self._first_checkpoint_only()

    def fit_meta(self) -> dict[str, Any]:
        """Settings a persisted fit must match to be reused (damping excluded)."""
        return {
            "non_kfac_strategy": self.non_kfac_strategy,
            "direct_fim_max_params": self.direct_fim_max_params,
            **self._fit_settings,
        }

    # ------------------------------------------------------------------ layer routing
    def covariances_for(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Covariances ``(A, G)`` of a layer: supplied (``fit(covariances=...)``) or captured.

        Captured ones are those recorded at capture for this call's train store
        and selection (see :meth:`_use_store_covariances`).
        """
        if self.covariances is not None and name in self.covariances:
            return self.covariances[name]
        return self._capture_time_covariances.get(name)

    def kfac_layers(self, grad: Gradient) -> list[str]:
        """K-FAC layers: eligible and factorized, or dense with covariances (supplied/captured)."""
        return [
            name
            for name, layer_type in grad.layer_types.items()
            if is_kfac_eligible(layer_type)
            and (
                grad.representation[name] == "factorized"
                or self.covariances_for(name) is not None
                or self._capture_callback is not None
            )
        ]

    def fisher_layers(self, grad: Gradient) -> list[str]:
        """Layers preconditioned by the dense empirical Fisher (warns once per layer)."""
        kfac = set(self.kfac_layers(grad))
        layers = []
        for name, layer_type in grad.layer_types.items():
            if name in kfac:
                continue
            if is_kfac_eligible(layer_type):
                if self._unusable_covariances is not None:
                    raise ValueError(
                        f"layer {name!r} ({layer_type}) is stored dense, so K-FAC needs its "
                        f"covariances from the capture, but {self._unusable_covariances}. "
                        "Select what they were recorded for, recapture the store "
                        "(attributor.cache), or pass fit(covariances=...)."
                    )
                self._warn_once(
                    name,
                    f"layer {name!r} ({layer_type}) is stored dense and no covariances were "
                    "supplied: it uses the dense empirical Fisher. Capture it factorized, or pass "
                    "covariances (fit(covariances=...) / KroneckerCovarianceCallback).",
                )
                layers.append(name)
            elif is_norm(layer_type) and self.non_kfac_strategy == "direct":
                layers.append(name)
            elif is_embedding(layer_type) and self.non_kfac_strategy == "direct":
                self._warn_once(
                    name,
                    f"embedding layer {name!r} is never preconditioned; it does not contribute "
                    "to the scores.",
                )
        return layers

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(message, UserWarning, stacklevel=4)

    def accumulate_fisher(self, fisher_acc: FisherAccumulator, grad: Gradient) -> None:
        """Feed the dense-Fisher layers of one first-pass block into ``fisher_acc``."""
        layers = self.fisher_layers(grad)
        if layers:
            fisher_acc.update(grad, layers)

    def covariance_pass(
        self, train_source: GradientSource, fisher_acc: FisherAccumulator
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """First pass: ``{layer: (A, G)}`` for every K-FAC layer (+ dense Fisher accumulation).

        Under a process group the covariances are reduced over the union of the
        layers every rank saw (a rank may skip a layer or hold fewer blocks), so
        every rank fits the same layers with the global row counts.

        Supplied covariances are used as given; on a live source a
        ``KroneckerCovarianceCallback`` records the others during this pass only
        (each layer's rows once: the callback's layers are not accumulated again
        from the blocks); on a store they are accumulated from the factorized
        blocks. Supplied covariances whose widths disagree with the stored
        factors raise ``ValueError`` naming the layer and shapes (checked once
        per layer).
        """
        acc = KroneckerAccumulator()
        seen: dict[str, str] = {}
        with self._capturing_covariances(train_source):
            for _step, block, _ids in train_source:
                require_raw_factors(block, f"{type(self).__name__} (K-FAC covariances)")
                layers = self.kfac_layers(block)
                for name in layers:
                    if name not in seen:
                        seen[name] = block.layer_types[name]
                        self._check_covariance_widths(block, name)
                acc.update(block, self._block_fitted_layers(block, layers))
                self.accumulate_fisher(fisher_acc, block)
            acc.all_reduce()
            fitted = acc.result(consume=True)
            if self._capture_callback is not None:
                self._capture_callback.all_reduce()
                fitted.update(self._capture_callback.result())
        seen = _union_layer_types(seen)
        result = {}
        for name in seen:
            cov = self.covariances_for(name)
            if cov is None:
                cov = fitted.get(name)
            if cov is not None:
                result[name] = cov
        self._fitted_layer_types = {name: seen[name] for name in result}
        return result

    def _block_fitted_layers(self, block: Gradient, layers: list[str]) -> list[str]:
        """K-FAC layers whose covariances come from this block's factors.

        Not those with supplied covariances, dense ones, nor those the live
        capture callback already recorded (it saw this block's backward).
        """
        captured = self._capture_callback.layer_names if self._capture_callback is not None else ()
        return [
            n
            for n in layers
            if self.covariances_for(n) is None
            and block.representation[n] == "factorized"
            and n not in captured
        ]

    def _check_covariance_widths(self, block: Gradient, name: str) -> None:
        """``ValueError`` if supplied covariances do not fit the layer's stored gradients."""
        cov = self.covariances_for(name)
        if cov is None:
            return
        value = block.data[name]
        k, d = cov[0].shape[0], cov[1].shape[0]
        if isinstance(value, torch.Tensor):
            ok = _token_summed_rows(value).shape[1] == k * d
            stored = f"dense rows {tuple(_token_summed_rows(value).shape)}"
        else:
            f = value.as_batch_first()
            a, g = kfac_rows(
                f.activation[:1], f.pre_activation_grad[:1], block.layer_types[name],
                f.module_kwargs,
            )  # fmt: skip
            ok = (a.shape[-1], g.shape[-1]) == (k, d)
            stored = f"factor widths K={a.shape[-1]}, D={g.shape[-1]}"
        if not ok:
            raise ValueError(
                f"layer {name!r}: supplied covariances A {tuple(cov[0].shape)} and G "
                f"{tuple(cov[1].shape)} do not match the stored gradients ({stored}); they were "
                "recorded for another layer set, projection or include_bias setting — "
                "record them on the same capture (KroneckerCovarianceCallback) or refit."
            )

    # ------------------------------------------------------------------ subclass contract
    def fit_factors(
        self, train_source: GradientSource, fisher_acc: FisherAccumulator
    ) -> dict[str, Any]:
        """Damping-free per-layer factors ``{layer: raw}`` (feed first-pass blocks to Fisher)."""
        raise NotImplementedError

    def damp(self, raw_factors: Mapping[str, Any], damping: float) -> dict[str, Any]:
        """Damped per-layer factors ready for :meth:`precondition_test_layer`."""
        raise NotImplementedError

    def precondition_test_layer(
        self, value: Any, layer_type: str, factors: Any
    ) -> Any:  # Factorized | Tensor
        """``F⁻¹·dW`` of one test layer from its damped factors."""
        raise NotImplementedError

    # ------------------------------------------------------------------ fitting
    def fit_raw(self, train_source: GradientSource) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(raw_factors, raw_fisher)`` over a reusable train source (damping-free)."""
        if not getattr(train_source, "reusable", False):
            raise ValueError(
                f"{type(self).__name__} fits the curvature with extra passes over the training "
                f"gradients, but the train source {type(train_source).__name__} is not reusable; "
                "use a frozen probe or a gradient store, or fit first (fit / fit_dir)."
            )
        fisher_acc = FisherAccumulator(max_params=self.direct_fim_max_params)
        raw = self.fit_factors(train_source, fisher_acc)
        fisher_acc.all_reduce()
        fisher = fisher_acc.result()
        if fisher_acc.skipped:
            warnings.warn(
                f"layers {fisher_acc.skipped} exceed direct_fim_max_params="
                f"{self.direct_fim_max_params} and are dropped from the dense Fisher (they do "
                "not contribute to the scores); raise direct_fim_max_params to keep them.",
                UserWarning,
                stacklevel=3,
            )
        if not raw and not fisher:
            raise ValueError(
                f"{type(self).__name__}: no layer can be preconditioned (K-FAC needs "
                "linear/conv/conv-transpose layers captured factorized or with covariances; "
                "norm layers need non_kfac_strategy='direct')."
            )
        return raw, fisher

    def _capturing_covariances(self, train_source: GradientSource) -> Any:
        """Context: attach a ``KroneckerCovarianceCallback`` to a live source's hooks.

        Covariances of dense eligible layers then come from the capture.
        """
        manager = getattr(train_source, "hook_manager", None)
        if manager is None or not self.covariances_at_capture:
            return contextlib.nullcontext()
        return self._attached_callback(manager)

    @contextlib.contextmanager
    def _attached_callback(self, manager: Any) -> Iterator[None]:
        """A fresh covariance callback on ``manager`` for the duration of the context."""
        callback = KroneckerCovarianceCallback()
        manager.add_callback(callback)
        self._capture_callback = callback
        try:
            yield
        finally:
            manager.callbacks.remove(callback)
            self._capture_callback = None

    def damp_fit(
        self, raw_fit: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]], damping: float
    ) -> None:
        """Damp a raw fit and hold the result (device or ``factor_cache_residency``)."""
        raw_factors, raw_fisher = raw_fit
        factors = self.damp(raw_factors, damping)
        fisher = {}
        for name, matrix in raw_fisher.items():
            shift = damping_for(matrix, damping, self.relative_damping)
            try:
                fisher[name] = checked_spd_inverse(matrix, shift, "dense_inverse")
            except ValueError as error:
                raise _layer_error(name, error) from None
        self._factors = self._hold(factors)
        self._fisher_inverse = self._hold(fisher)

    def _hold(self, values: dict[str, Any]) -> Any:
        """Damped factors on the compute device, or host-side in a ``TensorCache``."""
        if self.factor_cache_residency is None:
            device = torch.device(self.args.device)
            return {name: _to(value, device) for name, value in values.items()}
        cache = TensorCache(self.factor_cache_residency)
        for name, value in values.items():
            cache.put(name, _to(value, torch.device("cpu")))
        return cache

    def _fetch(self, holder: Any, name: str) -> Any:
        """One layer's damped factors on the compute device (``None`` if absent)."""
        value = holder.get(name)
        return None if value is None else _to(value, torch.device(self.args.device))

    def _ensure_fit(self, train_source: GradientSource) -> None:
        """Fit (unless loaded/held), persist when requested, then damp."""
        if self.raw_fit is None:
            self.raw_fit = self.fit_raw(train_source)
            if self._fisher_dir_to_write is not None:
                self.save_fisher(self.raw_fit[0], self._fisher_dir_to_write, fisher=self.raw_fit[1])
        self.damp_fit(self.raw_fit, self.damping)

    # ------------------------------------------------------------------ persistence
    def default_fisher_dir(self) -> Path:
        """``<output_dir>/<algorithm.lower()>_fisher``."""
        return Path(self.args.output_dir).expanduser() / f"{self.algorithm.lower()}_fisher"

    @keywords(aliases={"fisher_dir": "fit_dir"})
    def save_fisher(
        self,
        covariances: Mapping[str, Any],
        fit_dir: str | Path | None = None,
        *,
        fisher: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write a damping-free fit to ``<fit_dir>/fisher_factors.pt``; return the directory."""
        directory = Path(fit_dir or self.default_fisher_dir()).expanduser()
        if self.args.should_log:
            directory.mkdir(parents=True, exist_ok=True)
            payload = {
                "algorithm": self.algorithm,
                "meta": self.fit_meta(),
                "factors": {k: _to(v, torch.device("cpu")) for k, v in covariances.items()},
                "fisher": {k: v.cpu() for k, v in (fisher or {}).items()},
                "layer_types": dict(self._fitted_layer_types),
            }
            atomic_torch_save(payload, directory / FISHER_FILE)
        return directory

    @keywords(aliases={"fisher_dir": "fit_dir"})
    def load_fisher(self, fit_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load a fit written by :meth:`save_fisher` (settings must match; damping may differ)."""
        path = Path(fit_dir).expanduser() / FISHER_FILE
        if not path.is_file():
            raise ValueError(
                f"no fit at {str(path)!r}; run {type(self).__name__}.fit(...) or pass a "
                "fit_dir written by a previous call."
            )
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("algorithm") != self.algorithm:
            raise ValueError(
                f"{str(path)!r} holds a {payload.get('algorithm')} fit, not {self.algorithm}; "
                "use the matching attributor or another fit_dir."
            )
        expected = self.fit_meta()
        stored = payload.get("meta", {})
        different = {k: (stored.get(k), v) for k, v in expected.items() if stored.get(k) != v}
        if different:
            raise ValueError(
                f"the fit in {str(path)!r} was made with different settings "
                f"{{setting: (stored, requested)}} = {different}; refit with fit(...) or use "
                "another fit_dir (only damping may differ)."
            )
        self._fitted_layer_types = dict(payload.get("layer_types", {}))
        self.raw_fit = (payload["factors"], payload["fisher"])
        return self.raw_fit

    # ------------------------------------------------------------------ scoring hooks
    def prepare_scoring(self, train_source: GradientSource, test_source: GradientSource) -> None:
        """Fit (or reuse the loaded fit) and damp it before the test side is transformed.

        The scoring pass that follows is the last over a planned train source:
        it releases the kept blocks as it goes.
        """
        if not self._identity_test:
            self._ensure_fit(train_source)
        if isinstance(train_source, KeptPasses):
            train_source.last_pass_next()

    def score_sources(
        self,
        train_source: GradientSource,
        test_source: GradientSource,
        *,
        loop_over_test: bool = False,
        transform_test: Callable[[Gradient], Gradient] | None = None,
        attribution_granularity: str = "instance",
    ) -> tuple:
        """Base scoring over the train source wrapped in a pass plan (:class:`KeptPasses`).

        A live source (one that runs the model) keeps the longest suffix of its
        first-pass blocks within ``kept_gradient_budget`` bytes and replays them
        in the EK-FAC eigenvalue and scoring passes; a store is re-read (budget
        0). The plan run is recorded as ``algorithm_meta["pass_plan"]``.
        """
        live = getattr(train_source, "hook_manager", None) is not None
        planned = KeptPasses(train_source, self._kept_budget if live else 0)
        self._test_eigenbasis_mode = None
        self._score_granularity = attribution_granularity
        try:
            result = super().score_sources(
                planned,
                test_source,
                loop_over_test=loop_over_test,
                transform_test=transform_test,
                attribution_granularity=attribution_granularity,
            )
        finally:  # the eigenbasis test side only pairs with this pass's rotated blocks
            self._test_eigenbasis_mode = None
        self._pass_plan = planned.plan()
        return result

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """``F⁻¹`` applied to every preconditioned layer; other layers are dropped."""
        if self._identity_test:
            return block
        if self._factors is None:
            raise ValueError(
                f"{type(self).__name__}: the curvature is not fitted; score through "
                "attribute/attribute_from_cache, or fit first (fit / fit_dir)."
            )

        def convert(name: str, value: Any, layer_type: str) -> Any:
            try:
                factors = self._fetch(self._factors, name)
                if factors is not None:
                    if isinstance(value, torch.Tensor):
                        value = _token_summed_rows(value)
                    return self.precondition_test_layer(value, layer_type, factors)
                inverse = self._fetch(self._fisher_inverse, name)
                if inverse is None:
                    return None
                rows = (
                    _token_summed_rows(value)
                    if isinstance(value, torch.Tensor)
                    else materialize(value, layer_type)
                )
                return _matmul_checked(rows, inverse)
            except ValueError as error:
                raise _layer_error(name, error) from None

        return block.map_layers(convert)

    def build_score(
        self,
        scores: torch.Tensor,
        row_train_ids: list[str],
        row_steps: list[int],
        test_ids: list[str],
        *,
        algorithm_meta: dict[str, Any] | None = None,
        layer_name: list[str] | None = None,
        row_token_ids: list[int] | None = None,
    ) -> AttributionScore:
        """Base ``build_score`` with ``direct_fim_layers`` added to ``algorithm_meta``."""
        meta = dict(algorithm_meta or {})
        if self.raw_fit is not None:
            meta.setdefault("direct_fim_layers", sorted(self.raw_fit[1]))
        if self._pass_plan is not None:
            meta.setdefault("pass_plan", dict(self._pass_plan))
        return super().build_score(
            scores,
            row_train_ids,
            row_steps,
            test_ids,
            algorithm_meta=meta,
            layer_name=layer_name,
            row_token_ids=row_token_ids,
        )

    # ------------------------------------------------------------------ entry points
    def _start_call(self, options: dict[str, Any], layer_name: Any, steps: Any) -> None:
        """Reset per-call state and apply the options."""
        self.configure(**options)
        self._fit_settings = {
            "layer_name": normalize_layer_names(layer_name),
            "selected_training_steps": None if steps is None else sorted(set(steps)),
        }
        self.covariances = None
        self._capture_time_covariances = {}
        self._unusable_covariances = None
        self._fitted_layer_types = {}
        self.raw_fit = None
        self._factors = self._fisher_inverse = None
        self._fisher_dir_to_write = None
        self._identity_test = False
        self._warned = set()
        self._kept_budget = 0
        self._pass_plan = None
        self._test_eigenbasis_mode = None

    def _use_fisher_dir(self, fit_dir: str | Path | None) -> None:
        """Load the fit in ``fit_dir`` if present, else write this call's fit there."""
        if fit_dir is None:
            return
        if (Path(fit_dir).expanduser() / FISHER_FILE).is_file():
            self.load_fisher(fit_dir)
        else:
            self._fisher_dir_to_write = Path(fit_dir).expanduser()

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

    @keywords(aliases={"fisher_dir": "fit_dir"})
    def attribute_from_cache(  # noqa: D417 - documented in attribution.md §7
        self,
        train_source: object,
        test_source: object,
        *,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        algorithm_meta: dict[str, Any] | None = None,
        attribution_granularity: str = "instance",
        damping: float = 1e-3,
        preconditioned_test_dir: str | None = None,
        preconditioned_test_cache_residency: str | None = None,
        fit_dir: str | None = None,
        non_kfac_strategy: str = "ignore",
        direct_fim_max_params: int = 4096,
        relative_damping: bool = False,
        factor_cache_residency: str | None = None,
        covariances_at_capture: bool = True,
    ) -> AttributionScore:
        """Curvature-weighted scores from gradient stores (no model needed).

        A fit in ``fit_dir`` is loaded and re-damped (no train pre-pass);
        otherwise the fit of this call is written there. With
        ``preconditioned_test_dir``/``preconditioned_test_cache_residency``
        (``loop_over_test=True`` only) the preconditioned queries are cached
        once and re-read per train block.
        """
        options = {
            "damping": damping,
            "non_kfac_strategy": non_kfac_strategy,
            "direct_fim_max_params": direct_fim_max_params,
            "relative_damping": relative_damping,
            "factor_cache_residency": factor_cache_residency,
            "covariances_at_capture": covariances_at_capture,
        }
        if (
            preconditioned_test_dir is not None or preconditioned_test_cache_residency is not None
        ) and not loop_over_test:
            raise ValueError(
                "preconditioned_test_dir / preconditioned_test_cache_residency cache the "
                "preconditioned queries for loop_over_test=True; set loop_over_test=True or drop "
                "them."
            )
        self._start_call(options, layer_name, selected_training_steps)
        self._use_store_covariances(train_source)
        self._use_fisher_dir(fit_dir)
        meta = {**(algorithm_meta or {}), **self._meta_extra()}
        kwargs = dict(
            selected_training_steps=selected_training_steps,
            layer_name=layer_name,
            verbose=verbose,
            loop_over_test=loop_over_test,
            attribution_granularity=attribution_granularity,
            fit_dir=None if fit_dir is None else str(fit_dir),
            **options,
        )
        if preconditioned_test_dir is None and preconditioned_test_cache_residency is None:
            return super().attribute_from_cache(
                train_source, test_source, algorithm_meta=meta, **kwargs
            )
        return self._score_with_cached_queries(
            train_source,
            test_source,
            preconditioned_test_dir,
            preconditioned_test_cache_residency or "disk",
            meta,
            kwargs,
        )

    def _meta_extra(self) -> dict[str, Any]:
        """Subclass-specific ``algorithm_meta`` entries (EK-FAC mode)."""
        return {}

    def _score_with_cached_queries(
        self,
        train_source: object,
        test_source: object,
        directory: str | None,
        residency: str,
        meta: dict[str, Any],
        kwargs: dict[str, Any],
    ) -> AttributionScore:
        """Fit, cache the preconditioned queries into a store, then score against it."""
        steps = kwargs["selected_training_steps"]
        layers = self._fit_settings["layer_name"]
        train = self.load_train_rep(train_source, steps=steps, layer_name=layers)
        self._ensure_fit(train)
        with tempfile.TemporaryDirectory(prefix="dattri_llm_precond_") as tmp:
            target = directory if directory is not None else f"{tmp}/test"
            with GradientStorageManager(target, residency=residency) as store:
                test = self.load_test_rep(test_source, layer_name=layers)
                self.cache_representations(
                    test, store, sample_id_key=self.resolve_store(test_source).sample_id_key
                )
                self._identity_test = True
                try:
                    return super().attribute_from_cache(
                        train_source, store, algorithm_meta=meta, **kwargs
                    )
                finally:
                    self._identity_test = False

    @keywords(aliases={"train_gradients_dir": "train_source", "fisher_dir": "fit_dir"})
    def fit(  # noqa: D417 - documented in attribution.md §7
        self,
        train_source: object,
        fit_dir: str | None = None,
        *,
        selected_training_steps: Iterable[int] | None = None,
        non_kfac_strategy: str = "ignore",
        direct_fim_max_params: int = 4096,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        covariances: Covariances | None = None,
        factor_cache_residency: str | None = None,
        covariances_at_capture: bool = True,
    ) -> Path:
        """Fit the damping-free curvature over a train store and persist it; return the dir.

        ``covariances={layer: (A, G)}`` replaces the covariance sweep (EK-FAC:
        must cover every eligible layer).
        """
        self._start_call(
            {
                "non_kfac_strategy": non_kfac_strategy,
                "direct_fim_max_params": direct_fim_max_params,
                "factor_cache_residency": factor_cache_residency,
                "covariances_at_capture": covariances_at_capture,
            },
            layer_name,
            selected_training_steps,
        )
        self.covariances = None if covariances is None else dict(covariances)
        self._use_store_covariances(train_source)
        self._verbose = verbose
        try:
            source = self.load_train_rep(
                train_source,
                steps=self._fit_settings["selected_training_steps"],
                layer_name=self._fit_settings["layer_name"],
            )
            self.raw_fit = self.fit_raw(source)
        finally:
            self._verbose = False
        return self.save_fisher(self.raw_fit[0], fit_dir, fisher=self.raw_fit[1])

    @keywords(aliases={"train_gradients_dir": "train_source", "test_gradients_dir": "test_source"})
    def cache_preconditioned_test(  # noqa: D417 - documented in attribution.md §7
        self,
        train_source: object,
        test_source: object,
        preconditioned_test_dir: str | None = None,
        *,
        damping: float = 1e-3,
        selected_training_steps: Iterable[int] | None = None,
        non_kfac_strategy: str = "ignore",
        direct_fim_max_params: int = 4096,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        relative_damping: bool = False,
        factor_cache_residency: str | None = None,
        covariances_at_capture: bool = True,
    ) -> Path:
        """Write ``F⁻¹·g_test`` per query to a store; return its directory.

        Default directory ``<output_dir>/<algorithm.lower()>_preconditioned_test``;
        ``TracInAttributor.attribute_from_cache(train_dir, dir)`` then equals this
        attributor's score.
        """
        self._start_call(
            {
                "damping": damping,
                "non_kfac_strategy": non_kfac_strategy,
                "direct_fim_max_params": direct_fim_max_params,
                "relative_damping": relative_damping,
                "factor_cache_residency": factor_cache_residency,
                "covariances_at_capture": covariances_at_capture,
            },
            layer_name,
            selected_training_steps,
        )
        self._use_store_covariances(train_source)
        directory = Path(
            preconditioned_test_dir
            or Path(self.args.output_dir).expanduser()
            / f"{self.algorithm.lower()}_preconditioned_test"
        ).expanduser()
        layers = self._fit_settings["layer_name"]
        train = self.load_train_rep(
            train_source,
            steps=self._fit_settings["selected_training_steps"],
            layer_name=layers,
            verbose=verbose,
        )
        self._ensure_fit(train)
        test_store = self.resolve_store(test_source)
        with GradientStorageManager(str(directory)) as store:
            self.cache_representations(
                self.load_test_rep(test_source, layer_name=layers),
                store,
                sample_id_key=test_store.sample_id_key,
            )
        return directory

    @keywords(aliases={"fisher_dir": "fit_dir"})
    def attribute(  # noqa: D417 - documented in attribution.md §7
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        gradient_cache_residency: str | None = None,
        attribution_granularity: str = "instance",
        damping: float = 1e-3,
        non_kfac_strategy: str = "ignore",
        direct_fim_max_params: int = 4096,
        relative_damping: bool = False,
        factor_cache_residency: str | None = None,
        covariances_at_capture: bool = True,
        fit_dir: str | None = None,
        kept_gradient_budget: int | None = None,
    ) -> AttributionScore:
        """Run the model (frozen probes) and score with the fitted curvature.

        Residency ``None`` (live): the first pass over the training set keeps
        the longest suffix of its gradient blocks that fits
        ``kept_gradient_budget`` bytes (extension; ``None`` =
        ``DEFAULT_KEPT_GRADIENT_BUDGET``, 1 GiB; 0 keeps nothing) and the later
        passes (EK-FAC eigenvalues, scoring) re-run the model only for the
        blocks before it; the scores do not depend on the budget. Otherwise each
        side is collected once (with ``covariances_at_capture`` a
        ``KroneckerCovarianceCallback`` on the train collection records
        ``(A, G)``, saved beside a disk train store).
        """
        options = {
            "damping": damping,
            "non_kfac_strategy": non_kfac_strategy,
            "direct_fim_max_params": direct_fim_max_params,
            "relative_damping": relative_damping,
            "factor_cache_residency": factor_cache_residency,
            "covariances_at_capture": covariances_at_capture,
        }
        self._start_call(options, None, None)
        budget = resolve_kept_budget(kept_gradient_budget)
        _require_factors_or_capture_covariances(hook_config, covariances_at_capture, self.algorithm)
        self._collect_covariances = covariances_at_capture and gradient_cache_residency is not None
        self._recorder = self._recorded = None
        if gradient_cache_residency is None:
            self._use_fisher_dir(fit_dir)
            self._kept_budget = budget
        try:
            return super().attribute(
                train_dataset,
                test_dataset,
                hook_config=hook_config,
                verbose=verbose,
                loop_over_test=loop_over_test,
                gradient_cache_residency=gradient_cache_residency,
                attribution_granularity=attribution_granularity,
                **options,
                fit_dir=fit_dir,
            )
        finally:
            self._collect_covariances = False
            self._recorder = self._recorded = None
            self._kept_budget = 0

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
    def cache(  # noqa: D417 - documented in attribution.md §7
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


def _require_factors_or_capture_covariances(
    hook_config: HookManagerConfig | None, covariances_at_capture: bool, algorithm: str
) -> None:
    """``ValueError`` for a pinned ``"materialized"`` capture without covariances at capture."""
    style = getattr(hook_config, "capture_style", "factorized")
    if style == "materialized" and not covariances_at_capture:
        raise ValueError(
            f"{algorithm} needs the Kronecker factors of each layer, but hook_config pins "
            "capture_style='materialized' with covariances_at_capture=False; use "
            "capture_style='factorized' or 'auto', or set covariances_at_capture=True so the "
            "covariances are recorded during capture."
        )


def _to(value: Any, device: torch.device) -> Any:
    """Move a tensor or a tuple/dict of tensors to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def _rotate_factors(
    value: Factorized, layer_type: str, u_a: torch.Tensor, u_g: torch.Tensor
) -> bool:
    """Whether the EK-FAC rotation of a factorized layer is cheaper on its factors.

    ``ops.ekfac_rotation_prefers_factors`` with the layer's token count and the
    eigenbasis widths (bias column included).
    """
    _batch, tokens, _k, _d = effective_dims(value, layer_type)
    return ekfac_rotation_prefers_factors(tokens, u_a.shape[0], u_g.shape[0])


def _matmul_checked(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows @ inverse`` (symmetric inverse) after checking the width."""
    if rows.shape[1] != inverse.shape[0]:
        raise ValueError(
            f"dense gradients {tuple(rows.shape)} do not match the fitted Fisher "
            f"{tuple(inverse.shape)}; the fit belongs to another layer set or projection — refit."
        )
    dtype = torch.promote_types(rows.dtype, inverse.dtype)
    return rows.to(dtype) @ inverse.to(dtype)


class KFACAttributor(KroneckerAttributor):
    """K-FAC influence (``algorithm="KFAC"``): ``F_l ≈ A ⊗ G`` per eligible layer.

    Tied weights are scored per use site (cross-site terms dropped).
    """

    algorithm: ClassVar[str] = "KFAC"

    def fit_factors(
        self, train_source: GradientSource, fisher_acc: FisherAccumulator
    ) -> dict[str, Any]:
        """``{layer: (A, G)}`` from one pass (supplied covariances used as given)."""
        return self.covariance_pass(train_source, fisher_acc)

    def damp(self, raw_factors: Mapping[str, Any], damping: float) -> dict[str, Any]:
        """``{layer: ((A+λ_A I)⁻¹, (G+λ_G I)⁻¹)}``; a singular damped factor is refused."""
        damped = {}
        for name, (a_cov, g_cov) in raw_factors.items():
            shifts = [damping_for(m, damping, self.relative_damping) for m in (a_cov, g_cov)]
            try:
                damped[name] = tuple(
                    checked_spd_inverse(matrix, shift, "sym_inverse")
                    for matrix, shift in zip((a_cov, g_cov), shifts)
                )
            except ValueError as error:
                raise _layer_error(name, error) from None
        return damped

    def precondition_test_layer(self, value: Any, layer_type: str, factors: Any) -> Any:
        """``G⁻¹·dW·A⁻¹``: final factors for a factorized layer, dense for a dense one."""
        a_inv, g_inv = factors
        if isinstance(value, torch.Tensor):
            if is_conv_transpose(layer_type):  # layout (K, D): A⁻¹·dW·G⁻¹
                return kfac_precondition_materialized(value, g_inv, a_inv)
            return kfac_precondition_materialized(value, a_inv, g_inv)
        wa, wg = kfac_precondition(value, layer_type, a_inv, g_inv)
        return Factorized(wa, wg, None)


class EKFACAttributor(KroneckerAttributor):
    """EK-FAC influence (``algorithm="EKFAC"``): K-FAC eigenbases with corrected eigenvalues.

    The eigenvalue pass rotates each factorized train layer either on its
    factors (``aᵀU_A``, ``U_Gᵀg`` per token, then materialized) or after
    materializing it, whichever costs fewer FLOPs
    (``ops.kronecker.ekfac_rotation_prefers_factors``); both routes give the
    same scores. When the pass plan keeps every training block, that pass
    replaces the kept layers by their rotations and the queries skip (part of)
    the rotation back (``_ekfac_eigenbasis``; equal scores to float rounding).
    ``mode`` (``"exact"``/``"approx"``, identical scores) is validated and
    recorded with a persisted fit. Tied weights are scored per use site.
    """

    algorithm: ClassVar[str] = "EKFAC"
    EKFAC_MODES: ClassVar[tuple[str, ...]] = EKFAC_MODES

    def __init__(
        self, args: AttributionArguments, *, task: object | None = None, mode: EKFACMode = "exact"
    ) -> None:
        if mode not in EKFAC_MODES:
            raise ValueError(f"EKFACAttributor mode must be one of {EKFAC_MODES}, got {mode!r}.")
        super().__init__(args, task=task)
        self.mode = mode

    def fit_meta(self) -> dict[str, Any]:
        """Base settings plus the EK-FAC ``mode``."""
        return {**super().fit_meta(), "mode": self.mode}

    def _meta_extra(self) -> dict[str, Any]:
        return {"mode": self.mode}

    def fit_factors(
        self, train_source: GradientSource, fisher_acc: FisherAccumulator
    ) -> dict[str, Any]:
        """``{layer: {"U_A", "U_G", "lam"}}``: covariance pass, ``eigh``, eigenvalue pass.

        Under a process group the Λ sums and sample counts are reduced over the
        union of the ranks' layers (``Λ`` = global sum / global count).
        """
        if self.covariances is not None:
            self._check_covering(train_source)
        covariances = self.covariance_pass(train_source, fisher_acc)
        bases = {}
        for name, (a_cov, g_cov) in covariances.items():
            _, u_a, _, u_g = kfac_eigh(a_cov, g_cov)
            bases[name] = (u_a, u_g)
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        def add_squares(name: str, squared: torch.Tensor, samples: int) -> None:
            sums[name] = squared if name not in sums else sums[name] + squared.to(sums[name])
            counts[name] = counts.get(name, 0) + samples

        per_sample = self._score_granularity == "instance"
        mode = eigenbasis_mode(train_source, bases, per_sample)
        if mode is not None:
            train_source.transform_kept(
                lambda block: rotated_block(block, bases, add_squares, mode, per_sample)
            )
            self._test_eigenbasis_mode = mode
        else:
            for _step, block, _ids in train_source:
                for name in block.data:
                    if name in bases:
                        coords = self._eigen_coordinates(block, name, *bases[name])
                        add_squares(name, coords.square_().sum(dim=0), coords.shape[0])
        local = {name: ([total], counts[name]) for name, total in sums.items()}
        factors = {}
        for name, ([total], count) in all_reduce_named_sums(local, "EK-FAC Λ sums").items():
            u_a, u_g = bases[name]
            factors[name] = {"U_A": u_a, "U_G": u_g, "lam": total / count}
        return factors

    def _check_covering(self, train_source: GradientSource) -> None:
        """Supplied covariances must cover every eligible layer (``ValueError``)."""
        for _step, block, _ids in train_source:
            missing = [
                n
                for n, t in block.layer_types.items()
                if is_kfac_eligible(t) and self.covariances_for(n) is None
            ]
            if missing:
                raise ValueError(
                    f"EKFACAttributor: supplied covariances cover {sorted(self.covariances)} "
                    f"but eligible layers {missing} have none; record every K-FAC layer "
                    "(KroneckerCovarianceCallback) or fit without covariances."
                )
            return

    def _eigen_coordinates(
        self, block: Gradient, name: str, u_a: torch.Tensor, u_g: torch.Tensor
    ) -> torch.Tensor:
        """Per-sample ``vec(U_Gᵀ dW U_A)`` ``(B, D·K)`` of one block layer."""
        value, layer_type = block.data[name], block.layer_types[name]
        if isinstance(value, torch.Tensor):
            value = _token_summed_rows(value)
        elif not _rotate_factors(value, layer_type, u_a, u_g):
            value = materialize(value, layer_type)
        device = value.device if isinstance(value, torch.Tensor) else value.activation.device
        try:
            return ekfac_materialize(value, layer_type, u_a.to(device), u_g.to(device))
        except ValueError as error:
            raise _layer_error(name, error) from None

    def damp(self, raw_factors: Mapping[str, Any], damping: float) -> dict[str, Any]:
        """``{layer: (U_A, U_G, Λ + λ)}`` with ``λ = damping`` or ``damping·mean(Λ)``."""
        damped = {}
        for name, raw in raw_factors.items():
            lam = raw["lam"]
            shift = damping * float(lam.mean()) if self.relative_damping else damping
            shifted = lam + shift
            tol = 0.0
            if shift == 0:  # undamped: eigenvalues at round-off level count as zero
                tol = lam.numel() * torch.finfo(lam.dtype).eps * float(lam.abs().max())
            if not bool(torch.isfinite(shifted).all()) or float(shifted.min()) <= tol:
                raise ValueError(
                    f"layer {name!r}: the corrected eigenvalues Λ+λ reach "
                    f"{float(shifted.min()):.3e} with damping={damping} (singular curvature); "
                    "use damping > 0 or relative_damping=True."
                )
            damped[name] = (raw["U_A"], raw["U_G"], shifted)
        return damped

    def precondition_test_layer(self, value: Any, layer_type: str, factors: Any) -> Any:
        """``U_G((U_Gᵀ dW U_A)/(Λ+λ))U_Aᵀ`` as a dense ``(B, d)`` block.

        Without the outer rotation (``(U_Gᵀ dW U_A)/(Λ+λ)``, or with ``·U_Aᵀ``
        only) when this scoring pass's kept train blocks were rotated.
        """
        u_a, u_g, lam = factors
        coords = ekfac_materialize(value, layer_type, u_a, u_g)
        if self._test_eigenbasis_mode is not None:  # kept train blocks rotated (_ekfac_eigenbasis)
            return precondition_in_eigenbasis(coords, u_a, lam, self._test_eigenbasis_mode)
        return ekfac_precondition(coords, u_a, u_g, lam, layer_type)

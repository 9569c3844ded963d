"""Where each layer's curvature comes from, and the covariance pass that fits K-FAC's ``(A, G)``.

Layer routing: a K-FAC layer is an eligible layer stored factorized or with
covariances (supplied, recorded at capture, or captured live); other eligible
layers and (with ``non_kfac_strategy="direct"``) norm layers use the dense
empirical Fisher. The covariance pass is the first pass over the training
gradients; under a process group its covariances are reduced over the union of
the layers every rank saw.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.attribution.algorithm.kronecker.curvature import token_summed_rows
from dattri_llm.gradient.callbacks.kronecker_covariance_callback import (
    KroneckerCovarianceCallback,
)
from dattri_llm.gradient.model.lowrank import require_raw_factors
from dattri_llm.gradient.ops.fisher_accumulators import FisherAccumulator
from dattri_llm.gradient.ops.kronecker_accumulators import KroneckerAccumulator
from dattri_llm.gradient.ops.kronecker_rows import kfac_rows
from dattri_llm.gradient.ops.types import is_embedding, is_kfac_eligible, is_norm
from dattri_llm.utils.distributed import all_gather_objects

if TYPE_CHECKING:
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource

Covariances = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def _union_layer_types(local: dict[str, str]) -> dict[str, str]:
    """``{layer: type}`` seen on any rank (this rank's first, then the others' in rank order)."""
    union = dict(local)
    for seen in all_gather_objects(local):
        for name, layer_type in seen.items():
            union.setdefault(name, layer_type)
    return union


class CovariancePass:
    """Mixin of :class:`KroneckerAttributor`: layer routing and the covariance pass.

    Reads ``covariances`` (supplied), ``_capture_time_covariances`` and
    ``_unusable_covariances`` (``recorded.CaptureTimeCovariances``); sets
    ``_capture_callback`` (live capture during the pass), ``_fitted_layer_types``
    and ``_warned``.
    """

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
            ok = token_summed_rows(value).shape[1] == k * d
            stored = f"dense rows {tuple(token_summed_rows(value).shape)}"
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

"""The curvature of the Kronecker attributors: the subclass contract; fit, damp and apply it.

:meth:`CurvatureFit.fit_raw` fits the damping-free per-layer factors (the
subclass's :meth:`~CurvatureFit.fit_factors`) and the dense Fisher;
:meth:`~CurvatureFit.damp_fit` damps them and holds the result on the device
or in a ``TensorCache``; :meth:`~CurvatureFit.transform_test_rep` applies
``F⁻¹`` to the queries.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.attribution.algorithm.kronecker.plan import KeptPasses
from dattri_llm.gradient.ops.fisher_accumulators import FisherAccumulator
from dattri_llm.gradient.ops.kronecker import checked_spd_inverse, damping_for
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.utils.cache import TensorCache

if TYPE_CHECKING:
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource


def token_summed_rows(value: torch.Tensor) -> torch.Tensor:
    """A dense payload as ``(B, d)`` rows (``(B, T, d)`` summed over tokens)."""
    return value.sum(dim=1) if value.dim() == 3 else value.reshape(value.shape[0], -1)


def layer_error(name: str, error: ValueError) -> ValueError:
    """``error`` re-raised with the layer name in front."""
    return ValueError(f"layer {name!r}: {error}")


def to_device(value: Any, device: torch.device) -> Any:
    """Move a tensor or a tuple/dict of tensors to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def _matmul_checked(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows @ inverse`` (symmetric inverse) after checking the width."""
    if rows.shape[1] != inverse.shape[0]:
        raise ValueError(
            f"dense gradients {tuple(rows.shape)} do not match the fitted Fisher "
            f"{tuple(inverse.shape)}; the fit belongs to another layer set or projection — refit."
        )
    dtype = torch.promote_types(rows.dtype, inverse.dtype)
    return rows.to(dtype) @ inverse.to(dtype)


class CurvatureFit:
    """Mixin of :class:`KroneckerAttributor`: fit, damp and apply the curvature.

    State: ``raw_fit`` (damping-free ``(factors, fisher)``, fitted or loaded),
    ``_fit_kept_every_block`` (the pass plan of the call that fitted it kept
    every training block; persisted with the fit), ``_factors`` and
    ``_fisher_inverse`` (damped, held), ``_identity_test`` (queries already
    preconditioned) and ``_fisher_dir_to_write``.
    """

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
                raise layer_error(name, error) from None
        self._factors = self._hold(factors)
        self._fisher_inverse = self._hold(fisher)

    def _hold(self, values: dict[str, Any]) -> Any:
        """Damped factors on the compute device, or host-side in a ``TensorCache``."""
        if self.factor_cache_residency is None:
            device = torch.device(self.args.device)
            return {name: to_device(value, device) for name, value in values.items()}
        cache = TensorCache(self.factor_cache_residency)
        for name, value in values.items():
            cache.put(name, to_device(value, torch.device("cpu")))
        return cache

    def _fetch(self, holder: Any, name: str) -> Any:
        """One layer's damped factors on the compute device (``None`` if absent)."""
        value = holder.get(name)
        return None if value is None else to_device(value, torch.device(self.args.device))

    def _ensure_fit(self, train_source: GradientSource) -> None:
        """Fit (unless loaded/held), persist when requested, then damp."""
        if self.raw_fit is None:
            self.raw_fit = self.fit_raw(train_source)
            self._fit_kept_every_block = (
                isinstance(train_source, KeptPasses) and train_source.keeps_every_block
            )
            if self._fisher_dir_to_write is not None:
                self.save_fisher(self.raw_fit[0], self._fisher_dir_to_write, fisher=self.raw_fit[1])
        self.damp_fit(self.raw_fit, self.damping)

    def prepare_scoring(self, train_source: GradientSource, test_source: GradientSource) -> None:
        """Fit (or reuse the loaded fit) and damp it before the test side is transformed.

        The scoring pass that follows is the last over a planned train source:
        it releases the kept blocks as it goes.
        """
        if not self._identity_test:
            self._ensure_fit(train_source)
        if isinstance(train_source, KeptPasses):
            train_source.last_pass_next()

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
                        value = token_summed_rows(value)
                    return self.precondition_test_layer(value, layer_type, factors)
                inverse = self._fetch(self._fisher_inverse, name)
                if inverse is None:
                    return None
                rows = (
                    token_summed_rows(value)
                    if isinstance(value, torch.Tensor)
                    else materialize(value, layer_type)
                )
                return _matmul_checked(rows, inverse)
            except ValueError as error:
                raise layer_error(name, error) from None

        return block.map_layers(convert)

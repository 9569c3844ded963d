"""K-FAC: the Kronecker attributor base, composed from its jobs, and ``KFACAttributor``.

:class:`KroneckerAttributor` holds the per-call state and runs the scoring pass
over a pass plan (``plan.KeptPasses``); its jobs live in mixins, one module
each: options (``options``), layer routing and the covariance pass
(``covariances``), covariances recorded at capture (``recorded``), fit
persistence (``persistence``), fitting/damping/applying the curvature
(``curvature``) and the public calls (``calls``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.kronecker.calls import KroneckerCalls
from dattri_llm.attribution.algorithm.kronecker.covariances import CovariancePass
from dattri_llm.attribution.algorithm.kronecker.curvature import CurvatureFit, layer_error
from dattri_llm.attribution.algorithm.kronecker.options import KroneckerOptions
from dattri_llm.attribution.algorithm.kronecker.persistence import FisherPersistence
from dattri_llm.attribution.algorithm.kronecker.plan import KeptPasses
from dattri_llm.attribution.algorithm.kronecker.recorded import CaptureTimeCovariances
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.fisher_accumulators import FisherAccumulator
from dattri_llm.gradient.ops.kronecker import (
    checked_spd_inverse,
    damping_for,
    kfac_precondition,
    kfac_precondition_materialized,
)
from dattri_llm.gradient.ops.types import is_conv_transpose

if TYPE_CHECKING:
    from dattri_llm.attribution.algorithm.kronecker.recorded import _RecordedCovariances
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.callbacks.kronecker_covariance_callback import (
        KroneckerCovarianceCallback,
    )
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource


class KroneckerAttributor(
    KroneckerOptions,
    CovariancePass,
    CaptureTimeCovariances,
    FisherPersistence,
    CurvatureFit,
    KroneckerCalls,
    BaseInnerProductAttributor,
):
    """Base of the curvature attributors: fit, damping, persistence and test preconditioning.

    Subclasses implement :meth:`fit_factors` (damping-free per-layer factors),
    :meth:`damp` and :meth:`precondition_test_layer`. A single checkpoint is
    used (``checkpoints() -> [0]``; more → ``UserWarning``); the train source
    must be ``reusable`` for the fit pass(es).
    """

    algorithm: ClassVar[str] = "Kronecker"

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        super().__init__(args, task=task)
        # options (options.py); the layer and step selection a fit records
        self.damping = 1e-3
        self.relative_damping = False
        self.non_kfac_strategy = "ignore"
        self.direct_fim_max_params = 4096
        self.factor_cache_residency: str | None = None
        self.covariances_at_capture = True
        self._fit_settings: dict[str, Any] = {"layer_name": None, "selected_training_steps": None}
        # the curvature (curvature.py, persisted by persistence.py): the damping-free fit,
        # whether the plan of the call that fitted it kept every block, the damped factors
        self.raw_fit: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self._fit_kept_every_block = False
        self._fisher_dir_to_write: Path | None = None
        self._factors: Any = None
        self._fisher_inverse: Any = None
        self._identity_test = False
        # the covariance pass (covariances.py): supplied covariances, the live capture
        # callback of the pass, the fitted layers' types, layers warned about
        self.covariances: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._capture_callback: Any = None
        self._fitted_layer_types: dict[str, str] = {}
        self._warned: set[str] = set()
        # covariances recorded while attribute()/cache() collect the train side
        # (recorded.py): the callback of the running collection, then its payload bound
        # to the store it was recorded for (never adopted for another store)
        self._collect_covariances = False
        self._recorder: KroneckerCovarianceCallback | None = None
        self._recorded: _RecordedCovariances | None = None
        # capture-time covariances adopted by the running call after validation, or why
        # the ones recorded for its train store do not fit it
        self._capture_time_covariances: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._unusable_covariances: str | None = None
        # pass plan of the running call (plan.py): bytes of first-pass blocks a live train
        # source may keep (0 for stores and outside attribute), and the plan the last
        # scoring pass ran
        self._kept_budget = 0
        self._pass_plan: dict[str, int] | None = None
        # EK-FAC: how this scoring pass's kept train blocks were rotated (None: not at all)
        self._test_eigenbasis_mode: str | None = None
        self._score_granularity = "instance"  # of the scoring pass under way

    def checkpoints(self) -> list[int]:
        """``[0]``: curvature methods use one checkpoint (``UserWarning`` if the task has more)."""
        return self._first_checkpoint_only()

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
                raise layer_error(name, error) from None
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

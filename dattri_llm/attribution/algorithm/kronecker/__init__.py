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

The package splits the attributor by job: ``options`` (validation),
``covariances`` (layer routing, the covariance pass), ``recorded``
(covariances recorded at capture), ``persistence`` (fit files, shared with
LoRIF), ``curvature`` (fit, damp, apply), ``calls`` (entry points), ``plan``
(which first-pass blocks are kept), ``kfac`` (the base and K-FAC) and
``ekfac`` (EK-FAC and scoring in the eigenbasis). This module re-exports.
"""

# re-exports (``X as X``): the names importable from the former kronecker.py
from dattri_llm.attribution.algorithm.kronecker.covariances import Covariances as Covariances
from dattri_llm.attribution.algorithm.kronecker.ekfac import EKFAC_MODES as EKFAC_MODES
from dattri_llm.attribution.algorithm.kronecker.ekfac import EKFACAttributor as EKFACAttributor
from dattri_llm.attribution.algorithm.kronecker.kfac import KFACAttributor as KFACAttributor
from dattri_llm.attribution.algorithm.kronecker.kfac import (
    KroneckerAttributor as KroneckerAttributor,
)
from dattri_llm.attribution.algorithm.kronecker.options import (
    NON_KFAC_STRATEGIES as NON_KFAC_STRATEGIES,
)
from dattri_llm.attribution.algorithm.kronecker.persistence import FISHER_FILE as FISHER_FILE
from dattri_llm.attribution.algorithm.kronecker.plan import (
    DEFAULT_KEPT_GRADIENT_BUDGET as DEFAULT_KEPT_GRADIENT_BUDGET,
)
from dattri_llm.attribution.algorithm.kronecker.plan import (
    KEPT_BUDGET_FREE_FRACTION as KEPT_BUDGET_FREE_FRACTION,
)
from dattri_llm.attribution.algorithm.kronecker.plan import (
    default_kept_budget as default_kept_budget,
)
from dattri_llm.attribution.algorithm.kronecker.recorded import (
    COVARIANCES_FILE as COVARIANCES_FILE,
)

"""Options of the curvature attributors: their validation and the settings a persisted fit records.

A call's options (damping, non-K-FAC strategy, dense-Fisher width cap, where
damped factors are held, covariances at capture) are validated by
:meth:`KroneckerOptions.configure` before anything runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dattri_llm.utils.cache import CACHE_RESIDENCIES

if TYPE_CHECKING:
    from dattri_llm.gradient.hooks.config import HookManagerConfig

NON_KFAC_STRATEGIES = ("ignore", "direct")


class KroneckerOptions:
    """Mixin of :class:`KroneckerAttributor`: the options of the coming call.

    Sets ``damping``, ``non_kfac_strategy``, ``direct_fim_max_params``,
    ``relative_damping``, ``factor_cache_residency`` and
    ``covariances_at_capture``; ``_fit_settings`` holds the call's layer and
    step selection (``persistence.fit_settings``).
    """

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

    def fit_meta(self) -> dict[str, Any]:
        """Settings a persisted fit must match to be reused (damping excluded)."""
        return {
            "non_kfac_strategy": self.non_kfac_strategy,
            "direct_fim_max_params": self.direct_fim_max_params,
            **self._fit_settings,
        }


def require_factors_or_capture_covariances(
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

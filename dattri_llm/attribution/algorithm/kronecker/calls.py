"""The public calls of the Kronecker attributors and their per-call setup.

``attribute``, ``attribute_from_cache``, ``fit`` and ``cache_preconditioned_test``.

Each call resets the per-call state (:meth:`KroneckerCalls._start_call`),
applies its options, chooses where the fit and the covariances come from
(``fit_dir``, covariances recorded at capture, supplied ones) and hands the
scoring to :class:`~dattri_llm.attribution.base.BaseInnerProductAttributor`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dattri_llm.attribution.algorithm.kronecker.options import (
    require_factors_or_capture_covariances,
)
from dattri_llm.attribution.algorithm.kronecker.persistence import fit_settings
from dattri_llm.attribution.algorithm.kronecker.plan import resolve_kept_budget
from dattri_llm.attribution.sources import open_store_directory
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.algorithm.kronecker.covariances import Covariances
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig


class KroneckerCalls:
    """Mixin of :class:`KroneckerAttributor`: its entry points and their per-call setup."""

    def _start_call(self, options: dict[str, Any], layer_name: Any, steps: Any) -> None:
        """Reset per-call state and apply the options."""
        self.configure(**options)
        self._fit_settings = fit_settings(layer_name, steps)
        self.covariances = None
        self._capture_time_covariances = {}
        self._unusable_covariances = None
        self._fitted_layer_types = {}
        self.raw_fit = None
        self._fit_kept_every_block = False
        self._factors = self._fisher_inverse = None
        self._fisher_dir_to_write = None
        self._identity_test = False
        self._warned = set()
        self._kept_budget = 0
        self._pass_plan = None
        self._test_eigenbasis_mode = None

    @keywords(aliases={"fisher_dir": "fit_dir"})
    def attribute_from_cache(  # noqa: D417 - documented in docs/API.md
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
        train_source = open_store_directory(train_source)  # one store (and index) per call
        test_source = open_store_directory(test_source)
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
    def fit(  # noqa: D417 - documented in docs/API.md
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
        train_source = open_store_directory(train_source)  # one store (and index) per call
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
    def cache_preconditioned_test(  # noqa: D417 - documented in docs/API.md
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
        train_source = open_store_directory(train_source)  # one store (and index) per call
        test_source = open_store_directory(test_source)
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
    def attribute(  # noqa: D417 - documented in docs/API.md
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
        ``min(1 GiB, KEPT_BUDGET_FREE_FRACTION`` of the compute device's free
        memory), see ``plan.default_kept_budget``; 0 keeps nothing) and the later
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
        budget = resolve_kept_budget(kept_gradient_budget, self.args.device)
        require_factors_or_capture_covariances(hook_config, covariances_at_capture, self.algorithm)
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

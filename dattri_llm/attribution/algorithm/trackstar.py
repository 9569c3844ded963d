"""TrackStar: cosine of whitened, optimizer-normalised, projected loss gradients.

TrackStar (Chang et al., 2024, "Scalable Influence and Fact Tracing for Large
Language Model Pretraining") scores a training sample ``z`` against a query
``q`` as

    ``τ(z, q) = φ̂(z)ᵀ φ̂(q)``,  ``φ̂ = φ / ‖φ‖``,  ``φ = R^{-1/2} φ₀``,
    ``φ₀ = P (∇θ L ⊘ d)``,

where ``d`` is the trained model's optimizer second-moment denominator
(``sqrt(v) + eps`` for Adam / AdamW, ``sqrt(max(v, eps1²))`` for Adafactor;
``ops.second_moment_normalize``, applied at capture before the capture's
projection ``P``) and
``R = λ·R_train + (1 − λ)·R_query + δI`` with ``R_train = Φ₀ᵀΦ₀ / N`` over the
training rows and ``R_query`` likewise over the queries.

``R`` is per hooked layer (block-diagonal over layers, as the curvature of
:class:`~dattri_llm.attribution.algorithm.lorif.LoRIFAttributor`, whose exact
streaming ``Φ₀ᵀΦ₀`` fit this reuses); the unit normalisation is over the
whole sample (all scored layers), after ``R^{-1/2}``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import dattri_llm.attribution.sources as sources
from dattri_llm.attribution.algorithm.less import scale_to_norm
from dattri_llm.attribution.algorithm.lorif import (
    DEFAULT_RELATIVE_DAMPING,
    LoRIFAttributor,
    LoRIFLayerFit,
)
from dattri_llm.attribution.algorithm.trajectory.sweep import LOSS_REDUCTIONS, check_choice
from dattri_llm.gradient.ops.optimizer import SECOND_MOMENT_STATE_KEYS
from dattri_llm.gradient.state.names import optimizer_from_state_dict
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.attribution.scoring import ScoreResult
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource
    from dattri_llm.gradient.stream.streamer import GradientStreamer

__all__ = ["TrackStarAttributor"]

DEFAULT_MIXING = 0.9
OptimizerState = torch.optim.Optimizer | Mapping[str, Any] | str | os.PathLike

# The torch.optim class a saved state dict is rebuilt as, by a state key it holds.
_CLASS_OF_STATE_KEY: dict[str, type[torch.optim.Optimizer]] = {
    "exp_avg_sq": torch.optim.AdamW,
    "row_var": torch.optim.Adafactor,
    "variance": torch.optim.Adafactor,
}


def _check_mixing(mixing: object) -> float:
    """``λ`` as a float in ``[0, 1]`` (``ValueError`` otherwise)."""
    if isinstance(mixing, bool) or not isinstance(mixing, (int, float)):
        raise ValueError(
            f"TrackStarAttributor: mixing must be a float in [0, 1] (the weight of R_train; "
            f"1 - mixing weights R_query), got {mixing!r}."
        )
    if not (math.isfinite(mixing) and 0.0 <= mixing <= 1.0):
        raise ValueError(
            f"TrackStarAttributor: mixing must lie in [0, 1] (1 = training rows only, 0 = "
            f"queries only), got {mixing!r}."
        )
    return float(mixing)


def _check_damping(damping: object) -> None:
    """``None`` or a finite number ``> 0`` (``ValueError`` otherwise)."""
    if damping is None:
        return
    number = isinstance(damping, (int, float)) and not isinstance(damping, bool)
    if not (number and math.isfinite(damping) and damping > 0):
        raise ValueError(
            f"TrackStarAttributor: damping must be finite and > 0 (added to R before its "
            f"inverse square root), got {damping!r}; None uses 0.1 × trace(R)/D per layer."
        )


def _supported_type(optimizer: torch.optim.Optimizer) -> str:
    """The first class name along the MRO with a second moment (``ValueError`` otherwise)."""
    for cls in type(optimizer).__mro__:
        if cls.__name__ in SECOND_MOMENT_STATE_KEYS:
            return cls.__name__
    raise ValueError(
        f"TrackStarAttributor: optimizer {type(optimizer).__name__} keeps no second moment "
        f"TrackStar can normalise by; pass the trained model's "
        f"{' / '.join(SECOND_MOMENT_STATE_KEYS)} optimizer (torch.optim, or a subclass), or "
        "its state_dict."
    )


def _check_optimizer(optimizer: object) -> OptimizerState | None:
    """An optimizer of a supported type, a state dict, a path to one, or ``None``."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        _supported_type(optimizer)
        return optimizer
    if isinstance(optimizer, Mapping):
        if "state" not in optimizer or "param_groups" not in optimizer:
            raise ValueError(
                "TrackStarAttributor: an optimizer state dict must hold 'state' and "
                f"'param_groups' (optimizer.state_dict()), got keys {sorted(optimizer)}."
            )
        _class_of_state(optimizer)
        return optimizer
    if isinstance(optimizer, (str, os.PathLike)):
        if not Path(optimizer).expanduser().is_file():
            raise ValueError(
                f"TrackStarAttributor: no optimizer state file at {str(optimizer)!r}; pass the "
                "path of a saved optimizer.state_dict() (e.g. a Trainer's optimizer.pt)."
            )
        return Path(optimizer).expanduser()
    raise ValueError(
        "TrackStarAttributor: optimizer must be a torch.optim optimizer (Adam, AdamW, "
        "Adafactor), its state_dict(), or the path of a saved state_dict, got "
        f"{type(optimizer).__name__}."
    )


def _class_of_state(state_dict: Mapping[str, Any]) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class to rebuild a saved state as (by its state keys)."""
    keys = {key for entry in state_dict["state"].values() for key in entry}
    for key, cls in _CLASS_OF_STATE_KEY.items():
        if key in keys:
            return cls
    raise ValueError(
        "TrackStarAttributor: the optimizer state dict holds no second moment (state keys "
        f"{sorted(keys)}; expected 'exp_avg_sq' (Adam / AdamW) or 'row_var' / 'col_var' / "
        "'variance' (torch.optim.Adafactor)); pass the state of the trained model's optimizer."
    )


def _check_state_shapes(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` when a rebuilt state does not fit its parameter (names out of order)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            v = state.get("exp_avg_sq", state.get("variance"))
            rows = state.get("row_var")
            fits = (v is None or v.shape == param.shape) and (
                rows is None or tuple(rows.shape) == (*param.shape[:-1], 1)
            )
            if not fits:
                raise ValueError(
                    f"TrackStarAttributor: the saved optimizer state of a parameter of shape "
                    f"{tuple(param.shape)} does not fit it: the state dict's parameter indices "
                    "map to other parameters. Pass optimizer_param_names (the parameter names in "
                    "the order the optimizer was built with, e.g. [n for n, _ in "
                    "model.named_parameters()])."
                )


def _whitener(
    name: str,
    train: LoRIFLayerFit,
    query: LoRIFLayerFit | None,
    mixing: float,
    damping: float | None,
) -> torch.Tensor:
    """``(R + δI)^{-1/2}`` ``(D, D)`` of one layer, ``R = λ R_train + (1 − λ) R_query``."""
    if query is not None and query.width != train.width:
        raise ValueError(
            f"TrackStarAttributor: layer {name!r} has D={train.width} projected entries per "
            f"training row but D={query.width} per query row; capture both sides with one "
            "projection."
        )

    def second_moment(fit: LoRIFLayerFit) -> torch.Tensor:
        basis = fit.basis.to(torch.float64)
        return (basis * fit.eigenvalues.to(basis)) @ basis.T

    matrix = mixing * second_moment(train)
    mean = mixing * train.mean_eigenvalue
    if query is not None and mixing < 1.0:
        matrix = matrix + (1.0 - mixing) * second_moment(query)
        mean += (1.0 - mixing) * query.mean_eigenvalue
    delta = damping if damping is not None else DEFAULT_RELATIVE_DAMPING * mean
    if not delta > 0:
        raise ValueError(
            f"TrackStarAttributor: layer {name!r} has all-zero gradients on both sides, so the "
            "default damping (0.1 × mean eigenvalue of R) is 0; pass damping > 0 or leave the "
            "layer out."
        )
    values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    scale = (values.clamp_min(0.0) + delta).rsqrt()
    return ((vectors * scale) @ vectors.T).to(train.basis.dtype)


class TrackStarAttributor(LoRIFAttributor):
    """TrackStar (``algorithm="TrackStar"``): cosine of ``R^{-1/2} P (∇L ⊘ d)``.

    Both sides are captured through the optimizer map
    ``ops.second_moment_normalize`` (``HookManager.precondition_rule =
    "second_moment"``) and the capture's projection
    (``HookManagerConfig(projection_kwargs=...)``, ``"mask"`` or ``"dense"``,
    or none). Per layer, ``R`` mixes the second moments of the training rows and
    of the queries; each side's rows are multiplied by ``(R + δI)^{-1/2}`` and
    scaled to unit norm over all scored layers; the score is their inner
    product (a cosine in ``[-1, 1]``, larger = more helpful, polarity ``+1``).
    One model: the task's first checkpoint, whose optimizer state is
    ``optimizer``.

    Args:
        args: the run settings.
        task: the :class:`AttributionTask` (``None`` for cache-only use).
        optimizer: the trained model's optimizer state: a ``torch.optim``
            Adam / AdamW / Adafactor over the task model's parameters, its
            ``state_dict()``, or the path of a saved one (rebuilt over the task
            model by :func:`~dattri_llm.gradient.state.names.optimizer_from_state_dict`).
            Needed by :meth:`attribute` and :meth:`cache`; not by
            :meth:`attribute_from_cache`, whose stores hold normalised rows.
        mixing: ``λ`` in ``[0, 1]``, the weight of ``R_train`` (default 0.9).
        damping: ``δ > 0`` added to ``R``; ``None`` = 0.1 × the mean
            eigenvalue ``trace(R)/D`` of the layer.
        loss_reduction: how the task's losses reduce over a batch (``"mean"``
            or ``"sum"``), so each row is the sample's own gradient and the
            training and query sides weigh alike in ``R``.
        optimizer_param_names: for a state dict, the model parameter name of
            each saved parameter index (the order the optimizer was built
            with); default: the names saved with the state (torch >= 2.6, an
            optimizer built over ``named_parameters()``), else HF ``Trainer``'s
            order (``optimizer_from_state_dict``).

    Raises:
        ValueError: ``mixing`` outside ``[0, 1]``; ``damping <= 0``; an
            optimizer without a second moment (not Adam / AdamW / Adafactor);
            a state dict without one; a missing state file; an unknown
            ``loss_reduction``.
    """

    algorithm: ClassVar[str] = "TrackStar"
    polarity: ClassVar[int] = 1

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        optimizer: OptimizerState | None = None,
        mixing: float = DEFAULT_MIXING,
        damping: float | None = None,
        loss_reduction: str = "mean",
        optimizer_param_names: Sequence[str] | None = None,
    ) -> None:
        _check_damping(damping)
        super().__init__(args, task=task, rank=None, svd_rank=None, damping=damping)
        self.mixing = _check_mixing(mixing)
        self.optimizer_state = _check_optimizer(optimizer)
        self.loss_reduction = check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        self.optimizer_param_names = (
            None if optimizer_param_names is None else list(optimizer_param_names)
        )
        self._optimizer: torch.optim.Optimizer | None = None
        self._whiteners: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ optimizer
    def resolved_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose second moment normalises the captures.

        A state dict (or file) is rebuilt over the task model once, as
        ``torch.optim.AdamW`` (``exp_avg_sq`` state) or ``torch.optim.Adafactor``.

        Raises:
            ValueError: no optimizer was given.
        """
        if self._optimizer is not None:
            return self._optimizer
        state = self.optimizer_state
        if state is None:
            raise ValueError(
                "TrackStarAttributor normalises gradients by the trained model's optimizer "
                "second moment and got no optimizer state; pass optimizer=<the Adam / AdamW / "
                "Adafactor optimizer>, its state_dict(), or the path of a saved one."
            )
        if isinstance(state, torch.optim.Optimizer):
            self._optimizer = state
        else:
            if not isinstance(state, Mapping):
                state = torch.load(state, map_location="cpu", weights_only=True)
            model = self.require_task("attribute").model
            self._optimizer = optimizer_from_state_dict(
                model,
                dict(state),
                self.optimizer_param_names,
                optimizer_cls=_class_of_state(state),
            )
            _check_state_shapes(self._optimizer)
        _supported_type(self._optimizer)
        return self._optimizer

    def checkpoints(self) -> list[int]:
        """``[0]``: one trained model and its optimizer state."""
        return self._first_checkpoint_only()

    def _normalising(self, streamer: GradientStreamer) -> GradientStreamer:
        """Set the streamer's manager to the second-moment map and this loss convention."""
        manager: HookManager = streamer.hook_manager
        manager.precondition_rule = "second_moment"
        manager.set_loss_convention(self.loss_reduction, 1)
        return streamer

    # ------------------------------------------------------------------ sources
    def generate_train_rep(
        self,
        train_dataset: object,
        *,
        checkpoint_step: int = 0,
        enable_update: bool = False,
        hook_config: HookManagerConfig | None = None,
    ) -> GradientStreamer:
        """Frozen train probe capturing ``P(∇L ⊘ d)`` (``ValueError`` for ``enable_update``)."""
        if enable_update:
            raise ValueError(
                "TrackStarAttributor scores one trained model (a frozen probe); "
                "enable_update=True is not supported."
            )
        optimizer = self.resolved_optimizer()
        streamer = self._train_streamer(
            train_dataset,
            "generate_train_rep",
            checkpoint_step=checkpoint_step,
            config=hook_config,
            optimizer=optimizer,
            precondition=True,
        )
        return self._normalising(streamer)

    def generate_test_rep(
        self,
        test_dataset: object,
        *,
        checkpoint_step: int = 0,
        hook_config: HookManagerConfig | None = None,
        hook_manager: HookManager | None = None,
        forward_model: torch.nn.Module | None = None,
        shard: bool = True,
    ) -> GradientStreamer:
        """Frozen query probe capturing ``P(∇L ⊘ d)`` with the same optimizer map."""
        streamer = sources.query_streamer(
            self,
            test_dataset,
            checkpoint_step=checkpoint_step,
            hook_config=hook_config,
            hook_manager=hook_manager,
            forward_model=forward_model,
            shard=shard,
            optimizer=self.resolved_optimizer(),
            precondition=True,
        )
        return self._normalising(streamer)

    # ------------------------------------------------------------------ whitening
    def fit_rows(self, block: Gradient) -> Gradient:
        """The fit sweeps the captured rows ``φ₀`` as they are."""
        return block

    def prepare_scoring(self, train_source: GradientSource, test_source: GradientSource) -> None:
        """Fit ``R_train`` (and ``R_query`` when ``mixing < 1``) and each layer's whitener.

        ``R_train`` covers every rank's training rows (summed over the shards
        of a sharded :meth:`attribute`); every rank holds all the queries.
        """
        train_fits = self.fit_source(train_source)
        query_fits = self.fit_source(test_source, sharded_source=False) if self.mixing < 1.0 else {}
        names = [n for n in train_fits if self.mixing == 1.0 or n in query_fits]
        self._whiteners = {
            name: _whitener(name, train_fits[name], query_fits.get(name), self.mixing, self.damping)
            for name in names
        }
        self.layer_fits = {name: train_fits[name] for name in names}

    def precondition(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """``(R + δI)^{-1/2} φ₀`` of ``(B, D)`` rows of layer ``name``."""
        whitener = self._whiteners[name]
        if rows.shape[1] != whitener.shape[0]:
            raise ValueError(
                f"TrackStarAttributor: layer {name!r} has {rows.shape[1]} entries per row but "
                f"R was fitted with D={whitener.shape[0]}; both sides need one projection."
            )
        return rows.to(whitener.dtype) @ whitener.to(rows.device)

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """Rows whitened per fitted layer (other layers dropped), then scaled to unit norm."""
        return scale_to_norm(super().transform_test_rep(block), 1.0)

    def transform_train_rep(self, block: Gradient) -> Gradient:
        """As :meth:`transform_test_rep` (both sides are whitened and normalised alike)."""
        return self.transform_test_rep(block)

    def score_sources(
        self,
        train_source: GradientSource,
        test_source: GradientSource,
        **options: Any,
    ) -> ScoreResult:
        """The base pass (instance granularity only: rows are normalised per sample)."""
        granularity = options.get("attribution_granularity", "instance")
        if granularity != "instance":
            raise ValueError(
                f"TrackStarAttributor scores whole samples (each row is unit-normalised after "
                f"whitening); attribution_granularity={granularity!r} is not supported, use "
                "'instance'."
            )
        try:
            return super().score_sources(train_source, test_source, **options)
        finally:
            self._whiteners = {}

    def build_score(self, *args: Any, **kwargs: Any) -> AttributionScore:
        """The base score, with ``mixing``, ``damping`` and ``loss_reduction`` in its meta."""
        kwargs["algorithm_meta"] = {**(kwargs.get("algorithm_meta") or {}), **self._meta()}
        return super().build_score(*args, **kwargs)

    def _meta(self) -> dict[str, Any]:
        """``algorithm_meta`` entries of a call."""
        return {
            "mixing": self.mixing,
            "damping": self.damping,
            "loss_reduction": self.loss_reduction,
        }

    # ------------------------------------------------------------------ entry points
    def fit(self, train_source: object, fit_dir: str | None = None, **kwargs: Any) -> Path:
        """Refused (``ValueError``): ``R`` mixes in the queries, so it is fitted per call."""
        raise ValueError(
            "TrackStarAttributor has no persisted fit: R mixes the training rows with the "
            "queries of each call; score with attribute(...) or attribute_from_cache(...)."
        )

    @keywords()
    def attribute_from_cache(
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
    ) -> AttributionScore:
        """TrackStar scores from stores written by :meth:`cache` (rows ``P(∇L ⊘ d)``).

        ``R`` is fitted from both stores in this call. The stores must hold
        normalised rows (as :meth:`cache` writes them): raw-gradient stores are
        not recognised and would be scored without the optimizer normalisation.
        """
        return super().attribute_from_cache(
            train_source,
            test_source,
            selected_training_steps=selected_training_steps,
            layer_name=layer_name,
            verbose=verbose,
            loop_over_test=loop_over_test,
            algorithm_meta=algorithm_meta,
            attribution_granularity=attribution_granularity,
        )

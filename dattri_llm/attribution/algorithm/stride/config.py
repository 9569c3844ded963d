"""``StrideConfig``: the settings of a STRIDE fit and its sparse recovery, checked on creation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dattri_llm.attribution.algorithm.stride.operators import INJECTIONS

__all__ = ["StrideConfig"]

_POSITIVE_INTS = (
    "rank",
    "subsets_per_example",
    "expected_sparsity",
    "steps",
    "subsets_per_step",
    "fidelity_batch_size",
    "reference_batch_size",
    "probe_size",
    "linearity_every",
    "subset_chunk",
    "lasso_max_iter",
)
_NON_NEGATIVE_FLOATS = ("fidelity_weight", "stability_weight", "linearity_weight")
_POSITIVE_FLOATS = ("learning_rate", "ridge", "lasso_tol")


@dataclass(frozen=True)
class StrideConfig:
    """Settings of the operators, their fit and the Lasso (``docs/stride.md`` explains each).

    Attributes:
        rank: ``r``, the width of the shared basis.
        num_subsets: ``K``; ``None`` picks ``ceil(2 s ln(N / s))`` from
            ``expected_sparsity`` ``s`` when the training set is known.
        subsets_per_example: ``d``, the subsets each example joins.
        expected_sparsity: ``s``, only used when ``num_subsets`` is ``None``.
        injection: ``"logits"`` (default) or ``"residual"``.
        layer: the module whose output the basis reads; ``None`` = the block at
            about 0.63 depth of a Hugging Face decoder.
        fidelity_weight, stability_weight, linearity_weight: loss weights (``>= 0``,
            fidelity ``> 0``).
        learning_rate: Adam's step size.
        steps: optimizer steps of the fit.
        subsets_per_step: subsets drawn (without replacement) per step.
        fidelity_batch_size: members of each drawn subset per step.
        reference_batch_size: ``|R_k|``, non-members per drawn subset per step.
        probe_size: training examples whose responses feed the linearity term.
        linearity_every: the linearity term runs every this many steps.
        sketch_dim: ``q`` of the sketch ``Π = M Ω``; ``None`` = ``max(1, K // 4)``.
        ridge: ``γ`` relative to ``trace(ΠᵀΠ) / q``.
        subset_chunk: subsets per batched product (measurement, linearity); the
            steered logits of one chunk take ``subset_chunk · B · T · C`` floats.
        lasso_lambda: ``λ`` relative to each query's ``λ_max = ‖Aᵀu‖_∞``, in ``[0, 1)``.
        lasso_max_iter, lasso_tol: FISTA's iteration cap and relative tolerance.
        fit_intercept: give the Lasso a free intercept (centres ``u`` and ``M``).
        seed: seed of the design, the sketch, the operator init and the sampling.
    """

    rank: int = 16
    num_subsets: int | None = None
    subsets_per_example: int = 10
    expected_sparsity: int = 10
    injection: str = "logits"
    layer: str | None = None
    fidelity_weight: float = 1.0
    stability_weight: float = 1.0
    linearity_weight: float = 1.0
    learning_rate: float = 1e-3
    steps: int = 1000
    subsets_per_step: int = 8
    fidelity_batch_size: int = 4
    reference_batch_size: int = 4
    probe_size: int = 8
    linearity_every: int = 1
    sketch_dim: int | None = None
    ridge: float = 1e-3
    subset_chunk: int = 16
    lasso_lambda: float = 0.01
    lasso_max_iter: int = 2000
    lasso_tol: float = 1e-6
    fit_intercept: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        """Check every field (``TypeError`` / ``ValueError`` naming the field and the fix)."""
        for name in _POSITIVE_INTS:
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("num_subsets", "sketch_dim"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=None)
        for name in _NON_NEGATIVE_FLOATS + _POSITIVE_FLOATS + ("lasso_lambda",):
            _check_float(name, getattr(self, name))
        for name in _NON_NEGATIVE_FLOATS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.fidelity_weight == 0:
            raise ValueError(
                "fidelity_weight must be > 0: without the fidelity term the operators learn "
                "nothing about their subsets"
            )
        for name in _POSITIVE_FLOATS:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.lasso_lambda < 1:
            raise ValueError(
                f"lasso_lambda is relative to each query's λ_max and must be in [0, 1), got "
                f"{self.lasso_lambda}; 1 or more gives all-zero scores"
            )
        if self.injection not in INJECTIONS:
            raise ValueError(f"injection must be one of {INJECTIONS}, got {self.injection!r}")
        if self.layer is not None and (not isinstance(self.layer, str) or not self.layer):
            raise TypeError(f"layer must be a module name (str) or None, got {self.layer!r}")
        if not isinstance(self.fit_intercept, bool):
            raise TypeError(f"fit_intercept must be a bool, got {self.fit_intercept!r}")
        if self.num_subsets is not None and self.subsets_per_example > self.num_subsets:
            raise ValueError(
                f"subsets_per_example (d={self.subsets_per_example}) must not exceed "
                f"num_subsets (K={self.num_subsets}); lower d or raise K"
            )

    def replace(self, **changes: Any) -> StrideConfig:
        """A copy with ``changes`` applied (and checked); ``None`` values are ignored."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict."""
        return dataclasses.asdict(self)


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    """``TypeError`` unless ``value`` is an int; ``ValueError`` below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")

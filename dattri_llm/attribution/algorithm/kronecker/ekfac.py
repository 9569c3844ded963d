"""EK-FAC: K-FAC eigenbases with corrected eigenvalues, and scoring in the eigenbasis.

``EKFACAttributor`` fits ``U_A``, ``U_G`` (eigenvectors of the K-FAC
covariances) and ``Λ = mean_i (U_Gᵀ dW_i U_A)²`` (the eigenvalue pass); a query
layer becomes ``U_G((U_Gᵀ dW U_A)/(Λ+λ))U_Aᵀ``.

Scoring in the eigenbasis, when the pass plan keeps every training block: the
eigenvalue pass rotates every training sample into the K-FAC eigenbases
(``U_Gᵀ·dW·U_A``) anyway, so it replaces each kept layer by a rotation, and the
queries skip the matching part of their rotation back out of the eigenbasis,
because

    ⟨U_G·(M/Λ)·U_Aᵀ, dW⟩ = ⟨M/Λ, U_Gᵀ·dW·U_A⟩ = ⟨(M/Λ)·U_Aᵀ, U_Gᵀ·dW⟩.

Two modes, for every layer of the call alike:

* ``"both"`` (the rotations fit ``kept_gradient_budget``): a factorized layer
  keeps its rotated token rows ``a'·U_A``, ``g·U_G`` (final factors; the bias
  column makes them one column wider), or, for per-sample scores, its
  eigen-coordinates ``(B, D·K)`` when they are smaller (scoring then needs no
  materialization either); the queries are only divided by ``Λ``.
* ``"gradient"`` (otherwise; the kept bytes do not change): only ``g·U_G`` is
  kept rotated, ``a`` stays as captured; the queries are rotated back on the
  activation side only (``Q·D·K²`` instead of ``Q·(D²K + DK²)``).

Scores equal the rotate-back path's to float rounding. A fit read back from
``fit_dir`` takes the route of the call that wrote it (the same bits).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.kronecker.curvature import layer_error, token_summed_rows
from dattri_llm.attribution.algorithm.kronecker.kfac import KroneckerAttributor
from dattri_llm.attribution.algorithm.kronecker.plan import KeptPasses
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.dot import effective_dims
from dattri_llm.gradient.ops.fisher_accumulators import FisherAccumulator
from dattri_llm.gradient.ops.kronecker import (
    ekfac_materialize,
    ekfac_precondition,
    ekfac_rotate_factors,
    ekfac_rotation_prefers_factors,
    ekfac_scale,
    kfac_eigh,
)
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import is_kfac_eligible, is_linear
from dattri_llm.utils.distributed import all_reduce_named_sums

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource
    from dattri_llm.options import EKFACMode

EKFAC_MODES = ("exact", "approx")
Bases = dict[str, tuple[torch.Tensor, torch.Tensor]]
BOTH, GRADIENT = "both", "gradient"

_EXACT_DTYPES = (torch.float32, torch.float64)


def _rotated_nbytes(
    value: Factorized | torch.Tensor,
    layer_type: str,
    u_a: torch.Tensor,
    u_g: torch.Tensor,
    per_sample: bool,
) -> int | None:
    """Bytes of a layer kept in mode ``"both"``, or ``None`` when it cannot be rotated in place.

    In place: linear layers in float32/float64 (the rotation's dtype, so the
    kept bytes do not grow from 16-bit captures), as dense ``(B, d)`` rows or
    factorized with the factor route the cheaper rotation. A factorized layer
    is kept as the smaller of its rotated factors and, for ``per_sample``
    scores, its eigen-coordinates.
    """
    if not is_linear(layer_type):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 2 or value.dtype not in _EXACT_DTYPES:
            return None
        return value.shape[0] * u_a.shape[0] * u_g.shape[0] * value.element_size()
    dtypes = {value.activation.dtype, value.pre_activation_grad.dtype}
    if len(dtypes) != 1 or not dtypes <= set(_EXACT_DTYPES):
        return None
    batch, tokens, _k, _d = effective_dims(value, layer_type)
    k, d = u_a.shape[0], u_g.shape[0]
    if not ekfac_rotation_prefers_factors(tokens, k, d):
        return None
    kept = min(tokens * (k + d), k * d) if per_sample else tokens * (k + d)
    return batch * kept * value.activation.element_size()


def eigenbasis_mode(train_source: GradientSource, bases: Bases, per_sample: bool) -> str | None:
    """``"both"``, ``"gradient"`` or ``None`` (rotate the queries back as usual).

    The plan must keep every block and every fitted layer must be rotatable in
    place (:func:`_rotated_nbytes`); ``"both"`` when the rotated blocks fit the
    plan's budget, else ``"gradient"`` (same bytes as the kept blocks).
    """
    if not isinstance(train_source, KeptPasses) or not train_source.keeps_every_block:
        return None
    total = 0
    for block in train_source.kept_blocks():
        for name, value in block.data.items():
            if name not in bases:
                total += value.nbytes
                continue
            size = _rotated_nbytes(value, block.layer_types[name], *bases[name], per_sample)
            if size is None:
                return None
            total += size
    return BOTH if total <= train_source.budget else GRADIENT


def rotated_block(
    block: Gradient,
    bases: Bases,
    add_squares: Callable[[str, torch.Tensor, int], None],
    mode: str,
    per_sample: bool,
) -> Gradient:
    """``block`` with every fitted layer rotated for ``mode`` (consumes ``block``).

    ``add_squares(name, Σ_samples coords², samples)`` receives each layer's
    squared eigen-coordinates for the eigenvalue correction.
    """

    def rotate(
        name: str, value: Factorized | torch.Tensor, layer_type: str
    ) -> Factorized | torch.Tensor:
        if name not in bases:
            return value
        device = value.device if isinstance(value, torch.Tensor) else value.activation.device
        u_a, u_g = (u.to(device) for u in bases[name])
        try:
            kept, coords = _rotated_layer(value, layer_type, u_a, u_g, mode, per_sample)
        except ValueError as error:
            raise ValueError(f"layer {name!r}: {error}") from None
        squared = coords.square() if coords is kept else coords.square_()  # coords are temporary
        add_squares(name, squared.sum(dim=0), coords.shape[0])
        return kept

    return block.map_layers(rotate, consume=True)


def _rotated_layer(
    value: Factorized | torch.Tensor,
    layer_type: str,
    u_a: torch.Tensor,
    u_g: torch.Tensor,
    mode: str,
    per_sample: bool,
) -> tuple[Factorized | torch.Tensor, torch.Tensor]:
    """``(kept value, eigen-coordinates (B, D·K))`` of one linear layer."""
    if isinstance(value, torch.Tensor):
        coords = ekfac_materialize(value, layer_type, u_a, u_g)
        if mode == BOTH:
            return coords, coords
        dw = value.to(coords.dtype).reshape(value.shape[0], u_g.shape[0], u_a.shape[0])
        return (u_g.to(dw).T @ dw).reshape(value.shape[0], -1), coords
    f = value.as_batch_first()
    rotated_a, rotated_g = ekfac_rotate_factors(
        f.activation, f.pre_activation_grad, layer_type, u_a, u_g, f.module_kwargs
    )
    coords = materialize(Factorized(rotated_a, rotated_g), layer_type)
    if mode == GRADIENT:
        grad = rotated_g.reshape(f.pre_activation_grad.shape)
        return Factorized(f.activation, grad, f.module_kwargs), coords
    if per_sample and coords.nbytes < rotated_a.nbytes + rotated_g.nbytes:
        return coords, coords
    return Factorized(rotated_a, rotated_g), coords


def precondition_in_eigenbasis(
    coords: torch.Tensor, u_a: torch.Tensor, lam: torch.Tensor, mode: str
) -> torch.Tensor:
    """Query eigen-coordinates ``(B, D·K)`` divided by ``lam``; ``"gradient"``: ``·U_Aᵀ`` too."""
    scaled = ekfac_scale(coords, lam)
    if mode == BOTH:
        return scaled
    k = u_a.shape[0]
    return (scaled.reshape(scaled.shape[0], -1, k) @ u_a.to(scaled).T).reshape(scaled.shape[0], -1)


def _rotate_factors(
    value: Factorized, layer_type: str, u_a: torch.Tensor, u_g: torch.Tensor
) -> bool:
    """Whether the EK-FAC rotation of a factorized layer is cheaper on its factors.

    ``ops.ekfac_rotation_prefers_factors`` with the layer's token count and the
    eigenbasis widths (bias column included).
    """
    _batch, tokens, _k, _d = effective_dims(value, layer_type)
    return ekfac_rotation_prefers_factors(tokens, u_a.shape[0], u_g.shape[0])


class EKFACAttributor(KroneckerAttributor):
    """EK-FAC influence (``algorithm="EKFAC"``): K-FAC eigenbases with corrected eigenvalues.

    The eigenvalue pass rotates each factorized train layer either on its
    factors (``aᵀU_A``, ``U_Gᵀg`` per token, then materialized) or after
    materializing it, whichever costs fewer FLOPs
    (``ops.kronecker.ekfac_rotation_prefers_factors``); both routes give the
    same scores. When the pass plan keeps every training block, that pass
    replaces the kept layers by their rotations and the queries skip (part of)
    the rotation back (see the module; equal scores to float rounding), and so
    does a call that reads such a fit back from ``fit_dir``. ``mode``
    (``"exact"``/``"approx"``, identical scores) is validated and recorded
    with a persisted fit. Tied weights are scored per use site.
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

        The covariances are dropped once their eigenbases are taken, so the
        eigenvalue pass holds the bases only (supplied or recorded covariances
        stay with their owner).

        Under a process group the Λ sums and sample counts are reduced over the
        union of the ranks' layers (``Λ`` = global sum / global count).
        """
        if self.covariances is not None:
            self._check_covering(train_source)
        covariances = self.covariance_pass(train_source, fisher_acc)
        bases = {}
        for name in list(covariances):  # each (A, G) released once its eigenbases are taken
            _, u_a, _, u_g = kfac_eigh(*covariances.pop(name))
            bases[name] = (u_a, u_g)
        del covariances  # not held through the eigenvalue pass
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        def add_squares(name: str, squared: torch.Tensor, samples: int) -> None:
            sums[name] = squared if name not in sums else sums[name] + squared.to(sums[name])
            counts[name] = counts.get(name, 0) + samples

        if not self._rotate_kept(train_source, bases, add_squares):
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

    def _rotate_kept(
        self,
        train_source: GradientSource,
        bases: Bases,
        add_squares: Callable[[str, torch.Tensor, int], None],
    ) -> bool:
        """Rotate the kept blocks for scoring in the eigenbasis, if the plan allows.

        Whether it did (:func:`eigenbasis_mode`); ``add_squares`` receives each
        layer's squared eigen-coordinates.
        """
        per_sample = self._score_granularity == "instance"
        mode = eigenbasis_mode(train_source, bases, per_sample)
        if mode is None:
            return False
        train_source.transform_kept(
            lambda block: rotated_block(block, bases, add_squares, mode, per_sample)
        )
        self._test_eigenbasis_mode = mode
        return True

    def prepare_scoring(self, train_source: GradientSource, test_source: GradientSource) -> None:
        """Base preparation; a fit read back takes the scoring route of the call that wrote it.

        When that call's pass plan kept every training block, a live train
        source keeps its first pass here as well and the kept blocks are
        rotated as that call rotated them, so a repeated call with the fit
        gives the same scores, bit for bit (the model still runs once).
        """
        if self.raw_fit is not None and self._fit_kept_every_block and not self._identity_test:
            self._keep_first_pass(train_source)
        super().prepare_scoring(train_source, test_source)

    def _keep_first_pass(self, train_source: GradientSource) -> None:
        """The first pass of a live planned source (a store keeps nothing), then the rotation."""
        if not isinstance(train_source, KeptPasses) or train_source.budget == 0:
            return
        for _item in train_source:  # keeps the blocks, as the fitting call's covariance pass did
            pass
        bases = {name: (raw["U_A"], raw["U_G"]) for name, raw in self.raw_fit[0].items()}
        self._rotate_kept(train_source, bases, lambda _name, _squared, _samples: None)

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
            value = token_summed_rows(value)
        elif not _rotate_factors(value, layer_type, u_a, u_g):
            value = materialize(value, layer_type)
        device = value.device if isinstance(value, torch.Tensor) else value.activation.device
        try:
            return ekfac_materialize(value, layer_type, u_a.to(device), u_g.to(device))
        except ValueError as error:
            raise layer_error(name, error) from None

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
        if self._test_eigenbasis_mode is not None:  # kept train blocks rotated
            return precondition_in_eigenbasis(coords, u_a, lam, self._test_eigenbasis_mode)
        return ekfac_precondition(coords, u_a, u_g, lam, layer_type)

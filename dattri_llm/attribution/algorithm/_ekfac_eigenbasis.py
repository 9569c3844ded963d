"""EK-FAC scoring in the eigenbasis when the pass plan keeps every training block.

The eigenvalue pass rotates every training sample into the K-FAC eigenbases
(``U_Gᵀ·dW·U_A``). When the plan keeps all first-pass blocks, that pass
replaces each kept layer by a rotation, and the queries skip the matching part
of their rotation back out of the eigenbasis, because

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

Scores equal the rotate-back path's to float rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dattri_llm.attribution.algorithm._kfac_plan import KeptPasses
from dattri_llm.gradient.gradient import Factorized
from dattri_llm.gradient.ops.dot import effective_dims
from dattri_llm.gradient.ops.kronecker import (
    ekfac_materialize,
    ekfac_rotate_factors,
    ekfac_rotation_prefers_factors,
    ekfac_scale,
)
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import is_linear

if TYPE_CHECKING:
    from collections.abc import Callable

    from dattri_llm.gradient.gradient import Gradient
    from dattri_llm.gradient.streaming import GradientSource

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

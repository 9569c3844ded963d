"""EK-FAC scoring in the eigenbasis when the pass plan keeps every training block.

The eigenvalue pass rotates every training sample into the K-FAC eigenbases
(``U_Gᵀ·dW·U_A``). When the plan keeps all first-pass blocks, that pass
replaces each kept layer by its rotation, which has the size of what it
replaces or less: token rows ``a'·U_A``, ``g·U_G`` for a factorized layer
(final factors), or its eigen-coordinates ``(B, D·K)`` when they are smaller and
the scores are per sample (scoring then needs no materialization either); the
eigen-coordinates of a dense ``(B, d)`` layer. The query side is then
divided by the corrected eigenvalues and not rotated back, because

    ⟨U_G·(M/Λ)·U_Aᵀ, dW⟩ = ⟨M/Λ, U_Gᵀ·dW·U_A⟩,

so scores equal the rotate-back path's (to float rounding) and the scoring pass
skips the ``Q·(D²K + DK²)`` rotation of the queries back out of the eigenbasis.
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
)
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import is_linear

if TYPE_CHECKING:
    from collections.abc import Callable

    from dattri_llm.gradient.gradient import Gradient
    from dattri_llm.gradient.streaming import GradientSource

Bases = dict[str, tuple[torch.Tensor, torch.Tensor]]

_EXACT_DTYPES = (torch.float32, torch.float64)


def _rotated_nbytes(
    value: Factorized | torch.Tensor,
    layer_type: str,
    u_a: torch.Tensor,
    u_g: torch.Tensor,
    per_sample: bool,
) -> int | None:
    """Bytes of a layer's rotation as kept, or ``None`` when it is not rotated in place.

    In place: dense ``(B, d)`` rows, and factorized linear layers whose factor
    route is the cheaper rotation; both in float32/float64 (the rotation's
    dtype, so the kept bytes do not grow from 16-bit captures). A factorized
    layer is kept as the smaller of its rotated factors and, for
    ``per_sample`` scores, its eigen-coordinates.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 2 or value.dtype not in _EXACT_DTYPES:
            return None
        return value.shape[0] * u_a.shape[0] * u_g.shape[0] * value.element_size()
    dtypes = {value.activation.dtype, value.pre_activation_grad.dtype}
    if not is_linear(layer_type) or len(dtypes) != 1 or not dtypes <= set(_EXACT_DTYPES):
        return None
    batch, tokens, _k, _d = effective_dims(value, layer_type)
    k, d = u_a.shape[0], u_g.shape[0]
    if not ekfac_rotation_prefers_factors(tokens, k, d):
        return None
    kept = min(tokens * (k + d), k * d) if per_sample else tokens * (k + d)
    return batch * kept * value.activation.element_size()


def rotates_kept_blocks(train_source: GradientSource, bases: Bases, per_sample: bool) -> bool:
    """Whether the eigenvalue pass can rotate the kept blocks in place.

    The plan must keep every block, every fitted layer of every block must be
    rotatable in place (:func:`_rotated_nbytes`), and the rotated blocks must
    fit the plan's budget.
    """
    if not isinstance(train_source, KeptPasses) or not train_source.keeps_every_block:
        return False
    total = 0
    for block in train_source.kept_blocks():
        for name, value in block.data.items():
            if name not in bases:
                total += value.nbytes
                continue
            size = _rotated_nbytes(value, block.layer_types[name], *bases[name], per_sample)
            if size is None:
                return False
            total += size
    return total <= train_source.budget


def rotated_block(
    block: Gradient,
    bases: Bases,
    add_squares: Callable[[str, torch.Tensor, int], None],
    per_sample: bool,
) -> Gradient:
    """``block`` with every fitted layer rotated into its eigenbasis (consumes ``block``).

    A factorized layer is kept as eigen-coordinates instead of rotated factors
    when ``per_sample`` and they are smaller (as :func:`rotates_kept_blocks` sized it).

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
            if isinstance(value, torch.Tensor):
                rotated = ekfac_materialize(value, layer_type, u_a, u_g)
                coords = rotated
            else:
                f = value.as_batch_first()
                rotated = Factorized(
                    *ekfac_rotate_factors(
                        f.activation, f.pre_activation_grad, layer_type, u_a, u_g,
                        f.module_kwargs,
                    )
                )  # fmt: skip
                coords = materialize(rotated, layer_type)
                if per_sample and coords.nbytes < rotated.nbytes:
                    rotated = coords
        except ValueError as error:
            raise ValueError(f"layer {name!r}: {error}") from None
        add_squares(name, coords.square().sum(dim=0), coords.shape[0])
        return rotated

    return block.map_layers(rotate, consume=True)

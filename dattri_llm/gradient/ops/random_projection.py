"""The built-in projector factory, `random_project`: a deterministic CPU construction.

It follows dattri's ``random_project`` protocol (see :mod:`dattri_llm.gradient.ops.projection`)
and is the default factory when ``dattri`` is not installed. Its ``(d_in, proj_dim)`` map is
generated in float32 on CPU from ``torch.Generator`` s seeded by ``(proj_seed, d_in,
proj_dim, row block)``, so it is the same on every device, process, step and rank.
``proj_type`` is ``"normal"``, ``"rademacher"``, ``"sjlt"`` or ``"grass"``. This module
also holds the seed folding (`_mix_seed`) that the masks share.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

_SEED_MOD_MASK = 2**63 - 1
_SEED_MULTIPLIER = 1_000_003

_BUILTIN_PROJ_TYPES = ("normal", "rademacher", "sjlt", "grass")
_BUILTIN_ROW_BLOCK = 1024


def _mix_seed(*parts: int) -> int:
    """Fold integers into one 63-bit seed: ``s ← (s·1_000_003 + p) & (2⁶³−1)``."""
    seed = 0
    for part in parts:
        seed = (seed * _SEED_MULTIPLIER + int(part)) & _SEED_MOD_MASK
    return seed


def _check_proj_dim(proj_dim: object, where: str) -> int:
    if isinstance(proj_dim, bool) or not isinstance(proj_dim, int) or proj_dim < 1:
        raise ValueError(f"{where}: proj_dim must be a positive int, got {proj_dim!r}.")
    return proj_dim


@functools.lru_cache(maxsize=32)
def _grass_selection(proj_seed: int, d_in: int, proj_dim: int, mask_dim: int) -> torch.Tensor:
    """Sorted ``(mask_dim,)`` input coordinates kept by the GraSS sparsifier."""
    gen = torch.Generator().manual_seed(_mix_seed(proj_seed, d_in, proj_dim, mask_dim, 1))
    return torch.randperm(d_in, generator=gen)[:mask_dim].sort().values


def _sjlt_rows(gen: torch.Generator, rows: int, proj_dim: int, sjlt_c: int) -> torch.Tensor:
    """``(rows, proj_dim)`` sparse JL rows: ``sjlt_c`` signed entries ``±1/√c`` per row.

    Block construction (Kane & Nelson): the output axis is split into
    ``sjlt_c`` contiguous blocks and each row picks one bucket per block, so
    the ``c`` buckets of a row are distinct.
    """
    bounds = torch.tensor([j * proj_dim // sjlt_c for j in range(sjlt_c + 1)])
    widths = bounds[1:] - bounds[:-1]
    offsets = bounds[:-1]
    picks = (torch.rand(rows, sjlt_c, generator=gen) * widths).long()
    buckets = torch.minimum(picks, widths - 1) + offsets
    signs = torch.randint(0, 2, (rows, sjlt_c), generator=gen, dtype=torch.float32) * 2 - 1
    out = torch.zeros(rows, proj_dim)
    return out.scatter_(1, buckets, signs / math.sqrt(sjlt_c))


def _builtin_rows(
    start: int,
    stop: int,
    *,
    d_in: int,
    proj_dim: int,
    proj_seed: int,
    proj_type: str,
    sjlt_c: int,
    grass_mask_dim: int,
) -> torch.Tensor:
    """Rows ``start:stop`` (one aligned block) of the built-in ``(d_in, proj_dim)`` map.

    Float32 on CPU, from a generator seeded by ``(proj_seed, d_in, proj_dim, block)``.
    """
    block = start // _BUILTIN_ROW_BLOCK
    rows = stop - start
    gen = torch.Generator().manual_seed(_mix_seed(proj_seed, d_in, proj_dim, block, 0))
    if proj_type == "normal":
        return torch.randn(rows, proj_dim, generator=gen) / math.sqrt(proj_dim)
    if proj_type == "rademacher":
        signs = torch.randint(0, 2, (rows, proj_dim), generator=gen, dtype=torch.float32)
        return (signs * 2 - 1) / math.sqrt(proj_dim)
    out = _sjlt_rows(gen, rows, proj_dim, sjlt_c)
    if proj_type == "sjlt":
        return out
    kept = _grass_selection(proj_seed, d_in, proj_dim, grass_mask_dim)
    coords = torch.arange(start, stop)
    pos = torch.searchsorted(kept, coords).clamp_max(kept.numel() - 1)
    selected = kept[pos] == coords
    return out * selected.unsqueeze(1) * math.sqrt(d_in / grass_mask_dim)


def random_project(
    feature: torch.Tensor,
    feature_batch_size: int,
    proj_dim: int,
    proj_max_batch_size: int | None = None,
    device: torch.device | str = "cpu",
    proj_seed: int = 0,
    *,
    proj_type: str = "normal",
    sjlt_c: int = 1,
    grass_mask_dim: int | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Built-in projector factory (dattri ``random_project`` protocol), deterministic on CPU.

    ``feature`` is a sample ``(n, d_in)`` batch fixing ``d_in``; the returned
    callable maps ``(n, d_in)`` features to ``(n, proj_dim)`` on ``device``
    (in the features' dtype). The ``(d_in, proj_dim)`` map is generated in
    float32 on CPU by ``torch.Generator`` s seeded from ``(proj_seed, d_in,
    proj_dim)``, one per block of 1024 input rows, so it is identical across
    devices, processes, steps and ranks; only blocks touched by non-zero input
    columns are generated.

    ``proj_type``:

    * ``"normal"``: i.i.d. ``N(0, 1/proj_dim)`` entries;
    * ``"rademacher"``: i.i.d. ``±1/√proj_dim`` entries;
    * ``"sjlt"``: sparse JL transform, each input coordinate hashed to
      ``sjlt_c`` distinct buckets with random signs, entries ``±1/√sjlt_c``
      (default ``sjlt_c=1``, a CountSketch, as in GraSS);
    * ``"grass"``: GraSS sparsify-then-project — a fixed random subset of
      ``grass_mask_dim`` input coordinates (default ``min(4·proj_dim, d_in)``),
      rescaled by ``√(d_in/grass_mask_dim)`` so norms are preserved in
      expectation, then the ``"sjlt"`` map.

    All maps preserve squared norms and inner products in expectation.
    ``feature_batch_size`` and ``proj_max_batch_size`` are accepted for
    protocol compatibility and ignored.
    """
    if not isinstance(feature, torch.Tensor) or feature.ndim != 2:
        raise TypeError(
            "random_project: feature must be a (n, d_in) tensor, got "
            f"{type(feature).__name__}{tuple(getattr(feature, 'shape', ()))}; flatten "
            "per-sample features to rows first."
        )
    d_in = feature.shape[-1]
    _check_proj_dim(proj_dim, "random_project")
    if proj_type not in _BUILTIN_PROJ_TYPES:
        raise ValueError(
            f"random_project: unknown proj_type {proj_type!r}; it must be one of "
            f"{_BUILTIN_PROJ_TYPES}."
        )
    if not 1 <= sjlt_c <= proj_dim:
        raise ValueError(
            f"random_project: sjlt_c must be in [1, proj_dim={proj_dim}], got {sjlt_c}."
        )
    mask_dim = min(4 * proj_dim, d_in) if grass_mask_dim is None else grass_mask_dim
    if proj_type == "grass" and not 1 <= mask_dim <= d_in:
        raise ValueError(
            f"random_project: grass_mask_dim must be in [1, d_in={d_in}], got {mask_dim}."
        )
    target = torch.device(device)
    rows_of = functools.partial(
        _builtin_rows,
        d_in=d_in,
        proj_dim=proj_dim,
        proj_seed=int(proj_seed),
        proj_type=proj_type,
        sjlt_c=sjlt_c,
        grass_mask_dim=mask_dim,
    )

    def project(features: torch.Tensor) -> torch.Tensor:
        if features.ndim != 2 or features.shape[1] != d_in:
            raise ValueError(
                f"random_project: expected features (n, {d_in}), got {tuple(features.shape)}."
            )
        features = features.to(target)
        used_columns = features.ne(0).any(dim=0).cpu()
        out = features.new_zeros(features.shape[0], proj_dim)
        for start in range(0, d_in, _BUILTIN_ROW_BLOCK):
            stop = min(start + _BUILTIN_ROW_BLOCK, d_in)
            if not bool(used_columns[start:stop].any()):
                continue
            block = rows_of(start, stop).to(device=target, dtype=features.dtype)
            out += features[:, start:stop] @ block
        return out

    return project


# Stores record the factory by this name (``module.qualname``): its public path.
random_project.__module__ = "dattri_llm.gradient.ops.projection"

"""Random projection and coordinate masking of per-sample gradients.

Three styles (`PROJECTION_STYLES`) reduce one layer's per-sample gradient:

* ``"logra"`` — project the preprocessed output-gradient factor with seed
  ``proj_seed`` and the input factor with seed ``proj_seed + 1``; the gradient
  stays the outer product of the projected factors (row-major ``(k_g, k_a)``
  when materialized). Linear, conv, conv-transpose and embedding layers.
* ``"dense"`` — materialize ``(B, d)`` and project with one ``(d, proj_dim)``
  matrix.
* ``"mask"`` — keep ``proj_dim`` fixed coordinates of the flattened gradient,
  gathered exactly from the factors without forming the full gradient.

A projection matrix is obtained by pushing identity rows through a projector
factory following dattri's ``random_project`` protocol::

    factory(features, feature_batch_size, proj_dim=..., proj_seed=..., device=..., **kw)
        -> callable mapping (n, d_in) features to (n, proj_dim)

and is cached per `DattriProjector`. ``DattriProjector(None)`` resolves the
factory lazily to ``dattri.func.projection.random_project`` when the
``attribution`` extra (``dattri``) is importable, and otherwise to the built-in
`random_project` of this module, so the default works with the core install.
The two factories give different matrices for the same seed: gradients that
are compared must be projected with the same factory (and device type).

The built-in `random_project` is a deterministic CPU construction (seeded
``torch.Generator``, independent of device, process, step and rank) with
``proj_type`` in ``"normal"``, ``"rademacher"``, ``"sjlt"`` and ``"grass"``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.materialize import check_token_ids, materialize_factors
from dattri_llm.gradient.ops.preprocess import check_layer_type, preprocess_factors
from dattri_llm.gradient.ops.types import (
    is_conv_transpose,
    is_embedding,
    is_linear,
    is_norm,
)
from dattri_llm.utils.cache import TensorCache

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import Factorized

PROJECTION_STYLES = ("logra", "dense", "mask")
CAPTURE_STYLES = ("factorized", "materialized", "auto")
MASK_KEYS = frozenset({"style", "proj_dim", "proj_seed", "include_bias", "device"})

_IDENTITY_CHUNK_ROWS = 8192
# Identity chunks are capped at this many float32 elements (512 MiB) so that
# building the matrix of a very wide input cannot exhaust memory.
_IDENTITY_CHUNK_ELEMENTS = 2**27
_SEED_MOD_MASK = 2**63 - 1
_SEED_MULTIPLIER = 1_000_003
# Output elements per chunk of the mask gather (bounds the (B, S, chunk) temporaries), and
# per sample chunk of the materialize-then-index mask route (bounds the (b, D·K) block).
_MASK_GATHER_ELEMENTS = 2**24
# Mask routing constants, measured on CPU (one thread, float32): one gathered multiply-add
# (`_gather_outer`) costs about as much as 300 multiply-adds of the token-contracting GEMM
# and as 20 element writes of the materialized block.
_MASK_GEMM_SPEEDUP = 300.0
_MASK_WRITE_SPEEDUP = 20.0

_BUILTIN_PROJ_TYPES = ("normal", "rademacher", "sjlt", "grass")
_BUILTIN_ROW_BLOCK = 1024


def _mix_seed(*parts: int) -> int:
    """Fold integers into one 63-bit seed: ``s ← (s·1_000_003 + p) & (2⁶³−1)``."""
    seed = 0
    for part in parts:
        seed = (seed * _SEED_MULTIPLIER + int(part)) & _SEED_MOD_MASK
    return seed


def _canonical_device(device: torch.device | str) -> torch.device:
    """``torch.device`` with the current CUDA index filled in (``"cuda"`` → ``"cuda:<i>"``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_proj_dim(proj_dim: object, where: str) -> int:
    if isinstance(proj_dim, bool) or not isinstance(proj_dim, int) or proj_dim < 1:
        raise ValueError(f"{where}: proj_dim must be a positive int, got {proj_dim!r}.")
    return proj_dim


# =========================================================================== built-in factory


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


def _default_factory() -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
    """dattri's ``random_project`` when importable, else the built-in `random_project`."""
    try:
        from dattri.func.projection import random_project as dattri_random_project
    except ImportError:
        return random_project
    return dattri_random_project


# =========================================================================== projector


def _freeze(value: Any) -> Any:
    """Hashable stand-in for a kwarg value (lists/dicts → tuples, else ``repr``)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


class ProjectionMatrix:
    """A resolved projection: ``x @ matrix (+ bias_row)`` over the last axis.

    ``matrix`` is the ``(d_in [+1], proj_dim)`` map; with ``include_bias`` its
    last row is split off as ``bias_row`` (equivalent to projecting ``[x, 1]``).
    """

    __slots__ = ("matrix", "bias_row", "d_in", "dtype", "device", "proj_dim")

    def __init__(
        self,
        matrix: torch.Tensor,
        include_bias: bool,
        d_in: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        rows = d_in + int(bool(include_bias))
        if matrix.ndim != 2 or matrix.shape[0] != rows:
            raise ValueError(
                f"ProjectionMatrix: expected a ({rows}, proj_dim) matrix for d_in={d_in}, "
                f"include_bias={include_bias}, got {tuple(matrix.shape)}."
            )
        self.device = _canonical_device(device)
        self.dtype = dtype
        full = matrix.to(device=self.device, dtype=dtype)
        self.matrix = full[:d_in]
        self.bias_row = full[d_in] if include_bias else None
        self.d_in = d_in
        self.proj_dim = full.shape[1]

    def matches(self, x: torch.Tensor) -> bool:
        """Whether ``x`` has this map's input width, dtype and device."""
        return x.shape[-1] == self.d_in and x.dtype == self.dtype and x.device == self.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``x : (..., d_in)`` → ``(..., proj_dim)``.

        ``x`` is moved/cast to this map's device and dtype first.
        """
        if x.ndim == 0 or x.shape[-1] != self.d_in:
            raise ValueError(
                f"ProjectionMatrix: input of shape {tuple(x.shape)} does not end in "
                f"d_in={self.d_in}; resolve a matrix for width {x.shape[-1] if x.ndim else 0}."
            )
        x = x.to(device=self.device, dtype=self.dtype)
        out = x.reshape(-1, self.d_in) @ self.matrix
        if self.bias_row is not None:
            out = out + self.bias_row
        return out.reshape(*x.shape[:-1], self.proj_dim)

    def __repr__(self) -> str:
        """Shape, bias, dtype and device."""
        return (
            f"ProjectionMatrix(d_in={self.d_in}, proj_dim={self.proj_dim}, "
            f"bias={self.bias_row is not None}, dtype={self.dtype}, device={self.device})"
        )


class DattriProjector:
    """A projector factory plus a `TensorCache` of the matrices and masks it built.

    Args:
        projector: factory following dattri's ``random_project`` protocol (see
            module docstring); ``None`` resolves lazily to dattri's
            ``random_project`` when installed, else to the built-in
            `random_project`.
        cache: where built matrices/masks are kept (default: a private
            ``"memory"`` `TensorCache`).

    Reuse one instance to reuse its matrices: every `coerce` of a bare factory
    starts with an empty cache. Context manager; `close` on exit.
    """

    def __init__(
        self,
        projector: Callable[..., Callable[[torch.Tensor], torch.Tensor]] | None = None,
        *,
        cache: TensorCache | None = None,
    ) -> None:
        if projector is not None and not callable(projector):
            raise TypeError(
                f"DattriProjector: projector must be a factory callable or None, got "
                f"{type(projector).__name__}."
            )
        self._factory = projector
        self._cache = cache if cache is not None else TensorCache("memory")

    @classmethod
    def coerce(cls, projector: DattriProjector | Callable | None) -> DattriProjector:
        """``projector`` itself if it is a `DattriProjector`, else a new one wrapping it."""
        return projector if isinstance(projector, DattriProjector) else cls(projector)

    @property
    def factory(self) -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
        """The projector factory (resolved on first access when constructed with ``None``)."""
        if self._factory is None:
            self._factory = _default_factory()
        return self._factory

    @property
    def cache(self) -> TensorCache:
        """The cache of built matrices and masks."""
        return self._cache

    def matrix(
        self,
        d_in: int,
        *,
        proj_dim: int,
        proj_seed: int,
        device: torch.device | str,
        dtype: torch.dtype,
        **proj_kwargs: Any,
    ) -> torch.Tensor:
        """The ``(d_in, proj_dim)`` matrix of the seeded map, in ``dtype`` on ``device``.

        Built by pushing float32 identity rows (chunks of 8192 rows, fewer for
        inputs wider than 16384 so a chunk stays under 512 MiB) through the
        factory, then cast and cached by ``(factory identity, d_in, proj_dim,
        proj_seed, device, dtype, kwargs)``.
        """
        _check_proj_dim(proj_dim, "DattriProjector.matrix")
        if d_in < 1:
            raise ValueError(f"DattriProjector.matrix: d_in must be >= 1, got {d_in}.")
        device = _canonical_device(device)
        factory = self.factory
        key = (
            "matrix",
            id(factory),
            d_in,
            proj_dim,
            int(proj_seed),
            str(device),
            dtype,
            _freeze(proj_kwargs),
        )

        def build() -> torch.Tensor:
            return self._build_matrix(factory, d_in, proj_dim, proj_seed, device, **proj_kwargs)

        matrix = self._cache.get_or_compute(key, lambda: build().to(dtype))
        return matrix.to(device)

    @staticmethod
    def _build_matrix(
        factory: Callable,
        d_in: int,
        proj_dim: int,
        proj_seed: int,
        device: torch.device,
        **proj_kwargs: Any,
    ) -> torch.Tensor:
        chunk = max(1, min(_IDENTITY_CHUNK_ROWS, _IDENTITY_CHUNK_ELEMENTS // d_in))
        blocks = []
        for start in range(0, d_in, chunk):
            rows = min(chunk, d_in - start)
            eye = torch.zeros(rows, d_in, dtype=torch.float32, device=device)
            eye[
                torch.arange(rows, device=device), torch.arange(start, start + rows, device=device)
            ] = 1.0
            fn = factory(
                eye, rows, proj_dim=proj_dim, proj_seed=proj_seed, device=device, **proj_kwargs
            )
            out = fn(eye)
            if tuple(out.shape) != (rows, proj_dim):
                raise ValueError(
                    f"DattriProjector: factory {getattr(factory, '__name__', factory)!r} mapped "
                    f"({rows}, {d_in}) features to {tuple(out.shape)}, expected "
                    f"({rows}, {proj_dim}); it must follow dattri's random_project protocol."
                )
            blocks.append(out.to(device=device, dtype=torch.float32))
        return torch.cat(blocks)

    def mask_indices(
        self, d: int, *, proj_dim: int, proj_seed: int, device: torch.device | str
    ) -> torch.Tensor:
        """Sorted ``(proj_dim,)`` long coordinates of a width-``d`` mask (see module docs).

        First ``proj_dim`` entries of ``torch.randperm(d)`` drawn from a CPU
        generator seeded with ``((proj_seed·1_000_003 + d)·1_000_003 + proj_dim)
        & (2⁶³−1)``, sorted. Requires ``0 < proj_dim <= d``.
        """
        if isinstance(proj_dim, bool) or not isinstance(proj_dim, int) or not 0 < proj_dim <= d:
            raise ValueError(
                f"mask: proj_dim must satisfy 0 < proj_dim <= d (the layer's flattened gradient "
                f"width {d}), got proj_dim={proj_dim!r}; choose a smaller proj_dim."
            )
        device = _canonical_device(device)
        key = ("mask", d, proj_dim, int(proj_seed), str(device))

        def build() -> torch.Tensor:
            gen = torch.Generator().manual_seed(_mix_seed(proj_seed, d, proj_dim))
            idx = torch.randperm(d, generator=gen)[:proj_dim].sort().values
            return idx.to(device)

        return self._cache.get_or_compute(key, build).to(device)

    def resolve(
        self,
        d_in: int,
        *,
        proj_dim: int,
        proj_seed: int = 0,
        include_bias: bool = False,
        device: torch.device | str,
        dtype: torch.dtype,
        **proj_kwargs: Any,
    ) -> ProjectionMatrix:
        """The `ProjectionMatrix` for width ``d_in`` (``include_bias`` adds the bias row)."""
        rows = d_in + int(bool(include_bias))
        matrix = self.matrix(
            rows, proj_dim=proj_dim, proj_seed=proj_seed, device=device, dtype=dtype, **proj_kwargs
        )
        return ProjectionMatrix(matrix, include_bias, d_in, dtype, device)

    def apply(
        self,
        x: torch.Tensor,
        *,
        proj_dim: int,
        proj_seed: int = 0,
        include_bias: bool = False,
        **proj_kwargs: Any,
    ) -> torch.Tensor:
        """Project ``x : (..., d_in)`` → ``(..., proj_dim)`` with the seeded map.

        Integer input is converted to float first, at least float32 so that
        values above 256 stay exact (up to 2²⁴) under a forced 16-bit compute
        policy; the result is then cast to the policy dtype (`ops.as_float`'s).
        A ``device`` kwarg selects where the projection runs (and where the
        result stays), default ``x.device``. ``include_bias`` projects ``[x, 1]``.
        """
        if x.ndim == 0:
            raise ValueError("DattriProjector.apply: cannot project a 0-d tensor.")
        device = _canonical_device(proj_kwargs.pop("device", None) or x.device)
        result_dtype = x.dtype
        if not x.is_floating_point():
            result_dtype = dtypes.resolve(x)
            (x,) = dtypes.as_float(x, minimum=torch.float32)
        x = x.to(device)
        proj = self.resolve(
            x.shape[-1],
            proj_dim=proj_dim,
            proj_seed=proj_seed,
            include_bias=include_bias,
            device=device,
            dtype=x.dtype,
            **proj_kwargs,
        )
        return proj(x).to(result_dtype)

    def clear(self) -> None:
        """Drop every cached matrix and mask."""
        self._cache.clear()

    def close(self) -> None:
        """Drop cached matrices (the projector stays usable)."""
        self._cache.clear()

    def __enter__(self) -> DattriProjector:
        """Return ``self``."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """`close` on exit."""
        self.close()

    def __repr__(self) -> str:
        """Factory name and number of cached entries."""
        name = "default" if self._factory is None else getattr(self._factory, "__name__", "?")
        return f"DattriProjector(factory={name}, cached={len(self._cache)})"


def apply_projection(
    projector: DattriProjector | Callable | None,
    x: torch.Tensor,
    *,
    proj_dim: int,
    proj_seed: int = 0,
    include_bias: bool = False,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """``DattriProjector.coerce(projector).apply(x, ...)``: ``(..., d)`` → ``(..., proj_dim)``."""
    return DattriProjector.coerce(projector).apply(
        x, proj_dim=proj_dim, proj_seed=proj_seed, include_bias=include_bias, **proj_kwargs
    )


# =========================================================================== logra


def _fold_positions(x: torch.Tensor) -> torch.Tensor:
    """``(B, *positions, K)`` with >1 position axis → ``(B, S, K)``; 2-D/3-D unchanged."""
    return x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim > 3 else x


def _require_linear(layer_type: str, fn: str) -> None:
    if not is_linear(layer_type):
        raise ValueError(
            f"{fn}: layer type {layer_type!r} is not a linear type; one-sided factor projection "
            "applies to linear layers only. Use project_factors for conv, conv-transpose and "
            "embedding layers."
        )


def _has_bias(module_kwargs: dict | None, include_bias: bool) -> bool:
    return bool(include_bias and module_kwargs is not None and module_kwargs.get("has_bias"))


def project_activation(
    a: torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    module_kwargs: dict | None,
    include_bias: bool = True,
    *,
    proj_dim: int,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """A-side ``"logra"`` projection of a linear layer's input ``(B, [T,] D_in)`` → ``(B, [T,] k)``.

    Seed ``proj_seed + 1``; the bias (``module_kwargs["has_bias"]`` and
    ``include_bias``) is folded in through the bias row, exactly as projecting
    ``[a, 1]``. Extra position axes are folded into one, as in preprocessing.
    """
    _require_linear(layer_type, "project_activation")
    (a,) = dtypes.align(_fold_positions(a))
    return apply_projection(
        projector,
        a,
        proj_dim=proj_dim,
        proj_seed=proj_seed + 1,
        include_bias=_has_bias(module_kwargs, include_bias),
        **proj_kwargs,
    )


def project_gradient(
    g: torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    module_kwargs: dict | None,
    *,
    proj_dim: int,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """G-side ``"logra"`` projection of a linear layer's output gradient → ``(B, [T,] k)``.

    Seed ``proj_seed``; extra position axes are folded into one.
    """
    _require_linear(layer_type, "project_gradient")
    (g,) = dtypes.align(_fold_positions(g))
    return apply_projection(projector, g, proj_dim=proj_dim, proj_seed=proj_seed, **proj_kwargs)


def _norm_logra_error(layer_type: str) -> ValueError:
    return ValueError(
        f"'logra' (factor) projection is not defined for normalization layer type "
        f"{layer_type!r}: its gradient is an elementwise product of the factors, not an outer "
        "product. Use style 'dense' or 'mask' for this layer."
    )


def _embedding_kwargs(module_kwargs: dict | None, layer_type: str, fn: str) -> int:
    if module_kwargs is None or "num_embeddings" not in module_kwargs:
        raise ValueError(
            f"{fn}: layer type {layer_type!r} needs module_kwargs with 'num_embeddings' "
            "(ids are expanded to one-hot of that width); pass "
            "ops.extract_module_kwargs(module, layer_type)."
        )
    return int(module_kwargs["num_embeddings"])


def _project_embedding(
    a: torch.Tensor,
    g: torch.Tensor,
    layer_type: str,
    projector: DattriProjector,
    module_kwargs: dict | None,
    proj_dim: int,
    proj_seed: int,
    proj_kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding logra: one-hot ids ``(B, T, V)`` @ P_a is the row gather ``P_a[ids]``."""
    vocab = _embedding_kwargs(module_kwargs, layer_type, "project_factors")
    ids, g = preprocess_factors(a, g, layer_type, module_kwargs, include_bias=False)
    check_token_ids(ids, vocab, layer_type)
    device = _canonical_device(proj_kwargs.pop("device", None) or g.device)
    g = g.to(device)
    p_a = projector.matrix(
        vocab,
        proj_dim=proj_dim,
        proj_seed=proj_seed + 1,
        device=device,
        dtype=g.dtype,
        **proj_kwargs,
    )
    a_p = p_a[ids.to(device)]
    g_p = projector.apply(g, proj_dim=proj_dim, proj_seed=proj_seed, **proj_kwargs)
    return a_p, g_p


def project_factors(
    a: torch.Tensor,
    g: torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
    *,
    proj_dim: int,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``"logra"`` projection of batch-first factors → final ``(a_p, g_p)``, ``(B, S, k)`` each.

    The factors are preprocessed; ``g'`` is projected with seed ``proj_seed``
    and ``a'`` with ``proj_seed + 1`` along the last axis. Linear factors keep
    a 2-D ``(B, k)`` shape; the bias is folded through the bias row (so this
    equals `project_activation` ∘ `project_gradient` exactly). Embedding ids
    are expanded to one-hot of width ``num_embeddings`` (needs
    ``module_kwargs``). Norm layers raise ``ValueError``.
    """
    check_layer_type(layer_type)
    if is_norm(layer_type):
        raise _norm_logra_error(layer_type)
    projector = DattriProjector.coerce(projector)
    proj_dim = _check_proj_dim(proj_dim, f"project_factors({layer_type})")
    if is_embedding(layer_type):
        return _project_embedding(
            a, g, layer_type, projector, module_kwargs, proj_dim, proj_seed, dict(proj_kwargs)
        )
    if is_linear(layer_type):
        if a.shape[:-1] != g.shape[:-1]:
            raise ValueError(
                f"project_factors({layer_type}): factors a {tuple(a.shape)} and g "
                f"{tuple(g.shape)} must agree on all but the last axis."
            )
        common = {"proj_dim": proj_dim, "proj_seed": proj_seed, **proj_kwargs}
        a_p = project_activation(a, layer_type, projector, module_kwargs, include_bias, **common)
        g_p = project_gradient(g, layer_type, projector, module_kwargs, **common)
        return a_p, g_p
    a, g = preprocess_factors(a, g, layer_type, module_kwargs, include_bias)
    a_p = projector.apply(a, proj_dim=proj_dim, proj_seed=proj_seed + 1, **proj_kwargs)
    g_p = projector.apply(g, proj_dim=proj_dim, proj_seed=proj_seed, **proj_kwargs)
    return a_p, g_p


def project_factorized(
    f: Factorized,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    *,
    proj_dim: int,
    include_bias: bool = True,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`project_factors` on a ``Factorized`` (made batch-first, its ``module_kwargs``)."""
    f = f.as_batch_first()
    return project_factors(
        f.activation,
        f.pre_activation_grad,
        layer_type,
        projector,
        f.module_kwargs,
        include_bias,
        proj_dim=proj_dim,
        proj_seed=proj_seed,
        **proj_kwargs,
    )


# =========================================================================== dense


def project_materialized_factors(
    a: torch.Tensor,
    g: torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
    *,
    proj_dim: int,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """``"dense"``: materialize ``(B, d)``, then one ``(d, proj_dim)`` map → ``(B, proj_dim)``."""
    _check_proj_dim(proj_dim, f"project_materialized_factors({layer_type})")
    dense = materialize_factors(a, g, layer_type, module_kwargs, include_bias)
    return apply_projection(projector, dense, proj_dim=proj_dim, proj_seed=proj_seed, **proj_kwargs)


def project_materialized(
    f: Factorized | torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    *,
    proj_dim: int,
    include_bias: bool = True,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """``"dense"`` projection of a ``Factorized``, or of a dense tensor along its last axis."""
    if isinstance(f, torch.Tensor):
        return apply_projection(projector, f, proj_dim=proj_dim, proj_seed=proj_seed, **proj_kwargs)
    f = f.as_batch_first()
    return project_materialized_factors(
        f.activation,
        f.pre_activation_grad,
        layer_type,
        projector,
        f.module_kwargs,
        include_bias,
        proj_dim=proj_dim,
        proj_seed=proj_seed,
        **proj_kwargs,
    )


# =========================================================================== mask


def _check_mask_kwargs(proj_kwargs: dict, where: str) -> None:
    extra = sorted(set(proj_kwargs) - MASK_KEYS)
    if extra:
        raise ValueError(
            f"{where}: style 'mask' accepts only {sorted(MASK_KEYS)}, got extra keys {extra}; "
            "a mask keeps exact coordinates and uses no projector, so remove them (or use "
            "style 'dense')."
        )
    style = proj_kwargs.get("style", "mask")
    if style != "mask":
        raise ValueError(f"{where}: got style={style!r} in a mask call; use style 'mask'.")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sum 16-bit products in float32; wider dtypes in themselves."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def _gather_outer(
    a: torch.Tensor, g: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """``out[b, j] = Σ_s g[b, s, rows_j] · a[b, s, cols_j]`` without forming ``g ⊗ a``.

    ``a : (B, S, K)``, ``g : (B, S, D)`` → ``(B, P)``; chunked over ``P`` to
    bound the ``(B, S, chunk)`` temporaries; 16-bit inputs accumulate in float32.
    """
    batch, tokens = a.shape[0], a.shape[1]
    accumulate = _accumulation_dtype(a.dtype)
    chunk = max(1, _MASK_GATHER_ELEMENTS // max(1, batch * tokens))
    parts = []
    for start in range(0, rows.numel(), chunk):
        r, c = rows[start : start + chunk], cols[start : start + chunk]
        parts.append((g[:, :, r] * a[:, :, c]).sum(dim=1, dtype=accumulate))
    return torch.cat(parts, dim=1).to(a.dtype)


def _prefers_materialized_mask(tokens: int, width: int, proj_dim: int, gemm: bool) -> bool:
    """Whether reading ``proj_dim`` of a layer's ``width`` coordinates is cheaper materialized.

    Per sample, gathering costs ``tokens·proj_dim`` gathered multiply-adds; materializing
    then indexing costs ``tokens·width`` GEMM multiply-adds (``gemm``: outer-family layers;
    an embedding scatter-adds ``tokens·E`` entries instead, counted in ``width`` by the
    caller) plus ``width + proj_dim`` element writes, each scaled to gathered multiply-adds
    by the measured `_MASK_GEMM_SPEEDUP` / `_MASK_WRITE_SPEEDUP`. Ties go to materializing.
    """
    cost_gather = tokens * proj_dim
    cost_materialize = (width + proj_dim) / _MASK_WRITE_SPEEDUP
    if gemm:
        cost_materialize += tokens * width / _MASK_GEMM_SPEEDUP
    return cost_gather >= cost_materialize


def _sample_chunks(batch: int, width: int) -> list[slice]:
    """Sample slices whose ``(chunk, width)`` dense blocks stay within ``_MASK_GATHER_ELEMENTS``."""
    step = max(1, _MASK_GATHER_ELEMENTS // max(1, width))
    return [slice(start, start + step) for start in range(0, batch, step)]


def _materialized_outer_entries(
    a: torch.Tensor, g: torch.Tensor, idx: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """``idx`` entries of ``Σ_s g_sᵀ a_s`` (``transposed``: ``Σ_s a_sᵀ g_s``) → ``(B, P)``.

    ``a : (B, S, K)``, ``g : (B, S, D)``; samples are materialized in chunks (one GEMM
    each, 16-bit inputs in float32) and indexed, so the dense block stays bounded.
    """
    accumulate = _accumulation_dtype(a.dtype)
    left, right = (a, g) if transposed else (g, a)
    parts = []
    for rows in _sample_chunks(a.shape[0], left.shape[-1] * right.shape[-1]):
        dense = torch.bmm(left[rows].transpose(1, 2).to(accumulate), right[rows].to(accumulate))
        parts.append(dense.reshape(dense.shape[0], -1)[:, idx].to(a.dtype))
    return torch.cat(parts)


def _mask_embedding(
    a: torch.Tensor,
    g: torch.Tensor,
    layer_type: str,
    module_kwargs: dict | None,
    idx_of: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """Entries ``dW[b, v, e] = Σ_t [ids[b,t] = v] · g[b, t, e]`` at the masked ``(v, e)``.

    Routed by `_prefers_materialized_mask`: scatter-add sample chunks into
    ``(chunk, V·E)`` and index them, or match token ids per kept coordinate
    (chunked over the coordinates; 16-bit inputs accumulate in float32).
    """
    vocab = _embedding_kwargs(module_kwargs, layer_type, "mask_factors")
    ids, g = preprocess_factors(a, g, layer_type, module_kwargs, include_bias=False)
    check_token_ids(ids, vocab, layer_type)
    (g,) = dtypes.align(g)
    width = g.shape[-1]
    idx = idx_of(vocab * width)
    tokens = ids[0].numel() if ids.shape[0] else 0
    if _prefers_materialized_mask(tokens, vocab * width + tokens * width, idx.numel(), False):
        return _materialized_embedding_entries(ids, g, vocab, idx)
    rows, cols = idx // width, idx % width
    accumulate = _accumulation_dtype(g.dtype)
    chunk = max(1, _MASK_GATHER_ELEMENTS // max(1, ids.numel()))
    parts = []
    for start in range(0, idx.numel(), chunk):
        r, c = rows[start : start + chunk], cols[start : start + chunk]
        hits = ids.unsqueeze(-1) == r
        parts.append((g[:, :, c] * hits).sum(dim=1, dtype=accumulate))
    return torch.cat(parts, dim=1).to(g.dtype)


def _materialized_embedding_entries(
    ids: torch.Tensor, g: torch.Tensor, vocab: int, idx: torch.Tensor
) -> torch.Tensor:
    """``idx`` entries of the scatter-added ``(B, V·E)`` table, built in sample chunks."""
    ids = ids.reshape(ids.shape[0], -1)
    g = g.reshape(g.shape[0], -1, g.shape[-1])
    accumulate = _accumulation_dtype(g.dtype)
    parts = []
    for rows in _sample_chunks(g.shape[0], vocab * g.shape[-1]):
        values = g[rows].to(accumulate)
        table = values.new_zeros(values.shape[0], vocab, values.shape[-1])
        table.scatter_add_(1, ids[rows].unsqueeze(-1).expand_as(values), values)
        parts.append(table.reshape(table.shape[0], -1)[:, idx].to(g.dtype))
    return torch.cat(parts)


def mask_factors(
    a: torch.Tensor,
    g: torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    module_kwargs: dict | None = None,
    include_bias: bool = True,
    *,
    proj_dim: int,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """``"mask"``: ``proj_dim`` exact coordinates of the flattened gradient → ``(B, proj_dim)``.

    Coordinates follow the materialize layout (outer family:
    ``dW[b,o,i] = Σ_t g[b,t,o]·a[b,t,i]``; conv-transpose in its ``(K_a, D_g)``
    orientation; embeddings by token id, needing ``module_kwargs``). Each layer
    takes the cheaper of two exact routes by `_prefers_materialized_mask`:
    gather the entries from the factors (cost ``∝ B·S·proj_dim``) or
    materialize the layer in sample chunks and index it (``∝ B·S·D·K +
    B·proj_dim``), so a mask is never much slower than the unmasked layer.
    Norm layers are materialized, then gathered. Only `MASK_KEYS` are accepted.
    """
    _check_mask_kwargs(proj_kwargs, f"mask_factors({layer_type})")
    check_layer_type(layer_type)
    projector = DattriProjector.coerce(projector)
    device = _canonical_device(proj_kwargs.get("device") or g.device)
    a, g = a.to(device), g.to(device)

    def idx_of(width: int) -> torch.Tensor:
        if isinstance(proj_dim, bool) or not isinstance(proj_dim, int) or not 0 < proj_dim <= width:
            raise ValueError(
                f"mask_factors({layer_type}): proj_dim={proj_dim!r} must satisfy 0 < proj_dim <= "
                f"{width}, the flattened gradient width of factors a {tuple(a.shape)}, g "
                f"{tuple(g.shape)}; choose a smaller proj_dim."
            )
        return projector.mask_indices(width, proj_dim=proj_dim, proj_seed=proj_seed, device=device)

    if is_norm(layer_type):
        dense = materialize_factors(a, g, layer_type, module_kwargs, include_bias)
        return dense[:, idx_of(dense.shape[1])]
    if is_embedding(layer_type):
        return _mask_embedding(a, g, layer_type, module_kwargs, idx_of)
    a, g = preprocess_factors(a, g, layer_type, module_kwargs, include_bias)
    a, g = dtypes.align(a, g)
    a = a.reshape(a.shape[0], -1, a.shape[-1])
    g = g.reshape(g.shape[0], -1, g.shape[-1])
    if a.shape[:2] != g.shape[:2]:
        raise ValueError(
            f"mask_factors({layer_type}): preprocessed factors a {tuple(a.shape)} and g "
            f"{tuple(g.shape)} disagree on (B, S); check module_kwargs for this layer."
        )
    k_a, k_g = a.shape[-1], g.shape[-1]
    idx = idx_of(k_a * k_g)
    transposed = is_conv_transpose(layer_type)  # row-major (K_a, D_g)
    if _prefers_materialized_mask(a.shape[1], k_a * k_g, idx.numel(), True):
        return _materialized_outer_entries(a, g, idx, transposed)
    if transposed:
        return _gather_outer(a, g, idx % k_g, idx // k_g)
    return _gather_outer(a, g, idx // k_a, idx % k_a)


def mask_materialized(
    x: torch.Tensor,
    projector: DattriProjector | Callable | None,
    *,
    proj_dim: int,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """``x[..., idx]``: the masked coordinates of a dense ``(..., d)`` gradient."""
    _check_mask_kwargs(proj_kwargs, "mask_materialized")
    device = _canonical_device(proj_kwargs.get("device") or x.device)
    idx = DattriProjector.coerce(projector).mask_indices(
        x.shape[-1], proj_dim=proj_dim, proj_seed=proj_seed, device=device
    )
    return x.to(device)[..., idx]


def mask_factorized(
    f: Factorized | torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    *,
    proj_dim: int,
    include_bias: bool = True,
    proj_seed: int = 0,
    **proj_kwargs: Any,
) -> torch.Tensor:
    """`mask_factors` on a ``Factorized`` (batch-first, its ``module_kwargs``).

    A dense tensor is masked directly (`mask_materialized`).
    """
    if isinstance(f, torch.Tensor):
        return mask_materialized(
            f, projector, proj_dim=proj_dim, proj_seed=proj_seed, **proj_kwargs
        )
    f = f.as_batch_first()
    return mask_factors(
        f.activation,
        f.pre_activation_grad,
        layer_type,
        projector,
        f.module_kwargs,
        include_bias,
        proj_dim=proj_dim,
        proj_seed=proj_seed,
        **proj_kwargs,
    )


def mask_coordinates(
    projection: dict[str, dict] | None,
    layer_name: str,
    width: int,
    projector: DattriProjector | Callable | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """Indices a ``"mask"`` capture of ``layer_name`` kept, from its config or ``"__default__"``.

    ``None`` when ``projection`` is ``None`` or has no entry for the layer;
    ``ValueError`` when the layer's style is not ``"mask"``.
    """
    if not projection:
        return None
    config = projection.get(layer_name, projection.get("__default__"))
    if config is None:
        return None
    style = config.get("style", "logra")
    if style != "mask":
        raise ValueError(
            f"mask_coordinates: layer {layer_name!r} is projected with style {style!r}; only "
            "style 'mask' keeps gradient coordinates. Use a 'mask' config for this layer."
        )
    _check_mask_kwargs(config, f"mask_coordinates({layer_name!r})")
    if "proj_dim" not in config:
        raise ValueError(f"mask_coordinates: the config of layer {layer_name!r} lacks 'proj_dim'.")
    return DattriProjector.coerce(projector).mask_indices(
        width, proj_dim=config["proj_dim"], proj_seed=config.get("proj_seed", 0), device=device
    )


# =========================================================================== capture style


def maybe_materialize_projected(seq_len: int, k_a: int, k_g: int, kappa: float = 1.0) -> bool:
    """Whether materialized projected factors are smaller: ``seq_len >= κ·k_a·k_g/(k_a+k_g)``.

    ``False`` when ``k_a + k_g <= 0``.
    """
    if k_a + k_g <= 0:
        return False
    return seq_len >= kappa * k_a * k_g / (k_a + k_g)


def should_materialize(capture_style: str, seq_len: int, k_a: int, k_g: int) -> bool:
    """Capture-style rule: ``"factorized"`` → ``False``, ``"materialized"`` → ``True``,
    ``"auto"`` → `maybe_materialize_projected`."""
    if capture_style == "factorized":
        return False
    if capture_style == "materialized":
        return True
    if capture_style == "auto":
        return maybe_materialize_projected(seq_len, k_a, k_g)
    raise ValueError(
        f"Unknown capture_style {capture_style!r}; it must be one of {CAPTURE_STYLES}."
    )


def project_layer(
    f: Factorized | torch.Tensor,
    layer_type: str,
    projector: DattriProjector | Callable | None,
    *,
    style: str = "logra",
    capture_style: str = "factorized",
    **proj_kwargs: Any,
) -> tuple[tuple[torch.Tensor, torch.Tensor] | torch.Tensor, bool]:
    """Project one layer's gradient by ``style`` → ``(payload, is_factorized)``.

    ``"logra"`` kept factorized → ``((a_p, g_p), True)``; materialized by the
    capture style → ``((B, k_g·k_a), False)``. ``"dense"``/``"mask"`` (and
    any dense input tensor) → ``((B, proj_dim), False)``. ``proj_kwargs`` holds
    ``proj_dim`` (required), ``proj_seed``, ``include_bias``, ``device`` and
    factory kwargs.
    """
    if style not in PROJECTION_STYLES:
        raise ValueError(
            f"project_layer({layer_type}): unknown projection style {style!r}; it must be one of "
            f"{PROJECTION_STYLES}."
        )
    if capture_style not in CAPTURE_STYLES:
        raise ValueError(
            f"project_layer({layer_type}): unknown capture_style {capture_style!r}; it must be "
            f"one of {CAPTURE_STYLES}."
        )
    if "proj_dim" not in proj_kwargs:
        raise ValueError(
            f"project_layer({layer_type}): the projection config needs 'proj_dim' (target width)."
        )
    if style == "mask":
        return mask_factorized(f, layer_type, projector, **proj_kwargs), False
    if style == "dense" or isinstance(f, torch.Tensor):
        return project_materialized(f, layer_type, projector, **proj_kwargs), False
    a_p, g_p = project_factorized(f, layer_type, projector, **proj_kwargs)
    seq_len = a_p.shape[1] if a_p.ndim == 3 else 1
    if should_materialize(capture_style, seq_len, a_p.shape[-1], g_p.shape[-1]):
        return materialize_factors(a_p, g_p, "nn.Linear"), False
    return (a_p, g_p), True

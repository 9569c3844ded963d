"""Projection matrices: `DattriProjector` (a factory plus a cache) and `ProjectionMatrix`.

A `DattriProjector` turns a projector factory (dattri's ``random_project`` protocol, see
:mod:`dattri_llm.gradient.ops.projection`) into cached ``(d_in, proj_dim)`` matrices by
pushing identity rows through it, and draws the seeded coordinates of ``"mask"``
projections. ``DattriProjector(None)`` resolves to dattri's ``random_project`` when
``dattri`` is installed, else to the built-in
:func:`~dattri_llm.gradient.ops.random_projection.random_project`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.random_projection import _check_proj_dim, _mix_seed, random_project
from dattri_llm.utils.cache import TensorCache

# Both classes report their public path, where they are documented and compared.
_SPEC_MODULE = "dattri_llm.gradient.ops.projection"

_IDENTITY_CHUNK_ROWS = 8192
# Identity chunks are capped at this many float32 elements (512 MiB) so that
# building the matrix of a very wide input cannot exhaust memory.
_IDENTITY_CHUNK_ELEMENTS = 2**27


def _canonical_device(device: torch.device | str) -> torch.device:
    """``torch.device`` with the current CUDA index filled in (``"cuda"`` → ``"cuda:<i>"``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _default_factory() -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
    """dattri's ``random_project`` when importable, else the built-in `random_project`."""
    try:  # optional dependency: dattri
        from dattri.func.projection import random_project as dattri_random_project
    except ImportError:
        return random_project
    return dattri_random_project


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

    __module__ = _SPEC_MODULE
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

    __module__ = _SPEC_MODULE

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

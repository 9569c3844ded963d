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
`random_project`, so the default works with the core install.
The two factories give different matrices for the same seed: gradients that
are compared must be projected with the same factory (and device type).

The built-in `random_project` is a deterministic CPU construction (seeded
``torch.Generator``, independent of device, process, step and rank) with
``proj_type`` in ``"normal"``, ``"rademacher"``, ``"sjlt"`` and ``"grass"``.

This module holds the projection and mask functions of the three styles and the
capture-style rule. `DattriProjector` and `ProjectionMatrix` are defined in
:mod:`~dattri_llm.gradient.ops.projector`, `random_project` in
:mod:`~dattri_llm.gradient.ops.random_projection` (both re-exported here, the path
they report and stores record), and the mask routes in
:mod:`~dattri_llm.gradient.ops.mask_kernels`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops import dtypes
from dattri_llm.gradient.ops.mask_kernels import (
    _MASK_GATHER_ELEMENTS,
    _accumulation_dtype,
    _gather_outer,
    _materialized_embedding_entries,
    _materialized_outer_entries,
    _prefers_materialized_mask,
)
from dattri_llm.gradient.ops.materialize import check_token_ids, materialize_factors
from dattri_llm.gradient.ops.preprocess import check_layer_type, preprocess_factors
from dattri_llm.gradient.ops.projector import DattriProjector, _canonical_device
from dattri_llm.gradient.ops.projector import ProjectionMatrix as ProjectionMatrix
from dattri_llm.gradient.ops.random_projection import _check_proj_dim
from dattri_llm.gradient.ops.random_projection import random_project as random_project
from dattri_llm.gradient.ops.types import (
    is_conv_transpose,
    is_embedding,
    is_linear,
    is_norm,
)

PROJECTION_STYLES = ("logra", "dense", "mask")
CAPTURE_STYLES = ("factorized", "materialized", "auto")
MASK_KEYS = frozenset({"style", "proj_dim", "proj_seed", "include_bias", "device"})


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

"""Read a training optimizer's state in the coordinates of captured gradients.

Coordinate-wise ``torch.optim`` optimizers keep per-parameter state tensors
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, …) shaped like the
parameter. Captured per-sample gradients live in the *materialize layout* of
their layer (``ops/materialize.py``): a Linear / conv layer is ``(out, K)``
row-major with the bias as an extra last column, HF ``Conv1D`` is reported
``(out, in)`` (its weight transposed), embeddings are ``(num_embeddings, E)``
and norm layers ``[dγ, dβ]``. :class:`OptimizerSnapshot` rearranges a hooked
layer's optimizer state into that layout (all coordinates, or the mask subset
a ``"mask"`` capture keeps), and :class:`GradientPreconditioner` maps
per-sample gradients through ``ops.optimizer.precondition`` with it — what
``HookManager(optimizer=...)`` buffers.

Also here: :func:`optimizer_type`, :func:`hf_trainer_param_names` and
:func:`optimizer_from_state_dict` (rebuild a saved optimizer over a model, as
LESS's frozen form needs).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.gradient import base_layer_name
from dattri_llm.gradient.hooks.hooks import detect_layer_type, unwrap_model
from dattri_llm.gradient.ops.optimizer import OPTIMIZER_STATE_KEYS, precondition
from dattri_llm.gradient.ops.projection import (
    DattriProjector,
    mask_coordinates,
    project_materialized,
)
from dattri_llm.gradient.ops.types import (
    CONV_TYPES,
    EMBEDDING_TYPES,
    LINEAR_TYPES,
    NORM_TYPES,
)

__all__ = [
    "GradientPreconditioner",
    "LayerOptimizerState",
    "OptimizerSnapshot",
    "hf_trainer_param_names",
    "optimizer_from_state_dict",
    "optimizer_type",
]

OptimizerLike = torch.optim.Optimizer | Callable[[], torch.optim.Optimizer]

# Layouts: "outer" = (out, K [+1 bias column]); "concat" = [weight, bias] flattened;
# "rows" = the weight flattened row-major (no bias).
_HF_CONV1D = "transformers.pytorch_utils.Conv1D"
_UNSUPPORTED_LINEAR = frozenset({"nn.Bilinear"})
_SUPPORTED_TYPES = (LINEAR_TYPES - _UNSUPPORTED_LINEAR) | CONV_TYPES | EMBEDDING_TYPES | NORM_TYPES
# Wrapper segments that FSDP / activation checkpointing / torch.compile insert into module names.
_WRAPPER_SEGMENT = re.compile(
    r"(?:^|\.)(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)"
)
# Param-group entries that are bookkeeping or execution switches, not optimizer hyperparameters.
_NON_HYPERPARAMETERS = frozenset(
    {
        "params",
        "param_names",
        "lr",
        "initial_lr",
        "foreach",
        "fused",
        "capturable",
        "differentiable",
    }
)


def optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    """First class name along the optimizer's MRO that is a key of ``OPTIMIZER_STATE_KEYS``.

    Raises:
        NotImplementedError: no class in the MRO is a supported optimizer.
    """
    for cls in type(optimizer).__mro__:
        if cls.__name__ in OPTIMIZER_STATE_KEYS:
            return cls.__name__
    raise NotImplementedError(
        f"optimizer type {type(optimizer).__name__} is not supported: its update is not one of "
        f"the coordinate-wise rules {sorted(OPTIMIZER_STATE_KEYS)} (matched by class name along "
        "the MRO). Use one of these torch.optim optimizers (or a subclass)."
    )


def hf_trainer_param_names(model: nn.Module) -> list[str]:
    """Trainable parameter names in the order of HF ``Trainer``'s optimizer groups.

    Decayed parameters first (neither a bias nor a LayerNorm/RMSNorm weight,
    by ``Trainer.get_decay_parameter_names``), then the rest, each in
    ``named_parameters()`` order; frozen parameters are left out. Needs
    ``transformers``.
    """
    from transformers import Trainer

    # The method reads only its ``model`` argument; calling it unbound keeps HF's own rule.
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    return [n for n in trainable if n in decayed] + [n for n in trainable if n not in decayed]


def _load_optimizer_state(state_dict: dict | str | os.PathLike) -> dict:
    if isinstance(state_dict, (str, os.PathLike)):
        return torch.load(state_dict, map_location="cpu", weights_only=True)
    return state_dict


def _group_params(
    group: dict, param_names: Sequence[str], params: dict[str, nn.Parameter]
) -> list[nn.Parameter]:
    """The model parameters of one saved group (global indices → names → parameters)."""
    resolved = []
    for index in group["params"]:
        if not 0 <= index < len(param_names):
            raise ValueError(
                f"optimizer_from_state_dict: the state dict refers to parameter index {index}, "
                f"but param_names has {len(param_names)} entries; pass the names of the "
                "parameters in the order the optimizer was built with."
            )
        name = param_names[index]
        if name not in params:
            raise KeyError(
                f"optimizer_from_state_dict: parameter {name!r} (index {index}) is not a "
                "parameter of the model; check param_names against model.named_parameters()."
            )
        resolved.append(params[name])
    return resolved


def optimizer_from_state_dict(
    model: nn.Module,
    state_dict: dict | str | os.PathLike,
    param_names: Sequence[str] | None = None,
    *,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
) -> torch.optim.Optimizer:
    """Rebuild a saved optimizer over ``model``'s parameters and load its state.

    Args:
        model: the model the optimizer trained (unwrapped names).
        state_dict: ``optimizer.state_dict()`` (or a path to one, loaded with
            ``weights_only=True``): global parameter index → state, groups of indices.
        param_names: name of each global parameter index. Default: the names
            saved in the groups (``param_names``, torch ≥ 2.6) when present,
            else :func:`hf_trainer_param_names` (``model`` trained by HF ``Trainer``).
        optimizer_cls: class to rebuild (the saved group hyperparameters are passed).

    Raises:
        ValueError / KeyError: an index has no name, or a name is not a model parameter.
    """
    state_dict = _load_optimizer_state(state_dict)
    groups = state_dict["param_groups"]
    if param_names is None:
        param_names = _saved_param_names(groups) or hf_trainer_param_names(model)
    params = dict(model.named_parameters())
    rebuilt = [
        {
            "params": _group_params(group, param_names, params),
            **{k: v for k, v in group.items() if k not in ("params", "param_names")},
        }
        for group in groups
    ]
    optimizer = optimizer_cls(rebuilt)
    optimizer.load_state_dict(
        {"state": state_dict["state"], "param_groups": [_without_names(g) for g in groups]}
    )
    return optimizer


def _saved_param_names(groups: list[dict]) -> list[str] | None:
    """Global index → name from groups saved with ``param_names`` (``None`` if one lacks them)."""
    if not groups or any("param_names" not in group for group in groups):
        return None
    names = {i: n for g in groups for i, n in zip(g["params"], g["param_names"], strict=True)}
    return [names.get(i, "") for i in range(max(names, default=-1) + 1)]


def _without_names(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "param_names"}


# --------------------------------------------------------------------------- layouts


def _layout(layer_type: str) -> str:
    if layer_type in NORM_TYPES:
        return "concat"
    if layer_type in EMBEDDING_TYPES:
        return "rows"
    return "outer"


def _weight_matrix(weight: torch.Tensor, layer_type: str) -> torch.Tensor:
    """``(out, K)`` view of a linear / conv weight (HF ``Conv1D`` transposed)."""
    if layer_type == _HF_CONV1D:
        return weight.t()
    return weight.reshape(weight.shape[0], -1)


def _flatten_layer(
    weight: torch.Tensor, bias: torch.Tensor | None, layer_type: str
) -> torch.Tensor:
    """All ``(d,)`` coordinates of parameter-shaped ``weight``/``bias``, materialize layout."""
    layout = _layout(layer_type)
    if layout == "outer":
        matrix = _weight_matrix(weight, layer_type)
        if bias is not None:
            matrix = torch.cat([matrix, bias.reshape(-1, 1)], dim=1)
        return matrix.reshape(-1)
    if layout == "concat" and bias is not None:
        return torch.cat([weight.reshape(-1), bias.reshape(-1)])
    return weight.reshape(-1)


def _gather_layer(
    weight: torch.Tensor, bias: torch.Tensor | None, layer_type: str, idx: torch.Tensor
) -> torch.Tensor:
    """Coordinates ``idx`` of the layer's flattened layout without forming all of it."""
    if _layout(layer_type) != "outer":
        return _flatten_layer(weight, bias, layer_type)[idx]
    matrix = _weight_matrix(weight, layer_type)
    k = matrix.shape[1]
    width = k + (bias is not None)
    rows, cols = idx // width, idx % width
    values = matrix[rows, cols.clamp(max=k - 1)]
    if bias is None:
        return values
    return torch.where(cols == k, bias.reshape(-1)[rows], values)


def _resolve_module_names(model: nn.Module) -> dict[str, nn.Module]:
    """``name → module`` of the unwrapped model, wrapper segments removed from names."""
    return {
        _WRAPPER_SEGMENT.sub("", name).lstrip("."): module
        for name, module in unwrap_model(model).named_modules()
    }


def _check_fsdp(model: nn.Module) -> None:
    """``NotImplementedError`` for FSDP wrappers built without ``use_orig_params=True``."""
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel" and not getattr(
            module, "_use_orig_params", True
        ):
            raise NotImplementedError(
                "OptimizerSnapshot: the model is wrapped in FSDP with use_orig_params=False, so "
                "the optimizer holds state for flattened parameters, not for the hooked layers. "
                "Wrap with FullyShardedDataParallel(..., use_orig_params=True) (or fully_shard)."
            )


def _gather_shards(local: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Full ``shape`` tensor from per-rank state pieces (DTensor, or FSDP flat shards)."""
    if hasattr(local, "full_tensor"):
        return local.full_tensor().reshape(shape)
    if local.numel() == math.prod(shape):
        return local.reshape(shape)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(
            f"OptimizerSnapshot: a state tensor of {local.numel()} elements belongs to a "
            f"parameter of shape {tuple(shape)}, but no process group is initialized to gather "
            "its shards."
        )
    pieces: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(pieces, local.detach().reshape(-1).cpu())
    return torch.cat(pieces).to(local.device).reshape(shape)


def _shares_memory(value: torch.Tensor, *sources: torch.Tensor | None) -> bool:
    """Whether ``value`` is a view of one of ``sources`` (the optimizer's live state)."""
    ptr = value.untyped_storage().data_ptr()
    return any(
        isinstance(s, torch.Tensor) and s.untyped_storage().data_ptr() == ptr for s in sources
    )


@dataclass
class LayerOptimizerState:
    """One layer's optimizer state in materialize layout.

    Attributes:
        state: state key → float32 tensor ``(k,)`` on the captured coordinates
            (``k`` = layer width, or the mask size), a copy that later optimizer
            steps leave unchanged; a per-parameter scalar state (NAdam's
            ``mu_product``) is a float32 0-d tensor. Keys no parameter of the
            layer holds yet are absent (the maps treat them as missing).
        step: updates taken so far (``state["step"]`` of the weight, 0 before the first).
        hyperparameters: the weight's param-group entries that define the update
            (``betas``, ``eps``, ``weight_decay``, ``momentum``, ``maximize``, …;
            ``lr`` and execution switches such as ``foreach`` excluded).
        lr: the weight's param-group learning rate.
    """

    state: dict[str, torch.Tensor]
    step: int
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.0


@dataclass
class _Binding:
    """A hooked layer's module, type and full parameter shapes (taken while unsharded)."""

    module: nn.Module
    layer_type: str
    weight_shape: torch.Size
    bias_shape: torch.Size | None


class OptimizerSnapshot:
    """Read hooked layers' optimizer state in the materialize layout of their gradients.

    Supported layer types: Linear (and ``NonDynamicallyQuantizableLinear``),
    HF ``Conv1D`` (transposed to ``(out, in)``), Conv1d/2d/3d, Embedding /
    EmbeddingBag, and the norm layers; others raise ``NotImplementedError``.
    Layer names are the hook manager's (module names of the unwrapped model;
    a use-site suffix ``name@k`` reads ``name``). Under FSDP the model must be
    wrapped with ``use_orig_params=True`` (else ``NotImplementedError``) and
    each layer should be :meth:`bind`-ed while its parameters are unsharded
    (inside its forward/backward), which the recorders do; every rank must
    then read the same layers in the same order (shards are all-gathered).

    Args:
        model: the trained model (wrapped or not).
        optimizer: its optimizer, or a callable returning it (resolved on first use).
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        _check_fsdp(model)
        self.model = model
        self._optimizer_source = optimizer
        self._optimizer: torch.optim.Optimizer | None = None
        self._modules: dict[str, nn.Module] | None = None
        self._bindings: dict[str, _Binding] = {}
        self._groups: dict[int, dict] = {}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (a callable given at construction is called once, here)."""
        if self._optimizer is None:
            source = self._optimizer_source
            self._optimizer = source if isinstance(source, torch.optim.Optimizer) else source()
            if not isinstance(self._optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "OptimizerSnapshot: optimizer must be a torch.optim.Optimizer or a callable "
                    f"returning one, got {type(self._optimizer).__name__}."
                )
        return self._optimizer

    @property
    def optimizer_type(self) -> str:
        """:func:`optimizer_type` of the optimizer (``NotImplementedError`` if unsupported)."""
        return optimizer_type(self.optimizer)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The per-parameter state keys of this optimizer type (``OPTIMIZER_STATE_KEYS``)."""
        return OPTIMIZER_STATE_KEYS[self.optimizer_type]

    # ---- layers

    def _module(self, name: str) -> nn.Module:
        if self._modules is None or name not in self._modules:
            self._modules = _resolve_module_names(self.model)
        if name not in self._modules:
            raise KeyError(
                f"OptimizerSnapshot: layer {name!r} is not a module of {type(self.model).__name__}"
                " (names as the hook manager reports them, on the unwrapped model)."
            )
        return self._modules[name]

    def bind(self, layer_name: str) -> None:
        """Record ``layer_name``'s module, type and parameter shapes (idempotent).

        Under FSDP call it while the layer's parameters are unsharded (its
        forward / backward hooks); elsewhere binding happens on first read.
        """
        name = base_layer_name(layer_name)
        if name in self._bindings:
            return
        module = self._module(name)
        layer_type = detect_layer_type(module)
        if layer_type not in _SUPPORTED_TYPES:
            raise NotImplementedError(
                f"OptimizerSnapshot: layer {name!r} has type {layer_type}, whose optimizer state "
                f"cannot be laid out like its captured gradient; supported types: "
                f"{sorted(_SUPPORTED_TYPES)}. Leave this layer out of the capture."
            )
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"OptimizerSnapshot: layer {name!r} has no weight parameter.")
        bias = getattr(module, "bias", None)
        bias_shape = bias.shape if isinstance(bias, torch.Tensor) else None
        self._bindings[name] = _Binding(module, layer_type, weight.shape, bias_shape)

    def _binding(self, layer_name: str) -> _Binding:
        self.bind(layer_name)
        return self._bindings[base_layer_name(layer_name)]

    def layer_type(self, layer_name: str) -> str:
        """Canonical type of the layer's module."""
        return self._binding(layer_name).layer_type

    def layer_width(self, layer_name: str, include_bias: bool = True) -> int:
        """Flattened gradient width ``d`` of the layer (with its bias when ``include_bias``)."""
        binding = self._binding(layer_name)
        width = math.prod(binding.weight_shape)
        if include_bias and binding.bias_shape is not None:
            width += math.prod(binding.bias_shape)
        return width

    # ---- state

    def _group_of(self, param: torch.Tensor) -> dict:
        if id(param) not in self._groups:
            self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        if id(param) not in self._groups:
            raise KeyError(
                "OptimizerSnapshot: a hooked layer's parameter is not in any param group of the "
                f"{type(self.optimizer).__name__} optimizer; build the optimizer over the model's "
                "parameters (or leave the layer out of the capture)."
            )
        return self._groups[id(param)]

    def read(
        self,
        layer_name: str,
        keys: Sequence[str] | None = None,
        *,
        coordinates: torch.Tensor | None = None,
        include_bias: bool = True,
        device: torch.device | str | None = None,
        zeros_for_missing: bool = False,
    ) -> LayerOptimizerState:
        """The layer's optimizer state, float32, in materialize layout.

        Args:
            layer_name: hooked layer name (``name@k`` reads ``name``).
            keys: state keys to read (default: all of :attr:`state_keys`).
            coordinates: long indices into the flattened layout (mask capture),
                ``None`` = all coordinates.
            include_bias: lay out the bias as the layout's bias coordinates
                (as the capture did; ignored for layers without bias).
            device: where the tensors go (default CPU).
            zeros_for_missing: return zeros for keys that no parameter holds yet
                instead of leaving them out.

        Returns:
            a :class:`LayerOptimizerState`; per-coordinate tensors are ``(k,)``.
        """
        binding = self._binding(layer_name)
        if coordinates is not None:
            self._check_coordinates(layer_name, coordinates, include_bias)
        weight = binding.module.weight
        bias = binding.module.bias if include_bias and binding.bias_shape is not None else None
        group = self._group_of(weight)
        weight_state = self.optimizer.state.get(weight, {})
        bias_state = self.optimizer.state.get(bias, {}) if bias is not None else {}
        out: dict[str, torch.Tensor] = {}
        for key in self.state_keys if keys is None else keys:
            value = self._layer_value(binding, weight_state, bias_state, key, bias, coordinates)
            if value is None and zeros_for_missing:
                width = self.layer_width(layer_name, include_bias)
                value = torch.zeros(width if coordinates is None else coordinates.numel())
            if value is not None:
                value = value.to(device=device or "cpu", dtype=torch.float32)
                sources = (weight_state.get(key), bias_state.get(key))
                out[key] = value.clone() if _shares_memory(value, *sources) else value
        source = weight_state if "step" in weight_state else bias_state
        return LayerOptimizerState(
            state=out,
            step=int(source.get("step", 0)),
            hyperparameters={k: v for k, v in group.items() if k not in _NON_HYPERPARAMETERS},
            lr=float(group.get("lr", 0.0)),
        )

    def _check_coordinates(
        self, layer_name: str, coordinates: torch.Tensor, include_bias: bool
    ) -> None:
        width = self.layer_width(layer_name, include_bias)
        if (
            coordinates.numel()
            and not 0 <= int(coordinates.min()) <= int(coordinates.max()) < width
        ):
            raise ValueError(
                f"OptimizerSnapshot: coordinates of layer {layer_name!r} must lie in [0, {width}) "
                f"(its flattened width with include_bias={include_bias}), got values in "
                f"[{int(coordinates.min())}, {int(coordinates.max())}]."
            )

    @staticmethod
    def _layer_value(
        binding: _Binding,
        weight_state: dict,
        bias_state: dict,
        key: str,
        bias: torch.Tensor | None,
        coordinates: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """One state key of the layer in materialize layout; ``None`` if no parameter holds it."""
        w, b = weight_state.get(key), bias_state.get(key)
        if w is None and b is None:
            return None
        if (w if w is not None else b).ndim == 0:  # scalar state (NAdam mu_product)
            return (w if w is not None else b).detach()
        w = _gather_shards(w, binding.weight_shape) if w is not None else None
        if bias is not None:
            b = _gather_shards(b, binding.bias_shape) if b is not None else None
        template = w if w is not None else b
        w = torch.zeros(binding.weight_shape, dtype=template.dtype) if w is None else w.detach()
        if bias is not None:
            b = torch.zeros(binding.bias_shape, dtype=w.dtype) if b is None else b.detach()
            b = b.to(w.device)
        if coordinates is None:
            return _flatten_layer(w, b, binding.layer_type)
        return _gather_layer(w, b, binding.layer_type, coordinates.to(w.device))


class GradientPreconditioner:
    """Map a layer's per-sample gradients through the optimizer's update rule.

    Called as ``preconditioner(layer_name, entries, proj_kw=None)`` where
    ``entries`` is the layer's per-sample gradient as a dense ``(B, k)`` tensor
    in materialize layout on the captured coordinates:

    * ``proj_kw is None`` — all ``k = d`` coordinates (bias included when the
      layer has one); the result is ``(B, d)``;
    * ``proj_kw["style"] == "mask"`` — the ``k = proj_dim`` masked coordinates
      (``ops.mask_coordinates`` of that config: ``proj_dim``, ``proj_seed``,
      ``include_bias``); the result is ``(B, proj_dim)`` on the same coordinates;
    * ``proj_kw["style"] == "dense"`` — all ``k = d`` coordinates
      (``include_bias`` of the config, default ``True``); the preconditioned
      ``(B, d)`` is then projected with ``projector`` and the config, so the
      result is ``(B, proj_dim)``.

    The map is ``ops.optimizer.precondition`` with the layer's current state
    (:meth:`OptimizerSnapshot.read` on those coordinates, on ``entries``'
    device), ``step = state step + 1`` and the weight's group hyperparameters;
    the result is float32. With ``enabled = False`` the map is skipped (the
    ``"dense"`` projection still applies), so a raw pass can share the hooks.
    ``"logra"`` configs raise ``ValueError`` (a preconditioned gradient is not
    rank-structured).

    Args:
        snapshot: the model's :class:`OptimizerSnapshot`.
        projector: the capture's projector (mask coordinates, dense matrices);
            ``None`` → a default ``DattriProjector``.
    """

    def __init__(self, snapshot: OptimizerSnapshot, projector: Any = None) -> None:
        self.snapshot = snapshot
        self.projector = DattriProjector.coerce(projector)
        self.enabled = True

    def __call__(
        self, layer_name: str, entries: torch.Tensor, proj_kw: dict | None = None
    ) -> torch.Tensor:
        """Preconditioned ``(B, k)`` (or projected ``(B, proj_dim)`` for ``"dense"``)."""
        style = None if proj_kw is None else proj_kw.get("style", "logra")
        if style not in (None, "mask", "dense"):
            raise ValueError(
                f"GradientPreconditioner: layer {layer_name!r} is configured with projection "
                f"style {style!r}; preconditioned capture supports no projection, 'mask' or "
                "'dense' (a preconditioned gradient is no longer rank-structured)."
            )
        include_bias = True if proj_kw is None else bool(proj_kw.get("include_bias", True))
        coordinates = self.coordinates(layer_name, proj_kw, entries.device)
        self._check_width(layer_name, entries, include_bias, coordinates)
        out = self._precondition(layer_name, entries, coordinates, include_bias)
        if style == "dense":
            proj = {k: v for k, v in proj_kw.items() if k != "style"}
            return project_materialized(
                out, self.snapshot.layer_type(layer_name), self.projector, **proj
            )
        return out

    def coordinates(
        self, layer_name: str, proj_kw: dict | None, device: torch.device | str = "cpu"
    ) -> torch.Tensor | None:
        """Mask indices of a ``"mask"`` config (``None`` for no projection and ``"dense"``)."""
        if proj_kw is None or proj_kw.get("style", "logra") != "mask":
            return None
        width = self.snapshot.layer_width(layer_name, bool(proj_kw.get("include_bias", True)))
        return mask_coordinates({layer_name: proj_kw}, layer_name, width, self.projector, device)

    def _check_width(
        self,
        layer_name: str,
        entries: torch.Tensor,
        include_bias: bool,
        coordinates: torch.Tensor | None,
    ) -> None:
        expected = (
            self.snapshot.layer_width(layer_name, include_bias)
            if coordinates is None
            else coordinates.numel()
        )
        if entries.ndim != 2 or entries.shape[1] != expected:
            raise ValueError(
                f"GradientPreconditioner: layer {layer_name!r} expects per-sample gradients of "
                f"shape (B, {expected}) in materialize layout on the captured coordinates, got "
                f"{tuple(entries.shape)}."
            )

    def _precondition(
        self,
        layer_name: str,
        entries: torch.Tensor,
        coordinates: torch.Tensor | None,
        include_bias: bool,
    ) -> torch.Tensor:
        if not self.enabled:
            return entries
        layer = self.snapshot.read(
            layer_name, coordinates=coordinates, include_bias=include_bias, device=entries.device
        )
        return precondition(
            entries,
            layer.state,
            optimizer_type=self.snapshot.optimizer_type,
            step=layer.step + 1,
            **layer.hyperparameters,
        )

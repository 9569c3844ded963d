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
``HookManager(optimizer=...)`` buffers — reading each layer's state once per
optimizer step.

Under DDP the state is read locally. Under FSDP1 (``use_orig_params=True``)
and FSDP2 (``fully_shard``) each rank reads its own shard's state and the
full layer is assembled by collectives (an exact all-reduce of the disjoint
slices for FSDP1, ``DTensor.full_tensor()`` for FSDP2), so reads are
collective there; FSDP1 with ``use_orig_params=False`` is refused.

Also here: :func:`optimizer_type`, :func:`hf_trainer_param_names` and
:func:`optimizer_from_state_dict` (rebuild a saved optimizer over a model, as
LESS's frozen form needs).
"""

from __future__ import annotations

import math
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
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


def _plain_name(name: str) -> str:
    """``name`` without the segments FSDP / checkpointing / compile insert."""
    return _WRAPPER_SEGMENT.sub("", name).lstrip(".")


def _resolve_module_names(model: nn.Module) -> dict[str, nn.Module]:
    """``name → module`` of the unwrapped model, wrapper segments removed from names."""
    return {_plain_name(name): module for name, module in unwrap_model(model).named_modules()}


def _check_fsdp(model: nn.Module) -> None:
    """``NotImplementedError`` for FSDP wrappers built without ``use_orig_params=True``."""
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel" and not getattr(
            module, "_use_orig_params", True
        ):
            raise NotImplementedError(_NO_ORIG_PARAMS)


_NO_ORIG_PARAMS = (
    "OptimizerSnapshot: the model is wrapped in FSDP with use_orig_params=False, so the "
    "optimizer holds state for flattened parameters, not for the hooked layers. Wrap with "
    "FullyShardedDataParallel(..., use_orig_params=True) (or use FSDP2's fully_shard)."
)
# Floating dtypes a sharded read can carry (their index travels in the metadata exchange).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2 parameters and their optimizer state)."""
    return isinstance(tensor, torch.Tensor) and hasattr(tensor, "full_tensor")


def _flat_parameter(tensor: object) -> Any:
    """The FSDP1 ``FlatParameter`` ``tensor`` is an unsharded view of, else ``None``."""
    base = getattr(tensor, "_base", None)
    return base if getattr(base, "_is_flat_param", False) else None


def _scalar_value(tensor: torch.Tensor) -> float:
    """A 0-d state (``step``, ``mu_product``) as a Python float, without a collective."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return float(tensor.item())


def _shares_memory(value: torch.Tensor, *sources: torch.Tensor | None) -> bool:
    """Whether ``value`` is a view of one of ``sources`` (the optimizer's live state)."""
    ptr = value.untyped_storage().data_ptr()
    return any(
        isinstance(s, torch.Tensor) and not _is_dtensor(s) and s.untyped_storage().data_ptr() == ptr
        for s in sources
    )


def _lay_out(
    layer_type: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    idx: torch.Tensor | None,
) -> torch.Tensor:
    """Parameter-shaped ``weight``/``bias`` in materialize layout, all coordinates or ``idx``."""
    if idx is None:
        return _flatten_layer(weight, bias, layer_type)
    return _gather_layer(weight, bias, layer_type, idx.to(weight.device))


def _comm_device(group: Any, fallback: torch.device) -> torch.device:
    """Device the collectives of ``group`` take tensors on (CUDA for NCCL, else ``fallback``)."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


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
class _ParamRef:
    """Where one parameter of a hooked layer keeps its optimizer state.

    ``param`` is the tensor the optimizer holds (its ``optimizer.state`` key);
    ``shape`` the full (unsharded) parameter shape. ``kind``: ``"local"`` (the
    state is parameter-shaped here: no sharding, DDP, FSDP1 ``NO_SHARD``),
    ``"dtensor"`` (FSDP2: DTensor state, read with ``full_tensor()``) or
    ``"flat"`` (FSDP1 ``use_orig_params=True``: this rank holds positions
    ``[start, stop)`` of the flattened parameter, sharded over ``group``).
    """

    param: torch.Tensor
    shape: torch.Size
    kind: str = "local"
    start: int = 0
    stop: int = 0
    group: Any = None


@dataclass
class _Binding:
    """A hooked layer's module, type, full parameter shapes and optimizer-side parameters."""

    module: nn.Module
    layer_type: str
    weight_shape: torch.Size
    bias_shape: torch.Size | None
    params: dict[str, _ParamRef] = field(default_factory=dict)


class OptimizerSnapshot:
    """A live view of an optimizer's state in the materialize layout of hooked layers' gradients.

    Every read goes to the optimizer's current tensors: a snapshot built before
    training follows the state as it changes (reads return new tensors, never
    views of the state). Supported layer types: Linear (and
    ``NonDynamicallyQuantizableLinear``), HF ``Conv1D`` (transposed to
    ``(out, in)``), Conv1d/2d/3d, Embedding / EmbeddingBag and the norm layers;
    others raise ``NotImplementedError``. Layer names are the hook manager's
    (module names of the unwrapped model; a use-site suffix ``name@k`` reads
    ``name``). The flat layout puts the bias block after the weight block.

    Sharding: under FSDP1 with ``use_orig_params=True`` and FSDP2
    (``fully_shard``) each rank reads its own shard's state and the pieces are
    combined by collectives, so every rank gets the full layer (equal to the
    single-process read). Reads of :meth:`state`, :meth:`states`,
    :meth:`step_count`, :meth:`precondition` and :meth:`read` are then
    collective: every rank must make them for the same layers in the same
    order. Under FSDP1 a layer must first be :meth:`bind`-ed while its unit is
    unsharded (inside its forward, where the ``HookManager`` and
    ``OptimizerStateCallback`` bind) unless ``model`` is the FSDP wrapper.
    FSDP1 with ``use_orig_params=False`` raises ``NotImplementedError``.

    Args:
        model: the trained model (DDP / FSDP wrappers are unwrapped through ``.module``).
        optimizer: its optimizer, or a callable returning it (resolved on first use).

    Raises:
        NotImplementedError: ``model`` contains FSDP1 with ``use_orig_params=False``.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerLike) -> None:
        _check_fsdp(model)
        self.model = model
        self._optimizer_source = optimizer
        self._optimizer: torch.optim.Optimizer | None = None
        self._modules: dict[str, nn.Module] | None = None
        self._bindings: dict[str, _Binding] = {}
        self._groups: dict[int, dict] = {}
        self._fsdp_index: dict[tuple, Any] | None = None
        self._updates = 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer being read (a callable given at construction is called once, here)."""
        if self._optimizer is None:
            source = self._optimizer_source
            optimizer = source if isinstance(source, torch.optim.Optimizer) else source()
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "OptimizerSnapshot: optimizer must be a torch.optim.Optimizer or a callable "
                    f"returning one, got {type(optimizer).__name__}."
                )
            self._optimizer = optimizer
            self._watch(optimizer)
        return self._optimizer

    def _watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Count the optimizer's steps and state loads (for :attr:`state_version`)."""
        ref = weakref.ref(self)

        def bump(*_args: Any, **_kwargs: Any) -> None:
            snapshot = ref()
            if snapshot is not None:
                snapshot._updates += 1

        handles = [optimizer.register_step_post_hook(bump)]
        if hasattr(optimizer, "register_load_state_dict_post_hook"):
            handles.append(optimizer.register_load_state_dict_post_hook(bump))
        weakref.finalize(self, _remove_handles, handles)

    @property
    def optimizer_type(self) -> str:
        """:func:`optimizer_type` of the optimizer (``NotImplementedError`` if unsupported)."""
        return optimizer_type(self.optimizer)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The per-parameter state keys of this optimizer type (``OPTIMIZER_STATE_KEYS``)."""
        return OPTIMIZER_STATE_KEYS[self.optimizer_type]

    @property
    def state_version(self) -> tuple[int, int, int]:
        """A value that changes whenever the optimizer's state may have changed.

        ``(id(optimizer), id(optimizer.state), updates)`` where ``updates``
        counts ``optimizer.step()`` and ``optimizer.load_state_dict()`` calls
        seen since the optimizer was resolved (post hooks). Equal on every rank
        of a data-parallel run. Editing ``optimizer.state`` by hand does not
        change it.
        """
        optimizer = self.optimizer
        return (id(optimizer), id(optimizer.state), self._updates)

    # ---- layers

    def _module(self, name: str) -> nn.Module:
        name = _plain_name(name)
        if self._modules is None or name not in self._modules:
            self._modules = _resolve_module_names(self.model)
        if name not in self._modules:
            raise KeyError(
                f"OptimizerSnapshot: layer {name!r} is not a module of {type(self.model).__name__}"
                " (names as the hook manager reports them, on the unwrapped model)."
            )
        return self._modules[name]

    def module(self, layer_name: str) -> nn.Module:
        """The hooked module behind ``layer_name`` (``name@k`` → module ``name``)."""
        return self._module(base_layer_name(layer_name))

    def bind(self, layer_name: str) -> None:
        """Record the layer's module, type, full parameter shapes and optimizer-side parameters.

        Under FSDP1 (``use_orig_params=True``) this records where each of the
        layer's parameters sits in its flat parameter and which slice of it this
        rank holds; the first call must run while the unit is unsharded (inside
        the layer's forward, where the ``HookManager`` calls it; in a backward
        hook on a root unit's output FSDP1 may still show the shard), unless
        ``model`` is the FSDP wrapper itself, whose units are then searched.
        Under FSDP2 it finds the sharded (DTensor) parameter behind the
        unsharded one a forward shows. Elsewhere it only caches what the first
        read would look up. Idempotent; no collective.

        Raises:
            KeyError: not a module of the model.
            NotImplementedError: unsupported layer type, or FSDP1 with
                ``use_orig_params=False``.
            ValueError: the module has no ``weight``.
            RuntimeError: FSDP1 shows the layer sharded and its unit is not
                reachable from ``model`` (bind it inside its forward).
        """
        if layer_name in self._bindings:  # fast path: called in every forward
            return
        name = _plain_name(base_layer_name(layer_name))
        if name in self._bindings:
            self._bindings[layer_name] = self._bindings[name]
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
        params = {"weight": self._param_ref(module, "weight")}
        if len(params["weight"].shape) < 2 and layer_type not in NORM_TYPES:
            raise RuntimeError(
                f"OptimizerSnapshot: layer {name!r} ({layer_type}) shows a 1-D weight: FSDP1 "
                "holds it sharded. Bind the layer inside its forward (where the HookManager "
                "and OptimizerStateCallback do), or build the snapshot on the FSDP-wrapped model."
            )
        if isinstance(getattr(module, "bias", None), torch.Tensor):
            params["bias"] = self._param_ref(module, "bias")
        bias = params.get("bias")
        binding = _Binding(
            module, layer_type, params["weight"].shape, None if bias is None else bias.shape, params
        )
        self._bindings[name] = self._bindings[layer_name] = binding

    def _param_ref(self, module: nn.Module, role: str) -> _ParamRef:
        """The optimizer-side parameter behind ``module.<role>`` (see :class:`_ParamRef`)."""
        tensor = getattr(module, role)
        flat = _flat_parameter(tensor)
        if flat is not None:  # FSDP1, unit unsharded: a view of its flat parameter
            index = _flat_index(flat, module, role)
            return self._flat_ref(flat, index, self._fsdp_lookup().get(("flat", id(flat))))
        found = self._fsdp_lookup().get((id(module), role))
        if found is not None and found[0] == "fsdp1":
            return self._flat_ref(found[1], found[2], found[3])
        if found is not None:  # FSDP2: the sharded DTensor parameter
            tensor = found[1]
        kind = "dtensor" if _is_dtensor(tensor) else "local"
        return _ParamRef(tensor, tensor.shape, kind)

    def _flat_ref(self, flat: Any, index: int, group: Any) -> _ParamRef:
        """Reference to original parameter ``index`` of an FSDP1 ``FlatParameter``."""
        if flat._params is None:
            raise NotImplementedError(_NO_ORIG_PARAMS)
        param, shape = flat._params[index], torch.Size(flat._shapes[index])
        if flat._sharded_size.numel() == flat._padded_unsharded_size.numel():
            return _ParamRef(param, shape)  # NO_SHARD / one rank: the whole parameter is here
        if group is None:
            world = torch.distributed.get_world_size()
            if flat._sharded_size.numel() * world != flat._padded_unsharded_size.numel():
                raise RuntimeError(
                    "OptimizerSnapshot: an FSDP1 flat parameter is not sharded over the default "
                    "process group (e.g. HYBRID_SHARD); pass the FSDP-wrapped model so that "
                    "its process group can be found."
                )
        info = flat._shard_param_infos[index]
        start, stop = (
            (int(info.intra_param_start_idx), int(info.intra_param_end_idx) + 1)
            if info.in_shard
            else (0, 0)
        )
        return _ParamRef(param, shape, "flat", start, stop, group)

    def _fsdp_lookup(self) -> dict[tuple, Any]:
        """FSDP1 / FSDP2 parameter index of the model, built once on first use.

        ``(id(module), name)`` → ``("fsdp1", flat, index, group)`` or
        ``("fsdp2", sharded parameter)``; ``("flat", id(flat))`` → FSDP1 group.
        """
        if self._fsdp_index is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                return {}  # no process group: nothing can be sharded
            index = _index_fsdp(self.model)
            if not index:  # nothing sharded (yet): look again at the next bind
                return index
            self._fsdp_index = index
        return self._fsdp_index

    def _binding(self, layer_name: str) -> _Binding:
        self.bind(layer_name)
        return self._bindings[layer_name]

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

    def width(self, layer_name: str, include_bias: bool = True) -> int:
        """The flat width of the layer's materialized gradient (alias of :meth:`layer_width`)."""
        return self.layer_width(layer_name, include_bias)

    def parameters(
        self, layer_name: str, include_bias: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        """``[(role, parameter), ...]``: ``"weight"``, then ``"bias"`` when present and included.

        The parameters are the ones the optimizer holds (its ``state`` keys):
        under FSDP1 the original parameter (this rank's flat slice), under FSDP2
        the sharded DTensor parameter.
        """
        refs = self._refs(self._binding(layer_name), include_bias)
        return [(role, ref.param) for role, ref in refs]

    def shapes(self, layer_name: str, include_bias: bool = True) -> list[tuple[str, torch.Size]]:
        """``[(role, full parameter shape), ...]`` in the order of :meth:`parameters`.

        The unsharded shapes :meth:`flatten` takes (under FSDP1 the parameters
        the optimizer holds are this rank's 1-D slices).
        """
        refs = self._refs(self._binding(layer_name), include_bias)
        return [(role, ref.shape) for role, ref in refs]

    def flatten(
        self,
        layer_name: str,
        tensors: Mapping[str, torch.Tensor],
        idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Parameter-shaped tensors laid out as the layer's flat gradient.

        Args:
            layer_name: hooked layer name.
            tensors: ``{"weight": ..., "bias": ...}`` with the full parameter
                shapes; the bias block is included iff a ``"bias"`` entry is given.
            idx: long flat positions to read (default: all).

        Returns:
            ``(d,)``, or ``(len(idx),)`` with ``idx``.

        Raises:
            ValueError: a missing weight, a bias for a layer without one, a
                shape that is not the parameter's, or ``idx`` out of range.
        """
        binding = self._binding(layer_name)
        weight, bias = tensors.get("weight"), tensors.get("bias")
        unknown = set(tensors) - {"weight", "bias"}
        if weight is None or unknown:
            raise ValueError(
                f"OptimizerSnapshot.flatten: layer {layer_name!r} takes {{'weight': ..., "
                f"'bias': ...}} (bias optional), got keys {sorted(tensors)}."
            )
        if bias is not None and binding.bias_shape is None:
            raise ValueError(f"OptimizerSnapshot.flatten: layer {layer_name!r} has no bias.")
        for role, value, shape in (
            ("weight", weight, binding.weight_shape),
            ("bias", bias, binding.bias_shape),
        ):
            if value is not None and tuple(value.shape) != tuple(shape):
                raise ValueError(
                    f"OptimizerSnapshot.flatten: layer {layer_name!r}: {role} has shape "
                    f"{tuple(value.shape)}, the parameter's is {tuple(shape)}."
                )
        if idx is not None:
            self._check_coordinates(layer_name, idx, bias is not None)
        return _lay_out(binding.layer_type, weight, bias, idx)

    # ---- groups

    def _group_of(self, param: torch.Tensor, layer_name: str = "") -> dict:
        if id(param) not in self._groups:
            self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        if id(param) not in self._groups:
            layer = f"layer {layer_name!r}" if layer_name else "a hooked layer"
            raise KeyError(
                f"OptimizerSnapshot: the weight of {layer} is not in any param group of the "
                f"{type(self.optimizer).__name__} optimizer; build the optimizer over the model's "
                "parameters (or leave the layer out of the capture)."
            )
        return self._groups[id(param)]

    def group(self, layer_name: str) -> dict:
        """The optimizer's parameter group (the dict itself) holding the layer's weight.

        Raises:
            KeyError: naming the layer, when its weight is in no param group.
        """
        weight = self._binding(layer_name).params["weight"].param
        return self._group_of(weight, layer_name)

    def hyperparameters(self, layer_name: str) -> dict[str, Any]:
        """The weight's group entries without ``params`` (``lr``, ``betas``, ``eps``, …).

        ``param_names`` (bookkeeping, torch >= 2.6) is left out too; unlike
        :attr:`LayerOptimizerState.hyperparameters` this keeps ``lr`` and the
        execution switches.
        """
        return {k: v for k, v in self.group(layer_name).items() if k not in _BOOKKEEPING}

    def _update_hyperparameters(self, layer_name: str) -> dict[str, Any]:
        """The group entries that define the update (``lr`` and switches excluded)."""
        return {k: v for k, v in self.group(layer_name).items() if k not in _NON_HYPERPARAMETERS}

    # ---- state

    @staticmethod
    def _refs(binding: _Binding, include_bias: bool) -> list[tuple[str, _ParamRef]]:
        refs = [("weight", binding.params["weight"])]
        if include_bias and "bias" in binding.params:
            refs.append(("bias", binding.params["bias"]))
        return refs

    def step_count(self, layer_name: str) -> int:
        """Updates applied so far to the layer's weight (0 before the first).

        The bias's count when only the bias has state. Collective under FSDP1.
        """
        return self._gather(layer_name, (), None, include_bias=True)[1]

    def state(
        self,
        layer_name: str,
        key: str,
        idx: torch.Tensor | None = None,
        include_bias: bool = True,
    ) -> torch.Tensor | None:
        """One per-parameter state tensor of the layer in the flat layout.

        Args:
            layer_name: hooked layer name.
            key: a state key (``"exp_avg"``, ``"exp_avg_sq"``, ``"momentum_buffer"``, …).
            idx: long flat positions to gather (default: all ``d``).
            include_bias: lay out the bias block (layers with a bias).

        Returns:
            ``(d,)`` or ``(len(idx),)`` in the state's dtype, on its device (a new
            tensor); a per-parameter scalar state (NAdam's ``mu_product``) 0-d;
            ``None`` when no parameter of the layer has ``key`` yet. A parameter
            missing a state that another has reads as zeros.
        """
        return self._gather(layer_name, (key,), idx, include_bias)[0][key]

    def states(
        self,
        layer_name: str,
        idx: torch.Tensor | None = None,
        include_bias: bool = True,
    ) -> dict[str, torch.Tensor | None]:
        """``{key: state(...)}`` for every state key the optimizer type keeps (one read)."""
        return self._gather(layer_name, self.state_keys, idx, include_bias)[0]

    def precondition(
        self,
        layer_name: str,
        entries: torch.Tensor,
        idx: torch.Tensor | None = None,
        include_bias: bool = True,
    ) -> torch.Tensor:
        """``ops.precondition`` of ``(B, k)`` entries with the optimizer's current state.

        The state is read on ``idx`` (``k = len(idx)``; default all ``k = d``
        coordinates), the step is ``step_count + 1`` and the hyperparameters are
        the weight's group's. Returns float32 ``(B, k)``.
        """
        hyper = self._update_hyperparameters(layer_name)
        values, step = self._gather(layer_name, self.state_keys, idx, include_bias)
        return precondition(
            entries, values, optimizer_type=self.optimizer_type, step=step + 1, **hyper
        )

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
        group = self.group(layer_name)
        keys = tuple(self.state_keys if keys is None else keys)
        values, step = self._gather(layer_name, keys, coordinates, include_bias)
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            value = values[key]
            if value is None and zeros_for_missing:
                width = self.layer_width(layer_name, include_bias)
                value = torch.zeros(width if coordinates is None else coordinates.numel())
            if value is not None:
                out[key] = value.to(device=device or "cpu", dtype=torch.float32)
        return LayerOptimizerState(
            state=out,
            step=step,
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

    def _gather(
        self,
        layer_name: str,
        keys: Sequence[str],
        idx: torch.Tensor | None,
        include_bias: bool,
    ) -> tuple[dict[str, torch.Tensor | None], int]:
        """``({key: flat state or None}, step)`` of the layer; the core of every read."""
        binding = self._binding(layer_name)
        self.group(layer_name)  # KeyError naming the layer before any collective
        if idx is not None:
            self._check_coordinates(layer_name, idx, include_bias)
        refs = self._refs(binding, include_bias)
        local = [self.optimizer.state.get(ref.param, {}) for _, ref in refs]
        with torch.no_grad():
            if any(ref.kind == "flat" for _, ref in refs):
                return _gather_flat(binding.layer_type, refs, local, tuple(keys), idx)
            return _gather_local(binding.layer_type, refs, local, tuple(keys), idx)


_BOOKKEEPING = frozenset({"params", "param_names"})


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _step_of(steps: Sequence[float | None]) -> int:
    """The weight's step count, else the bias's, else 0."""
    return next((int(s) for s in steps if s is not None), 0)


def _full_state(value: torch.Tensor, ref: _ParamRef) -> torch.Tensor:
    """A parameter-shaped state tensor from its local (or DTensor) value."""
    if _is_dtensor(value):
        value = value.full_tensor()
    if value.numel() != math.prod(ref.shape):
        raise RuntimeError(
            f"OptimizerSnapshot: a state tensor of {value.numel()} elements belongs to a "
            f"parameter of shape {tuple(ref.shape)}: the layer was bound while FSDP held it "
            "sharded; bind it inside its forward or backward (or pass the FSDP-wrapped model)."
        )
    return value.detach().reshape(ref.shape)


def _gather_local(
    layer_type: str,
    refs: list[tuple[str, _ParamRef]],
    local: list[dict],
    keys: tuple[str, ...],
    idx: torch.Tensor | None,
) -> tuple[dict[str, torch.Tensor | None], int]:
    """Read unsharded (or DTensor) state: parameter-shaped tensors, laid out here."""
    step = _step_of([_scalar_value(s["step"]) if "step" in s else None for s in local])
    out: dict[str, torch.Tensor | None] = {}
    for key in keys:
        values = [state.get(key) for state in local]
        present = [v for v in values if v is not None]
        if not present:
            out[key] = None
            continue
        if present[0].ndim == 0:  # a per-parameter scalar (NAdam mu_product)
            out[key] = torch.tensor(_scalar_value(present[0]), dtype=present[0].dtype)
            continue
        full = [None if v is None else _full_state(v, ref) for v, (_, ref) in zip(values, refs)]
        template = next(f for f in full if f is not None)
        dtype = template.dtype
        for f in full:
            dtype = dtype if f is None else torch.promote_types(dtype, f.dtype)
        full = [
            torch.zeros(ref.shape, dtype=dtype, device=template.device)
            if f is None
            else f.to(device=template.device, dtype=dtype)
            for f, (_, ref) in zip(full, refs)
        ]
        laid = _lay_out(layer_type, full[0], full[1] if len(full) > 1 else None, idx)
        out[key] = laid.clone() if _shares_memory(laid, *present) else laid
    return out, step


def _gather_flat(
    layer_type: str,
    refs: list[tuple[str, _ParamRef]],
    local: list[dict],
    keys: tuple[str, ...],
    idx: torch.Tensor | None,
) -> tuple[dict[str, torch.Tensor | None], int]:
    """Read FSDP1 (``use_orig_params=True``) state: every rank contributes its slice.

    Two collectives on the flat parameter's process group, in this order on
    every rank: an all-reduce (MAX) of a small float64 metadata table (step,
    which rank has which key, dtypes, scalar values), then — when some rank
    holds a per-coordinate key — one all-reduce (SUM) of the laid-out values,
    where each rank fills the positions it holds and ``-0.0`` elsewhere
    (``x + (-0.0) == x`` bit for bit, so the sum is exact).
    """
    dist = torch.distributed
    ref0 = refs[0][1]
    group = ref0.group
    device = _comm_device(group, ref0.param.device)
    width = 1 + 3 * len(keys)
    meta = torch.full((len(refs), width), -math.inf, dtype=torch.float64)
    for r, state in enumerate(local):
        if "step" in state:
            meta[r, 0] = _scalar_value(state["step"])
        for j, key in enumerate(keys):
            value = state.get(key)
            if value is None:
                continue
            if value.dtype not in _DTYPES:
                raise TypeError(
                    f"OptimizerSnapshot: state {key!r} has dtype {value.dtype}; sharded reads "
                    f"carry {[str(d) for d in _DTYPES]}."
                )
            meta[r, 1 + 3 * j] = 1.0 if value.ndim == 0 else 2.0
            meta[r, 2 + 3 * j] = _DTYPES.index(value.dtype)
            if value.ndim == 0:
                meta[r, 3 + 3 * j] = _scalar_value(value)
    meta = meta.to(device)
    dist.all_reduce(meta, op=dist.ReduceOp.MAX, group=group)
    meta = meta.cpu()
    steps = [float(m) if math.isfinite(float(m)) else None for m in meta[:, 0]]
    out: dict[str, torch.Tensor | None] = {}
    tensor_keys: list[tuple[str, torch.dtype, list[bool]]] = []
    for j, key in enumerate(keys):
        kinds = meta[:, 1 + 3 * j]
        has = [bool(k > 0) for k in kinds]
        if not any(has):
            out[key] = None
            continue
        r = has.index(True)
        dtype = _DTYPES[int(meta[r, 2 + 3 * j])]
        if float(kinds[r]) == 1.0:
            out[key] = torch.tensor(float(meta[r, 3 + 3 * j]), dtype=dtype)
            continue
        for rr, flag in enumerate(has):
            if flag:
                dtype = torch.promote_types(dtype, _DTYPES[int(meta[rr, 2 + 3 * j])])
        tensor_keys.append((key, dtype, has))
    if not tensor_keys:
        return out, _step_of(steps)
    transport = tensor_keys[0][1]
    for _, dtype, _ in tensor_keys:
        transport = torch.promote_types(transport, dtype)
    rows = []
    for key, _, has in tensor_keys:
        blocks = []
        for (_, ref), state, held in zip(refs, local, has):
            if not held:  # no rank holds this key for this parameter: zeros
                blocks.append(torch.zeros(ref.shape, dtype=transport, device=device))
                continue
            block = torch.full(ref.shape, -0.0, dtype=transport, device=device)
            value = state.get(key)
            if value is not None and ref.stop > ref.start:
                if value.numel() != ref.stop - ref.start:
                    raise RuntimeError(
                        f"OptimizerSnapshot: state {key!r} has {value.numel()} elements but "
                        f"this rank holds {ref.stop - ref.start} of the parameter."
                    )
                block.view(-1)[ref.start : ref.stop] = value.detach().reshape(-1)
            blocks.append(block)
        rows.append(_lay_out(layer_type, blocks[0], blocks[1] if len(blocks) > 1 else None, idx))
    packed = torch.stack(rows)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    for (key, dtype, _), row in zip(tensor_keys, packed):
        out[key] = row.to(dtype)
    return out, _step_of(steps)


def _flat_index(flat: Any, module: nn.Module, role: str) -> int:
    """Index of ``module.<role>`` among an FSDP1 flat parameter's original parameters."""
    for i, info in enumerate(flat._param_infos):
        if info.module is module and info.param_name == role:
            return i
    for info in getattr(flat, "_shared_param_infos", ()):
        if info.module is module and info.param_name == role:
            return _flat_index(flat, info.prim_module, info.prim_param_name)
    raise RuntimeError(
        f"OptimizerSnapshot: {type(module).__name__}.{role} is a view of an FSDP flat parameter "
        "that does not list it."
    )


def _index_fsdp(model: nn.Module) -> dict[tuple, Any]:
    """``(id(module), name)`` → the FSDP1 / FSDP2 entry of every sharded parameter in ``model``."""
    index: dict[tuple, Any] = {}
    for unit in model.modules():
        handle = getattr(unit, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if type(unit).__name__ == "FullyShardedDataParallel" and flat is not None:
            group = getattr(unit, "process_group", None)
            index[("flat", id(flat))] = group
            for i, info in enumerate(flat._param_infos):
                index[(id(info.module), info.param_name)] = ("fsdp1", flat, i, group)
            for info in getattr(flat, "_shared_param_infos", ()):
                i = _flat_index(flat, info.prim_module, info.prim_param_name)
                index[(id(info.module), info.param_name)] = ("fsdp1", flat, i, group)
        get_state = getattr(unit, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [] if single is None else [single]
        for param_group in groups:
            for fsdp_param in param_group.fsdp_params:
                info = fsdp_param._module_info
                entry = ("fsdp2", fsdp_param.sharded_param)
                index[(id(info.module), info.param_name)] = entry
                for shared, name in zip(info.shared_modules, info.shared_param_names):
                    index[(id(shared), name)] = entry
    return index


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

    The map is :meth:`OptimizerSnapshot.precondition`: ``ops.optimizer.precondition``
    with the layer's current state on those coordinates, ``step = state step +
    1`` and the weight's group hyperparameters; the result is float32. With
    ``enabled = False`` the map is skipped (the ``"dense"`` projection still
    applies), so a raw pass can share the hooks. ``"logra"`` configs raise
    ``ValueError`` (a preconditioned gradient is not rank-structured).

    Caching: with ``cache = True`` (default) each layer's state read
    (:meth:`OptimizerSnapshot.states` and the step, per layer, coordinates,
    ``include_bias`` and device) is kept until the optimizer's state changes —
    :attr:`OptimizerSnapshot.state_version`, bumped by ``optimizer.step()`` and
    ``optimizer.load_state_dict()`` — so the micro-batches of one accumulation
    window read (under FSDP: gather) each layer's state once. The cache holds
    one copy of every preconditioned layer's state on its captured coordinates,
    on the capture device. State edited by hand in between is not seen until
    :meth:`clear_cache`; ``cache = False`` reads on every call.

    Args:
        snapshot: the model's :class:`OptimizerSnapshot`.
        projector: the capture's projector (mask coordinates, dense matrices);
            ``None`` → a default ``DattriProjector``.
    """

    def __init__(self, snapshot: OptimizerSnapshot, projector: Any = None) -> None:
        self.snapshot = snapshot
        self.projector = DattriProjector.coerce(projector)
        self.enabled = True
        self.cache = True
        self.loss_reduction: str | None = None
        self.loss_divisor = 1
        self._cache: dict[tuple, tuple[dict[str, torch.Tensor | None], int, dict]] = {}
        self._cache_version: tuple | None = None
        self._lock = threading.RLock()

    def sample_scale(self, batch_size: int) -> float:
        """The factor taking a captured share to the sample's own gradient before the map.

        ``1`` unless a loss convention is set (``loss_reduction``,
        ``loss_divisor``): then ``(batch_size if "mean" else 1) · loss_divisor``
        (see ``HookManager.set_loss_convention``).
        """
        if self.loss_reduction is None:
            return 1.0
        rows = batch_size if self.loss_reduction == "mean" else 1
        return float(rows * self.loss_divisor)

    def clear_cache(self) -> None:
        """Forget the cached state reads (the next call of each layer reads again)."""
        with self._lock:
            self._cache.clear()
            self._cache_version = None

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
        mask_key = (
            None
            if coordinates is None
            else (int(proj_kw["proj_dim"]), int(proj_kw.get("proj_seed", 0)))
        )
        key = (base_layer_name(layer_name), include_bias, mask_key, str(entries.device))
        out = self._precondition(layer_name, entries, coordinates, include_bias, key)
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

    def _read(
        self,
        layer_name: str,
        coordinates: torch.Tensor | None,
        include_bias: bool,
        device: torch.device,
    ) -> tuple[dict[str, torch.Tensor | None], int, dict]:
        """``(states on device, step count, update hyperparameters)`` of the layer."""
        snapshot = self.snapshot
        hyper = snapshot._update_hyperparameters(layer_name)
        states = snapshot.states(layer_name, coordinates, include_bias)
        states = {k: None if v is None else v.to(device) for k, v in states.items()}
        return states, snapshot.step_count(layer_name), hyper

    def _cached_read(
        self,
        layer_name: str,
        coordinates: torch.Tensor | None,
        include_bias: bool,
        device: torch.device,
        key: tuple,
    ) -> tuple[dict[str, torch.Tensor | None], int, dict]:
        if not self.cache:
            return self._read(layer_name, coordinates, include_bias, device)
        with self._lock:
            version = self.snapshot.state_version
            if version != self._cache_version:
                self._cache.clear()
                self._cache_version = version
            if key not in self._cache:
                self._cache[key] = self._read(layer_name, coordinates, include_bias, device)
            return self._cache[key]

    def _precondition(
        self,
        layer_name: str,
        entries: torch.Tensor,
        coordinates: torch.Tensor | None,
        include_bias: bool,
        key: tuple,
    ) -> torch.Tensor:
        if not self.enabled:
            return entries
        states, step, hyper = self._cached_read(
            layer_name, coordinates, include_bias, entries.device, key
        )
        scale = self.sample_scale(entries.shape[0])
        if scale != 1.0:
            entries = entries * scale
        return precondition(
            entries, states, optimizer_type=self.snapshot.optimizer_type, step=step + 1, **hyper
        )

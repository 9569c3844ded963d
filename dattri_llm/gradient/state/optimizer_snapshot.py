"""``OptimizerSnapshot``: a live view of an optimizer's state in hooked layers' gradient layout.

Coordinate-wise ``torch.optim`` optimizers keep per-parameter state tensors
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, …) shaped like the
parameter. Captured per-sample gradients live in the *materialize layout* of
their layer (``ops/materialize.py``): a Linear / conv layer is ``(out, K)``
row-major with the bias as an extra last column, HF ``Conv1D`` is reported
``(out, in)`` (its weight transposed), embeddings are ``(num_embeddings, E)``
and norm layers ``[dγ, dβ]``. :class:`OptimizerSnapshot` resolves a hooked
layer's module and parameter groups and reads its optimizer state in that
layout (all coordinates, or the mask subset a ``"mask"`` capture keeps); where
the state sits under DDP / FSDP1 / FSDP2 and how it is read whole is
``sharding.py``, the layout itself ``layout.py``.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.model.records import base_layer_name
from dattri_llm.gradient.ops.optimizer import (
    OPTIMIZER_STATE_KEYS,
    SECOND_MOMENT_STATE_KEYS,
    adafactor_variance,
    precondition,
)
from dattri_llm.gradient.ops.types import NORM_TYPES, detect_layer_type
from dattri_llm.gradient.state.layout import _SUPPORTED_TYPES, _lay_out
from dattri_llm.gradient.state.names import optimizer_type
from dattri_llm.gradient.state.sharding import (
    _check_fsdp,
    _gather_flat,
    _gather_local,
    _index_fsdp,
    _param_ref,
    _ParamRef,
)
from dattri_llm.utils.wrappers import unwrap_model

__all__ = ["LayerOptimizerState", "OptimizerSnapshot"]

OptimizerLike = torch.optim.Optimizer | Callable[[], torch.optim.Optimizer]

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


def _plain_name(name: str) -> str:
    """``name`` without the segments FSDP / checkpointing / compile insert."""
    return _WRAPPER_SEGMENT.sub("", name).lstrip(".")


def _resolve_module_names(model: nn.Module) -> dict[str, nn.Module]:
    """``name → module`` of the unwrapped model, wrapper segments removed from names."""
    return {_plain_name(name): module for name, module in unwrap_model(model).named_modules()}


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
        """The per-parameter state keys of this optimizer type (``OPTIMIZER_STATE_KEYS``).

        Adafactor: ``("variance",)`` (``SECOND_MOMENT_STATE_KEYS``), its factored
        moments of a matrix read as their rank-1 reconstruction.
        """
        kind = self.optimizer_type
        return OPTIMIZER_STATE_KEYS.get(kind) or SECOND_MOMENT_STATE_KEYS[kind]

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
        params = {"weight": _param_ref(module, "weight", self._fsdp_lookup)}
        if len(params["weight"].shape) < 2 and layer_type not in NORM_TYPES:
            raise RuntimeError(
                f"OptimizerSnapshot: layer {name!r} ({layer_type}) shows a 1-D weight: FSDP1 "
                "holds it sharded. Bind the layer inside its forward (where the HookManager "
                "and OptimizerStateCallback do), or build the snapshot on the FSDP-wrapped model."
            )
        if isinstance(getattr(module, "bias", None), torch.Tensor):
            params["bias"] = _param_ref(module, "bias", self._fsdp_lookup)
        bias = params.get("bias")
        binding = _Binding(
            module, layer_type, params["weight"].shape, None if bias is None else bias.shape, params
        )
        self._bindings[name] = self._bindings[layer_name] = binding

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
        if self.optimizer_type == "Adafactor":
            local = self._adafactor_states(layer_name, refs, local)
        with torch.no_grad():
            if any(ref.kind == "flat" for _, ref in refs):
                return _gather_flat(binding.layer_type, refs, local, tuple(keys), idx)
            return _gather_local(binding.layer_type, refs, local, tuple(keys), idx)

    def _adafactor_states(
        self, layer_name: str, refs: list[tuple[str, _ParamRef]], local: list[dict]
    ) -> list[dict]:
        """Adafactor states with ``variance`` for every parameter (factored ones reconstructed).

        Raises:
            NotImplementedError: the layer is sharded (the factors of a shard are not
                the shard of the factors).
        """
        if any(ref.kind != "local" for _, ref in refs):
            raise NotImplementedError(
                f"OptimizerSnapshot: layer {layer_name!r} is sharded (FSDP) and its Adafactor "
                "state is factored per shard; read Adafactor state on an unsharded model."
            )
        eps1 = self.group(layer_name).get("eps", (None, None))[0]
        out = []
        for state in local:
            if "row_var" in state and "col_var" in state:
                with torch.no_grad():
                    variance = adafactor_variance(state["row_var"], state["col_var"], eps1)
                state = {**state, "variance": variance}
            out.append(state)
        return out


_BOOKKEEPING = frozenset({"params", "param_names"})


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()

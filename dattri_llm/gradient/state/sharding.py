"""Where a layer's optimizer state lives under DDP, FSDP1 and FSDP2, and reading it whole.

Under DDP (or no wrapper) the state is parameter-shaped on every rank. Under
FSDP1 (``use_orig_params=True``) each rank holds a slice of a flat parameter and
the full layer is assembled by an exact all-reduce of the disjoint slices;
under FSDP2 (``fully_shard``) the state is a ``DTensor`` read with
``full_tensor()``. FSDP1 with ``use_orig_params=False`` is refused. The reads
return the layer's state laid out like its captured gradient (``layout.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.state.layout import _lay_out


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


def _comm_device(group: Any, fallback: torch.device) -> torch.device:
    """Device the collectives of ``group`` take tensors on (CUDA for NCCL, else ``fallback``)."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


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


def _param_ref(
    module: nn.Module, role: str, fsdp_lookup: Callable[[], dict[tuple, Any]]
) -> _ParamRef:
    """The optimizer-side parameter behind ``module.<role>`` (see :class:`_ParamRef`).

    ``fsdp_lookup`` returns the model's FSDP parameter index (``_index_fsdp``; built on
    first use by the caller).
    """
    tensor = getattr(module, role)
    flat = _flat_parameter(tensor)
    if flat is not None:  # FSDP1, unit unsharded: a view of its flat parameter
        index = _flat_index(flat, module, role)
        return _flat_ref(flat, index, fsdp_lookup().get(("flat", id(flat))))
    found = fsdp_lookup().get((id(module), role))
    if found is not None and found[0] == "fsdp1":
        return _flat_ref(found[1], found[2], found[3])
    if found is not None:  # FSDP2: the sharded DTensor parameter
        tensor = found[1]
    kind = "dtensor" if _is_dtensor(tensor) else "local"
    return _ParamRef(tensor, tensor.shape, kind)


def _flat_ref(flat: Any, index: int, group: Any) -> _ParamRef:
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

"""Which optimizer a ``torch.optim`` instance is, and rebuilding a saved one over a model.

:func:`optimizer_type` names the update rule of ``ops.optimizer`` an optimizer
follows; :func:`hf_trainer_param_names` and :func:`optimizer_from_state_dict`
map a saved ``optimizer.state_dict()`` (global parameter indices) back onto a
model's named parameters, as LESS's frozen form needs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from dattri_llm.gradient.ops.optimizer import OPTIMIZER_STATE_KEYS, SECOND_MOMENT_STATE_KEYS

__all__ = ["hf_trainer_param_names", "optimizer_from_state_dict", "optimizer_type"]


def optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    """First class name along the optimizer's MRO that is a key of ``OPTIMIZER_STATE_KEYS``.

    Or of ``SECOND_MOMENT_STATE_KEYS`` (``"Adafactor"``: its state is read, e.g.
    for ``ops.second_moment_normalize``, but it has no update map).

    Raises:
        NotImplementedError: no class in the MRO is a supported optimizer.
    """
    for cls in type(optimizer).__mro__:
        if cls.__name__ in OPTIMIZER_STATE_KEYS or cls.__name__ in SECOND_MOMENT_STATE_KEYS:
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
    from transformers import Trainer  # optional dependency: transformers

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

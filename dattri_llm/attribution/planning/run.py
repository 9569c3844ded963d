"""``plan_run``: what an attribution run will cost, before it starts, and its ``RunPlan``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dattri_llm.attribution.algorithm.kronecker.plan import resolve_kept_budget
from dattri_llm.attribution.planning.costs import (
    METHOD_PASSES,
    PassPlan,
    block_sizes,
    curvature_bytes,
    held_test_bytes,
    pass_plan,
    peak_memory_bytes,
    store_bytes,
)
from dattri_llm.attribution.planning.layers import (
    LayerPlan,
    activation_bytes,
    default_plan_config,
    plan_layers,
)
from dattri_llm.gradient.hooks.config import HookManagerConfig

__all__ = ["RunPlan", "format_bytes", "meta_model", "plan_run"]

SCORE_ITEMSIZE = 4  # the score matrix is float32


def format_bytes(n: int | float) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.2 KiB"``, ``"3.0 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "unknown (no probe)"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class RunPlan:
    """The predicted cost of an attribution run.

    Attributes:
        method: ``"graddot"``, ``"kfac"`` or ``"ekfac"``.
        num_train, num_test, seq_len, batch_size: the run's sizes.
        dtype: the parameters' and activations' floating dtype (``"float32"``).
        device: the device holding the kept blocks.
        layers: one :class:`LayerPlan` per hooked layer.
        bytes_per_record: all layers' payload bytes per record.
        train_store_bytes, test_store_bytes: the predicted sizes of disk stores
            of each side (payload + measured store overhead).
        covariance_bytes, eigenbasis_bytes, correction_bytes: the fit's
            memory (K-FAC / EK-FAC; 0 for Grad-Dot).
        train_block_bytes: one training block of ``batch_size`` records.
        held_test_bytes: the test side the scoring engine holds.
        score_bytes: the ``num_train × num_test`` float32 score matrix.
        scoring_bytes: ``train_block_bytes + held_test_bytes + score_bytes``.
        parameter_bytes: the model's parameters (each once: tied weights share).
        gradient_bytes: weight gradients the backward computes: 0 for a
            frozen probe that backpropagates to the hooked outputs only (the
            default), the trainable parameters' bytes with ``weight_gradients``.
        activation_bytes: what autograd saves for one batch's backward (a meta
            forward under ``saved_tensors_hooks``), plus the largest saved
            tensor once more (the backward's working gradient).
        peak_memory_bytes: the process's peak: ``parameter_bytes +
            gradient_bytes + activation_bytes + train_block_bytes`` (a batch's
            capture) plus the state held across it: the test side and the
            scores, and for K-FAC / EK-FAC the kept blocks and the fit. It
            leaves out the interpreter and its libraries (the process
            baseline: a few hundred MiB on CPU, the CUDA context on a GPU).
        passes: the pass plan (kept blocks, re-runs, the resolved budget).
        seconds_per_record: the probe's measurement, ``None`` without a probe.
        estimated_seconds: capture time of every record the run captures
            (training records × model runs + the test records), ``None``
            without a probe.
        notes: what the plan left out or assumed for this model.
    """

    method: str
    num_train: int
    num_test: int
    seq_len: int
    batch_size: int
    dtype: str
    device: str
    layers: tuple[LayerPlan, ...]
    bytes_per_record: int
    train_store_bytes: int
    test_store_bytes: int
    covariance_bytes: int
    eigenbasis_bytes: int
    correction_bytes: int
    train_block_bytes: int
    held_test_bytes: int
    score_bytes: int
    scoring_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    activation_bytes: int
    peak_memory_bytes: int
    passes: PassPlan
    seconds_per_record: float | None
    estimated_seconds: float | None
    notes: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-serializable dicts, lists, numbers and strings."""
        out = asdict(self)
        out["layers"] = [
            {
                **row,
                "shape": list(row["shape"]),
                "stored_shape": [list(s) for s in row["stored_shape"]],
                "curvature_dims": None
                if row["curvature_dims"] is None
                else list(row["curvature_dims"]),
            }
            for row in out["layers"]
        ]
        out["notes"] = list(self.notes)
        return out

    def format(self) -> str:
        """A plain-text table: one row per layer, then the totals in human units."""
        header = ("layer", "type", "d_in x d_out", "route", "per record")
        rows = [
            (
                layer.name,
                layer.layer_type.rsplit(".", 1)[-1],
                f"{layer.shape[0]} x {layer.shape[1]}",
                layer.route + (" (projected)" if layer.projection else ""),
                format_bytes(layer.bytes_per_record)
                + (f" + {format_bytes(layer.shared_bytes)}/block" if layer.shared_bytes else ""),
            )
            for layer in self.layers
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        line = "  ".join("{:<%d}" % w for w in widths)  # noqa: UP031 - a column template
        p = self.passes
        lines = [
            f"{self.method} plan: {self.num_train} train x {self.num_test} test records, "
            f"seq_len {self.seq_len}, batch {self.batch_size}, {self.dtype}, {self.device}",
            "",
            line.format(*header),
            line.format(*("-" * w for w in widths)),
            *(line.format(*row) for row in rows),
            "",
            f"layers                {len(self.layers)}",
            f"bytes per record      {format_bytes(self.bytes_per_record)}",
            f"train store           {format_bytes(self.train_store_bytes)}",
            f"test store            {format_bytes(self.test_store_bytes)}",
            f"fit: covariances      {format_bytes(self.covariance_bytes)}",
            f"fit: eigenbases       {format_bytes(self.eigenbasis_bytes)}",
            f"fit: EK-FAC correction {format_bytes(self.correction_bytes)}",
            f"scoring memory        {format_bytes(self.scoring_bytes)} (train block "
            f"{format_bytes(self.train_block_bytes)} + held test "
            f"{format_bytes(self.held_test_bytes)} + scores {format_bytes(self.score_bytes)})",
            f"peak memory           {format_bytes(self.peak_memory_bytes)} (parameters "
            f"{format_bytes(self.parameter_bytes)} + weight gradients "
            f"{format_bytes(self.gradient_bytes)} + activations "
            f"{format_bytes(self.activation_bytes)} + blocks, fit and scoring state)",
            f"passes                {p.passes} over {p.blocks} train blocks; kept "
            f"{p.kept_blocks} blocks ({format_bytes(p.kept_bytes)}) of budget "
            f"{format_bytes(p.budget_bytes)}; model runs {p.model_runs}, re-run blocks "
            f"{p.recomputed_blocks}",
            f"estimated time        {_format_seconds(self.estimated_seconds)}",
        ]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def meta_model(config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on the ``meta`` device (no storage), eval mode.

    Eval mode as attribution at a fixed checkpoint runs it: no dropout (whose
    masks would count in the planned activations).

    ``config`` is a ``transformers.PretrainedConfig``, or a local directory /
    Hub id that ``AutoConfig.from_pretrained`` reads.
    """
    # optional dependency: transformers (only to build a model from its config)
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(os.fspath(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _itemsize(param: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes per element of ``param`` in the run: floating parameters in ``dtype``."""
    kind = dtype if param.is_floating_point() else param.dtype
    return torch.empty((), dtype=kind, device="meta").element_size()


def _is_config(model: object) -> bool:
    return hasattr(model, "to_dict") and hasattr(model, "model_type")


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        low = 0 if name in ("num_test",) else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"plan_run: {name} must be an int >= {low}, got {value!r}.")


def plan_run(
    model: nn.Module | Any,
    *,
    num_train: int,
    num_test: int,
    seq_len: int,
    method: str = "graddot",
    hook_config: HookManagerConfig | None = None,
    projection: dict[str, dict] | None = None,
    batch_size: int = 8,
    dtype: torch.dtype = torch.float32,
    kept_gradient_budget: int | None = None,
    device: torch.device | str = "cpu",
    probe: float | Callable[[], float] | None = None,
    weight_gradients: bool = False,
) -> RunPlan:
    """Predict the cost of attributing ``num_train`` × ``num_test`` records of ``seq_len`` tokens.

    Args:
        model: an ``nn.Module`` (any device; run only on ``meta``), a
            ``transformers.PretrainedConfig`` (built on ``meta``: no weights are
            loaded or allocated), or a config directory / Hub id.
        num_train, num_test: records on each side.
        seq_len: tokens per record ``T``.
        method: ``"graddot"`` (1 pass), ``"kfac"`` (2) or ``"ekfac"`` (3).
        hook_config: the run's hook config (``None``: ``linear_io=REGISTER_ALL``,
            the gradient streamer's default).
        projection: ``projection_kwargs`` (``{layer | "__default__": {...}}``)
            to plan with; replaces the hook config's.
        batch_size: records per block (both sides).
        dtype: the floating dtype of the parameters and activations.
        kept_gradient_budget: bytes of first-pass blocks K-FAC / EK-FAC keep
            (``None``: ``min(1 GiB, share of device's free memory)``).
        device: the device holding the kept blocks (the compute device).
        probe: seconds per record of capture (a number, e.g. from
            :func:`measure_capture_seconds`, or a callable returning it);
            ``None`` leaves the time unknown.
        weight_gradients: whether the backward computes the parameters'
            gradients (a wrapped DDP / FSDP model, training with updates,
            gradient checkpointing, ``param_grad`` hooks); ``False``: the
            frozen probe's backward to the hooked outputs only.

    Returns:
        The :class:`RunPlan`.
    """
    if method not in METHOD_PASSES:
        raise ValueError(f"plan_run: method {method!r} must be one of {sorted(METHOD_PASSES)}.")
    _check_sizes(num_train=num_train, num_test=num_test, seq_len=seq_len, batch_size=batch_size)
    if isinstance(model, (str, os.PathLike)) or _is_config(model):
        model = meta_model(model, dtype)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"plan_run: model must be an nn.Module, a transformers config or a config path, "
            f"got {type(model).__name__}."
        )
    if projection is not None:
        settings = dict(vars(default_plan_config() if hook_config is None else hook_config))
        hook_config = HookManagerConfig(**{**settings, "projection_kwargs": projection})
    layers, notes = plan_layers(model, hook_config, seq_len=seq_len, dtype=dtype)
    device = torch.device(device)
    budget = resolve_kept_budget(kept_gradient_budget, device)
    passes = pass_plan(layers, method, num_train, batch_size, budget)
    cov, eig, corr = curvature_bytes(layers, method)
    train_block = sum(layer.block_bytes(min(batch_size, num_train)) for layer in layers)
    held = held_test_bytes(layers, method, num_test, batch_size)
    scores = num_train * num_test * SCORE_ITEMSIZE
    params = {id(p): p for p in model.parameters()}.values()
    parameter_bytes = sum(p.numel() * _itemsize(p, dtype) for p in params)
    gradient_bytes = (
        sum(p.numel() * _itemsize(p, dtype) for p in params if p.requires_grad)
        if weight_gradients
        else 0
    )
    saved, largest = activation_bytes(
        model, batch=min(batch_size, num_train), seq_len=seq_len, dtype=dtype
    )
    if not saved:
        notes.append("activations unknown (the meta forward with gradients failed): counted as 0")
    peak = peak_memory_bytes(
        method=method,
        parameters=parameter_bytes,
        gradients=gradient_bytes,
        activations=saved,
        largest_activation=largest,
        train_block=train_block,
        kept=passes.kept_bytes,
        curvature=(cov, eig, corr),
        held_test=held,
        scores=scores,
    )
    seconds = probe() if callable(probe) else probe
    estimate = None
    if seconds is not None:
        rerun = sum(block_sizes(num_train, batch_size)[: passes.blocks - passes.kept_blocks])
        captured = num_train + rerun * (passes.passes - 1) + num_test
        estimate = float(seconds) * captured
    if method != "graddot":
        others = [layer.name for layer in layers if layer.curvature_dims is None]
        if others:
            notes.append(
                f"not Kronecker-preconditioned (non_kfac_strategy decides; sized as captured): "
                f"{others}"
            )
    return RunPlan(
        method=method,
        num_train=num_train,
        num_test=num_test,
        seq_len=seq_len,
        batch_size=batch_size,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        layers=tuple(layers),
        bytes_per_record=sum(layer.bytes_per_record for layer in layers),
        train_store_bytes=store_bytes(layers, num_train, batch_size),
        test_store_bytes=store_bytes(layers, num_test, batch_size),
        covariance_bytes=cov,
        eigenbasis_bytes=eig,
        correction_bytes=corr,
        train_block_bytes=train_block,
        held_test_bytes=held,
        score_bytes=scores,
        scoring_bytes=train_block + held + scores,
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_bytes,
        activation_bytes=saved + largest,
        peak_memory_bytes=peak,
        passes=passes,
        seconds_per_record=None if seconds is None else float(seconds),
        estimated_seconds=estimate,
        notes=tuple(notes),
    )

"""STRIDE's steering operators, the frozen model's forward, and the subset measurements.

A steering operator stands in for "the model after also training on subset
``A_k``": a shared rank-``r`` basis ``β_ψ(h) = h Wᵀ`` (``W`` ``(r, D)``, no
bias, no nonlinearity) read from the hidden state ``h`` ``(D,)`` at one layer,
times a per-subset coefficient matrix ``G_k`` ``(r, O)``. The shift
``β_ψ(h) G_k`` is added

* to the logits (``injection="logits"``, ``O = C``): ``õ = o + β_ψ(h) G_k``.
  The frozen model runs once; each subset then costs one ``(r, C)`` product.
* to the layer's output (``injection="residual"``, ``O = D``): the frozen
  layers above it carry ``h + β_ψ(h) G_k`` to the logits, one forward per
  subset (batched: the batch is repeated once per subset of a chunk).

The measurement of subset ``k`` on query ``x`` is ``u_k(x) = L(o(x)) −
L(õ^{(k)}(x))``, ``L`` the mean token cross-entropy over ``x``'s target tokens:
positive when the subset's operator lowers the query loss (it helps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm.gradient.stream.training import move_batch

__all__ = [
    "IGNORE_INDEX",
    "INJECTIONS",
    "FrozenPass",
    "LogitsFn",
    "SteeringOperators",
    "causal_lm_logits",
    "default_layer",
    "frozen_pass",
    "mean_token_kl",
    "mean_token_loss",
    "measure",
    "repeat_batch",
    "resolve_layer",
    "steered_logits",
    "subset_chunks",
]

IGNORE_INDEX = -100
INJECTIONS = ("logits", "residual")
DEFAULT_DEPTH = 0.625  # reproduces the released (depth, layer) pairs 12→8, 16→10, 20→12, 24→15

LogitsFn = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]
"""``(model, batch) -> (logits (B, T, C), labels (B, T))``: ``labels[b, t]`` is the target of
``logits[b, t]`` (already shifted), ``IGNORE_INDEX`` where there is none; position ``t`` is
the position of the hooked layer's hidden state. ``(B, C)`` logits with ``(B,)`` labels are
read as ``T = 1``."""


# --------------------------------------------------------------------------- model access


def causal_lm_logits(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``(B, T, C)`` and next-token labels ``(B, T)`` of a Hugging Face causal LM.

    Calls ``model(**inputs)`` with every batch field except ``labels``. The
    targets are ``batch["labels"]`` when present, else ``input_ids`` with
    ``IGNORE_INDEX`` where ``attention_mask == 0``; they are shifted left by one
    (position ``t`` predicts token ``t + 1``; the last position has no target).

    Raises:
        TypeError: the batch is not a dict.
        ValueError: the batch has neither ``labels`` nor ``input_ids``, or the
            output carries no logits.
    """
    if not isinstance(batch, dict):
        raise TypeError(
            f"the default logits_fn calls model(**batch) and needs a dict batch, got "
            f"{type(batch).__name__}; pass logits_fn=(model, batch) -> (logits, labels)"
        )
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    output = model(**inputs)
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if logits is None:
        raise ValueError(
            f"the output of {type(model).__name__}(**batch) has no logits; pass "
            "logits_fn=(model, batch) -> (logits, labels)"
        )
    labels = batch.get("labels")
    if labels is None:
        if "input_ids" not in batch:
            raise ValueError(
                f"the batch (keys {sorted(batch)}) has neither 'labels' nor 'input_ids'; "
                "add one or pass logits_fn=(model, batch) -> (logits, labels)"
            )
        labels = batch["input_ids"].clone()
        mask = batch.get("attention_mask")
        if mask is not None:
            labels[mask == 0] = IGNORE_INDEX
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return logits, shifted


def default_layer(model: nn.Module) -> str:
    """The output of block ``round(0.625 · L)`` (1-based) of a Hugging Face decoder.

    Looks for the block list at ``model.layers``, ``model.model.layers``,
    ``model.transformer.h`` or ``model.gpt_neox.layers``; returns its module
    name, e.g. ``"model.layers.7"`` for ``L = 12``.

    Raises:
        ValueError: no block list is found (pass ``layer=`` a module name).
    """
    names = dict(model.named_modules())
    for prefix in ("model.layers", "layers", "transformer.h", "gpt_neox.layers"):
        blocks = names.get(prefix)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            index = min(len(blocks), max(1, round(DEFAULT_DEPTH * len(blocks)))) - 1
            return f"{prefix}.{index}"
    raise ValueError(
        f"cannot find the decoder blocks of {type(model).__name__} (looked for model.layers, "
        "layers, transformer.h, gpt_neox.layers); pass layer= the name of the module whose "
        "output the operators read, e.g. one from model.named_modules()"
    )


def resolve_layer(model: nn.Module, layer: str | None) -> tuple[str, nn.Module]:
    """``(name, module)`` of ``layer`` (:func:`default_layer` when ``None``)."""
    name = default_layer(model) if layer is None else layer
    try:
        return name, model.get_submodule(name)
    except AttributeError:
        known = [n for n, _ in model.named_modules() if n][:8]
        raise ValueError(
            f"layer {name!r} is not a submodule of {type(model).__name__}; pass a name from "
            f"model.named_modules(), e.g. {known}"
        ) from None


def repeat_batch(batch: Any, times: int) -> Any:
    """``batch`` with every tensor of leading size ``B`` repeated ``times`` along dim 0.

    Dicts, lists and tuples are rebuilt; other values (and 0-d tensors) are kept.
    """
    if isinstance(batch, torch.Tensor):
        return batch.repeat(times, *([1] * (batch.dim() - 1))) if batch.dim() else batch
    if isinstance(batch, dict):
        return {key: repeat_batch(value, times) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(repeat_batch(value, times) for value in batch)
    return batch


def _first(output: Any) -> torch.Tensor:
    """The hidden state of a module output (the tensor, or its first element)."""
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(
            f"the STRIDE layer must output a tensor (or a tuple starting with one), got "
            f"{type(hidden).__name__}; pass layer= another module"
        )
    return hidden


@contextmanager
def _layer_hook(
    module: nn.Module,
    captured: list[torch.Tensor],
    shift: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[None]:
    """Record ``module``'s output hidden state; with ``shift``, return ``h + shift(h)`` instead."""

    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        hidden = _first(output)
        captured.append(hidden)
        if shift is None:
            return None
        moved = hidden + shift(hidden).to(hidden.dtype)
        if isinstance(output, tuple):
            return (moved, *output[1:])
        if isinstance(output, list):
            return [moved, *output[1:]]
        return moved

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _as_tokens(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T, C)`` float32 logits, ``(B, T)`` labels (``(B, C)``, ``(B,)`` read as ``T = 1``)."""
    if logits.dim() == 2 and labels.dim() == 1:
        logits, labels = logits[:, None], labels[:, None]
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits_fn must return logits (B, T, C) and labels (B, T), got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    return logits.float(), labels


def _align_hidden(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The hooked state as ``(B, T, D)`` float32, one row per logit position."""
    batch, tokens = logits.shape[:2]
    if hidden.numel() % (batch * tokens):
        raise ValueError(
            f"the STRIDE layer's output {tuple(hidden.shape)} does not hold one hidden state per "
            f"logit position (B={batch}, T={tokens}); pass layer= a module with output "
            "(B, T, D) or (B, D)"
        )
    return hidden.detach().float().reshape(batch, tokens, -1)


# --------------------------------------------------------------------------- operators


class SteeringOperators(nn.Module):
    """The shared basis ``W`` ``(r, D)`` and the coefficients ``G`` ``(K, r, O)``.

    ``W`` starts uniform in ``±1/√D`` (drawn from ``seed``), ``G`` at zero, so
    the untrained operators leave the model unchanged.

    Args:
        input_dim: ``D``, the hooked hidden size.
        rank: ``r``.
        output_dim: ``O``: ``C`` (logits) or ``D`` (residual).
        num_subsets: ``K``.
        seed: seed of ``W``'s draw.
    """

    def __init__(
        self, input_dim: int, rank: int, output_dim: int, num_subsets: int, seed: int = 0
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(input_dim)
        basis = (torch.rand(rank, input_dim, generator=generator) * 2 - 1) * bound
        self.basis = nn.Parameter(basis)
        self.coefficients = nn.Parameter(torch.zeros(num_subsets, rank, output_dim))

    def codes(self, hidden: torch.Tensor) -> torch.Tensor:
        """``β_ψ(h)``: ``(..., D)`` → ``(..., r)``."""
        return hidden.float() @ self.basis.T

    def shift_rows(self, hidden: torch.Tensor, subsets: torch.Tensor) -> torch.Tensor:
        """Row ``b``'s shift under its own subset: ``(B, ..., D)``, ``(B,)`` → ``(B, ..., O)``."""
        return torch.einsum("b...r,bro->b...o", self.codes(hidden), self.coefficients[subsets])

    def shift_subsets(self, hidden: torch.Tensor, subsets: torch.Tensor) -> torch.Tensor:
        """Every row under every subset: ``(B, ..., D)``, ``(S,)`` → ``(S, B, ..., O)``."""
        return torch.einsum("...r,sro->s...o", self.codes(hidden), self.coefficients[subsets])


# --------------------------------------------------------------------------- forwards


@dataclass
class FrozenPass:
    """The frozen model on one batch: hidden ``(B, T, D)``, logits ``(B, T, C)``, labels ``(B, T)``.

    ``hidden`` and ``logits`` are detached float32.
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor


def frozen_pass(model: nn.Module, batch: Any, layer: nn.Module, logits_fn: LogitsFn) -> FrozenPass:
    """One forward without gradients, reading ``layer``'s output and the logits."""
    captured: list[torch.Tensor] = []
    with torch.no_grad(), _layer_hook(layer, captured):
        logits, labels = _as_tokens(*logits_fn(model, batch))
    if len(captured) != 1:
        raise ValueError(
            f"the STRIDE layer ran {len(captured)} times in one forward; pass layer= a module "
            "that runs exactly once per forward"
        )
    return FrozenPass(_align_hidden(captured[0], logits), logits.detach(), labels)


def _residual_logits(
    operators: SteeringOperators,
    model: nn.Module,
    batch: Any,
    layer: nn.Module,
    logits_fn: LogitsFn,
    row_subsets: torch.Tensor,
) -> torch.Tensor:
    """Logits ``(B, T, C)`` with row ``b``'s layer output moved by its subset's operator."""

    def shift(hidden: torch.Tensor) -> torch.Tensor:
        return operators.shift_rows(hidden, row_subsets)

    with _layer_hook(layer, [], shift):
        logits, _ = _as_tokens(*logits_fn(model, batch))
    return logits


def steered_logits(
    operators: SteeringOperators,
    frozen: FrozenPass,
    subsets: torch.Tensor,
    *,
    injection: str,
    model: nn.Module,
    batch: Any,
    layer: nn.Module,
    logits_fn: LogitsFn,
    per_row: bool = False,
) -> torch.Tensor:
    """Steered logits ``õ``: every row under every subset, or each row under its own.

    Args:
        operators: the operators.
        frozen: :func:`frozen_pass` of ``batch``.
        subsets: ``(S,)`` subset indices, or ``(B,)`` with ``per_row=True``.
        injection: ``"logits"`` or ``"residual"``.
        model, batch, layer, logits_fn: the frozen model and its batch (the
            residual injection runs it again).
        per_row: row ``b`` under subset ``subsets[b]`` only.

    Returns:
        ``(S, B, T, C)``, or ``(B, T, C)`` with ``per_row=True``; differentiable
        in the operators.
    """
    if injection == "logits":
        if per_row:
            return frozen.logits + operators.shift_rows(frozen.hidden, subsets)
        return frozen.logits + operators.shift_subsets(frozen.hidden, subsets)
    if per_row:
        return _residual_logits(operators, model, batch, layer, logits_fn, subsets)
    rows = frozen.logits.shape[0]
    row_subsets = subsets.repeat_interleave(rows)
    logits = _residual_logits(
        operators, model, repeat_batch(batch, len(subsets)), layer, logits_fn, row_subsets
    )
    return logits.reshape(len(subsets), rows, *logits.shape[1:])


# --------------------------------------------------------------------------- losses


def _target_mask(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask (B, T) float, count (B,) clamped to >= 1)`` of the target positions."""
    mask = (labels != IGNORE_INDEX).float()
    return mask, mask.sum(dim=-1).clamp(min=1.0)


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-example mean cross-entropy over target tokens: ``(..., B, T, C)`` → ``(..., B)``.

    Each target token has weight ``1 / (number of targets of its example)``;
    an example without targets gets 0.
    """
    mask, count = _target_mask(labels)
    safe = labels.clamp(min=0).expand(logits.shape[:-1])
    nll = -torch.gather(F.log_softmax(logits, dim=-1), -1, safe.unsqueeze(-1)).squeeze(-1)
    return (nll * mask).sum(dim=-1) / count


def mean_token_kl(
    frozen_logits: torch.Tensor, steered: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Per-example mean ``KL(softmax(o) ‖ softmax(õ))`` over target positions, ``(B,)``."""
    mask, count = _target_mask(labels)
    log_p = F.log_softmax(frozen_logits, dim=-1)
    log_q = F.log_softmax(steered, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return (kl * mask).sum(dim=-1) / count


# --------------------------------------------------------------------------- measurement


def subset_chunks(num_subsets: int, chunk: int, device: torch.device) -> Iterator[torch.Tensor]:
    """``arange(K)`` in consecutive pieces of at most ``chunk`` subsets."""
    for start in range(0, num_subsets, chunk):
        yield torch.arange(start, min(num_subsets, start + chunk), device=device)


def measure(
    operators: SteeringOperators,
    model: nn.Module,
    batches: Iterable[Any],
    *,
    layer: nn.Module,
    logits_fn: LogitsFn,
    injection: str,
    subset_chunk: int,
    device: torch.device,
) -> torch.Tensor:
    """``u`` ``(Q, K)``: ``u[q, k] = L(o(x_q)) − L(õ^{(k)}(x_q))`` for every query batch.

    ``L`` is :func:`mean_token_loss`. Without gradients; subsets are handled
    ``subset_chunk`` at a time (the logits injection reuses one frozen
    forward per batch; the residual one runs the chunk as one repeated batch).
    """
    rows = []
    num_subsets = operators.coefficients.shape[0]
    with torch.no_grad():
        for batch in batches:
            batch = move_batch(batch, device)
            frozen = frozen_pass(model, batch, layer, logits_fn)
            base = mean_token_loss(frozen.logits, frozen.labels)
            u = torch.empty(base.shape[0], num_subsets, device=base.device)
            for chunk in subset_chunks(num_subsets, subset_chunk, base.device):
                steered = steered_logits(
                    operators,
                    frozen,
                    chunk,
                    injection=injection,
                    model=model,
                    batch=batch,
                    layer=layer,
                    logits_fn=logits_fn,
                )
                u[:, chunk] = (base - mean_token_loss(steered, frozen.labels)).T
            rows.append(u.cpu())
    return torch.cat(rows) if rows else torch.empty(0, num_subsets)

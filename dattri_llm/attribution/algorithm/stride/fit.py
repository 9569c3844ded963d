"""Fitting STRIDE's operators against a frozen model: fidelity, stability and linearity.

Each step draws ``subsets_per_step`` subsets ``k`` and, for each, members of
``A_k`` (fidelity rows) and non-members (reference rows ``R_k``), runs them as
one batch, and minimises

* fidelity: the mean over member rows of their mean token loss under their
  subset's steered model;
* stability: the mean over reference rows of ``KL(frozen ‖ steered)`` per
  target token;
* linearity (every ``linearity_every`` steps): the mean over a fixed probe
  batch of training examples of ``‖(I − H_γ) u(x)‖² / K``, ``u(x)`` ``(K,)``
  the probe's responses to all ``K`` operators and ``H_γ`` the ridge hat
  matrix of the sketched design ``Π = M Ω``.

Only the operators get gradients; the model's ``requires_grad`` flags and
training mode are restored afterwards.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from dattri_llm.attribution.algorithm.stride.config import StrideConfig
from dattri_llm.attribution.algorithm.stride.design import SubsetDesign
from dattri_llm.attribution.algorithm.stride.operators import (
    FrozenPass,
    LogitsFn,
    SteeringOperators,
    frozen_pass,
    mean_token_kl,
    mean_token_loss,
    steered_logits,
    subset_chunks,
)
from dattri_llm.gradient.stream.training import move_batch

__all__ = [
    "StrideFit",
    "fit_operators",
    "linearity_projector",
    "ridge_hat_matrix",
    "train_set_hash",
]

SAMPLING_SEED_OFFSET = 1  # the fit's row sampling draws from seed + 1
SKETCH_SEED_OFFSET = 2  # Ω draws from seed + 2
_REFERENCE_TRIES = 64  # rejection draws per reference row before giving up on it

Collate = Callable[[list[Any]], Any]


def train_set_hash(train_ids: Sequence[str]) -> str:
    """SHA-256 hex digest of the training ids in order (the identity of a fit's training set)."""
    digest = hashlib.sha256()
    for identifier in train_ids:
        digest.update(identifier.encode())
        digest.update(b"\n")
    return digest.hexdigest()


@dataclass
class StrideFit:
    """Fitted operators with everything needed to measure and recover.

    Attributes:
        operators: the basis ``(r, D)`` and coefficients ``(K, r, O)``.
        design: the subset design ``M`` ``(K, N)``.
        config: the settings, ``num_subsets`` resolved.
        layer: the module name the basis reads.
        train_ids: the ``N`` training ids in dataset order.
        history: per step ``{"fidelity", "stability", "linearity", "total"}``
            (``linearity`` is ``nan`` on steps without the term).
    """

    operators: SteeringOperators
    design: SubsetDesign
    config: StrideConfig
    layer: str
    train_ids: list[str]
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def train_hash(self) -> str:
        """:func:`train_set_hash` of :attr:`train_ids`."""
        return train_set_hash(self.train_ids)


# --------------------------------------------------------------------------- linearity


def ridge_hat_matrix(sketch: torch.Tensor, gamma: float) -> torch.Tensor:
    """``H_γ = Π (ΠᵀΠ + γ I)⁻¹ Πᵀ`` ``(K, K)`` of a sketch ``Π`` ``(K, q)``, in float64."""
    sketch = sketch.double()
    gram = sketch.T @ sketch + gamma * torch.eye(sketch.shape[1], dtype=torch.float64)
    return sketch @ torch.linalg.solve(gram, sketch.T)


def linearity_projector(
    design: SubsetDesign, sketch_dim: int, ridge: float, seed: int
) -> torch.Tensor:
    """``I − H_γ`` ``(K, K)`` float32 for ``Π = M Ω`` and ``γ = ridge · trace(ΠᵀΠ) / q``.

    ``Ω`` is drawn from ``seed`` (:meth:`SubsetDesign.sketch`). The matrix
    depends on no trained parameter and is built once per fit.
    """
    sketch = design.sketch(sketch_dim, torch.Generator().manual_seed(seed))
    gamma = ridge * float((sketch.double() ** 2).sum()) / sketch_dim
    hat = ridge_hat_matrix(sketch, max(gamma, 1e-12))
    return (torch.eye(design.num_subsets, dtype=torch.float64) - hat).float()


def _responses(
    operators: SteeringOperators,
    frozen: FrozenPass,
    chunk: torch.Tensor,
    context: dict[str, Any],
) -> torch.Tensor:
    """``u`` ``(P, S)`` of the probe rows for the subsets of ``chunk``."""
    base = mean_token_loss(frozen.logits, frozen.labels)
    steered = steered_logits(operators, frozen, chunk, **context)
    return (base - mean_token_loss(steered, frozen.labels)).T


def _linearity_backward(
    operators: SteeringOperators,
    frozen: FrozenPass,
    projector: torch.Tensor,
    weight: float,
    chunk_size: int,
    context: dict[str, Any],
) -> float:
    """Accumulate ``weight ·`` the linearity term's gradient; return the term's value.

    Two passes keep memory at one chunk of subsets: the responses ``u``
    ``(P, K)`` without gradients, then each chunk again with gradients,
    weighted by ``∂term/∂u = 2 (I − H)ᵀ (I − H) u / (P K)``.
    """
    num_subsets = projector.shape[0]
    chunks = list(subset_chunks(num_subsets, chunk_size, projector.device))
    with torch.no_grad():
        u = torch.cat([_responses(operators, frozen, c, context) for c in chunks], dim=1)
    residual = u @ projector.T
    scale = residual.shape[0] * num_subsets
    value = float((residual**2).sum()) / scale
    if weight > 0:
        upstream = weight * 2.0 * (residual @ projector) / scale
        for chunk in chunks:
            (_responses(operators, frozen, chunk, context) * upstream[:, chunk]).sum().backward()
    return value


# --------------------------------------------------------------------------- sampling


def _draw_rows(
    design: SubsetDesign, config: StrideConfig, generator: torch.Generator
) -> tuple[list[int], list[int], int]:
    """One step's rows: ``(examples, subsets, number of fidelity rows first)``."""
    n = design.num_examples
    nonempty = torch.nonzero(design.subset_sizes() > 0).flatten()
    picked = nonempty[torch.randperm(nonempty.numel(), generator=generator)]
    picked = picked[: config.subsets_per_step]
    fid_rows: list[tuple[int, int]] = []
    ref_rows: list[tuple[int, int]] = []
    for k in picked.tolist():
        members = design.subset(k)
        take = min(config.fidelity_batch_size, members.numel())
        order = torch.randperm(members.numel(), generator=generator)[:take]
        fid_rows += [(int(i), k) for i in members[order]]
        for _ in range(config.reference_batch_size if members.numel() < n else 0):
            for _ in range(_REFERENCE_TRIES):
                i = int(torch.randint(n, (1,), generator=generator))
                if not bool((design.members[i] == k).any()):
                    ref_rows.append((i, k))
                    break
    rows = fid_rows + ref_rows
    return [i for i, _ in rows], [k for _, k in rows], len(fid_rows)


# --------------------------------------------------------------------------- fit


@dataclass
class _Frozen:
    """The frozen model and how to feed it: the pieces every forward of the fit needs."""

    model: nn.Module
    module: nn.Module
    logits_fn: LogitsFn
    collate_fn: Collate
    device: torch.device
    injection: str

    def batch(self, dataset: Any, indices: list[int]) -> Any:
        """``collate_fn`` of the given items, moved to the device."""
        return move_batch(self.collate_fn([dataset[i] for i in indices]), self.device)

    def run(self, batch: Any) -> FrozenPass:
        """:func:`frozen_pass` of ``batch``."""
        return frozen_pass(self.model, batch, self.module, self.logits_fn)

    def context(self, batch: Any) -> dict[str, Any]:
        """The keywords :func:`steered_logits` needs besides the operators and subsets."""
        return {
            "injection": self.injection,
            "model": self.model,
            "batch": batch,
            "layer": self.module,
            "logits_fn": self.logits_fn,
        }


def fit_operators(
    model: nn.Module,
    dataset: Any,
    design: SubsetDesign,
    config: StrideConfig,
    *,
    layer: tuple[str, nn.Module],
    logits_fn: LogitsFn,
    collate_fn: Collate,
    device: torch.device,
    train_ids: list[str],
    verbose: bool = False,
) -> StrideFit:
    """Train the operators of every subset of ``design`` against the frozen ``model``.

    Args:
        model: the frozen model (never updated; its flags and mode are restored).
        dataset: the ``N`` training examples, indexable, in design order.
        design: the subset design over ``dataset``.
        config: the settings.
        layer: ``(name, module)`` whose output the basis reads.
        logits_fn: ``(model, batch) -> (logits, labels)``.
        collate_fn: builds a batch from a list of dataset items.
        device: where the operators live (the model's device).
        train_ids: the training ids, stored with the fit.
        verbose: show a progress bar over the steps.

    Returns:
        the :class:`StrideFit` (its config records the resolved ``K`` and ``q``).
    """
    frozen = _Frozen(model, layer[1], logits_fn, collate_fn, device, config.injection)
    generator = torch.Generator().manual_seed(config.seed + SAMPLING_SEED_OFFSET)
    sketch_dim = config.sketch_dim or max(1, design.num_subsets // 4)
    if sketch_dim >= design.num_subsets and config.linearity_weight > 0:
        warnings.warn(
            f"sketch_dim q={sketch_dim} is not below num_subsets K={design.num_subsets}: the hat "
            "matrix is then nearly the identity and the linearity term nearly vanishes; use "
            "q < K (default K // 4)",
            UserWarning,
            stacklevel=3,
        )
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    try:
        model.requires_grad_(False)
        model.eval()
        probe_index = torch.randperm(design.num_examples, generator=generator)
        probe_batch = frozen.batch(dataset, probe_index[: config.probe_size].tolist())
        probe = frozen.run(probe_batch)
        hidden_dim = probe.hidden.shape[-1]
        output_dim = probe.logits.shape[-1] if config.injection == "logits" else hidden_dim
        operators = SteeringOperators(
            hidden_dim, config.rank, output_dim, design.num_subsets, config.seed
        ).to(device)
        projector = linearity_projector(
            design, sketch_dim, config.ridge, config.seed + SKETCH_SEED_OFFSET
        ).to(device)
        optimizer = torch.optim.Adam(operators.parameters(), lr=config.learning_rate)
        history = []
        steps = tqdm(range(config.steps), desc="STRIDE fit", unit="step", disable=not verbose)
        for step in steps:
            optimizer.zero_grad(set_to_none=True)
            record = _fidelity_stability_backward(
                operators, frozen, dataset, design, config, generator
            )
            record["linearity"] = float("nan")
            if config.linearity_weight > 0 and step % config.linearity_every == 0:
                record["linearity"] = _linearity_backward(
                    operators,
                    probe,
                    projector,
                    config.linearity_weight,
                    config.subset_chunk,
                    frozen.context(probe_batch),
                )
                record["total"] += config.linearity_weight * record["linearity"]
            optimizer.step()
            history.append(record)
            if verbose:
                steps.set_postfix(loss=f"{record['total']:.4g}")
        optimizer.zero_grad(set_to_none=True)
    finally:
        for parameter, flag in zip(model.parameters(), flags):
            parameter.requires_grad_(flag)
        model.train(was_training)
    operators.requires_grad_(False)
    return StrideFit(
        operators=operators,
        design=design,
        config=config.replace(num_subsets=design.num_subsets, sketch_dim=sketch_dim),
        layer=layer[0],
        train_ids=list(train_ids),
        history=history,
    )


def _fidelity_stability_backward(
    operators: SteeringOperators,
    frozen: _Frozen,
    dataset: Any,
    design: SubsetDesign,
    config: StrideConfig,
    generator: torch.Generator,
) -> dict[str, float]:
    """One step's fidelity and stability terms: backward of their weighted sum, and the values."""
    examples, subsets, num_fid = _draw_rows(design, config, generator)
    batch = frozen.batch(dataset, examples)
    base = frozen.run(batch)
    row_subsets = torch.tensor(subsets, device=base.logits.device)
    steered = steered_logits(operators, base, row_subsets, per_row=True, **frozen.context(batch))
    fidelity = mean_token_loss(steered[:num_fid], base.labels[:num_fid]).mean()
    total = config.fidelity_weight * fidelity
    stability = torch.zeros((), device=fidelity.device)
    if len(examples) > num_fid:
        stability = mean_token_kl(
            base.logits[num_fid:], steered[num_fid:], base.labels[num_fid:]
        ).mean()
        total = total + config.stability_weight * stability
    total.backward()
    return {
        "fidelity": fidelity.item(),
        "stability": stability.item(),
        "total": total.item(),
    }

"""The plan's arithmetic: store size, fit and scoring memory, and the pass plan.

Store overhead constants were measured by writing tiny GPT-2 stores through
``OffloadCallback`` → ``GradientStorageManager`` (memmap groups, one group per
step) and subtracting the payload (``Gradient.nbytes``) from the files' sizes:
each group's ``.mmap.meta`` holds ~1.4 KB plus ~217 B per layer, and each
record adds ~73 B to it and ~67 B to ``index.jsonl`` (its identifier). With
10 and 28 layers, batch 1 and 8, the fit is within 1 % of the overhead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dattri_llm.attribution.planning.layers import LayerPlan

__all__ = [
    "CURVATURE_ITEMSIZE",
    "METHOD_PASSES",
    "STORE_GROUP_OVERHEAD_BYTES",
    "STORE_LAYER_OVERHEAD_BYTES",
    "STORE_RECORD_OVERHEAD_BYTES",
    "PassPlan",
    "block_sizes",
    "pass_plan",
    "peak_memory_bytes",
    "store_bytes",
]

STORE_GROUP_OVERHEAD_BYTES = 1460  # per written group (one step): the .mmap.meta header
STORE_LAYER_OVERHEAD_BYTES = 217  # per layer per group: its entry in the .mmap.meta
STORE_RECORD_OVERHEAD_BYTES = 140  # per record: its id in the .mmap.meta and index.jsonl
CURVATURE_ITEMSIZE = 4  # K-FAC / EK-FAC factors are float32
METHOD_PASSES = {"graddot": 1, "kfac": 2, "ekfac": 3}  # passes over the training gradients


def block_sizes(num_records: int, batch_size: int) -> list[int]:
    """Records per block: full blocks of ``batch_size``, then the remainder."""
    full, rest = divmod(num_records, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def _block_bytes(layers: list[LayerPlan], batch: int) -> int:
    return sum(layer.block_bytes(batch) for layer in layers)


def store_bytes(layers: list[LayerPlan], num_records: int, batch_size: int) -> int:
    """Predicted bytes on disk of a memmap store of ``num_records`` (one group per block)."""
    blocks = block_sizes(num_records, batch_size)
    payload = sum(_block_bytes(layers, b) for b in blocks)
    overhead = (
        len(blocks) * (STORE_GROUP_OVERHEAD_BYTES + STORE_LAYER_OVERHEAD_BYTES * len(layers))
        + num_records * STORE_RECORD_OVERHEAD_BYTES
    )
    return payload + overhead


@dataclass(frozen=True)
class PassPlan:
    """How a method reads the training gradients (mirrors ``kronecker.plan.KeptPasses``).

    Attributes:
        passes: passes over the training gradients (Grad-Dot 1, K-FAC 2, EK-FAC 3).
        blocks: training blocks per pass.
        kept_blocks: first-pass blocks kept (the longest suffix within the budget).
        kept_bytes: their bytes.
        recomputed_blocks: blocks the later passes read again (re-run the model).
        model_runs: passes that run the model for at least one block.
        budget_bytes: the resolved ``kept_gradient_budget``.
    """

    passes: int
    blocks: int
    kept_blocks: int
    kept_bytes: int
    recomputed_blocks: int
    model_runs: int
    budget_bytes: int


def pass_plan(
    layers: list[LayerPlan], method: str, num_train: int, batch_size: int, budget: int
) -> PassPlan:
    """The pass plan ``KeptPasses`` runs for these blocks (single process, live source).

    Grad-Dot makes one pass and keeps nothing; K-FAC / EK-FAC keep the longest
    suffix of first-pass blocks whose bytes fit ``budget`` (a block larger than
    the budget empties the kept suffix, as in ``KeptPasses._keep``).
    """
    passes = METHOD_PASSES[method]
    sizes = [_block_bytes(layers, b) for b in block_sizes(num_train, batch_size)]
    kept: list[int] = []
    if passes > 1:
        for size in sizes:
            if size > budget:
                kept = []
                continue
            kept.append(size)
            while sum(kept) > budget:
                kept.pop(0)
    recompute = len(sizes) - len(kept)
    later = passes - 1
    return PassPlan(
        passes=passes,
        blocks=len(sizes),
        kept_blocks=len(kept),
        kept_bytes=sum(kept),
        recomputed_blocks=recompute * later,
        model_runs=1 + (later if recompute > 0 else 0),
        budget_bytes=budget if passes > 1 else 0,
    )


def curvature_bytes(layers: list[LayerPlan], method: str) -> tuple[int, int, int]:
    """``(covariances, eigenbases, EK-FAC correction)`` bytes of a fit (0 for Grad-Dot).

    Per Kronecker layer ``(d_in', d_out)``: covariances ``d_in'² + d_out²``, the
    eigenbases the same, EK-FAC's eigenvalue correction ``d_in'·d_out`` (float32).
    """
    if method == "graddot":
        return 0, 0, 0
    dims = [layer.curvature_dims for layer in layers if layer.curvature_dims is not None]
    cov = sum(a * a + g * g for a, g in dims) * CURVATURE_ITEMSIZE
    correction = sum(a * g for a, g in dims) * CURVATURE_ITEMSIZE if method == "ekfac" else 0
    return cov, cov, correction


def held_test_bytes(layers: list[LayerPlan], method: str, num_test: int, batch_size: int) -> int:
    """Bytes of the test side the scoring engine holds.

    Grad-Dot holds the captured records; K-FAC / EK-FAC hold them
    preconditioned: a Kronecker layer as a dense ``d_in'·d_out`` float32 row
    per record, the other layers as captured.
    """
    total = 0
    for layer in layers:
        if method != "graddot" and layer.curvature_dims is not None:
            a, g = layer.curvature_dims
            total += num_test * a * g * CURVATURE_ITEMSIZE
        else:
            blocks = math.ceil(num_test / batch_size) if num_test else 0
            total += num_test * layer.bytes_per_record + blocks * layer.shared_bytes
    return total


def peak_memory_bytes(
    *,
    method: str,
    parameters: int,
    gradients: int,
    activations: int,
    largest_activation: int,
    train_block: int,
    kept: int,
    curvature: tuple[int, int, int],
    held_test: int,
    scores: int,
) -> int:
    """Peak bytes of one process's run: what coexists at its fullest moment.

    ``parameters + gradients`` stay resident; a training batch's capture adds
    its saved activations, the largest of them once more (the backward's
    working gradient) and its block. The method's state is held across that
    capture: the test side and the score matrix, and for K-FAC / EK-FAC the
    kept first-pass blocks and the fit (covariances, eigenbases, EK-FAC
    correction). Summing them is an upper bound: the test side is preconditioned
    only after the first pass, and the fit's eigenbases exist only from the
    fit on.
    """
    capture = activations + largest_activation + train_block
    state = held_test + scores
    if method != "graddot":
        state += kept + sum(curvature)
    return parameters + gradients + capture + state

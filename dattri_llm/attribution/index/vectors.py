"""Per-sample vectors of an attribution index: gradient blocks → float32 rows.

A sample's vector is its per-step rows side by side, in ascending step order;
each step's row is its layers' dense rows side by side, in sorted layer order
(a :class:`VectorLayout`). A factorized layer (``(a, g)`` factors, or the
rank-``c`` factors of a low-rank store) is materialized per sample; a dense
``"batch_token"`` layer is summed over tokens, as the instance-level inner
products do; a layer held by one row for a whole block (a broadcast layer)
stands for every sample of the block. A sample without a record at a step,
or a block without one of the layers, has zeros there, which adds nothing to
an inner product. So ``<u_i, v_j>`` equals the sum over steps and layers of the
per-step inner products, the score that ``AttributionScore.agnostic_matrix``
sums.

``normalize`` divides each step's part of a vector by its norm (zero parts
stay zero): the inner product is then the sum over steps of the per-step
cosines, the Grad-Cos score (whose denominator also adds ``1e-8``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.model.records import Factorized
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import PARAM_GRAD_TYPES

Block = tuple[int, Gradient, Sequence[str]]
Transform = Callable[[Gradient], Gradient]


@dataclass(frozen=True)
class VectorLayout:
    """Where each step and layer sits in a vector.

    Attributes:
        steps: the steps, ascending; step ``steps[s]`` fills columns
            ``[s * step_dim, (s + 1) * step_dim)``.
        layers: ``(layer name, width)`` pairs in sorted name order, the same at every step.
    """

    steps: tuple[int, ...]
    layers: tuple[tuple[str, int], ...]

    @property
    def step_dim(self) -> int:
        """Width of one step's part (the sum of the layer widths)."""
        return sum(width for _, width in self.layers)

    @property
    def dim(self) -> int:
        """Width of a whole vector."""
        return len(self.steps) * self.step_dim

    def to_json(self) -> dict[str, list]:
        """The layout as JSON-able lists."""
        return {"steps": list(self.steps), "layers": [[n, w] for n, w in self.layers]}

    @classmethod
    def from_json(cls, data: Mapping[str, list]) -> VectorLayout:
        """The layout written by :meth:`to_json`."""
        return cls(
            tuple(int(s) for s in data["steps"]),
            tuple((str(n), int(w)) for n, w in data["layers"]),
        )


def _layer_rows(gradient: Gradient, name: str) -> torch.Tensor:
    """Layer ``name`` of a block as ``(rows, width)`` float32 (factors materialized)."""
    value = gradient.data[name]
    if isinstance(value, Factorized):
        rows = materialize(value, gradient.layer_types[name])
    elif gradient.indexing.get(name) == "batch_token" and value.dim() == 3:
        rows = value.sum(1)
    else:
        rows = value.reshape(value.shape[0], -1)
    return rows.to(device="cpu", dtype=torch.float32)


def per_sample_layers(gradient: Gradient) -> list[str]:
    """The block's layers that hold per-sample rows (``param_grad`` layers left out), sorted."""
    return sorted(n for n in gradient.data if gradient.layer_types[n] != PARAM_GRAD_TYPES)


def layout_of(gradient: Gradient, steps: Iterable[int]) -> VectorLayout:
    """The layout of vectors over ``steps`` built from blocks shaped like ``gradient``."""
    widths = tuple((n, int(_layer_rows(gradient, n).shape[1])) for n in per_sample_layers(gradient))
    return VectorLayout(tuple(sorted(int(s) for s in steps)), widths)


def block_rows(
    gradient: Gradient, layout: VectorLayout, where: str, *, strict: bool = True
) -> torch.Tensor:
    """One step's part of the vectors of a block's samples, ``(batch_size, layout.step_dim)``.

    A layer of the layout that the block lacks gives zeros; a layer of another
    width raises ``ValueError`` naming ``where``, and so does (with ``strict``) a
    layer the layout does not hold; without ``strict`` it is left out, as the
    inner products leave out layers that one side lacks.
    """
    batch = gradient.batch_size
    known = dict(layout.layers)
    extra = [n for n in per_sample_layers(gradient) if n not in known]
    if extra and strict:
        raise ValueError(
            f"{where}: layers {extra} are not in the index's layers {sorted(known)}; build the "
            "index with layer_name= naming the layers every block holds, or pass queries "
            "captured on the same layers."
        )
    parts = []
    for name, width in layout.layers:
        if name not in gradient.data:
            parts.append(torch.zeros(batch, width))
            continue
        rows = _layer_rows(gradient, name)
        if rows.shape[1] != width:
            raise ValueError(
                f"{where}: layer {name!r} has {rows.shape[1]} features per sample but the index "
                f"holds {width}; both sides must be captured and projected the same way."
            )
        parts.append(rows.expand(batch, width) if rows.shape[0] == 1 else rows)
    return torch.cat(parts, dim=1) if parts else torch.zeros(batch, 0)


def normalize_parts(matrix: np.ndarray, layout: VectorLayout) -> None:
    """Divide each step's part of every row by its norm, in place (zero parts stay zero)."""
    width = layout.step_dim
    for s in range(len(layout.steps)):
        part = matrix[:, s * width : (s + 1) * width]
        norms = np.linalg.norm(part, axis=1, keepdims=True)
        np.divide(part, norms, out=part, where=norms > 0)


def _block_ids(step: int, gradient: Gradient, block_ids: Sequence[object], where: str) -> list[str]:
    """A block's identifiers as ``str`` (``ValueError`` unless one per sample)."""
    ids = [str(h) for h in block_ids]
    if len(ids) != gradient.batch_size:
        raise ValueError(
            f"{where}: a block of step {step} has {len(ids)} identifiers for "
            f"{gradient.batch_size} samples; the index needs one identifier per sample."
        )
    return ids


def iter_rows(
    blocks: Iterable[Block], layout: VectorLayout, where: str
) -> Iterator[tuple[list[str], np.ndarray]]:
    """``(ids, rows)`` of each block of a one-step layout, in block order."""
    for step, gradient, block_ids in blocks:
        ids = _block_ids(step, gradient, block_ids, where)
        yield ids, block_rows(gradient, layout, where).numpy()


def fill_matrix(
    blocks: Iterable[Block],
    ids: Sequence[str],
    layout: VectorLayout,
    where: str,
    *,
    transform: Transform | None = None,
    tile: bool = False,
    strict: bool = True,
) -> np.ndarray:
    """The ``(len(ids), layout.dim)`` float32 vectors of ``ids`` from ``blocks``.

    A block's step picks its part (``tile=True``: every block fills every part,
    the same query taken at each step); blocks of other steps and samples not in
    ``ids`` are skipped. ``transform`` is applied to each block first;
    ``strict`` is passed to :func:`block_rows`.
    """
    position = {h: i for i, h in enumerate(ids)}
    offset = {step: s * layout.step_dim for s, step in enumerate(layout.steps)}
    matrix = np.zeros((len(ids), layout.dim), dtype=np.float32)
    for step, gradient, block_ids in blocks:
        if not tile and int(step) not in offset:
            continue
        block_ids = _block_ids(step, gradient, block_ids, where)
        keep = [r for r, h in enumerate(block_ids) if h in position]
        if not keep:
            continue
        if transform is not None:
            gradient = transform(gradient)
        rows = block_rows(gradient, layout, where, strict=strict).numpy()[keep]
        targets = [position[block_ids[r]] for r in keep]
        starts = list(offset.values()) if tile else [offset[int(step)]]
        for start in starts:
            matrix[targets, start : start + layout.step_dim] = rows
    return matrix

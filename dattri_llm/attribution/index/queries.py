"""Queries of an attribution index as vectors: tensors, blocks, per-step blocks or stores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from dattri_llm.attribution.index.vectors import Transform, VectorLayout, fill_matrix
from dattri_llm.attribution.sources import resolve_store
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.stream.readers import DiskGradientSource


def query_matrix(
    queries: object,
    layout: VectorLayout,
    layer_name: list[str] | None,
    query_ids: Sequence[str] | None,
    transform: Transform | None,
) -> tuple[list[str], np.ndarray]:
    """The queries' names and ``(M, layout.dim)`` float32 vectors.

    See `AttributionIndex.search` for the accepted forms. Query layers the
    layout lacks are left out (the inner products skip layers one side lacks).
    """
    where = "AttributionIndex.search"
    if isinstance(queries, (torch.Tensor, np.ndarray)):
        if transform is not None:
            raise ValueError(f"{where}: transform= applies to blocks, not to vectors")
        matrix = np.array(
            queries.detach().cpu().numpy() if isinstance(queries, torch.Tensor) else queries,
            dtype=np.float32,
        )
        if matrix.ndim != 2 or matrix.shape[1] != layout.dim:
            raise ValueError(
                f"{where}: query vectors must have shape (M, {layout.dim}), got "
                f"{tuple(matrix.shape)}"
            )
        return _names(query_ids, matrix.shape[0]), matrix
    if isinstance(queries, Gradient):
        names = _names(query_ids, queries.batch_size)
        blocks = [(layout.steps[0], queries, names)]
        return names, fill_matrix(
            blocks, names, layout, where, transform=transform, tile=True, strict=False
        )
    if isinstance(queries, Mapping):
        steps = sorted(int(s) for s in queries)
        if steps != list(layout.steps):
            raise ValueError(
                f"{where}: per-step queries must cover the index's steps "
                f"{list(layout.steps)}, got {steps}"
            )
        sizes = {g.batch_size for g in queries.values()}
        if len(sizes) != 1:
            raise ValueError(f"{where}: per-step query blocks have different sizes {sizes}")
        names = _names(query_ids, sizes.pop())
        blocks = [(int(s), g, names) for s, g in queries.items()]
        return names, fill_matrix(blocks, names, layout, where, transform=transform, strict=False)
    manager = resolve_store(queries)
    source = DiskGradientSource(manager, None, layer_name=layer_name)
    tile = len(source.steps) == 1
    if not tile and source.steps != list(layout.steps):
        raise ValueError(
            f"{where}: the query store {manager.save_dir} holds steps {source.steps}; it "
            f"must hold one step or the index's steps {list(layout.steps)}"
        )
    names = list(dict.fromkeys(str(h) for _, _, ids in source for h in ids))
    matrix = fill_matrix(
        source,
        names,
        layout,
        f"query store {manager.save_dir}",
        transform=transform,
        tile=tile,
    )
    return names, matrix


def _names(query_ids: Sequence[str] | None, count: int) -> list[str]:
    if query_ids is None:
        return [str(i) for i in range(count)]
    names = [str(h) for h in query_ids]
    if len(names) != count:
        raise ValueError(f"query_ids has {len(names)} names for {count} queries")
    return names

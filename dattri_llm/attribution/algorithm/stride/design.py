"""STRIDE's subset design: a left-d-regular random bipartite graph between examples and subsets.

Every training example joins exactly ``d`` of the ``K`` subsets, chosen
uniformly without replacement and independently of the other examples. The
membership matrix ``M`` ``(K, N)`` (``M[k, i] = 1`` iff example ``i`` is in
subset ``k``) is the biadjacency matrix of that graph: exactly ``d`` ones per
column. Such graphs are good expanders with high probability, which is what
sparse recovery from ``u ≈ M w`` needs. Two examples with the same ``d``
subsets cannot be told apart, so duplicate columns are redrawn.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any

import torch

__all__ = ["SubsetDesign", "suggested_num_subsets"]

MAX_RESAMPLE_ROUNDS = 100
_DRAW_CHUNK = 65536  # examples drawn per random (chunk, K) matrix


def suggested_num_subsets(num_examples: int, expected_sparsity: int) -> int:
    """``K = ceil(2 s ln(N / s))`` (at least ``s + 1``, at most ``N``) for ``s``-sparse recovery.

    The expander bound guarantees recovery of every ``s``-sparse influence
    vector from ``K = O(s · log(N / s))`` measurements; the constant 2 is the
    rule of thumb this implementation uses (see ``docs/stride.md``).
    """
    if num_examples < 1 or expected_sparsity < 1:
        raise ValueError(
            f"num_examples and expected_sparsity must be >= 1, got {num_examples} and "
            f"{expected_sparsity}"
        )
    s = min(expected_sparsity, num_examples)
    k = math.ceil(2 * s * math.log(max(num_examples / s, math.e)))
    return max(1, min(num_examples, max(k, s + 1)))


class SubsetDesign:
    """``K`` random subsets of ``N`` examples, each example in exactly ``d`` of them.

    Deterministic from ``seed``: the same arguments give the same design on
    every machine (draws use a CPU ``torch.Generator``).

    Args:
        num_examples: ``N``, the training set size (``>= 1``).
        num_subsets: ``K`` (``>= 1``).
        subsets_per_example: ``d``, with ``1 <= d <= K``.
        seed: seed of the draw.

    Attributes:
        members: ``(N, d)`` int64, example ``i``'s subsets in ascending order.

    Raises:
        ValueError: a size out of range.

    Warns:
        UserWarning: the columns cannot all be distinct (``C(K, d) < N``) or
            stayed duplicated after ``MAX_RESAMPLE_ROUNDS`` redraws.
    """

    def __init__(
        self, num_examples: int, num_subsets: int, subsets_per_example: int, seed: int = 0
    ) -> None:
        for name, value in (
            ("num_examples", num_examples),
            ("num_subsets", num_subsets),
            ("subsets_per_example", subsets_per_example),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if subsets_per_example > num_subsets:
            raise ValueError(
                f"subsets_per_example (d={subsets_per_example}) must not exceed num_subsets "
                f"(K={num_subsets}); lower d or raise K"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.num_examples = num_examples
        self.num_subsets = num_subsets
        self.subsets_per_example = subsets_per_example
        self.seed = seed
        generator = torch.Generator().manual_seed(seed)
        self.members = self._draw(num_examples, generator)
        self._make_columns_distinct(generator)
        self._matrix: torch.Tensor | None = None
        self._by_subset: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_members(cls, members: torch.Tensor, num_subsets: int, seed: int) -> SubsetDesign:
        """The design whose member lists are ``members`` ``(N, d)`` (as saved), without redrawing.

        Raises:
            ValueError: ``members`` is not an ``(N, d)`` integer tensor of sorted,
                distinct subset indices in ``[0, num_subsets)``.
        """
        if members.dim() != 2 or members.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"members must be an (N, d) integer tensor, got {members.dtype} "
                f"{tuple(members.shape)}"
            )
        members = members.to(torch.long)
        sorted_rows = bool((members[:, 1:] > members[:, :-1]).all())
        in_range = bool(((members >= 0) & (members < num_subsets)).all())
        if not (sorted_rows and in_range):
            raise ValueError(
                f"members must hold each example's distinct subsets in ascending order, all in "
                f"[0, {num_subsets}); the saved design is damaged"
            )
        design = cls.__new__(cls)
        design.num_examples, design.subsets_per_example = members.shape
        design.num_subsets = num_subsets
        design.seed = seed
        design.members = members
        design._matrix = None
        design._by_subset = None
        return design

    # ------------------------------------------------------------------ drawing
    def _draw(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``(count, d)`` sorted subset indices, each row ``d`` distinct draws out of ``K``."""
        rows = []
        for start in range(0, count, _DRAW_CHUNK):
            size = min(_DRAW_CHUNK, count - start)
            keys = torch.rand(size, self.num_subsets, generator=generator)
            rows.append(keys.topk(self.subsets_per_example, dim=1).indices)
        return torch.cat(rows).to(torch.long).sort(dim=1).values

    def _duplicate_rows(self) -> torch.Tensor:
        """Indices of examples whose subsets repeat an earlier example's."""
        _, inverse = torch.unique(self.members, dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), self.num_examples, dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(self.num_examples), reduce="amin")
        return torch.nonzero(first[inverse] != torch.arange(self.num_examples)).flatten()

    def _make_columns_distinct(self, generator: torch.Generator) -> None:
        """Redraw duplicated columns (later occurrences) until all are distinct."""
        if math.comb(self.num_subsets, self.subsets_per_example) < self.num_examples:
            warnings.warn(
                f"only C(K={self.num_subsets}, d={self.subsets_per_example}) distinct subset "
                f"choices exist for {self.num_examples} examples, so some examples share all "
                "their subsets and cannot be told apart; raise num_subsets",
                UserWarning,
                stacklevel=3,
            )
            return
        for _ in range(MAX_RESAMPLE_ROUNDS):
            duplicates = self._duplicate_rows()
            if duplicates.numel() == 0:
                return
            self.members[duplicates] = self._draw(duplicates.numel(), generator)
        remaining = self._duplicate_rows().numel()
        if remaining:
            warnings.warn(
                f"{remaining} examples still share all their subsets with another after "
                f"{MAX_RESAMPLE_ROUNDS} redraws; raise num_subsets or subsets_per_example",
                UserWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ views
    def matrix(self) -> torch.Tensor:
        """``M`` as a sparse COO float32 tensor ``(K, N)`` (cached)."""
        if self._matrix is None:
            cols = torch.arange(self.num_examples).repeat_interleave(self.subsets_per_example)
            rows = self.members.reshape(-1)
            values = torch.ones(rows.numel(), dtype=torch.float32)
            self._matrix = torch.sparse_coo_tensor(
                torch.stack([rows, cols]),
                values,
                (self.num_subsets, self.num_examples),
                check_invariants=False,
            ).coalesce()
        return self._matrix

    def dense(self) -> torch.Tensor:
        """``M`` as a dense float32 tensor ``(K, N)``."""
        return self.matrix().to_dense()

    def subset_sizes(self) -> torch.Tensor:
        """``(K,)`` int64 number of examples in each subset."""
        return torch.bincount(self.members.reshape(-1), minlength=self.num_subsets)

    def subset(self, k: int) -> torch.Tensor:
        """Example indices ``(|A_k|,)`` of subset ``k``, ascending."""
        if not 0 <= k < self.num_subsets:
            raise IndexError(f"subset {k} is outside [0, {self.num_subsets})")
        if self._by_subset is None:
            flat = self.members.reshape(-1)
            order = torch.sort(flat, stable=True).indices
            offsets = torch.zeros(self.num_subsets + 1, dtype=torch.long)
            offsets[1:] = torch.cumsum(self.subset_sizes(), 0)
            self._by_subset = (order // self.subsets_per_example, offsets)
        examples, offsets = self._by_subset
        return examples[offsets[k] : offsets[k + 1]]

    def apply(self, weights: torch.Tensor) -> torch.Tensor:
        """``M @ weights``: ``(N, Q)`` → ``(K, Q)``."""
        matrix = self.matrix().to(device=weights.device, dtype=weights.dtype)
        return torch.sparse.mm(matrix, weights)

    def apply_transpose(self, residual: torch.Tensor) -> torch.Tensor:
        """``Mᵀ @ residual``: ``(K, Q)`` → ``(N, Q)`` (a gather-sum over each column's subsets)."""
        return residual[self.members].sum(dim=1)

    def sketch(self, sketch_dim: int, generator: torch.Generator) -> torch.Tensor:
        """``Π = M Ω`` ``(K, q)`` for a Gaussian ``Ω`` ``(N, q)`` with entries ``N(0, 1/q)``.

        ``Ω`` is drawn in chunks of examples and never held whole, so the cost
        is ``O(N · d · q)`` time and ``O(K · q)`` memory.
        """
        sketch = torch.zeros(self.num_subsets, sketch_dim)
        for start in range(0, self.num_examples, _DRAW_CHUNK):
            members = self.members[start : start + _DRAW_CHUNK]
            omega = torch.randn(members.shape[0], sketch_dim, generator=generator)
            omega = omega / math.sqrt(sketch_dim)
            sketch.index_add_(0, members.reshape(-1), omega.repeat_interleave(members.shape[1], 0))
        return sketch

    def lipschitz_bound(self) -> float:
        """An upper bound on ``‖M‖₂²``: ``d × max_k |A_k|`` (``‖M‖₁ · ‖M‖_∞``)."""
        return float(self.subsets_per_example * max(1, int(self.subset_sizes().max())))

    # ------------------------------------------------------------------ identity
    def params(self) -> dict[str, int]:
        """``{num_examples, num_subsets, subsets_per_example, seed}``: what rebuilds the design."""
        return {
            "num_examples": self.num_examples,
            "num_subsets": self.num_subsets,
            "subsets_per_example": self.subsets_per_example,
            "seed": self.seed,
        }

    def fingerprint(self) -> str:
        """SHA-256 hex digest of :attr:`members` (int64 bytes) and the sizes."""
        digest = hashlib.sha256(repr(sorted(self.params().items())).encode())
        digest.update(self.members.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def __eq__(self, other: Any) -> bool:
        """Same sizes and the same member lists."""
        return (
            isinstance(other, SubsetDesign)
            and self.params() == other.params()
            and torch.equal(self.members, other.members)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        """``SubsetDesign(N=…, K=…, d=…, seed=…)``."""
        return (
            f"SubsetDesign(N={self.num_examples}, K={self.num_subsets}, "
            f"d={self.subsets_per_example}, seed={self.seed})"
        )

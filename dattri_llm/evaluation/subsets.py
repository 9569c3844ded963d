"""Seeded random training subsets for the linear datamodeling score (LDS)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

__all__ = ["LDSConfig", "ids_digest", "sample_subsets", "subset_size"]


@dataclass(frozen=True)
class LDSConfig:
    """Design of an LDS evaluation.

    Attributes:
        alpha: fraction of the training set kept in each subset, in ``(0, 1)``.
        num_subsets: number of random subsets (= retrains), ``>= 2``.
        seed: seeds the subset draw; retrain ``m`` trains with seed ``seed + 1 + m``.
    """

    alpha: float = 0.5
    num_subsets: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        """Validate the fields (``ValueError`` saying what to pass)."""
        if not 0.0 < float(self.alpha) < 1.0:
            raise ValueError(f"alpha must be a fraction in (0, 1), e.g. 0.5; got {self.alpha!r}")
        if (
            isinstance(self.num_subsets, bool)
            or not isinstance(self.num_subsets, int)
            or self.num_subsets < 2
        ):
            raise ValueError(
                f"num_subsets must be an int >= 2 (LDS correlates across subsets); "
                f"got {self.num_subsets!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def retrain_seed(self, m: int) -> int:
        """Training seed of subset ``m``."""
        return self.seed + 1 + m

    def to_dict(self) -> dict[str, float | int]:
        """The fields as a JSON-able dict."""
        return asdict(self)


def subset_size(n_train: int, alpha: float) -> int:
    """Members per subset: ``round(alpha * n_train)`` clamped to ``[1, n_train - 1]``."""
    if n_train < 2:
        raise ValueError(f"LDS needs at least 2 training samples, got {n_train}")
    return min(max(round(alpha * n_train), 1), n_train - 1)


def sample_subsets(n_train: int, alpha: float, num_subsets: int, seed: int) -> torch.Tensor:
    """``num_subsets`` random subsets without replacement, ``(num_subsets, k)`` long, rows sorted.

    ``k = subset_size(n_train, alpha)``; the same arguments give the same subsets.
    """
    k = subset_size(n_train, alpha)
    generator = torch.Generator().manual_seed(int(seed))
    rows = [
        torch.randperm(n_train, generator=generator)[:k].sort().values for _ in range(num_subsets)
    ]
    return torch.stack(rows)


def ids_digest(train_ids: Sequence[str]) -> str:
    """SHA-256 of the ordered training ids (records which training set a design used)."""
    return hashlib.sha256(json.dumps([str(h) for h in train_ids]).encode()).hexdigest()

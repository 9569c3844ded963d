"""Pass planning of the curvature attributors: keep first-pass training gradients in a budget.

K-FAC reads the training gradients twice (covariances, scoring), EK-FAC three
times (covariances, eigenvalue correction, scoring). On the live path every
read re-runs the model. :class:`KeptPasses` wraps such a train source: its
first pass keeps the longest *suffix* of blocks whose bytes fit the budget;
every later pass re-runs the source only for the blocks before that suffix,
closes it there (the kept blocks are never recomputed) and replays the kept
blocks. The blocks are the ones of the first pass, so every pass yields the
same gradients in the same order and the scores do not depend on the plan.
Under a process group the ranks agree on how many blocks the later passes
re-run (a wrapped model runs collectives in every forward/backward).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.utils.distributed import all_gather_objects
from dattri_llm.utils.memory import free_memory_bytes

if TYPE_CHECKING:
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.stream.source import GradientSource

DEFAULT_KEPT_GRADIENT_BUDGET = 1 << 30  # 1 GiB: the default budget's cap
# share of the free memory of the device holding the kept blocks the default may take
KEPT_BUDGET_FREE_FRACTION = 0.25

StreamBatch = tuple[int, "Gradient", list[str]]


def default_kept_budget(device: torch.device | str | None = None) -> int:
    """The default budget: ``min(1 GiB, KEPT_BUDGET_FREE_FRACTION × free memory of device)``.

    ``device`` holds the kept blocks (the compute device; ``None``: the CPU).
    Free memory is available RAM on the CPU and ``torch.cuda.mem_get_info`` on
    CUDA (:func:`~dattri_llm.utils.memory.free_memory_bytes`); when it is
    unknown the default is :data:`DEFAULT_KEPT_GRADIENT_BUDGET`.
    """
    free = free_memory_bytes(device)
    if free is None:
        return DEFAULT_KEPT_GRADIENT_BUDGET
    return max(0, min(DEFAULT_KEPT_GRADIENT_BUDGET, int(KEPT_BUDGET_FREE_FRACTION * free)))


def resolve_kept_budget(budget: int | None, device: torch.device | str | None = None) -> int:
    """Budget in bytes: ``None`` → :func:`default_kept_budget` of ``device``; an int as given.

    A negative or non-int budget → ``ValueError``.
    """
    if budget is None:
        return default_kept_budget(device)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(
            f"kept_gradient_budget must be None (the default: min({DEFAULT_KEPT_GRADIENT_BUDGET} "
            f"bytes, {KEPT_BUDGET_FREE_FRACTION} x the free memory)) or an int >= 0 of bytes "
            f"(0 re-runs the model for every pass), got {budget!r}."
        )
    return budget


class KeptPasses:
    """A reusable train source whose later passes replay the first pass's kept blocks.

    Args:
        source: a ``reusable`` source (a frozen probe) yielding the same blocks
            every pass.
        budget: bytes of blocks (``Gradient.nbytes``) that may be kept; a
            block larger than the budget is never kept (0: re-run every pass).

    Other attributes (``hook_manager``, ``__len__``) are those of ``source``.
    Call :meth:`last_pass_next` before the final pass: it releases each kept
    block once yielded.
    """

    def __init__(self, source: GradientSource, budget: int) -> None:
        self.source = source
        self.budget = budget
        self._kept: deque[StreamBatch] = deque()
        self.kept_bytes = 0
        self.total_blocks: int | None = None
        self.passes = 0
        self.source_passes = 0
        self.recomputed_blocks = 0
        self._kept_count = 0
        self._release = False

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not yet set: no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.source, name)

    def __len__(self) -> int:
        return len(self.source)

    @property
    def reusable(self) -> bool:
        """The wrapped source's ``reusable``."""
        return bool(getattr(self.source, "reusable", False))

    def last_pass_next(self) -> None:
        """Release each kept block as the next pass yields it (the final pass)."""
        self._release = True

    @property
    def keeps_every_block(self) -> bool:
        """Whether the first pass ran and every one of its blocks is kept (nothing re-runs)."""
        return self.total_blocks is not None and len(self._kept) == self.total_blocks > 0

    def kept_blocks(self) -> list[Gradient]:
        """The kept blocks, in pass order (references; do not modify)."""
        return [block for _step, block, _ids in self._kept]

    def transform_kept(self, fn: Callable[[Gradient], Gradient]) -> None:
        """A pass that replaces every kept block by ``fn(block)``, one block at a time.

        Only when :attr:`keeps_every_block` (``RuntimeError`` otherwise): later
        passes then yield the transformed blocks. ``fn`` may consume its
        argument; each original is released as its replacement is stored.
        ``kept_bytes`` stays the first pass's (the caller bounds the new sizes).
        """
        if not self.keeps_every_block:
            raise RuntimeError(
                "KeptPasses.transform_kept: only a plan that keeps every block can transform "
                f"them ({len(self._kept)} of {self.total_blocks} blocks kept)."
            )
        self.passes += 1
        for index in range(len(self._kept)):
            step, block, ids = self._kept[index]
            self._kept[index] = (step, fn(block), ids)
            del block

    def plan(self) -> dict[str, int]:
        """The passes run so far.

        ``{"passes", "source_passes", "kept_blocks", "kept_bytes",
        "recomputed_blocks", "budget_bytes"}``: passes over the training
        gradients, those that read the source (ran the model, or read the store)
        for at least one block, blocks (bytes) kept from the first pass, blocks
        the later passes read again, and the budget.
        """
        return {
            "passes": self.passes,
            "source_passes": self.source_passes,
            "kept_blocks": self._kept_count,
            "kept_bytes": self.kept_bytes,
            "recomputed_blocks": self.recomputed_blocks,
            "budget_bytes": self.budget,
        }

    def __iter__(self) -> Iterator[StreamBatch]:
        self.passes += 1
        if self.total_blocks is None:
            return self._first_pass()
        return self._replay()

    def _first_pass(self) -> Iterator[StreamBatch]:
        """Run the source; keep the longest suffix of blocks within the budget."""
        self.source_passes += 1
        self._kept.clear()
        self.kept_bytes = 0
        count = 0
        for item in self.source:
            count += 1
            yield item
            self._keep(item)
            del item
        self.total_blocks = count
        self._agree_on_recomputed_blocks()
        self._kept_count = len(self._kept)

    def _agree_on_recomputed_blocks(self) -> None:
        """Under a process group, drop the oldest kept blocks until every rank re-runs as many.

        A wrapped model (DDP, FSDP) runs collectives in every forward/backward,
        so the ranks' later passes must run the model the same number of times;
        the kept suffixes differ when the ranks' blocks differ in size (control
        flow, sequence lengths). Every rank re-runs the largest count any rank
        needs. Nothing is agreed with a budget of 0 (nothing is kept anywhere).
        """
        if self.budget == 0:
            return
        recompute = max(all_gather_objects(self.total_blocks - len(self._kept)))
        while self._kept and self.total_blocks - len(self._kept) < recompute:
            self.kept_bytes -= self._kept.popleft()[1].nbytes

    def _keep(self, item: StreamBatch) -> None:
        """Append a block, then drop the oldest kept ones until the budget holds."""
        if item[1].nbytes > self.budget:
            self._kept.clear()
            self.kept_bytes = 0
            return
        self._kept.append(item)
        self.kept_bytes += item[1].nbytes
        while self.kept_bytes > self.budget:
            self.kept_bytes -= self._kept.popleft()[1].nbytes

    def _replay(self) -> Iterator[StreamBatch]:
        """Re-run the blocks before the kept suffix, then yield the kept blocks."""
        recompute = self.total_blocks - self._kept_count
        if recompute > 0:
            self.source_passes += 1
            self.recomputed_blocks += recompute
            yield from _first_blocks(self.source, recompute)
        if self._release:
            while self._kept:
                item = self._kept.popleft()
                yield item
                del item
        else:
            yield from list(self._kept)


def _first_blocks(source: GradientSource, count: int) -> Iterator[StreamBatch]:
    """The first ``count`` blocks of a pass over ``source``; the pass is closed after them."""
    iterator = iter(source)
    try:
        for index, item in enumerate(iterator):
            yield item
            del item
            if index + 1 >= count:
                break
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()

"""The input side of the live sources: which datasets they accept and how they batch them.

`check_dataset` admits what `GradientStreamer` (and through it every
attributor) streams: a list of dicts, a map-style ``torch`` `Dataset` of dicts,
or a Hugging Face ``datasets.Dataset``. `make_loader` builds the streamer's
``DataLoader``: dataset order, a ``Trainer``-like seeded shuffle, or one rank's
part of an unpadded distributed shard (`_UnpaddedShardBatches`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from dattri_llm.gradient.stream.settings import TrainingSettings

__all__ = ["ACCEPTED_DATASETS", "check_dataset", "make_loader"]

ACCEPTED_DATASETS = (
    "a list of dicts, a torch.utils.data.Dataset whose items are dicts (map-style: __len__ "
    "and __getitem__), or a Hugging Face datasets.Dataset (tuple items, as a TensorDataset "
    "gives, are accepted for a custom loss_func that reads positional fields)"
)


# --------------------------------------------------------------------------- accepted datasets


def _type_name(value: object) -> str:
    cls = type(value)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _is_hf_dataset(dataset: object) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.Dataset`` (never imports ``datasets``)."""
    hf = sys.modules.get("datasets")
    return hf is not None and isinstance(dataset, getattr(hf, "Dataset", ()))


def _is_map_style(dataset: object) -> bool:
    """A list/tuple, a sized non-iterable-style ``torch`` `Dataset`, or an HF ``Dataset``."""
    if isinstance(dataset, (list, tuple)) or _is_hf_dataset(dataset):
        return True
    return (
        isinstance(dataset, Dataset)
        and not isinstance(dataset, IterableDataset)
        and hasattr(dataset, "__len__")
    )


def _refusal_hint(dataset: object) -> str:
    if isinstance(dataset, Mapping):
        return (
            f" (keys {sorted(map(str, dataset))[:5]}); for a dict of columns use "
            "datasets.Dataset.from_dict(columns) or one dict per sample"
        )
    if isinstance(dataset, IterableDataset):
        return "; iterable-style datasets are not supported (streaming needs len() and indexing)"
    if isinstance(dataset, torch.Tensor):
        return f" of shape {tuple(dataset.shape)}; wrap each sample in a dict, e.g. {{'x': row}}"
    return ""


def check_dataset(dataset: object, what: str = "dataset") -> None:
    """Raise ``TypeError`` unless ``dataset`` is one of the `ACCEPTED_DATASETS` kinds.

    Accepted: a list (or tuple) of dicts, a map-style ``torch.utils.data.Dataset``
    (``__len__`` + ``__getitem__``) whose items are dicts, a Hugging Face
    ``datasets.Dataset``. The first item (when there is one) must be a mapping,
    or a tuple of positional fields (a ``TensorDataset``, a dattri-style task)
    for a custom loss function. Refused, among others: a dict of columns, a
    bare tensor, a list of tensors, an iterable-style dataset. ``what`` names
    the argument in the message (e.g. ``"train_dataset"``).
    """
    if not _is_map_style(dataset):
        raise TypeError(
            f"{what} must be {ACCEPTED_DATASETS}; got {_type_name(dataset)}{_refusal_hint(dataset)}"
        )
    if len(dataset) == 0:
        return
    first = dataset[0]
    if not isinstance(first, (Mapping, tuple)):
        raise TypeError(
            f"{what} must be {ACCEPTED_DATASETS}; got a {_type_name(dataset)} whose item 0 is a "
            f"{_type_name(first)}, not a dict; give each sample as a dict of named fields (the "
            "keys the loss function reads)"
        )


# --------------------------------------------------------------------------- batching


def _data_seed(args: TrainingSettings) -> int:
    """The seed of the data order: ``args.data_seed``, or ``args.seed`` when it is ``None``."""
    seed = getattr(args, "data_seed", None)
    return args.seed if seed is None else seed


def make_loader(
    dataset: Dataset,
    batch_size: int,
    args: TrainingSettings,
    *,
    collate_fn: Callable | None,
    shuffle: bool,
    shard: bool,
) -> DataLoader:
    """A fresh loader over ``dataset``, ``batch_size`` per batch.

    ``world_size>1`` and ``shard``: this rank's batches of an unpadded shard
    (`_UnpaddedShardBatches`, permutation seeded by ``data_seed``): every
    sample on exactly one rank, the same batch count on every rank.
    Otherwise ``shuffle`` hands a generator seeded by ``data_seed`` to the
    ``DataLoader`` itself (not to a sampler: the loader draws its base seed
    from that generator before the permutation, so the order is the one a
    ``Trainer`` gets); without ``shuffle``, dataset order.
    """
    batching: dict[str, Any] = {"batch_size": batch_size}
    if args.world_size > 1 and shard:
        batching = {
            "batch_sampler": _UnpaddedShardBatches(
                len(dataset),
                batch_size,
                world_size=args.world_size,
                rank=args.process_index,
                shuffle=shuffle,
                seed=_data_seed(args),
            )
        }
    elif shuffle:
        generator = torch.Generator().manual_seed(_data_seed(args))
        batching.update(shuffle=True, generator=generator)
    workers = args.dataloader_num_workers
    extra: dict[str, Any] = {}
    if workers > 0:
        extra["persistent_workers"] = args.dataloader_persistent_workers
        if args.dataloader_prefetch_factor is not None:
            extra["prefetch_factor"] = args.dataloader_prefetch_factor
    return DataLoader(
        dataset,
        collate_fn=collate_fn,
        num_workers=workers,
        pin_memory=args.dataloader_pin_memory,
        **batching,
        **extra,
    )


class _UnpaddedShardBatches(Sampler[list[int]]):
    """One rank's batches of a dataset split over ``world_size`` ranks without padding.

    The rank holds ``perm[rank::world_size]``, where ``perm`` is
    ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` with
    ``shuffle`` and ``range(n)`` without (``DistributedSampler``'s permutation
    at epoch 0), so the union over the ranks is the dataset, each sample once;
    shard sizes differ by at most one. Unlike ``DistributedSampler``, no sample
    is repeated to even them out (a repeated sample would enter curvature fits
    and scores twice).

    Every rank runs the same number of batches, ``ceil(ceil(n / world_size) /
    batch_size)``, since a wrapped model (DDP, FSDP) runs collectives in every
    forward and backward: batches hold ``batch_size`` consecutive indices of the
    shard, except that a rank whose shard would fill one batch fewer splits its
    last batches so that each holds at least one sample (see `_batch_sizes`).
    ``ValueError`` on every rank when a shard has fewer samples than batches
    (``n < world_size``, or ``batch_size == 1`` with ``n`` not a multiple of
    ``world_size``).
    """

    def __init__(
        self, n: int, batch_size: int, *, world_size: int, rank: int, shuffle: bool, seed: int
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        self._n, self._world_size, self._rank = n, world_size, rank
        self._shuffle, self._seed = shuffle, seed
        self._batches = math.ceil(math.ceil(n / world_size) / batch_size)
        if n // world_size < self._batches:  # the smallest shard, the same check on every rank
            raise ValueError(
                f"cannot split {n} samples over {world_size} ranks in batches of {batch_size}: "
                f"every rank must run {self._batches} batches (a wrapped model runs collectives "
                f"in each forward and backward) but the smallest shard holds {n // world_size} "
                "samples; use a batch size of at least 2 and at least world_size samples, or a "
                "dataset whose size is a multiple of world_size"
            )
        self._sizes = _batch_sizes(len(range(rank, n, world_size)), self._batches, batch_size)

    def _indices(self) -> list[int]:
        """This rank's dataset indices, ``perm[rank::world_size]``."""
        if self._shuffle:
            generator = torch.Generator().manual_seed(self._seed)
            perm = torch.randperm(self._n, generator=generator).tolist()
        else:
            perm = list(range(self._n))
        return perm[self._rank :: self._world_size]

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches of dataset indices, in shard order."""
        indices = self._indices()
        start = 0
        for size in self._sizes:
            yield indices[start : start + size]
            start += size

    def __len__(self) -> int:
        """Batches per pass (the same on every rank)."""
        return self._batches


def _batch_sizes(count: int, batches: int, batch_size: int) -> list[int]:
    """Sizes of ``batches`` non-empty batches of at most ``batch_size`` covering ``count`` samples.

    Full batches first; a batch is cut short only so that every later batch
    still gets a sample (``count=4, batches=2, batch_size=3`` → ``[3, 1]``;
    ``count=4, batches=3, batch_size=2`` → ``[2, 1, 1]``). Needs ``batches <=
    count <= batches * batch_size``.
    """
    sizes = []
    for remaining in range(batches, 0, -1):
        size = min(batch_size, count - (remaining - 1))
        sizes.append(size)
        count -= size
    return sizes

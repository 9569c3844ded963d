"""Content hashing: a position- and shuffling-independent identity for samples.

A sample's identity is the SHA-256 of its digestible fields (tensors and
numeric lists/scalars) in sorted key order, after stripping padding positions
given by a 1-D ``attention_mask``. A ``(T,)`` row and its ``(1, T)`` batched
form hash identically, and so do a padded sample and its unpadded tokens.
Identical samples hash identically; `occurrence_ids` gives the repeats within
one step distinct identifiers (``h``, ``h#1``, ``h#2``, …).
"""

from __future__ import annotations

import hashlib
import warnings
from collections import Counter
from collections.abc import Sequence

import torch

__all__ = ["PAD_MASK_KEY", "hash_batch", "hash_sample", "occurrence_ids"]

PAD_MASK_KEY = "attention_mask"


def _as_tensor(value: object) -> torch.Tensor | None:
    """``value`` as a tensor (default dtypes for Python data), or ``None`` if not digestible."""
    if isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, (list, tuple, int, float, bool)):
        return None
    try:
        return torch.tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _one_dim_mask(inputs: dict[str, object]) -> torch.Tensor | None:
    """The boolean keep-mask ``(L,)`` if ``inputs`` holds a 1-D attention mask, else ``None``."""
    if PAD_MASK_KEY not in inputs:
        return None
    mask = _as_tensor(inputs[PAD_MASK_KEY])
    if mask is None or mask.ndim != 1:
        return None
    return mask.detach().cpu() != 0


def _strip_padding(inputs: dict[str, object], keep: torch.Tensor) -> dict[str, object]:
    """Drop the mask key and keep only unpadded positions of every length-``L`` field."""
    length = keep.shape[0]
    stripped: dict[str, object] = {}
    for key, value in inputs.items():
        if key == PAD_MASK_KEY:
            continue
        if isinstance(value, (list, tuple)) and len(value) == length:
            converted = _as_tensor(value)
            value = converted if converted is not None else value
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == length:
            value = value[keep.to(value.device)]
        stripped[key] = value
    return stripped


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw bytes of ``tensor`` in its own dtype (CPU, contiguous, row-major)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def hash_sample(inputs: dict[str, object]) -> str:
    """64-character lowercase hex SHA-256 identity of **one** sample's fields.

    Args:
        inputs: field name → value for one sample, e.g. ``{"input_ids": (T,),
            "attention_mask": (T,)}``. Tensors and numeric lists/tuples/scalars
            are digested; strings, ``None``, dicts and ragged lists are skipped.
            With a 1-D ``attention_mask`` of length ``L`` the mask is dropped and
            every length-``L`` field keeps only its unmasked positions.

    Returns:
        The hex digest.

    Raises:
        ValueError: no field is digestible.
    """
    keep = _one_dim_mask(inputs)
    fields = _strip_padding(inputs, keep) if keep is not None else inputs
    digest = hashlib.sha256()
    digested = False
    for key in sorted(fields):
        tensor = _as_tensor(fields[key])
        if tensor is None:
            continue
        digest.update(key.encode())
        digest.update(_tensor_bytes(tensor))
        digested = True
    if not digested:
        raise ValueError(
            f"hash_sample: no digestible field among keys {sorted(fields)}; a sample needs at "
            "least one tensor or numeric list/scalar field (strings, None and dicts are skipped)."
        )
    return digest.hexdigest()


def _infer_batch_size(inputs: dict[str, object]) -> int:
    """Batch size from the leading dims of non-scalar tensors (size-1 dims ignored)."""
    leading = [v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    if not leading:
        raise ValueError(
            f"hash_batch: cannot infer the batch size, no field of {sorted(inputs)} is a "
            "non-scalar tensor; pass batch_size explicitly."
        )
    counts = Counter(d for d in leading if d != 1)
    if not counts:
        return 1
    if len(counts) > 1:
        warnings.warn(
            f"hash_batch: fields disagree on the leading (batch) dimension {dict(counts)}; "
            "using the most frequent one. Pass batch_size explicitly to silence this.",
            UserWarning,
            stacklevel=3,
        )
    return max(counts, key=lambda d: (counts[d], d))


def _sliceable_fields(inputs: dict[str, object], batch_size: int) -> dict[str, object]:
    """Per-sample fields: tensors with leading dim ``B`` and lists/tuples of length ``B``."""
    return {
        k: v
        for k, v in inputs.items()
        if (isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == batch_size)
        or (isinstance(v, (list, tuple)) and len(v) == batch_size)
    }


def hash_batch(inputs: dict[str, object], batch_size: int | None = None) -> list[str]:
    """Per-sample identities of a batched dict, in batch order.

    ``hash_batch(b, B)[i] == hash_sample({k: v[i] for k, v in sliceable})`` where
    *sliceable* fields are tensors with ``ndim > 0`` and leading dim ``B`` and
    lists/tuples of length ``B``; other fields (broadcast ``(1, T)`` tensors,
    offsets, scalars) do not enter the identity.

    Args:
        inputs: batched fields, e.g. ``{"input_ids": (B, T), "attention_mask": (B, T)}``.
        batch_size: ``B``; ``None`` infers it from the leading dims of non-scalar
            tensors (size-1 dims ignored; disagreement warns and the most frequent
            dim wins, ties to the larger).

    Returns:
        ``B`` hex digests.

    Raises:
        ValueError: ``batch_size < 1``, no tensor to infer it from, or no sliceable field.
    """
    if batch_size is None:
        batch_size = _infer_batch_size(inputs)
    elif batch_size < 1:
        raise ValueError(f"hash_batch: batch_size must be >= 1, got {batch_size}.")
    sliceable = _sliceable_fields(inputs, batch_size)
    if not sliceable:
        raise ValueError(
            f"hash_batch: no field of {sorted(inputs)} has batch size {batch_size} (a tensor with "
            f"leading dim {batch_size} or a list/tuple of length {batch_size})."
        )
    return [hash_sample({k: v[i] for k, v in sliceable.items()}) for i in range(batch_size)]


def occurrence_ids(ids: Sequence[str]) -> list[str]:
    """Make repeated identifiers of one step distinct, one per occurrence.

    The first occurrence of an identifier keeps it unchanged; each later repeat
    of the same identifier gets the smallest suffix ``f"{id}#{k}"`` (``k = 1,
    2, …``) not already used in the list, neither by an original identifier nor
    by an earlier assignment. A list without repeats is returned unchanged, the
    result is a fixed point (``occurrence_ids(occurrence_ids(x)) ==
    occurrence_ids(x)``), and a concatenation of already disambiguated lists is
    disambiguated again. Identical samples drawn several times in one step (GRPO
    completions, a repeated ``sample_id_key`` value) thus keep one row each,
    with identifiers stable for the same content and occurrence order.

    Example:
        >>> occurrence_ids(["h", "g", "h", "h"])
        ['h', 'g', 'h#1', 'h#2']
        >>> occurrence_ids(["h", "h#1", "h"])
        ['h', 'h#1', 'h#2']

    Args:
        ids: the step's identifiers in batch order.

    Returns:
        ``len(ids)`` distinct identifiers, in the same order.
    """
    ids = [str(i) for i in ids]
    used = set(ids)
    if len(used) == len(ids):
        return ids
    seen: set[str] = set()
    next_suffix: dict[str, int] = {}
    result: list[str] = []
    for identifier in ids:
        if identifier not in seen:
            seen.add(identifier)
            result.append(identifier)
            continue
        k = next_suffix.get(identifier, 1)
        while f"{identifier}#{k}" in used:
            k += 1
        candidate = f"{identifier}#{k}"
        next_suffix[identifier] = k + 1
        used.add(candidate)
        result.append(candidate)
    return result

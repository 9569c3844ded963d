"""Tests of content hashing (sample identity), checked against an independent SHA-256."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

from dattri_llm.utils import hashing
from dattri_llm.utils.hashing import PAD_MASK_KEY, hash_batch, hash_sample, occurrence_ids


def sha256_of(fields: dict[str, torch.Tensor]) -> str:
    """Independent digest: sorted keys, key bytes then raw tensor bytes (via numpy)."""
    digest = hashlib.sha256()
    for key in sorted(fields):
        digest.update(key.encode())
        digest.update(fields[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_digest_format_and_independent_recomputation():
    ids = torch.tensor([5, 3, 9])
    labels = torch.tensor([1.5, -2.0, 0.25])
    h = hash_sample({"labels": labels, "input_ids": ids})
    assert len(h) == 64 and h == h.lower() and int(h, 16) >= 0
    assert h == sha256_of({"input_ids": ids, "labels": labels})
    assert PAD_MASK_KEY == "attention_mask"


def test_same_content_same_hash_regardless_of_position_and_shape():
    batch = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 2, 3]])
    row = torch.tensor([1, 2, 3])
    assert hash_sample({"input_ids": row}) == hash_sample({"input_ids": row.unsqueeze(0)})
    hashes = hash_batch({"input_ids": batch})
    assert hashes[0] == hashes[2] != hashes[1]
    assert hashes[0] == hash_sample({"input_ids": row})
    assert hash_batch({"input_ids": batch[[2, 1, 0]]}) == hashes[::-1]


def test_different_content_dtype_or_key_changes_hash():
    base = hash_sample({"input_ids": torch.tensor([1, 2, 3])})
    assert hash_sample({"input_ids": torch.tensor([1, 2, 4])}) != base
    assert hash_sample({"input_ids": torch.tensor([1, 2, 3], dtype=torch.int32)}) != base
    assert hash_sample({"token_ids": torch.tensor([1, 2, 3])}) != base
    assert hash_sample({"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([0])}) != base


@pytest.mark.parametrize(
    ("ids", "mask"),
    [
        ([7, 8, 9, 0, 0], [1, 1, 1, 0, 0]),  # right padding
        ([0, 0, 7, 8, 9], [0, 0, 1, 1, 1]),  # left padding
        ([7, 8, 9], [1, 1, 1]),  # no padding
    ],
)
def test_padding_strip_by_one_dim_attention_mask(ids, mask):
    unpadded = hash_sample(
        {"input_ids": torch.tensor([7, 8, 9]), "labels": torch.tensor([7, 8, 9])}
    )
    sample = {"input_ids": torch.tensor(ids), "labels": ids, PAD_MASK_KEY: torch.tensor(mask)}
    assert hash_sample(sample) == unpadded
    assert hash_sample({**sample, PAD_MASK_KEY: mask}) == unpadded  # list mask converts


def test_padding_strip_keeps_fields_of_other_lengths_and_2d_mask_strips_nothing():
    pixel = torch.arange(4.0)
    with_mask = hash_sample(
        {"input_ids": torch.tensor([7, 8, 0]), "pix": pixel, PAD_MASK_KEY: torch.tensor([1, 1, 0])}
    )
    assert with_mask == hash_sample({"input_ids": torch.tensor([7, 8]), "pix": pixel})
    two_d = {"input_ids": torch.tensor([[7, 8, 0]]), PAD_MASK_KEY: torch.tensor([[1, 1, 0]])}
    assert hash_sample(two_d) == sha256_of(two_d)


def test_lists_match_tensors_with_default_dtypes():
    assert hash_sample({"input_ids": [1, 2, 3]}) == hash_sample(
        {"input_ids": torch.tensor([1, 2, 3])}
    )
    assert hash_sample({"x": [0.5, 1.0]}) == hash_sample({"x": torch.tensor([0.5, 1.0])})
    assert hash_sample({"x": (1, 2)}) == hash_sample({"x": torch.tensor([1, 2])})
    assert hash_sample({"y": 3}) == hash_sample({"y": torch.tensor(3)})
    assert hash_sample({"b": True}) == hash_sample({"b": torch.tensor(True)})
    bf16 = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)
    assert hash_sample({"x": bf16}) != hash_sample({"x": bf16.float()})


def test_non_digestible_fields_are_skipped():
    base = hash_sample({"input_ids": [1, 2]})
    extra = {"text": "hello", "meta": {"a": 1}, "none": None, "ragged": [[1], [2, 3]]}
    assert hash_sample({"input_ids": [1, 2], **extra}) == base


def test_no_digestible_field_raises():
    with pytest.raises(ValueError, match="no digestible field.*'text'"):
        hash_sample({"text": "hello", "none": None})
    with pytest.raises(ValueError, match="no digestible"):
        hash_sample({})


def test_hash_batch_equals_per_row_hash_sample_and_ignores_non_sliceable():
    batch = {
        "input_ids": torch.tensor([[1, 2, 0], [3, 4, 5]]),
        PAD_MASK_KEY: torch.tensor([[1, 1, 0], [1, 1, 1]]),
        "labels": [0, 1],
        "position_bias": torch.ones(1, 3),  # broadcast: not part of identity
        "offsets": torch.tensor([0, 2, 5]),  # (B+1,): not part of identity
        "scale": 2.0,
        "names": ["a", "b"],
    }
    with pytest.warns(UserWarning, match="disagree"):  # offsets (B+1,) vote for 3
        hashes = hash_batch(batch)
    for i, h in enumerate(hashes):
        row = {
            "input_ids": batch["input_ids"][i],
            PAD_MASK_KEY: batch[PAD_MASK_KEY][i],
            "labels": batch["labels"][i],
            "names": batch["names"][i],
        }
        assert h == hash_sample(row)
    assert hashes[0] == hash_sample({"input_ids": [1, 2], "labels": 0})
    assert hash_batch(batch, 2) == hashes


def test_hash_batch_inference_rules():
    assert len(hash_batch({"x": torch.ones(1, 4), "s": torch.tensor(2)})) == 1
    with pytest.warns(UserWarning, match="disagree"):
        hashes = hash_batch({"a": torch.ones(3, 2), "b": torch.ones(3), "c": torch.ones(2, 3)})
    assert len(hashes) == 3
    with pytest.warns(UserWarning):
        assert len(hash_batch({"a": torch.ones(2, 1), "b": torch.ones(4, 1)})) == 4  # tie → larger
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(hash_batch({"a": torch.ones(5, 2), "pos": torch.ones(1, 2)})) == 5


def test_hash_batch_errors():
    with pytest.raises(ValueError, match="batch_size"):
        hash_batch({"ids": [[1], [2]]})
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        hash_batch({"ids": torch.ones(2, 2)}, batch_size=0)
    with pytest.raises(ValueError, match="batch size 3"):
        hash_batch({"ids": torch.ones(2, 2)}, batch_size=3)
    assert hash_batch({"ids": [[1], [2]]}, batch_size=2)[1] == hash_sample({"ids": [2]})


def test_occurrence_ids_suffixes_later_repeats_in_order():
    assert occurrence_ids(["h", "g", "h", "h", "g"]) == ["h", "g", "h#1", "h#2", "g#1"]
    assert occurrence_ids([]) == []
    assert "occurrence_ids" in hashing.__all__


def test_occurrence_ids_without_repeats_is_unchanged():
    ids = ["b", "a", "a#1", "c#3"]
    got = occurrence_ids(ids)
    assert got == ids and got is not ids
    assert occurrence_ids(("x", "y")) == ["x", "y"]


def test_occurrence_ids_skips_suffixes_already_used():
    # a concatenation of already disambiguated lists is disambiguated again
    assert occurrence_ids(["h", "h#1", "h"]) == ["h", "h#1", "h#2"]
    # an original id later in the list is never taken by an assignment
    assert occurrence_ids(["h", "h", "h#1", "h#1"]) == ["h", "h#2", "h#1", "h#1#1"]
    assert occurrence_ids(["h#1", "h", "h", "h"]) == ["h#1", "h", "h#2", "h#3"]


def test_occurrence_ids_idempotent_distinct_and_stable():
    gen = torch.Generator().manual_seed(0)
    pool = ["a", "b", "a#1", "a#2", "b#1#1", "c"]
    for _ in range(200):
        n = int(torch.randint(0, 12, (1,), generator=gen))
        ids = [pool[int(i)] for i in torch.randint(0, len(pool), (n,), generator=gen)]
        once = occurrence_ids(ids)
        assert len(once) == len(ids) and len(set(once)) == len(once)
        assert occurrence_ids(once) == once
        # the first occurrence of every id keeps it; repeats get id#k
        for i, (orig, new) in enumerate(zip(ids, once)):
            if orig not in ids[:i]:
                assert new == orig
            else:
                assert new.startswith(orig + "#") and new[len(orig) + 1 :].isdigit()
        # the same content and occurrence gives the same id (a pure function of the list)
        assert occurrence_ids(list(ids)) == once


def test_occurrence_ids_on_identical_rows_of_a_batch():
    batch = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 2, 3], [1, 2, 3]])
    hashes = hash_batch({"input_ids": batch})
    assert hashes[0] == hashes[2] == hashes[3]  # hash_batch keeps its contract
    h = hashes[0]
    assert occurrence_ids(hashes) == [h, hashes[1], f"{h}#1", f"{h}#2"]

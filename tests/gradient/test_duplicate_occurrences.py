"""Identical samples in one step keep one row each, under ``#k`` occurrence ids.

GRPO draws several completions per prompt; two identical completions with
different advantages have different gradients. They share one content hash,
so the capture gives the later occurrences ``h#1``, ``h#2``, … (in batch
order) and every row reaches the store and the scores under its own id.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from capture_helpers import dense
from reference import call, per_sample_param_grads
from torch import nn

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback, merge_window
from dattri_llm.gradient.datasets import iter_gradient_blocks
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.hashing import hash_batch

VOCAB, WIDTH = 16, 8
LAYERS = ("emb", "mix", "head")
# four completions; rows 0 and 2 are the same token sequence
COMPLETIONS = torch.tensor([[1, 5, 7, 2, 9], [1, 5, 3, 3, 0], [1, 5, 7, 2, 9], [4, 11, 6, 8, 2]])
ADVANTAGES = torch.tensor([1.0, -0.5, -2.0, 0.7])
QUERIES = torch.tensor([[1, 5, 7, 2, 9], [3, 14, 15, 9, 2]])


class TinyLM(nn.Module):
    """Embedding → linear → tanh → vocabulary head; position ``t`` predicts token ``t + 1``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, idx: object = None) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(input_ids))))


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T-1)`` log-probabilities of the next tokens."""
    logp = F.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def grpo_loss(logits: torch.Tensor, input_ids: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Policy-gradient loss ``-Σ_i A_i Σ_t log p(token_{i,t})`` (importance ratio 1)."""
    return -(adv[:, None] * token_logprobs(logits, input_ids)).sum()


def nll_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return -token_logprobs(logits, input_ids).sum()


def reference_rows(model: nn.Module, input_ids: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``(B, d)`` per-sample gradients of each sample's own loss term (``vmap(grad(...))``).

    Layers in the materialize layout, concatenated in ``LAYERS`` order:
    embedding ``W`` row-major, linear ``[W | b]`` row-major.
    """

    def one(m, params, sample):
        ids, a = sample
        return grpo_loss(call(m, params, ids), ids, a)

    ref = per_sample_param_grads(model, one, (input_ids, adv))
    batch = input_ids.shape[0]
    parts = [ref["emb.weight"].reshape(batch, -1)]
    for name in ("mix", "head"):
        w, b = ref[f"{name}.weight"], ref[f"{name}.bias"]
        parts.append(torch.cat([w, b[..., None]], dim=-1).reshape(batch, -1))
    return torch.cat(parts, dim=1)


def flat_rows(gradient: Gradient) -> torch.Tensor:
    """``(B, d)`` captured rows in the layout of :func:`reference_rows`."""
    return torch.cat([dense(gradient, name) for name in LAYERS], dim=1)


def store_rows(store: GradientStorageManager, step: int) -> tuple[list[str], torch.Tensor]:
    """Live identifiers and ``(rows, d)`` gradients the store holds for ``step``."""
    [(got_step, gradient, ids)] = list(iter_gradient_blocks(store, steps=[step]))
    assert got_step == step
    return ids, flat_rows(gradient)


def capture(model, store, recording_type, batches, accumulation=1, **kwargs):
    """Capture one backward per ``(input_ids, loss_fn, model_kwargs)`` into ``store``."""
    config = HookManagerConfig(linear_io=list(LAYERS))
    callback = OffloadCallback(
        1, store, recording_type=recording_type, gradient_accumulation_steps=accumulation
    )
    manager = HookManager(model, config=config, callbacks=[callback], **kwargs)
    with manager.collect():
        for input_ids, loss_fn, model_kwargs in batches:
            model.zero_grad(set_to_none=True)
            loss_fn(model(input_ids=input_ids, **model_kwargs), input_ids).backward()
    manager.remove()
    return store


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("recording_type", ["per_batch", "per_sample"])
def test_grpo_identical_completions_keep_their_own_rows_and_scores(tmp_path, recording_type):
    model = tiny_lm()
    h = hash_batch({"input_ids": COMPLETIONS})
    assert h[0] == h[2] and len(set(h)) == 3
    expected_ids = [h[0], h[1], f"{h[0]}#1", h[3]]

    def train_loss(logits, ids):
        return grpo_loss(logits, ids, ADVANTAGES)

    train_store = GradientStorageManager(tmp_path / "train")
    train = capture(model, train_store, recording_type, [(COMPLETIONS, train_loss, {})])
    ids, rows = store_rows(train, 0)
    assert ids == expected_ids
    ref = reference_rows(model, COMPLETIONS, ADVANTAGES)
    assert not torch.allclose(ref[0], ref[2])  # same tokens, different advantages
    assert_close(rows, ref)
    assert train.lookup_by_hash(h[0]) == [(0, 0)]
    reopened = GradientStorageManager(tmp_path / "train")
    assert store_rows(reopened, 0)[0] == expected_ids
    assert train.lookup_by_hash(f"{h[0]}#1") == (
        [(0, 2)] if recording_type == "per_batch" else [(0, 0)]
    )

    # a step without repeats keeps its plain content hashes
    query = capture(
        model, GradientStorageManager(tmp_path / "query"), "per_batch", [(QUERIES, nll_loss, {})]
    )
    query_ids, query_rows = store_rows(query, 0)
    assert query_ids == hash_batch({"input_ids": QUERIES})

    args = AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True)
    score = TracInAttributor(args).attribute_from_cache(train, query)
    assert sorted(score.row_train_ids) == sorted(expected_ids)
    expected = ref @ query_rows.T
    train_ids, matrix = score.agnostic_matrix()
    assert sorted(train_ids) == sorted(expected_ids)
    for i, identifier in enumerate(expected_ids):
        assert_close(matrix[train_ids.index(identifier)], expected[i])
    assert not torch.allclose(expected[0], expected[2])


@pytest.mark.parametrize("recording_type", ["per_batch", "per_sample"])
def test_accumulation_window_repeats_get_distinct_ids(tmp_path, recording_type):
    model = tiny_lm()
    same = COMPLETIONS[0]
    first = torch.stack([same, COMPLETIONS[1]])
    second = torch.stack([COMPLETIONS[3], same])
    adv_first, adv_second = torch.tensor([1.0, -0.5]), torch.tensor([0.3, -2.0])
    store = capture(
        model,
        GradientStorageManager(tmp_path / "s"),
        recording_type,
        [
            (first, lambda logits, ids: grpo_loss(logits, ids, adv_first), {}),
            (second, lambda logits, ids: grpo_loss(logits, ids, adv_second), {}),
        ],
        accumulation=2,
    )
    h = hash_batch({"input_ids": torch.stack([same, COMPLETIONS[1], COMPLETIONS[3]])})
    ids, rows = store_rows(store, 0)
    assert store.available_steps() == [0]
    assert ids == [h[0], h[1], h[2], f"{h[0]}#1"]
    ref = torch.cat(
        [reference_rows(model, first, adv_first), reference_rows(model, second, adv_second)]
    )
    assert_close(rows, ref)
    assert not torch.allclose(rows[0], rows[3])


def test_merge_window_disambiguates_across_micro_batches():
    grad = Gradient(
        {"w": "materialized"}, {"w": torch.ones(2, 3)}, {"w": "nn.Linear"}, {"w": "batch"}
    )
    merged = merge_window(
        [GradientRecord(4, ["a", "b"], grad), GradientRecord(5, ["a", "a#1"], grad)], step=0
    )
    assert merged.step == 0 and merged.input_hash == ["a", "b", "a#2", "a#1"]
    assert merged.gradient.batch_size == 4


@pytest.mark.parametrize("recording_type", ["per_batch", "per_sample"])
def test_repeated_sample_id_key_values_are_disambiguated(tmp_path, recording_type):
    model = tiny_lm()
    idx = torch.tensor([7, 3, 7, 7])
    store = capture(
        model,
        GradientStorageManager(tmp_path / "s"),
        recording_type,
        [
            (COMPLETIONS, lambda logits, ids: grpo_loss(logits, ids, ADVANTAGES), {"idx": idx}),
            (QUERIES, nll_loss, {"idx": torch.tensor([7, 3])}),
        ],
        sample_id_key="idx",
    )
    assert store.sample_id_key == "idx"
    ids, rows = store_rows(store, 0)
    assert ids == ["7", "3", "7#1", "7#2"]
    assert_close(rows, reference_rows(model, COMPLETIONS, ADVANTAGES))
    # a step without repeats keeps its values; occurrence ids restart every step
    assert store_rows(store, 1)[0] == ["7", "3"]
    assert [s for s, _ in store.lookup_by_hash("7")] == [0, 1]

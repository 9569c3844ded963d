"""Attribution on-the-fly: score training samples live, nothing written to disk.

Mirrors the README's "One call, live" section with a tiny GPT-2 built from a config (no
download): an ``AttributionTask`` holds a ``(model, batch) -> loss`` function
evaluated on the live model, and ``TracInAttributor.attribute`` streams
per-sample gradients of the training and test sets and scores them (Grad-Dot
at the current weights; ``normalized_grad=True`` gives Grad-Cos).

Run:  python examples/attribution/attribution_on_the_fly.py
"""

from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    HookManagerConfig,
    TracInAttributor,
    hash_sample,
)

torch.manual_seed(0)
VOCAB, SEQ = 97, 12
model = GPT2LMHeadModel(
    GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
)

# Datasets are lists of per-sample dicts; the default collate stacks them.
train_dataset = [{"input_ids": torch.randint(1, VOCAB, (SEQ,))} for _ in range(16)]
test_dataset = [
    {"input_ids": train_dataset[3]["input_ids"].clone()},  # a duplicate of train 3
    {"input_ids": torch.randint(1, VOCAB, (SEQ,))},
]


def loss_fn(model, batch):
    """Sum of per-sample mean losses: each captured gradient is that sample's own."""
    ids = batch["input_ids"]
    return model(input_ids=ids, labels=ids).loss * len(ids)


with tempfile.TemporaryDirectory() as out:
    task = AttributionTask(loss_func=loss_fn, model=model)  # or checkpoints=[ckpt_a, ckpt_b]
    attributor = TracInAttributor(AttributionArguments(output_dir=out, use_cpu=True), task=task)
    # Every eligible layer except the position embedding, whose gradient is
    # shared by the whole batch (not per-sample).
    hook_config = HookManagerConfig(linear_io=[r"^(?!transformer\.wpe$)"])
    score = attributor.attribute(train_dataset, test_dataset, hook_config=hook_config)

train_ids, matrix = score.agnostic_matrix()  # (num_train, num_test)
print("scores (num_train, num_test):", tuple(matrix.shape))
print("most influential training row per query:", matrix.argmax(0).tolist())

# Scores are keyed by the content hash of the tensors the model was called with
# (here input_ids and labels): look a sample up by identity.
ids = train_dataset[3]["input_ids"]
h = hash_sample({"input_ids": ids, "labels": ids})
print("score of train sample 3 against the queries:", score.query([h]).squeeze(0).tolist())

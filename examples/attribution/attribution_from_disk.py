"""Attribution from disk: capture per-sample gradients from your own training loop, score later.

Mirrors section 1 of the README with a tiny GPT-2 built from a config (no
download). ``HookManager`` + ``OffloadCallback`` wrap an ordinary training loop
(the loop itself is untouched — ``trainer.train()`` works the same way) and
write every sample's gradient to a store; query gradients are captured the
same way at the final weights. Attribution then runs from the two stores
without the model, and different settings reuse the same cache.

Run:  python examples/attribution/attribution_from_disk.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
    hash_sample,
)

torch.manual_seed(0)
VOCAB, SEQ, EPOCHS = 97, 12, 2
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
train_ids = torch.randint(1, VOCAB, (16, SEQ))
test_ids = torch.stack([train_ids[5], torch.randint(1, VOCAB, (SEQ,))])


def loss_fn(model, ids):
    """Sum of per-sample mean losses: each captured gradient is that sample's own."""
    return model(input_ids=ids, labels=ids).loss * len(ids)


# Hook every eligible layer except the position embedding, whose gradient is
# shared by the whole batch (not per-sample).
config = HookManagerConfig(linear_io=[r"^(?!transformer\.wpe$)"])

root = Path(tempfile.mkdtemp())
train_store = GradientStorageManager(str(root / "train_grads"))
manager = HookManager(
    model,
    config=config,
    callbacks=[
        OffloadCallback(offload_interval=1, file_manager=train_store, recording_type="per_sample")
    ],
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
with manager.collect():  # any loop that calls .backward()
    for _epoch in range(EPOCHS):
        for batch in train_ids.split(4):
            optimizer.zero_grad()
            loss_fn(model, batch).backward()
            optimizer.step()
manager.remove()

# Query gradients at the final weights, captured the same way (no optimizer step).
test_store = GradientStorageManager(str(root / "test_grads"))
with HookManager(
    model, config=config, callbacks=[OffloadCallback(1, test_store, recording_type="per_sample")]
).collect(deregister_on_exit=True):
    model.zero_grad()
    loss_fn(model, test_ids).backward()

args = AttributionArguments(output_dir=str(root / "scores"), use_cpu=True)
attributor = TracInAttributor(args)
last_epoch = train_store.available_steps()[-len(train_ids.split(4)) :]
score = attributor.attribute_from_cache(
    str(root / "train_grads"), str(root / "test_grads"), selected_training_steps=last_epoch
)
ids, matrix = score.agnostic_matrix()  # (num_train, num_test), summed over the selected steps
print("stored steps:", train_store.available_steps(), "| scored steps:", last_epoch)
print("scores (num_train, num_test):", tuple(matrix.shape))

# The same cache, another setting: Grad-Cos.
cos = attributor.attribute_from_cache(
    str(root / "train_grads"),
    str(root / "test_grads"),
    selected_training_steps=last_epoch,
    normalized_grad=True,
)
# Identity = content hash of the tensors the model was called with (input_ids and labels).
row_of = {hash_sample({"input_ids": x, "labels": x}): k for k, x in enumerate(train_ids)}
h = hash_sample({"input_ids": train_ids[5], "labels": train_ids[5]})
print("train sample 5 is stored at (step, sample_idx):", train_store.lookup_by_hash(h))
print("its Grad-Cos with the queries:", cos.query([h]).squeeze(0).tolist())
cos_ids, cos_matrix = cos.agnostic_matrix()
print(
    "most similar training sample per query:",
    [row_of[cos_ids[int(i)]] for i in cos_matrix.argmax(0)],
)

"""dattri_llm quickstart: which training sentences shaped a tiny language model's answers?

Runs on a fresh install in well under a minute on CPU, with no download: a
small GPT-2 built from a config, a word-level tokenizer written below, and the
five-topic corpus in ``quickstart_corpus.py`` (cooking, astronomy, football,
programming, gardening).

1. Train the model on the corpus with a plain PyTorch loop. The last epochs run
   inside ``HookManager.collect()``: hooks capture every training sentence's
   per-sample gradient (factorized: the layers' inputs and output gradients)
   and ``OffloadCallback`` writes them to a gradient store. The training loop
   itself is not changed.
2. Capture the query sentences' gradients at the trained weights the same way.
3. Score every training sentence against every query from the two stores with
   Grad-Cos (``TracInAttributor.attribute_from_cache(..., normalized_grad=True)``;
   no model needed) and print each query's three most helpful training
   sentences (``score.top_k(3)``, right whichever sign a method calls helpful).

Run:  python examples/quickstart.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quickstart_corpus import CORPUS, QUERIES  # noqa: E402

SEED = 0
MAX_LEN = 16
EPOCHS = 12
CAPTURED_EPOCHS = 2  # the last epochs run under gradient capture
BATCH_SIZE = 16
LEARNING_RATE = 1e-2


class WordTokenizer:
    """Lower-case whitespace tokenizer over a fixed vocabulary; id 0 is padding."""

    def __init__(self, sentences: list[str]) -> None:
        words = sorted({w for s in sentences for w in s.lower().split()})
        self.vocab = {w: i + 1 for i, w in enumerate(words)}

    def encode(self, sentence: str) -> dict[str, torch.Tensor]:
        """``{"input_ids": (MAX_LEN,), "attention_mask": (MAX_LEN,)}``, right-padded."""
        ids = [self.vocab[w] for w in sentence.lower().split()][:MAX_LEN]
        pad = MAX_LEN - len(ids)
        return {
            "input_ids": torch.tensor(ids + [0] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
        }


def sentence_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sentence's mean next-token loss, ``(B,)`` (padding not counted)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    token_loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return token_loss.sum(1) / (targets != -100).sum(1)


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over the batch of each sentence's mean next-token loss.

    Summing over samples makes each captured per-sample gradient the gradient
    of that sentence's own loss.
    """
    return sentence_losses(model, batch).sum()


def train(model: torch.nn.Module, train_set: list[dict[str, torch.Tensor]], epochs: int) -> None:
    """A plain training loop: AdamW, shuffled mini-batches, mean loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    loader = torch.utils.data.DataLoader(train_set, batch_size=BATCH_SIZE, shuffle=True)
    model.train()
    for _ in range(epochs):
        total = 0.0
        for batch in loader:
            optimizer.zero_grad()
            # The usual mean loss: captured gradients carry a 1/B factor, which
            # Grad-Cos cancels (README, "Loss reduction").
            loss = loss_fn(model, batch) / len(batch["input_ids"])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch["input_ids"])
        print(f"  train loss {total / len(train_set):.3f}")


def query_gradients(model: torch.nn.Module, query_set: list[dict[str, torch.Tensor]]) -> None:
    """One backward pass over the queries at the current weights (no update)."""
    model.eval()
    batch = torch.utils.data.default_collate(query_set)
    loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)


def capture(model: torch.nn.Module, store_dir: str, config: HookManagerConfig) -> HookManager:
    """A ``HookManager`` that writes every step's per-sample gradients to ``store_dir``."""
    store = GradientStorageManager(store_dir)
    offload = OffloadCallback(offload_interval=4, file_manager=store, recording_type="per_sample")
    return HookManager(model, config=config, callbacks=[offload])


def print_table(score, train_text: dict[str, tuple[str, str]], query_ids: list[str]) -> int:
    """Print the top-3 proponents per query; return how many top-1s share the query's topic."""
    # {query id: [(train id, score), ...]}, most helpful first (rows summed over steps).
    top = score.top_k(3, test_ids=query_ids)
    hits = 0
    for (topic, query), query_id in zip(QUERIES, query_ids):
        print(f"\nquery [{topic}]: {query}")
        for rank, (train_id, value) in enumerate(top[query_id], start=1):
            train_topic, sentence = train_text[train_id]
            print(f"  {rank}. {value:+.3f}  [{train_topic:<11}] {sentence}")
        hits += train_text[top[query_id][0][0]][0] == topic
    return hits


def main() -> None:
    """Train, attribute, print."""
    torch.set_num_threads(1)  # a model this small runs fastest (and reproducibly) on one thread
    torch.manual_seed(SEED)
    pairs = [(topic, s) for topic, sentences in CORPUS.items() for s in sentences]
    tokenizer = WordTokenizer([s for _, s in pairs] + [q for _, q in QUERIES])
    train_set = [tokenizer.encode(s) for _, s in pairs]
    query_set = [tokenizer.encode(q) for _, q in QUERIES]
    # Scores are keyed by content hash: map each hash back to its sentence.
    train_text = {hash_sample(x): pair for x, pair in zip(train_set, pairs)}

    config = GPT2Config(
        vocab_size=len(tokenizer.vocab) + 1,
        n_positions=MAX_LEN,
        n_embd=64,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=False,
        resid_pdrop=0.0,  # no dropout: captured gradients are those of the model as it is
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    print(
        f"corpus: {len(train_set)} training sentences, {len(CORPUS)} topics, "
        f"vocabulary {len(tokenizer.vocab)} words"
    )
    # Per-sample gradients of the MLP layers and the output head (a regex
    # selector; the default, REGISTER_ALL, hooks every eligible layer).
    hook_config = HookManagerConfig(linear_io=[r"\.mlp\.", r"^lm_head$"])
    with tempfile.TemporaryDirectory() as work:
        train_dir, test_dir = f"{work}/train_grads", f"{work}/test_grads"
        print(f"training for {EPOCHS} epochs, the last {CAPTURED_EPOCHS} under capture")
        train(model, train_set, EPOCHS - CAPTURED_EPOCHS)
        with capture(model, train_dir, hook_config).collect(deregister_on_exit=True):
            train(model, train_set, CAPTURED_EPOCHS)  # the same, unmodified loop
        with capture(model, test_dir, hook_config).collect(deregister_on_exit=True):
            query_gradients(model, query_set)

        args = AttributionArguments(output_dir=f"{work}/scores", use_cpu=True, seed=SEED)
        score = TracInAttributor(args).attribute_from_cache(
            train_dir, test_dir, normalized_grad=True
        )
    print(
        f"\nGrad-Cos scores (TracInAttributor, normalized_grad=True, algorithm "
        f"{score.algorithm!r}):\nthe cosine of each training sentence's gradient with the "
        f"query's, summed over the {CAPTURED_EPOCHS} epochs it was captured in"
    )
    hits = print_table(score, train_text, [hash_sample(q) for q in query_set])
    print(f"\ntop-1 proponent shares the query's topic for {hits}/{len(QUERIES)} queries")


if __name__ == "__main__":
    main()

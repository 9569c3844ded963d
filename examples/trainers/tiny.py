"""Shared pieces of the trainer examples: a tiny model, a local tokenizer, capture and scoring.

Everything is built from a config (no download): a character-level tokenizer made
with `tokenizers`, a 2-layer Llama, a small corpus on three topics. `capture` is the
whole integration: a `HookManager` whose `OffloadCallback` writes every training
sample's gradient to a store; the trainers themselves are used unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerCallback,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)

# The trainers must not reach the network (TRL sends telemetry, the Hub checks versions).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"
CORPUS = [
    ("cats", "the cat sat on the mat."),
    ("cats", "a cat naps in the sun."),
    ("cats", "cats chase mice at night."),
    ("cats", "my cat purrs on the sofa."),
    ("cats", "the kitten plays with yarn."),
    ("boats", "the boat sails on the sea."),
    ("boats", "a ship docks at the port."),
    ("boats", "sailors row the small boat."),
    ("boats", "the ferry crosses the bay."),
    ("boats", "boats float on calm water."),
    ("bread", "we bake bread every day."),
    ("bread", "the baker kneads the dough."),
    ("bread", "fresh bread smells warm."),
    ("bread", "a loaf cools on the rack."),
    ("bread", "rye bread has a dark crust."),
    ("bread", "toast the bread with butter."),
]
QUERIES = ["a cat sleeps on the mat.", "the ship sails to port."]

# Hook the transformer blocks and the token embedding. The LM head is left out: the TRL
# trainers compute log-probabilities with a fused head that reads `lm_head.weight`
# without calling the module, so its hooks would never fire there.
LAYERS = [r"^model\.embed_tokens$", r"^model\.layers\."]


def char_tokenizer():
    """A character-level `PreTrainedTokenizerFast` (pad 0, eos 1, unk 2), built locally."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(ALPHABET)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_llama(tokenizer, seed: int = 0):
    """A 2-layer, width-32 `LlamaForCausalLM` from a config (fp32, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


class RowNames(HookManagerCallback):
    """Names every captured row (content hash) by its decoded ``input_ids``, for printing."""

    def __init__(self, model, tokenizer):
        self.names: dict[str, str] = {}
        self._tokenizer = tokenizer
        self._rows: list[str] = []
        model.register_forward_pre_hook(self._remember, with_kwargs=True)

    def _remember(self, module, args, kwargs):
        if torch.is_grad_enabled() and "input_ids" in kwargs:
            ids = kwargs["input_ids"]
            self._rows = self._tokenizer.batch_decode(ids, skip_special_tokens=True)

    def on_step_end(self, record):
        """Pair the step's row hashes with the rows of the forward that produced them."""
        self.names.update(zip(record.input_hash, self._rows))


def capture(
    model,
    store_dir: str | Path,
    gradient_accumulation_steps: int = 1,
    names: RowNames | None = None,
) -> HookManager:
    """Hooks that write each training sample's gradient to the store at ``store_dir``.

    Under gradient accumulation the micro-batches of one optimizer step are merged into
    one record stamped with the optimizer step (parameters do not change inside a window).
    """
    offload = OffloadCallback(
        offload_interval=1,
        file_manager=GradientStorageManager(str(store_dir)),
        recording_type="per_sample",
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    callbacks = [offload] + ([names] if names is not None else [])
    return HookManager(model, config=HookManagerConfig(linear_io=LAYERS), callbacks=callbacks)


def sequence_nll(model, batch: dict) -> torch.Tensor:
    """Sum over the batch of each sequence's summed next-token loss (pads masked out)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
    )


def capture_queries(model, tokenizer, texts: list[str], store_dir: str | Path) -> None:
    """Write the queries' gradients (one backward, no update) at the model's current weights."""
    model.eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with capture(model, store_dir).collect(deregister_on_exit=True):
        sequence_nll(model, dict(batch)).backward()
    model.zero_grad(set_to_none=True)


def score(train_dir: str | Path, test_dir: str | Path, out_dir: str | Path):
    """TracIn (Grad-Dot summed over steps) of every stored training row against each query.

    Returns ``(train_ids, matrix)``; ``matrix`` is ``(num_train, num_queries)``.
    """
    attributor = TracInAttributor(AttributionArguments(output_dir=str(out_dir), use_cpu=True))
    return attributor.attribute_from_cache(str(train_dir), str(test_dir)).agnostic_matrix()


def print_top(matrix: torch.Tensor, labels: list[str], queries: list[str], k: int = 3) -> None:
    """Print the ``k`` strongest proponents of each query."""
    for j, query in enumerate(queries):
        top = matrix[:, j].topk(min(k, matrix.shape[0])).indices.tolist()
        print(f"query {query!r}:")
        for rank, row in enumerate(top, 1):
            print(f"  {rank}. {matrix[row, j].item():+.4f}  {labels[row]}")


def score_queries(model, tokenizer, root: Path, names: dict[str, str]) -> torch.Tensor:
    """Capture the queries at the trained weights, score the stored rows, print the top ones.

    Returns the ``(num_train_rows, num_queries)`` TracIn matrix.
    """
    capture_queries(model, tokenizer, QUERIES, root / "query_grads")
    train_ids, matrix = score(root / "train_grads", root / "query_grads", root / "scores")
    print_top(matrix, [names.get(h, h) for h in train_ids], QUERIES)
    return matrix

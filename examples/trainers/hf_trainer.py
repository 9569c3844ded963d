"""Capture per-sample gradients from an unmodified Hugging Face `Trainer`, score from the store.

Two ways, same result:
* ``--pattern context``: ``with hm.collect(): trainer.train()``;
* ``--pattern callback``: a `TrainerCallback` opens capture at ``on_train_begin`` and
  closes it at ``on_train_end`` (for when ``train()`` is called by code you do not own).

The `Trainer` backpropagates its own loss: the mean over the label tokens of the
accumulation window (``num_items_in_batch``), so each stored row is that sample's
token-loss sum divided by the window's token count.

Run:  python examples/trainers/hf_trainer.py [--pattern callback]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
from tiny import CORPUS, RowNames, capture, char_tokenizer, score_queries, tiny_llama
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

SEQ = 32


class CollectCallback(TrainerCallback):
    """Opens the capture context when training begins and closes it when training ends."""

    def __init__(self, hook_manager):
        self.hook_manager = hook_manager
        self.stack = contextlib.ExitStack()

    def on_train_begin(self, args, state, control, **kwargs):
        self.stack.enter_context(self.hook_manager.collect(deregister_on_exit=True))

    def on_train_end(self, args, state, control, **kwargs):
        self.stack.close()


def dataset(tokenizer) -> list[dict[str, torch.Tensor]]:
    """The corpus padded to ``SEQ`` tokens; pads are masked out of the labels."""
    rows = tokenizer(
        [text for _, text in CORPUS], padding="max_length", max_length=SEQ, return_tensors="pt"
    )
    labels = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": lab}
        for ids, mask, lab in zip(rows["input_ids"], rows["attention_mask"], labels)
    ]


def main(
    output_dir: str | Path,
    pattern: str = "context",
    max_steps: int = 4,
    gradient_accumulation_steps: int = 2,
    callbacks: tuple = (),
):
    """Train, capture into ``output_dir/train_grads``, score the queries.

    Returns ``(trainer, matrix)``; ``matrix`` is ``(num_train_rows, num_queries)``.
    """
    root = Path(output_dir)
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer)
    names = RowNames(model, tokenizer)
    hm = capture(model, root / "train_grads", gradient_accumulation_steps, names)
    args = TrainingArguments(
        output_dir=str(root / "trainer"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=gradient_accumulation_steps,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    extra = [CollectCallback(hm)] if pattern == "callback" else []
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset(tokenizer),
        data_collator=default_data_collator,
        callbacks=extra + list(callbacks),
    )
    if pattern == "context":
        with hm.collect(deregister_on_exit=True):
            trainer.train()
    elif pattern == "callback":
        trainer.train()
    else:
        raise ValueError(f"pattern must be 'context' or 'callback', got {pattern!r}")
    return trainer, score_queries(model, tokenizer, root, names.names)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", choices=["context", "callback"], default="context")
    parser.add_argument("--max-steps", type=int, default=8)
    cli = parser.parse_args()
    main(tempfile.mkdtemp(), pattern=cli.pattern, max_steps=cli.max_steps)

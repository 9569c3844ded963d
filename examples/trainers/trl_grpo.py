"""Capture per-sample gradients of the GRPO loss from an unmodified TRL `GRPOTrainer`.

The tiny model generates completions on CPU, a local reward function scores them
(the share of vowels), and ``with hm.collect(): trainer.train()`` records the gradient
of the loss TRL backpropagates. One stored row is one completion: the sequence
``prompt + completion`` TRL feeds to the model, and its gradient is that completion's
share of the GRPO loss, ``-A_i * sum_t grad log p(token_t) / N`` (advantage of the
completion within its prompt group, summed over its completion tokens, divided by the
generation batch's completion-token count N for TRL's default ``"dapo"`` loss).

Run:  python examples/trainers/trl_grpo.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from datasets import Dataset
from tiny import RowNames, capture, char_tokenizer, score_queries, tiny_llama
from trl import GRPOConfig, GRPOTrainer

PROMPTS = ["the cat ", "a boat ", "we bake ", "my dog ", "the sea ", "fresh "]


def vowel_share(completions: list[str], **kwargs) -> list[float]:
    """Reward: the fraction of a completion's characters that are vowels."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def main(output_dir: str | Path, max_steps: int = 2, callbacks: tuple = ()):
    """Train with GRPO, capture into ``output_dir/train_grads``, score the queries.

    Returns ``(trainer, matrix)``; ``matrix`` is ``(num_completions, num_queries)``.
    """
    root = Path(output_dir)
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer)
    args = GRPOConfig(
        output_dir=str(root / "trainer"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        num_generations=4,  # one step: 1 prompt x 4 completions (one group)
        max_completion_length=8,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; fp32 keeps the example exact
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=vowel_share,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    names = RowNames(model, tokenizer)
    hm = capture(model, root / "train_grads", names=names)
    with hm.collect(deregister_on_exit=True):
        trainer.train()
    return trainer, score_queries(model, tokenizer, root, names.names)


if __name__ == "__main__":
    main(tempfile.mkdtemp(), max_steps=4)

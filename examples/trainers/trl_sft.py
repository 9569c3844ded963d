"""Capture per-sample gradients from an unmodified TRL `SFTTrainer` (packing off or on).

``with hm.collect(): trainer.train()`` around the trainer as TRL builds it. What one
stored row is depends on packing:

* packing off: one row is one training text (padded to the longest of its batch);
* packing on (TRL's default ``"bfd"`` strategy): TRL packs texts into bins of
  ``max_length`` tokens and trains padding-free, concatenating the bins of a batch into
  one sequence whose ``position_ids`` restart at every text. One row is then that whole
  packed micro-batch, so scores rank packed batches, not texts.

Run:  python examples/trainers/trl_sft.py [--packing]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from datasets import Dataset
from tiny import CORPUS, RowNames, capture, char_tokenizer, score_queries, tiny_llama
from trl import SFTConfig, SFTTrainer


def main(output_dir: str | Path, packing: bool = False, max_steps: int = 3, callbacks: tuple = ()):
    """Fine-tune, capture into ``output_dir/train_grads``, score the queries.

    Returns ``(trainer, matrix)``; ``matrix`` is ``(num_train_rows, num_queries)``.
    """
    root = Path(output_dir)
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer)
    args = SFTConfig(
        output_dir=str(root / "trainer"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_length=64,
        packing=packing,
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; fp32 keeps the example exact
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": [text for _, text in CORPUS]}),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    names = RowNames(model, tokenizer)
    hm = capture(model, root / "train_grads", names=names)
    with hm.collect(deregister_on_exit=True):
        trainer.train()
    return trainer, score_queries(model, tokenizer, root, names.names)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--max-steps", type=int, default=6)
    cli = parser.parse_args()
    main(tempfile.mkdtemp(), packing=cli.packing, max_steps=cli.max_steps)

"""Per-sample gradients from OLMo-core's own `Trainer`, unchanged.

A tiny OLMo-2-style transformer (2 reordered-norm blocks with QK-norm, width 32) is built
from an OLMo-core `TransformerConfig` (no download) and trained on CPU by OLMo-core's
`TransformerTrainModule` + `Trainer`, without a process group. Capture is opened by an
OLMo-core `Callback` at ``pre_epoch`` (after the trainer's forward/backward dry run on a
mock batch, which is therefore not stored) and closed at ``close``.

OLMo-core backpropagates, per micro-batch, the summed token loss divided by the label-token
count of the whole batch (``loss_div_factor``), so each stored row is that sequence's
token-loss sum divided by its batch's token count. A batch of ``BATCH`` rows is split into
micro-batches of ``MICRO`` rows; ``OffloadCallback(gradient_accumulation_steps=...)`` merges
them into one record per optimizer step.

Run:  python examples/trainers/olmo_core_trainer.py   (needs ``pip install ai2-olmo-core``)
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
from olmo_core.data.data_loader import DataLoaderBase
from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TransformerTrainModule
from tiny import CORPUS, QUERIES, RowNames, char_tokenizer, print_top, score

from dattri_llm import GradientStorageManager, HookManager, HookManagerConfig, OffloadCallback

SEQ = 32
BATCH = 4  # sequences per optimizer step
MICRO = 2  # sequences per micro-batch (one backward each)
# Token embedding, every linear layer of the blocks, and the LM head's projection. OLMo-core's
# RMSNorm is its own class (not `nn.RMSNorm`), so the norms are not hooked.
LAYERS = [r"^embeddings$", r"^blocks\.", r"^lm_head\.w_out$"]


def tiny_olmo(vocab_size: int, seed: int = 0):
    """A 2-block, width-32 OLMo-core `Transformer` (fp32) built from a `TransformerConfig`."""
    config = TransformerConfig.llama_like(
        d_model=32,
        vocab_size=vocab_size,
        n_layers=2,
        n_heads=2,
        block_name=TransformerBlockType.reordered_norm,
        qk_norm=True,
        hidden_size_multiple_of=16,
        init_seed=seed,
    )
    return config.build(init_device="cpu")


def tokenize(tokenizer, texts: list[str], length: int | None = None) -> dict[str, torch.Tensor]:
    """``input_ids`` ``(B, T)`` right-padded, and OLMo-core's shifted ``labels`` (pads -100)."""
    padding = "max_length" if length else "longest"
    rows = tokenizer(texts, padding=padding, max_length=length, return_tensors="pt")
    ids = rows["input_ids"]
    labels = ids.masked_fill(rows["attention_mask"] == 0, -100)
    labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    return {"input_ids": ids, "labels": labels}


class CorpusLoader(DataLoaderBase):
    """The corpus in a fixed order, ``BATCH`` padded sequences per batch, for one process.

    ``global_batch_size`` is in tokens, as OLMo-core's trainer expects.
    """

    def __init__(self, tokenizer, work_dir: str | Path):
        super().__init__(work_dir=work_dir, global_batch_size=BATCH * SEQ, fs_local_rank=0)
        self.data = tokenize(tokenizer, [text for _, text in CORPUS], SEQ)

    @property
    def total_batches(self) -> int:
        return len(CORPUS) // BATCH

    def _iter_batches(self):
        for start in range(self.batches_processed * BATCH, len(CORPUS) - BATCH + 1, BATCH):
            yield {key: value[start : start + BATCH].clone() for key, value in self.data.items()}

    def reshuffle(self, epoch: int | None = None, **kwargs):
        self._epoch = epoch or 1

    def state_dict(self) -> dict:
        return {"batches_processed": self.batches_processed, "epoch": self._epoch}

    def load_state_dict(self, state_dict: dict):
        self.batches_processed, self._epoch = state_dict["batches_processed"], state_dict["epoch"]

    def get_mock_batch(self) -> dict[str, torch.Tensor]:
        return {key: value[:BATCH].clone() for key, value in self.data.items()}


class CollectCallback(Callback):
    """OLMo-core callback: capture from the first epoch (after the dry run) until close."""

    def __init__(self, hook_manager: HookManager):
        self.hook_manager = hook_manager
        self.stack = contextlib.ExitStack()
        self.opened = False

    def pre_epoch(self):
        if not self.opened:
            self.stack.enter_context(self.hook_manager.collect(deregister_on_exit=True))
            self.opened = True

    def close(self):
        self.stack.close()


class OlmoRowNames(RowNames):
    """Names each row by its text; OLMo-core passes ``input_ids`` positionally."""

    def _remember(self, module, args, kwargs):
        if torch.is_grad_enabled() and args:
            self._rows = self._tokenizer.batch_decode(args[0], skip_special_tokens=True)


def capture(model, store_dir: str | Path, accumulation: int = 1, names=None) -> HookManager:
    """Hooks writing each sample's gradient of ``LAYERS`` to the store at ``store_dir``."""
    offload = OffloadCallback(
        offload_interval=1,
        file_manager=GradientStorageManager(str(store_dir)),
        recording_type="per_sample",
        gradient_accumulation_steps=accumulation,
    )
    callbacks = [offload] + ([names] if names is not None else [])
    return HookManager(model, config=HookManagerConfig(linear_io=LAYERS), callbacks=callbacks)


def capture_queries(model, tokenizer, store_dir: str | Path) -> None:
    """Each query's summed token loss, backpropagated once at the trained weights (no update)."""
    model.eval()
    batch = tokenize(tokenizer, QUERIES)
    with capture(model, store_dir).collect(deregister_on_exit=True):
        output = model(batch["input_ids"], labels=batch["labels"], loss_reduction="sum")
        output.loss.backward()
    model.zero_grad(set_to_none=True)


def main(output_dir: str | Path, max_steps: int = 4):
    """Train with OLMo-core's trainer, capture into ``output_dir/train_grads``, score queries.

    Returns ``(train_module, matrix)``; ``matrix`` is ``(num_train_rows, num_queries)``.
    """
    root = Path(output_dir)
    tokenizer = char_tokenizer()
    model = tiny_olmo(len(tokenizer))
    names = OlmoRowNames(model, tokenizer)
    hm = capture(model, root / "train_grads", BATCH // MICRO, names)
    train_module = TransformerTrainModule(
        model=model,
        optim=AdamWConfig(lr=1e-2),
        rank_microbatch_size=MICRO * SEQ,
        max_sequence_length=SEQ,
        device=torch.device("cpu"),
    )
    trainer = TrainerConfig(
        save_folder=str(root / "trainer"),
        max_duration=Duration.steps(max_steps),
        device="cpu",
        no_checkpoints=True,
        callbacks={"capture": CollectCallback(hm)},
    ).build(train_module, CorpusLoader(tokenizer, root / "trainer"))
    trainer.fit()

    capture_queries(train_module.model, tokenizer, root / "query_grads")
    train_ids, matrix = score(root / "train_grads", root / "query_grads", root / "scores")
    print_top(matrix, [names.names.get(h, h) for h in train_ids], QUERIES)
    return train_module, matrix


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=8)
    cli = parser.parse_args()
    main(tempfile.mkdtemp(), max_steps=cli.max_steps)

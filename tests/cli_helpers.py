"""A tiny causal LM, its tokenizer and a JSONL corpus on disk, for the command-line tests.

No network: a 2-layer GPT-2 from a config and a word-level ``tokenizers`` tokenizer
wrapped in ``PreTrainedTokenizerFast``, both saved with ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from dattri_llm.cli import main

TRAIN = [
    "preheat the oven and mix the flour with sugar and butter",
    "chop the onions and fry them in olive oil until golden",
    "season the soup with salt and pepper before serving",
    "the telescope showed the rings of saturn clearly",
    "a comet passed close to the sun last winter",
    "the striker scored a goal in the final minute",
    "the keeper saved the penalty with his left hand",
    "water the tomato plants early in the morning",
]
QUERIES = [
    "bake the bread with butter and sugar",
    "the goal was scored by the striker",
]
PROMPTS = [
    {"prompt": "the striker", "completion": "scored a goal"},
    {"prompt": "chop the", "completion": "onions and fry them"},
]


def write_model(directory: Path) -> Path:
    """Save a tiny GPT-2 and a word-level tokenizer of the corpus to ``directory``."""
    words = sorted({w for line in TRAIN + QUERIES for w in line.split()})
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(vocab),
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=0,
    )
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSON lines; return ``path``."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def capture_argv(paths, output_dir, *extra):
    """The flags of a capture of the shared corpus into ``output_dir``."""
    return [
        "capture",
        "--model", str(paths["model"]),
        "--train_data", str(paths["train"]),
        "--query_data", str(paths["query"]),
        "--linear_io", r"^transformer\.h\.",
        "--per_device_train_batch_size", "4",
        "--use_cpu",
        "--quiet",
        "--output_dir", str(output_dir),
        *extra,
    ]  # fmt: skip


def fails(argv, capsys, code=1):
    """Run ``main(argv)``; assert it exits ``code``; return its one stderr line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def nothing_written(out):
    """No output directory and no partial sibling left behind."""
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]

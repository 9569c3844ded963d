"""Output directories that are either finished or absent.

A command writes into a temporary sibling (``.<name>.partial-<random>``) and
renames it into place after its last file (the resolved ``config.yaml``) is
written; a failed run removes the sibling and leaves no output directory
behind. An existing non-empty output directory is refused unless
``--overwrite``, which replaces it only once the new one is complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from dattri_llm.cli.errors import CLIError

__all__ = ["CONFIG_FILE", "SAMPLE_FILES", "STORE_DIRS", "check_output_dir", "staged_output"]

CONFIG_FILE = "config.yaml"
# what `capture` writes: the two stores (TracInAttributor.cache's layout) and the samples
STORE_DIRS = {"train": "ckpt_0/train_grads", "query": "ckpt_0/test_grads"}
SAMPLE_FILES = {"train": "train_samples.jsonl", "query": "query_samples.jsonl"}


def check_output_dir(output_dir: str, overwrite: bool) -> Path:
    """The output path; ``CLIError`` when it holds files and ``overwrite`` is off."""
    final = Path(output_dir).expanduser().absolute()
    if final.exists() and not final.is_dir():
        raise CLIError(f"--output_dir {final} exists and is not a directory")
    if final.is_dir() and any(final.iterdir()) and not overwrite:
        raise CLIError(
            f"--output_dir {final} already holds a finished run; pass --overwrite "
            "to replace it or choose another directory"
        )
    return final


@contextmanager
def staged_output(final: Path, config: dict[str, Any]) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success write ``config`` and rename it in."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield staging
        text = yaml.safe_dump(config, sort_keys=False)
        with open(staging / CONFIG_FILE, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        _replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``, removing an old ``final`` only after the swap."""
    if not final.exists():
        os.replace(staging, final)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    os.replace(final, old / "previous")
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)

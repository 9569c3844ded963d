"""``top-k`` / ``report`` over an ``attribute`` run's saved score (``--scores``), any method.

The score (``scores.pt``, ``metadata.json``) is ranked with
``AttributionScore.load(dir).top_k(k)`` (its polarity respected). The samples'
texts and tokens come from what the run recorded in its ``config.yaml``: a run
from a capture (``--store``) re-tokenizes the capture's samples files with the
capture's tokenizer (:func:`~dattri_llm.cli.stores.captured_sets`); a live run
loads its ``--train_data`` / ``--query_data`` with its text field options and
tokenizes them with the tokenizer of its ``--model`` (``--tokenizer``), as the
run did. The ranked identifiers are checked against them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.topk import TopK
from dattri_llm.cli.arguments import DataArguments, ModelArguments
from dattri_llm.cli.data import TokenizedSet, load_records, tokenize
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.methods import check_not_stride, score_top_k
from dattri_llm.cli.model import load_tokenizer
from dattri_llm.cli.output import CONFIG_FILE
from dattri_llm.cli.stores import (
    capture_arguments,
    captured_sets,
    config_arguments,
    display_text,
)

__all__ = [
    "check_rank_source",
    "rank_scores",
    "scored_sets",
    "scores_config",
    "set_texts",
    "unshaded_note",
]

_SCORE_FILES = ("scores.pt", "metadata.json")


def check_rank_source(store: str | None, scores: str | None, method: str, command: str) -> bool:
    """Whether ``command`` ranks a saved score (``--scores``); ``CLIError`` unless one source.

    ``--store`` with ``--method stride`` is refused (stride reads no store),
    pointing to ``--scores``.
    """
    if store is not None and scores is not None:
        raise CLIError(
            "--store ranks a capture's gradient stores and --scores an attribute run's saved "
            "score; give one of them"
        )
    if store is None and scores is None:
        raise CLIError(
            "give --store (a capture's output directory) or --scores (an attribute run's)"
        )
    if store is not None:
        check_not_stride(method, command)
    return scores is not None


def scores_config(scores: str) -> dict[str, Any]:
    """The resolved ``config.yaml`` of an attribute run; ``CLIError`` unless ``scores`` is one."""
    root = Path(scores).expanduser()
    if not root.is_dir():
        raise CLIError(f"--scores {root} not found")
    config = root / CONFIG_FILE
    recorded = yaml.safe_load(config.read_text(encoding="utf-8")) if config.is_file() else None
    if not isinstance(recorded, dict) or recorded.get("command") != "attribute":
        raise CLIError(f"--scores {root} is not the output directory of `dattri-llm attribute`")
    missing = [name for name in _SCORE_FILES if not (root / name).is_file()]
    if missing:
        raise CLIError(f"--scores {root}: {', '.join(missing)} missing")
    return recorded


def rank_scores(scores: str, k: int, *, proponents: bool) -> TopK:
    """Each query's ``k`` best rows of the saved score: ``AttributionScore.load(...).top_k(k)``."""
    scores_config(scores)
    score = AttributionScore.load(Path(scores).expanduser())
    return score_top_k(score, k, proponents=proponents)


def scored_sets(scores: str, top: TopK) -> tuple[dict[str, TokenizedSet], Any]:
    """``({"train", "query": tokenized set}, tokenizer)`` of the run that wrote ``scores``.

    ``CLIError`` when the data or tokenizer cannot be loaded, or no longer give
    the ranked identifiers (the data files changed since the run).
    """
    config = scores_config(scores)
    store = config.get("store")
    if store is not None:
        tokenizer = load_tokenizer(capture_arguments(store)[0])
        sets = captured_sets(store, tokenizer)
    else:
        tokenizer = load_tokenizer(config_arguments(ModelArguments, config))
        data = config_arguments(DataArguments, config)
        sets = {
            side: tokenize(load_records(getattr(data, f"{side}_data")), tokenizer, data, side)
            for side in ("train", "query")
        }
    ranked = {"train": {i for row in top.train_ids for i in row}, "query": set(top.test_ids)}
    for side, ids in ranked.items():
        unknown = ids - set(sets[side].ids)
        if unknown:
            source = f"the capture {store}" if store is not None else f"the {side} data file"
            raise CLIError(
                f"--scores {scores}: {len(unknown)} ranked {side} sample(s) are not in "
                f"{source} as tokenized now (did the data change since the attribute run?)"
            )
    return sets, tokenizer


def set_texts(tokenized: TokenizedSet) -> dict[str, str]:
    """``{sample id: text}`` of a tokenized set, each text on one line as the tables show it."""
    return {i: display_text(text) for i, text in zip(tokenized.ids, tokenized.texts)}


def unshaded_note(top: TopK) -> str:
    """Why the report of a saved score shows its tokens unshaded."""
    return (
        f"Tokens are unshaded: ranked from an attribute run's saved {top.algorithm} score, "
        "which holds one score per training sample and no token-level scores."
    )

"""``dattri-llm report``: the token HTML report of a capture's stores and one method.

Ranks with ``top_k_from_cache`` (one pass over the training store), takes the
training samples' tokens from the capture's ``train_samples.jsonl`` and its
tokenizer (re-tokenized as the capture did; their ids are checked), and writes
``report.html`` through ``write_token_report``. With ``--shade`` (the default)
each token is shaded by the method's token-granularity score
(``attribute_from_cache(..., attribution_granularity="token")``); a store that
cannot give token rows (a materialized or projected capture, or a method
without them: the trajectory methods and less) gives an unshaded page that says
why. LESS ranks ``attribute_from_cache``'s score (it cannot stream). ``--format text|json``
also writes the top-k table (``top_k.txt`` / ``top_k.json``) and prints it.

``--scores`` (instead of ``--store``) renders the saved score of an
``attribute`` run, any method (STRIDE, which reads no store, included): ranked
with ``AttributionScore.load(dir).top_k(k)``, the tokens from the run's data
and tokenizer (:mod:`dattri_llm.cli.scores`), always unshaded (a saved score has
one value per sample) and the page says so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.report import write_token_report
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.topk import TopK
from dattri_llm.cli.arguments import RankSourceArguments, ReportArguments
from dattri_llm.cli.data import TokenizedSet
from dattri_llm.cli.method_arguments import LESS_METHOD, TRAJECTORY_METHODS, MethodArguments
from dattri_llm.cli.methods import build_attributor, rank_top_k
from dattri_llm.cli.model import load_tokenizer
from dattri_llm.cli.scores import (
    check_rank_source,
    rank_scores,
    scored_sets,
    set_texts,
    unshaded_note,
)
from dattri_llm.cli.stores import capture_arguments, capture_stores, captured_sets
from dattri_llm.cli.topk import Texts, store_texts, top_k_table, write_top_k

__all__ = ["REPORT_FILE", "run_report", "train_tokens"]

REPORT_FILE = "report.html"


def train_tokens(tokenized: TokenizedSet, tokenizer: Any) -> dict[str, list[str | None]]:
    """``{train id: [token, ...]}`` per input position as the model saw it (padding ``None``)."""
    tokens = {}
    for sample_id, sample in zip(tokenized.ids, tokenized.samples):
        strings = tokenizer.convert_ids_to_tokens(sample["input_ids"].tolist())
        mask = sample["attention_mask"].tolist()
        tokens[sample_id] = [t if m else None for t, m in zip(strings, mask)]
    return tokens


def _token_score(
    args: AttributionArguments,
    method_args: MethodArguments,
    train_dir: str,
    query_dir: str,
    quiet: bool,
) -> tuple[AttributionScore | None, str | None]:
    """The method's token-granularity score, or ``None`` and why the tokens stay unshaded."""
    if method_args.method in (*TRAJECTORY_METHODS, LESS_METHOD):
        return None, (
            f"Tokens are unshaded: {method_args.method} scores each sample at its training "
            "step and has no token-level scores."
        )
    attributor, options = build_attributor(args, method_args)
    try:
        score = attributor.attribute_from_cache(
            train_dir,
            query_dir,
            attribution_granularity="token",
            verbose=not quiet,
            **options,
        )
    except (ValueError, NotImplementedError, TypeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        return None, (
            f"Tokens are unshaded: {method_args.method} cannot give token-level scores from "
            f"these stores ({reason})."
        )
    return score, None


def run_report(
    staging: Path,
    args: AttributionArguments,
    store_args: RankSourceArguments,
    method_args: MethodArguments,
    report_args: ReportArguments,
    *,
    quiet: bool,
) -> str:
    """Write ``report.html`` (and a top-k table with ``--format``) into ``staging``.

    Returns the text to print: the table for ``text`` / ``json``, else a
    one-line summary (and, when tokens are unshaded, why). ``CLIError`` for
    stride with ``--store`` (it reads no store; ``--scores`` renders its output).
    """
    proponents = not report_args.opponents
    if check_rank_source(store_args.store, store_args.scores, method_args.method, "report"):
        top = rank_scores(store_args.scores, report_args.k, proponents=proponents)
        sets, tokenizer = scored_sets(store_args.scores, top)
        texts = (set_texts(sets["train"]), set_texts(sets["query"]))
        token_score, note = None, unshaded_note(top)
    else:
        train_dir, query_dir = capture_stores(store_args.store)
        run_args = dataclasses.replace(args, output_dir=str(staging))
        model_args, _capture, _config = capture_arguments(store_args.store)
        tokenizer = load_tokenizer(model_args)
        sets = captured_sets(store_args.store, tokenizer)
        attributor, options = build_attributor(run_args, method_args, store_args.store)
        top = rank_top_k(
            attributor,
            train_dir,
            query_dir,
            report_args.k,
            proponents=proponents,
            verbose=not quiet,
            options=options,
        )
        texts = store_texts(store_args.store)
        token_score, note = None, None
        if report_args.shade:
            token_score, note = _token_score(run_args, method_args, train_dir, query_dir, quiet)
    return _write_report(staging, report_args, top, sets, tokenizer, texts, token_score, note)


def _write_report(
    staging: Path,
    report_args: ReportArguments,
    top: TopK,
    sets: dict[str, TokenizedSet],
    tokenizer: Any,
    texts: Texts,
    token_score: AttributionScore | None,
    note: str | None,
) -> str:
    """``report.html`` (and the ``--format`` table) of a ranking; the text to print."""
    write_token_report(
        staging / REPORT_FILE,
        top,
        train_tokens(sets["train"], tokenizer),
        query_text=texts[1],
        token_score=token_score,
        note=note,
    )
    if report_args.format != "html":
        return write_top_k(staging, top_k_table(top, texts), report_args.format, both=False)
    shading = "tokens shaded by their scores" if token_score is not None else "tokens unshaded"
    lines = [f"{top.algorithm}: top {top.k} per query for {len(top.test_ids)} queries, {shading}"]
    if note is not None:
        lines.append(note)
    return "\n".join(lines)

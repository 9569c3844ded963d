"""``dattri-llm top-k``: each query's k best training samples, as a table or JSON.

Streams the training store of a capture (``--store``) once (``top_k_from_cache``,
no score matrix; LESS, which rescales its rows after the pass, ranks
``attribute_from_cache``'s score), or with ``--index`` searches a FAISS index of
it (``AttributionIndex``); or ranks the saved score of an ``attribute`` run
(``--scores``, any method, stride included: ``AttributionScore.load(dir).top_k(k)``,
texts from the run's data and tokenizer, :mod:`dattri_llm.cli.scores`). It
writes ``top_k.json`` and ``top_k.txt`` to the output directory; the chosen
``--format`` is printed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.index import AttributionIndex
from dattri_llm.attribution.topk import TopK
from dattri_llm.cli.arguments import RankSourceArguments, TopKArguments
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.method_arguments import MethodArguments
from dattri_llm.cli.methods import build_attributor, rank_top_k
from dattri_llm.cli.scores import check_rank_source, rank_scores, scored_sets, set_texts
from dattri_llm.cli.stores import capture_stores, sample_texts

__all__ = [
    "INDEX_METHODS",
    "Texts",
    "index_top_k",
    "render_text",
    "run_top_k",
    "store_texts",
    "top_k_table",
    "write_top_k",
]

INDEX_METHODS = ("graddot", "tracin", "gradcos")  # an index of the raw store, no fit
Texts = tuple[dict[str, str], dict[str, str]]  # ({train id: text}, {query id: text})


def store_texts(store: str) -> Texts:
    """The texts of a capture's training and query samples."""
    return sample_texts(store, "train"), sample_texts(store, "query")


def run_top_k(
    staging: Path,
    args: AttributionArguments,
    store_args: RankSourceArguments,
    method_args: MethodArguments,
    top_args: TopKArguments,
    *,
    quiet: bool,
) -> str:
    """Rank into ``staging``; return the text to print (``CLIError`` for stride with a store)."""
    if check_rank_source(store_args.store, store_args.scores, method_args.method, "top-k"):
        if top_args.index is not None:
            raise CLIError(
                "--index searches a capture's store and --scores ranks a saved score; drop --index"
            )
        top = rank_scores(store_args.scores, top_args.k, proponents=not top_args.opponents)
        sets, _tokenizer = scored_sets(store_args.scores, top)
        texts = (set_texts(sets["train"]), set_texts(sets["query"]))
        return write_top_k(staging, top_k_table(top, texts), top_args.format)
    train_dir, query_dir = capture_stores(store_args.store)
    attributor, options = build_attributor(
        dataclasses.replace(args, output_dir=str(staging)), method_args, store_args.store
    )
    if top_args.index is not None:
        return write_top_k(
            staging,
            index_top_k(store_args.store, method_args.method, top_args, quiet=quiet),
            top_args.format,
        )
    top = rank_top_k(
        attributor,
        train_dir,
        query_dir,
        top_args.k,
        proponents=not top_args.opponents,
        verbose=not quiet,
        options=options,
    )
    result = top_k_table(top, store_texts(store_args.store))
    return write_top_k(staging, result, top_args.format)


def index_top_k(store: str, method: str, top_args: TopKArguments, *, quiet: bool) -> dict[str, Any]:
    """The table of an index search of a capture (built beside its train store on first use).

    The index directory is ``<train store>/attribution_index_<kind>`` (``_cos``
    appended for Grad-Cos, whose index holds normalised vectors).
    """
    if method not in INDEX_METHODS:
        raise CLIError(
            f"--index serves {', '.join(INDEX_METHODS)}: {method} preconditions its queries "
            "with a fit; drop --index (top-k reads the store once, exactly)"
        )
    train_dir, query_dir = capture_stores(store)
    normalize = method == "gradcos"
    name = f"attribution_index_{top_args.index}{'_cos' if normalize else ''}"
    directory = Path(train_dir) / name
    if (directory / "index.json").is_file():
        index = AttributionIndex.load(train_dir, path=directory)
    else:
        index = AttributionIndex.build(
            train_dir,
            kind=top_args.index,
            normalize=normalize,
            path=directory,
            verbose=not quiet,
        )
    index.set_search_params(nprobe=top_args.nprobe, ef_search=top_args.ef_search)
    found = index.search(query_dir, top_args.k, proponents=not top_args.opponents)
    algorithm = "GradCos" if normalize else "TracIn"
    ranking = found.as_dict()
    return _table(algorithm, not top_args.opponents, 1, top_args.k, ranking, store_texts(store))


def write_top_k(directory: Path, result: dict[str, Any], fmt: str, both: bool = True) -> str:
    """Write ``top_k.json`` and ``top_k.txt`` (only ``fmt``'s unless ``both``); return ``fmt``'s."""
    as_json = json.dumps(result, indent=2, ensure_ascii=False)
    as_text = render_text(result)
    if both or fmt == "json":
        (directory / "top_k.json").write_text(as_json + "\n", encoding="utf-8")
    if both or fmt == "text":
        (directory / "top_k.txt").write_text(as_text + "\n", encoding="utf-8")
    return as_json if fmt == "json" else as_text


def top_k_table(top: TopK, texts: Texts) -> dict[str, Any]:
    """A ranking as plain data: per query its id and text, per row rank, id, score and text."""
    return _table(top.algorithm, top.proponents, top.polarity, top.k, top.as_dict(), texts)


def _table(
    algorithm: str,
    proponents: bool,
    polarity: int,
    k: int,
    ranking: dict[str, list[tuple[str, float]]],
    texts: Texts,
) -> dict[str, Any]:
    """:func:`top_k_table` of ``ranking`` (``{query id: [(train id, score), ...]}``)."""
    train_text, query_text = texts
    return {
        "algorithm": algorithm,
        "proponents": proponents,
        "polarity": polarity,
        "k": k,
        "queries": [
            {
                "id": query_id,
                "text": query_text.get(query_id),
                "top": [
                    {
                        "rank": rank,
                        "train_id": train_id,
                        "score": value,
                        "text": train_text.get(train_id),
                    }
                    for rank, (train_id, value) in enumerate(ranked, start=1)
                ],
            }
            for query_id, ranked in ranking.items()
        ],
    }


def render_text(result: dict[str, Any]) -> str:
    """A plain-text table: per query, its rank, score, training id and text."""
    kind = "proponents" if result["proponents"] else "opponents"
    lines = [f"{result['algorithm']}: top {result['k']} {kind} per query"]
    if result["polarity"] < 0:
        lines[0] += " (a more negative score is more helpful)"
    for number, query in enumerate(result["queries"], start=1):
        label = query["text"] if query["text"] is not None else query["id"]
        lines += ["", f"query {number}: {label}"]
        lines.append(f"  {'rank':>4}  {'score':>12}  {'train id':<12}  text")
        for row in query["top"]:
            text = row["text"] if row["text"] is not None else ""
            lines.append(
                f"  {row['rank']:>4}  {row['score']:>+12.5g}  {row['train_id'][:12]:<12}  {text}"
            )
    return "\n".join(lines)

"""``dattri-llm validate``: how well saved attribution scores predict retraining on this data.

Each ``--scores`` directory is an ``attribute`` run's saved ``AttributionScore``
(any method); its rows and queries are looked up by sample id
(:func:`~dattri_llm.evaluation.align_scores`), so every training sample and
query of ``--train_data`` / ``--query_data`` must be scored. The ground truth
comes from :mod:`dattri_llm.evaluation`: ``lds_ground_truth`` (LDS, retrains
on ``--num_subsets`` random ``--alpha`` subsets) and ``leave_one_out`` (LOO);
the retrains are those of :class:`~dattri_llm.cli.retrain.FineTuner`.

Retrains are saved one file each, at once, under ``--retrain_dir`` (default:
``<output_dir>.retrains`` beside the output directory, ``lds/`` and ``loo/``),
which lives outside the staged output directory: a killed run leaves them
there and a rerun with the same arguments trains only the missing ones. Its
``training.json`` records the model, the data (hashes of the ordered sample
ids) and the training settings; a rerun with other ones is refused.

Writes ``validation.json`` (per method: each metric's mean, bootstrap interval
and per-query values) and ``validation.md`` (the table, also printed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli.arguments import DataArguments, ModelArguments, ValidateArguments
from dattri_llm.cli.data import TokenizedSet, load_records, tokenize
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.model import load_model
from dattri_llm.cli.retrain import TRAINING_FIELDS, FineTuner, check_setup
from dattri_llm.cli.scores import scores_config
from dattri_llm.evaluation import (
    Interval,
    LDSConfig,
    LDSGroundTruth,
    LeaveOneOutResult,
    lds,
    lds_ground_truth,
    leave_one_out,
    loo_correlation,
    recall_at_k,
)
from dattri_llm.evaluation.retrain import DESIGN_FILE
from dattri_llm.evaluation.subsets import ids_digest, subset_size

__all__ = [
    "RESULT_FILE",
    "GroundTruth",
    "TABLE_FILE",
    "check_design",
    "check_score_ids",
    "default_retrain_dir",
    "ground_truth",
    "method_row",
    "planted_rows",
    "removed_rows",
    "render_table",
    "run_validate",
]

RESULT_FILE = "validation.json"
TABLE_FILE = "validation.md"


def default_retrain_dir(final: Path) -> Path:
    """``<output_dir>.retrains``: beside the output directory, so it outlives a killed run."""
    return final.parent / f"{final.name}.retrains"


def check_score_ids(
    directory: str, score: AttributionScore, train: TokenizedSet, query: TokenizedSet
) -> None:
    """``CLIError`` unless ``score`` scores every training sample and query of the data."""
    for side, tokenized, known in (
        ("training", train, score.train_index),
        ("query", query, set(score.test_ids)),
    ):
        missing = [i for i in tokenized.ids if i not in known]
        if missing:
            flag = "--train_data" if side == "training" else "--query_data"
            raise CLIError(
                f"--scores {directory}: {len(missing)} of the {len(tokenized.ids)} {side} "
                f"samples of {flag} have no score (ids such as {missing[0][:12]}); score this "
                "data with `dattri-llm attribute` (same files, fields, --max_length and "
                "tokenizer)"
            )


def planted_rows(path: str, train: TokenizedSet, query: TokenizedSet) -> list[list[int]]:
    """Per query (file order) the training rows planted for it, from the ``--planted`` file.

    The file holds a list (one list per query) or an object ``{query id: list}``
    (queries left out have nothing planted); entries are training ids or row
    indices. ``CLIError`` for anything else.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"--planted file {file} not found")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CLIError(f"--planted file {file} is not valid JSON: {err}") from err
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(query.ids))
        if unknown:
            raise CLIError(f"--planted {file}: unknown query id(s) {unknown[:3]}")
        lists = [data.get(query_id, []) for query_id in query.ids]
    elif isinstance(data, list):
        if len(data) != len(query.ids):
            raise CLIError(
                f"--planted {file} lists {len(data)} queries but --query_data has {len(query.ids)}"
            )
        lists = data
    else:
        raise CLIError(f"--planted {file} must hold a list of lists or an object of lists")
    row_of = {train_id: row for row, train_id in enumerate(train.ids)}
    rows = []
    for j, entries in enumerate(lists):
        if not isinstance(entries, list):
            raise CLIError(f"--planted {file}: query {j}'s entry must be a list")
        picked = []
        for entry in entries:
            if isinstance(entry, str) and entry in row_of:
                picked.append(row_of[entry])
            elif isinstance(entry, int) and not isinstance(entry, bool):
                if not 0 <= entry < len(train.ids):
                    raise CLIError(
                        f"--planted {file}: query {j}'s row {entry} is not in [0, {len(train.ids)})"
                    )
                picked.append(entry)
            else:
                raise CLIError(
                    f"--planted {file}: query {j}'s entry {entry!r} is neither a training id "
                    "nor a row index"
                )
        rows.append(sorted(set(picked)))
    return rows


def removed_rows(n_train: int, num_removed: int | None, seed: int) -> list[int]:
    """LOO's left-out rows: all, or ``num_removed`` drawn with ``seed`` (sorted)."""
    if num_removed is None or num_removed >= n_train:
        return list(range(n_train))
    generator = torch.Generator().manual_seed(int(seed))
    return sorted(torch.randperm(n_train, generator=generator)[:num_removed].tolist())


def _load_sets(
    model_args: ModelArguments, data_args: DataArguments, quiet: bool
) -> tuple[torch.nn.Module, dict[str, TokenizedSet]]:
    records = {
        side: load_records(getattr(data_args, f"{side}_data")) for side in ("train", "query")
    }
    model, tokenizer = load_model(model_args, quiet=quiet)
    sets = {name: tokenize(rows, tokenizer, data_args, name) for name, rows in records.items()}
    if len(sets["train"].ids) < 2:
        raise CLIError("validate retrains on parts of the training set: it needs 2+ samples")
    return model, sets


def _interval(value: Interval | None) -> dict[str, Any] | None:
    if value is None:
        return None
    finite = [None if math.isnan(v) else v for v in value.per_query.tolist()]
    return {
        "mean": None if math.isnan(value.mean) else value.mean,
        "low": None if math.isnan(value.low) else value.low,
        "high": None if math.isnan(value.high) else value.high,
        "level": value.level,
        "method": value.method,
        "per_query": finite,
    }


def _cell(value: dict[str, Any] | None) -> str:
    if value is None:
        return "—"
    if value["mean"] is None:
        return "n/a"
    return f"{value['mean']:.4f} [{value['low']:.4f}, {value['high']:.4f}]"


def render_table(result: dict[str, Any]) -> str:
    """``validation.md``: one row per scores directory."""
    k = result.get("recall", {}).get("k")
    head = ["method", "scores", "LDS mean [95% CI]", "LOO Spearman [95% CI]"]
    head.append(f"recall@{k}" if k is not None else "recall@k")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["methods"]:
        cells = [row["algorithm"], row["name"]]
        cells += [_cell(row.get(key)) for key in ("lds", "loo", "recall_at_k")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_FLAGS = {"alpha": "--alpha", "num_subsets": "--num_subsets", "seed": "--seed"}


def check_design(directory: Path, expected: dict[str, Any]) -> None:
    """``CLIError`` when ``directory``'s saved design (``design.json``) has other settings.

    The evaluation refuses such a directory too; this names the flags to change.
    """
    path = directory / DESIGN_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return  # the evaluation reports the unreadable file
    diff = [key for key in expected if isinstance(saved, dict) and saved.get(key) != expected[key]]
    if diff:
        shown = ", ".join(f"{_FLAGS[k]} {saved.get(k)!r} (now {expected[k]!r})" for k in diff)
        raise CLIError(
            f"--retrain_dir {directory.parent} holds {directory.name} retrains made with "
            f"{shown}; pass the same to reuse them, or another --retrain_dir"
        )


@dataclass
class GroundTruth:
    """The retraining ground truth of a validate run (``None``: that metric is not measured)."""

    lds: LDSGroundTruth | None
    loo: LeaveOneOutResult | None
    trained: int  # retrains trained in this run (the others were read back)

    @property
    def total(self) -> int:
        """Retrains the metrics rest on."""
        lds_count = 0 if self.lds is None else len(self.lds.losses)
        return lds_count + (0 if self.loo is None else len(self.loo.removed) + 1)


def ground_truth(
    tuner: FineTuner,
    train_ids: list[str],
    val_args: ValidateArguments,
    seed: int,
    retrain_dir: Path,
    quiet: bool,
) -> GroundTruth:
    """LDS and / or LOO retrains of ``tuner`` under ``retrain_dir`` (``lds/``, ``loo/``)."""
    trained = [0]

    def train_fn(kept: list[int], retrain_seed: int) -> torch.nn.Module:
        trained[0] += 1
        return tuner.train(kept, retrain_seed)

    truth = loo = None
    if val_args.metric in ("lds", "both"):
        config = LDSConfig(alpha=val_args.alpha, num_subsets=val_args.num_subsets, seed=seed)
        check_design(retrain_dir / "lds", config.to_dict())
        truth = lds_ground_truth(
            train_fn,
            tuner.losses,
            train_ids,
            config,
            out_dir=retrain_dir / "lds",
            progress=not quiet,
        )
    if val_args.metric in ("loo", "both"):
        check_design(retrain_dir / "loo", {"seed": seed})
        loo = leave_one_out(
            train_fn,
            tuner.losses,
            train_ids,
            removed=removed_rows(len(train_ids), val_args.num_removed, seed),
            seed=seed,
            out_dir=retrain_dir / "loo",
            progress=not quiet,
        )
    return GroundTruth(truth, loo, trained[0])


def method_row(
    directory: str,
    score: AttributionScore,
    truth: GroundTruth,
    query_ids: list[str],
    planted: list[list[int]] | None,
    k: int,
) -> dict[str, Any]:
    """One ``validation.json`` entry: the score's metrics against ``truth``."""
    row: dict[str, Any] = {
        "scores": str(directory),
        "name": Path(directory).name,
        "algorithm": score.algorithm,
        "polarity": score.polarity,
    }
    if truth.lds is not None:
        row["lds"] = _interval(lds(score, truth.lds, test_ids=query_ids))
    if truth.loo is not None:
        row["loo"] = _interval(loo_correlation(score, truth.loo, test_ids=query_ids))
    if planted is not None:
        train_ids = truth.lds.train_ids if truth.lds is not None else truth.loo.train_ids
        found = recall_at_k(score, planted, k, train_ids=train_ids, test_ids=query_ids)
        row["recall_at_k"] = _interval(found)
    return row


def run_validate(
    staging: Path,
    args: AttributionArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    val_args: ValidateArguments,
    *,
    quiet: bool,
    final: Path | None = None,
) -> str:
    """Retrain (resumably), score every ``--scores`` run, write the results; return the summary."""
    if args.world_size > 1:
        raise CLIError("validate retrains in one process; run it without torchrun / WORLD_SIZE")
    scores = []
    for directory in val_args.scores:
        scores_config(directory)
        scores.append((directory, AttributionScore.load(Path(directory).expanduser())))
    model, sets = _load_sets(model_args, data_args, quiet)
    train, query = sets["train"], sets["query"]
    for directory, score in scores:
        check_score_ids(directory, score, train, query)
    planted = None if val_args.planted is None else planted_rows(val_args.planted, train, query)
    if val_args.retrain_dir is not None:
        retrain_dir = Path(val_args.retrain_dir).expanduser().absolute()
    else:
        retrain_dir = default_retrain_dir(final or staging)
    check_setup(
        retrain_dir,
        {
            "model": model_args.model,
            "tokenizer": model_args.tokenizer,
            "train_ids_sha256": ids_digest(train.ids),
            "query_ids_sha256": ids_digest(query.ids),
            **{name: getattr(args, name) for name in TRAINING_FIELDS},
        },
    )
    tuner = FineTuner(model, args, train, query)
    truth = ground_truth(tuner, train.ids, val_args, args.seed, retrain_dir, quiet)
    result: dict[str, Any] = {
        "metric": val_args.metric,
        "num_train": len(train.ids),
        "num_queries": len(query.ids),
        "query_ids": query.ids,
        "retrain_dir": str(retrain_dir),
        "methods": [
            method_row(directory, score, truth, query.ids, planted, val_args.k)
            for directory, score in scores
        ],
    }
    if truth.lds is not None:
        config = truth.lds.config
        size = subset_size(len(train.ids), config.alpha)
        result["lds"] = {**config.to_dict(), "subset_size": size}
    if truth.loo is not None:
        result["loo"] = {"seed": args.seed, "removed": truth.loo.removed, "correlation": "spearman"}
    if planted is not None:
        result["recall"] = {"k": val_args.k, "planted": planted}
    table = render_table(result)
    (staging / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (staging / TABLE_FILE).write_text(table + "\n", encoding="utf-8")
    return (
        f"{table}\n{len(scores)} score(s) against {truth.total} retrains ({truth.trained} "
        f"trained now, {truth.total - truth.trained} reused from {retrain_dir})"
    )

"""A resumable runner of retrains: one small JSON result file per finished retrain.

:class:`RetrainRunner` calls the user's ``train_fn(kept_indices, seed)`` and
``eval_fn(model)`` for each job, and (with an output directory) writes each
finished job's query losses to ``<out_dir>/results/<key>.json`` atomically
(temporary file, fsync, rename). On a rerun, jobs whose result file exists are
read back (plain JSON, never executed) instead of being retrained. The
directory's ``design.json`` records the evaluation's design; a rerun with a
different design is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dattri_llm.utils.atomic import atomic_write

__all__ = ["DESIGN_FILE", "RESULTS_DIR", "RetrainJob", "RetrainRunner", "TrainFn", "EvalFn"]

DESIGN_FILE = "design.json"
RESULTS_DIR = "results"
_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")

TrainFn = Callable[[list[int], int], Any]
"""``train_fn(kept_indices, seed) -> model``: train on the kept training rows."""
EvalFn = Callable[[Any], torch.Tensor]
"""``eval_fn(model) -> (n_queries,)`` losses of the queries under the trained model."""


@dataclass(frozen=True)
class RetrainJob:
    """One retrain: train on ``kept`` (sorted training-row indices) with ``seed``.

    ``key`` names the result file (letters, digits, ``_ . -``).
    """

    key: str
    kept: tuple[int, ...]
    seed: int

    def __post_init__(self) -> None:
        """Check the key can be a file name."""
        if not _KEY.match(self.key):
            raise ValueError(f"job key must match {_KEY.pattern}, got {self.key!r}")

    @property
    def kept_digest(self) -> str:
        """SHA-256 of the kept indices: a result file is only reused for the same subset."""
        return hashlib.sha256(json.dumps(list(self.kept)).encode()).hexdigest()


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    data = json.dumps(payload, sort_keys=True).encode("utf-8")
    atomic_write(path, lambda handle: handle.write(data))


class RetrainRunner:
    """Run retrain jobs, persisting each finished one so a rerun never redoes it.

    Args:
        train_fn: ``train_fn(kept_indices: list[int], seed: int) -> model``.
        eval_fn: ``eval_fn(model) -> (n_queries,)`` query losses.
        out_dir: where results go; ``None`` keeps them in memory only (no resume).
        design: JSON-able description of the evaluation (kind, sizes, seeds...).
            The first run writes it to ``design.json``; a later run with a
            different design raises ``ValueError``.
        progress: show a tqdm bar over the jobs.
    """

    def __init__(
        self,
        train_fn: TrainFn,
        eval_fn: EvalFn,
        *,
        out_dir: str | Path | None,
        design: dict[str, Any],
        progress: bool = True,
    ) -> None:
        """Bind the functions; create ``out_dir`` and check or write its ``design.json``."""
        if not callable(train_fn) or not callable(eval_fn):
            raise TypeError("train_fn and eval_fn must be callables")
        self.train_fn = train_fn
        self.eval_fn = eval_fn
        self.design = json.loads(json.dumps(design, sort_keys=True))
        self.progress = progress
        self.out_dir = None if out_dir is None else Path(out_dir).expanduser()
        self.calls = 0
        if self.out_dir is not None:
            self._open_dir(self.out_dir)

    def _open_dir(self, out: Path) -> None:
        (out / RESULTS_DIR).mkdir(parents=True, exist_ok=True)
        path = out / DESIGN_FILE
        if path.is_file():
            try:
                saved = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{path} is not valid JSON ({err}); use a fresh out_dir") from None
            if saved != self.design:
                diff = sorted(
                    k for k in set(saved) | set(self.design) if saved.get(k) != self.design.get(k)
                )
                raise ValueError(
                    f"{out} holds results of a different evaluation design (differs in {diff}: "
                    f"saved {[saved.get(k) for k in diff]}, "
                    f"now {[self.design.get(k) for k in diff]}); "
                    "pass the same settings to resume, or use a new out_dir"
                )
        else:
            _write_json(path, self.design)

    def _result_path(self, job: RetrainJob) -> Path:
        assert self.out_dir is not None
        return self.out_dir / RESULTS_DIR / f"{job.key}.json"

    def _load(self, job: RetrainJob, path: Path) -> torch.Tensor:
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(
                f"result file {path} is not valid JSON ({err}); delete it to redo that retrain"
            ) from None
        ok = (
            isinstance(payload, dict)
            and payload.get("key") == job.key
            and payload.get("seed") == job.seed
            and payload.get("kept_sha256") == job.kept_digest
            and isinstance(payload.get("losses"), list)
            and all(isinstance(v, (int, float)) for v in payload["losses"])
        )
        if not ok:
            raise ValueError(
                f"result file {path} does not belong to job {job.key!r} (seed {job.seed}, "
                "its kept subset) or is malformed; delete it to redo that retrain"
            )
        return torch.tensor(payload["losses"], dtype=torch.float64)

    def run_job(self, job: RetrainJob) -> torch.Tensor:
        """Query losses ``(n_queries,)`` float64 of one job: read back if saved, else trained."""
        path = None if self.out_dir is None else self._result_path(job)
        if path is not None and path.is_file():
            return self._load(job, path)
        self.calls += 1
        model = self.train_fn(list(job.kept), job.seed)
        losses = torch.as_tensor(self.eval_fn(model)).detach().to("cpu", torch.float64)
        if losses.dim() != 1:
            raise ValueError(
                f"eval_fn must return (n_queries,) losses, got shape {tuple(losses.shape)}"
            )
        if path is not None:
            _write_json(
                path,
                {
                    "key": job.key,
                    "seed": job.seed,
                    "kept_sha256": job.kept_digest,
                    "num_kept": len(job.kept),
                    "losses": losses.tolist(),
                },
            )
        return losses

    def run(self, jobs: Sequence[RetrainJob], *, desc: str = "retrain") -> torch.Tensor:
        """Losses of every job, ``(len(jobs), n_queries)`` float64, in job order.

        Raises:
            ValueError: two jobs share a key, or the jobs return different numbers of queries.
        """
        keys = [job.key for job in jobs]
        if len(set(keys)) != len(keys):
            raise ValueError("job keys must be distinct")
        rows = [self.run_job(job) for job in tqdm(jobs, desc=desc, disable=not self.progress)]
        sizes = {row.numel() for row in rows}
        if len(sizes) > 1:
            raise ValueError(
                f"eval_fn returned different numbers of queries across retrains: {sizes}"
            )
        return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)

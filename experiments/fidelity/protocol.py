"""Ground truths and metrics of the fidelity experiments, through ``dattri_llm.evaluation``.

* Retraining: ``train_fn(kept, seed)`` = the pretrained start (``scoring.fresh_model``)
  fine-tuned by ``setting.run_subset_trajectory`` on the kept samples; ``eval_fn`` =
  ``setting.query_losses``. The trajectory is deterministic (fixed order and batches,
  dropout 0, one thread, deterministic kernels), so ``train_fn`` ignores ``seed``.
* Leave-one-out: :func:`dattri_llm.evaluation.leave_one_out` with those functions
  (all samples but ``i`` kept reproduces ``run_trajectory(removed=i)`` bit for bit,
  ``tests/test_lds_smoke.py``).
* LDS: :func:`dattri_llm.evaluation.lds_ground_truth` (subsets from
  :func:`~dattri_llm.evaluation.sample_subsets`) and :func:`~dattri_llm.evaluation.lds`.
* Summaries: per-query values → mean, standard error and the library's bootstrap 95 %
  interval over queries (:func:`~dattri_llm.evaluation.mean_ci`).

Retrains are resumable: with a cache directory each finished retrain is one JSON file
(``RetrainRunner``), and a rerun reads it back. The cache is keyed by the setting's fields
and the source of ``setting.py`` (a change to either starts a fresh directory).
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import setting as setting_module
import torch
from scoring import fresh_model
from setting import Data, Setting, query_losses, run_subset_trajectory

from dattri_llm import hash_sample
from dattri_llm.evaluation import (
    Interval,
    LDSConfig,
    LDSGroundTruth,
    LeaveOneOutResult,
    lds,
    lds_ground_truth,
    leave_one_out,
    loo_correlation,
    mean_ci,
)

CACHE = Path(__file__).resolve().parent / ".cache"
# The training code the retrains ran (read once, at import: the code this process runs).
_SETTING_SOURCE = Path(setting_module.__file__).read_bytes()
LDS_SEED = 10_000  # LDSConfig.seed: seeds evaluation.sample_subsets


@dataclass(frozen=True)
class Stat:
    """A per-query metric summarised: mean, standard error, bootstrap 95 % interval."""

    mean: float
    se: float
    low: float
    high: float

    @classmethod
    def of(cls, interval: Interval) -> Stat:
        """From a library :class:`Interval` (adds the standard error of its finite values)."""
        values = interval.per_query[torch.isfinite(interval.per_query)]
        n = values.numel()
        se = float(values.std() / math.sqrt(n)) if n > 1 else 0.0
        return cls(interval.mean, se, interval.low, interval.high)

    @classmethod
    def over(cls, per_query: torch.Tensor) -> Stat:
        """From ``(num_query,)`` per-query values (``mean_ci`` with its default seed)."""
        return cls.of(mean_ci(per_query))

    def cell(self) -> str:
        """``+0.777 ± 0.015``."""
        return f"{self.mean:+.3f} ± {self.se:.3f}"

    def ci(self) -> str:
        """``[+0.747, +0.806]``."""
        return f"[{self.low:+.3f}, {self.high:+.3f}]"


# ---------------------------------------------------------------------------- retraining
def train_fn_for(start: dict[str, torch.Tensor], setting: Setting, data: Data, dtype=torch.float32):
    """``train_fn(kept, seed)``: the pretrained model in ``dtype`` fine-tuned on ``kept``.

    ``seed`` is unused: the trajectory is deterministic (fixed order, dropout 0).
    """

    def train_fn(kept: list[int], seed: int) -> torch.nn.Module:
        del seed  # deterministic trajectory: every retrain follows the same order and batches
        model = fresh_model(start, setting, data, dtype)
        run_subset_trajectory(model, setting, data, kept)
        return model

    return train_fn


def eval_fn_for(data: Data):
    """``eval_fn(model) -> (num_queries,)`` query losses."""
    return lambda model: query_losses(model, data)


def train_ids(data: Data) -> list[str]:
    """Sample hashes of the fine-tuning set, in order (``Captured.train_ids``)."""
    return [hash_sample(x) for x in data.finetune]


def cache_dir(cache: Path | None, setting: Setting, what: str) -> Path | None:
    """``<cache>/<setting name>-<digest>/<what>``; ``None`` without a cache.

    The digest covers the setting's fields, ``setting.FLOAT64_LOSS`` and the source of
    ``setting.py``, so results of another setting or training code are never reused.
    """
    if cache is None:
        return None
    key = repr(sorted(setting.__dict__.items())) + repr(setting_module.FLOAT64_LOSS)
    digest = hashlib.sha256(key.encode() + _SETTING_SOURCE).hexdigest()[:12]
    return Path(cache) / f"{setting.name}-{digest}" / what


def loo_truth(
    start: dict[str, torch.Tensor],
    setting: Setting,
    data: Data,
    *,
    dtype: torch.dtype = torch.float32,
    cache: Path | None = None,
) -> LeaveOneOutResult:
    """Leave-one-out ground truth of ``data.removed`` (``Δ = L(without i) − L(full)``)."""
    return leave_one_out(
        train_fn_for(start, setting, data, dtype),
        eval_fn_for(data),
        train_ids(data),
        removed=data.removed,
        out_dir=cache_dir(cache, setting, f"loo_{str(dtype).removeprefix('torch.')}"),
        progress=False,
    )


def lds_truth(
    start: dict[str, torch.Tensor],
    setting: Setting,
    data: Data,
    count: int,
    fraction: float,
    *,
    cache: Path | None = None,
) -> LDSGroundTruth:
    """Query losses after retraining on ``count`` subsets of ``fraction`` of the samples."""
    config = LDSConfig(alpha=fraction, num_subsets=count, seed=LDS_SEED)
    return lds_ground_truth(
        train_fn_for(start, setting, data),
        eval_fn_for(data),
        train_ids(data),
        config,
        out_dir=cache_dir(cache, setting, f"lds_{count}_{fraction:g}"),
        progress=False,
    )


# ---------------------------------------------------------------------------- metrics
def tsloo_stat(scores: torch.Tensor, truth: LeaveOneOutResult) -> Stat:
    """Per-query Spearman of ``(num_train, num_query)`` "helps" scores with ``Δ``."""
    return Stat.of(loo_correlation(scores, truth))


def lds_stat(scores: torch.Tensor, truth: LDSGroundTruth) -> Stat:
    """LDS of ``(num_train, num_query)`` "helps" scores."""
    return Stat.of(lds(scores, truth))


def membership(truth: LDSGroundTruth) -> torch.Tensor:
    """``(count, num_train)`` 0/1 membership of the subsets."""
    members = torch.zeros(truth.subsets.shape[0], len(truth.train_ids), dtype=torch.float64)
    members.scatter_(1, truth.subsets, 1.0)
    return members


# ---------------------------------------------------------------------------- report
def machine() -> str:
    """CPU model and core count from ``lscpu``, torch threads and versions."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        cpu = f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPU(s)"
        cpu += f" (nproc {len(os.sched_getaffinity(0))})"
    except (OSError, subprocess.CalledProcessError):
        cpu = "lscpu unavailable"
    import transformers  # optional dependency of the experiment

    return (
        f"{cpu}; torch {torch.__version__} with {torch.get_num_threads()} thread, "
        f"transformers {transformers.__version__}"
    )

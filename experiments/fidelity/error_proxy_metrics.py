"""The statistics of ``error_proxy.py``: one configuration's numbers (:class:`Row`).

``evaluate`` turns a configuration's float64 replays (Δ_true, the exact first-order
removal estimate, the finite-difference ``½a''(0)``), AdamW-influence's ``Δ_linear`` and
the library's error proxy into config-level metrics, per-query tensors and the per-pair
tensors of the plot.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from setting import batch_order  # noqa: E402

from dattri_llm.evaluation import spearman as spearman_per_query  # noqa: E402


def pearson_per_query(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(num_query,)`` Pearson correlations between the columns of two ``(n, m)`` matrices."""
    a, b = a.double() - a.double().mean(0), b.double() - b.double().mean(0)
    return (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-300)


def spearman_flat(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman over all entries (sample × query pairs, or configurations)."""
    a, b = a.reshape(-1, 1).double(), b.reshape(-1, 1).double()
    return float(spearman_per_query(a, b)[0])


def relative_statistic(second: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """``(num_query,)`` ``|mean_i second| / rms_i(linear)`` (the proxy's ``relative_error``)."""
    return second.mean(0).abs() / linear.pow(2).mean(0).sqrt().clamp_min(1e-300)


def split_ratios(name: str, second: torch.Tensor, taylor: torch.Tensor, first) -> dict:
    """``mean |second| / mean |taylor|`` over the first update's samples and the others."""
    out = {}
    for part, rows in (("first", first), ("rest", ~first)):
        if rows.any():
            out[f"{name}_ratio_{part}"] = float(
                second[rows].abs().mean() / taylor[rows].abs().mean()
            )
    return out


@dataclass
class Row:
    """One configuration's numbers."""

    lr: float
    steps: int
    length: str
    metrics: dict
    per_query: dict  # (num_query,) tensors: AdamW Spearman, relative_error, reliable
    scatter: dict  # per-pair tensors for the plot


def evaluate(setting, length, rep, linear, proxy, removed: list[int]) -> Row:
    """Every statistic of one configuration (``proxy`` may be ``None``)."""
    truth, exact, fd = rep["truth"], rep["exact_linear"], rep["fd_second"]
    error = truth - linear
    first = torch.tensor([i in batch_order(setting)[0] for i in removed])
    m = {
        "num_first": int(first.sum()),
        **split_ratios("fd", fd, truth - exact, first),
        **split_ratios("method", exact - linear, truth, first),
        "mean_abs_truth": float(truth.abs().mean()),
        "mean_abs_error": float(error.abs().mean()),
        "rel_error": float(error.abs().mean() / truth.abs().mean()),
        "mean_abs_taylor": float((truth - exact).abs().mean()),
        "mean_abs_method": float((exact - linear).abs().mean()),
        "mean_abs_fd": float(fd.abs().mean()),
        "median_abs_fd": float(fd.abs().median()),
        "median_abs_error": float(error.abs().median()),
        "median_abs_taylor": float((truth - exact).abs().median()),
        "fd_vs_taylor_pairs": spearman_flat(fd, truth - exact),
        "fd_vs_error_pairs": spearman_flat(fd, error),
        "fd_relative": float(relative_statistic(fd, exact).median()),
        "spearman": float(spearman_per_query(linear, truth).mean()),
        "spearman_se": float(spearman_per_query(linear, truth).std() / math.sqrt(truth.shape[1])),
        "pearson": float(pearson_per_query(linear, truth).mean()),
        "limit_spearman": float(spearman_per_query(exact, truth).mean()),
        "fd_corrected_spearman": float(spearman_per_query(exact + fd, truth).mean()),
        "replay_seconds": float(rep["seconds"]),
    }
    per_query = {"spearman": spearman_per_query(linear, truth)}
    scatter = {"error": error, "fd": fd, "first": first}
    if proxy is not None:
        second = proxy["second"]
        m |= split_ratios("proxy", second, truth - exact, first)
        m |= {
            "mean_abs_proxy": float(second.abs().mean()),
            "median_abs_proxy": float(second.abs().median()),
            "max_share": float(second.abs().amax(1).max() / second.abs().amax(1).sum()),
            "ratio": float(second.abs().mean() / error.abs().mean()),
            "proxy_vs_error_pairs": spearman_flat(second, error),
            "proxy_vs_error_query": float(spearman_per_query(second, error).mean()),
            "proxy_vs_fd_pairs": spearman_flat(second, fd),
            "proxy_vs_fd_rel": float((second - fd).abs().mean() / fd.abs().mean()),
            "sign_agreement": float((second.sign() == error.sign()).double().mean()),
            "linear_check": float((proxy["linear"] - linear).abs().max() / linear.abs().max()),
            "relative_error": float(proxy["relative_error"].median()),
            "reliable": proxy["reliable"],
            "reliable_fraction": float(proxy["reliable_queries"].double().mean()),
            "corrected_spearman": float(spearman_per_query(linear + second, truth).mean()),
            "proxy_seconds": proxy["seconds"],
            "nonfinite32": proxy["nonfinite32"],
            "reliable32": proxy["reliable32"],
            "relative32": proxy["relative32"],
            "threshold": proxy["threshold"],
        }
        m |= rest_metrics(truth, linear, second, ~first, threshold=proxy["threshold"])
        per_query |= {
            "relative_error": proxy["relative_error"],
            "reliable": proxy["reliable_queries"],
        }
        scatter["proxy"] = second
    return Row(setting.peak_lr, setting.num_steps, length, m, per_query, scatter)


def rest_metrics(truth, linear, second, rest: torch.Tensor, threshold: float) -> dict:
    """The statistics over the removed samples outside the first batch (``rest``)."""
    truth, linear, second = truth[rest], linear[rest], second[rest]
    error = truth - linear
    relative = relative_statistic(second, linear)
    return {
        "rest_n": int(rest.sum()),
        "rest_mean_abs_truth": float(truth.abs().mean()),
        "rest_mean_abs_error": float(error.abs().mean()),
        "rest_rel_error": float(error.abs().mean() / truth.abs().mean()),
        "rest_mean_abs_proxy": float(second.abs().mean()),
        "rest_ratio": float(second.abs().mean() / error.abs().mean()),
        "rest_proxy_vs_error_pairs": spearman_flat(second, error),
        "rest_proxy_vs_error_query": float(spearman_per_query(second, error).mean()),
        "rest_spearman": float(spearman_per_query(linear, truth).mean()),
        "rest_relative": float(relative.median()),
        "rest_reliable": bool(relative.median() <= threshold),
    }

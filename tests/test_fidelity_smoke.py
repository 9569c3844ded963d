"""Smoke test: the TSLOO experiment's smallest setting runs end to end and writes a table."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIDELITY = Path(__file__).resolve().parents[1] / "experiments" / "fidelity"
SCRIPT = FIDELITY / "tsloo.py"


@pytest.mark.parametrize("setting, stem", [("default", "tsloo"), ("trainer", "tsloo_trainer")])
def test_tsloo_smoke_writes_table_and_plot(tmp_path, setting, stem):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--setting",
            setting,
            "--out",
            str(tmp_path),
            "--cache",
            str(tmp_path / "cache"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / f"{stem}.md").read_text(encoding="utf-8")
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([+-]\d\.\d{3}) ± \d\.\d{3} \|", table, flags=re.M))
    methods = ("Random", "Grad-Dot", "Grad-Cos", "K-FAC", "EK-FAC", "TracIn", "LESS", "TRAK (k=32)",
               "DataInf", "Influence function (lm_head only)", "Metagradient (exact ∂L/∂w, MAGIC)",
               "TrackStar (k²=1024 mask)", "SOURCE (L=4)", "SOURCE (L=1)")  # fmt: skip
    for method in methods:
        assert method in rows, table
        assert -1.0 <= float(rows[method]) <= 1.0
    # float32 and float64 replays of a 4-step trajectory rank the removals identically
    assert float(rows["Noise ceiling (float32 vs float64 TSLOO)"]) > 0.99, table
    assert "Sign convention" in table and "Machine:" in table
    assert "First-order limit" not in table  # the MAGIC row replaced the ε-replay reference
    # the library's bootstrap 95 % interval beside every mean, the mean inside it
    cis = re.findall(r"^\| ([^|]+?) \| ([+-]\d\.\d{3}) ± \d\.\d{3} \| \[([+-]\d\.\d{3}), "
                     r"([+-]\d\.\d{3})\] \|", table, flags=re.M)  # fmt: skip
    assert len(cis) == len(rows), table
    for _name, mean, low, high in cis:
        assert float(low) <= float(mean) <= float(high)
    assert list((tmp_path / "cache").glob("*/loo_float32/results/loo-*.json")), "no resumable cache"
    if setting == "trainer":  # the Trainer defaults: mean loss, clip 1.0, no-decay groups
        assert "clipped at 1.0" in table and "no-decay group" in table
        assert "AdamW-influence (full)" in rows


def _fidelity_modules(*names: str):
    sys.path.insert(0, str(FIDELITY))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(FIDELITY))


@pytest.mark.parametrize("name", ["default", "trainer"])
def test_metagradient_row_is_the_float64_weight_derivative(tmp_path, name):
    """The MAGIC row equals a float64 central difference in the sample's loss weight (float64
    loss, ε = 1e-6) through replays of the trajectory; the summed-loss and Trainer settings
    (clip, mean loss, no-decay group). The old reference row, a one-sided ε = 1e-4 replay
    with the setting's float32 loss, is far off it."""
    methods, scoring, setting = _fidelity_modules("methods", "scoring", "setting")
    chosen = {"default": setting.SMOKE, "trainer": setting.TRAINER_SMOKE}[name]
    prepared = scoring.prepare(chosen)
    captured = scoring.capture_with_model(prepared, tmp_path)
    exact = methods.metagradient(captured)  # (num_train, num_query), "helps" sign

    def replayed(sample: int, weight: float, float64_loss: bool = True) -> torch.Tensor:
        model = scoring.fresh_model(prepared.start, chosen, prepared.data, torch.float64)
        previous, setting.FLOAT64_LOSS = setting.FLOAT64_LOSS, float64_loss
        try:
            setting.run_trajectory(
                model, chosen, prepared.data, removed=sample, removed_weight=weight
            )
            return setting.query_losses(model, prepared.data)
        finally:
            setting.FLOAT64_LOSS = previous

    eps = 1e-6
    for sample in (0, 5):
        # (L(1 − ε) − L(1 + ε)) / 2ε = −dL/dw: the first-order removal effect, "helps" sign
        reference = (replayed(sample, 1 - eps) - replayed(sample, 1 + eps)) / (2 * eps)
        error = (exact[sample] - reference).norm() / reference.norm()
        assert error < 1e-5, (sample, float(error))  # measured 3e-7 .. 1.7e-6
        rounded = (replayed(sample, 1 - 1e-4, False) - replayed(sample, 1.0, False)) / 1e-4
        assert (rounded - reference).norm() / reference.norm() > 0.1  # the old ε-replay row

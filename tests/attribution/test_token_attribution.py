"""Token-level scores: per-token contributions sum to the sequence score; the HTML example runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, mlp_data, mlp_loss, write_store

from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "attribution" / "token_attribution.py"


@pytest.mark.parametrize("cls", [TracInAttributor, KFACAttributor, EKFACAttributor])
def test_token_contributions_sum_to_sequence_score(tmp_path, cls):
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(5, 1), mlp_data(3, 2)
    tr = write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[3, 2])
    te = write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3])
    args = AttributionArguments(output_dir=str(tmp_path / "o"), use_cpu=True)
    instance = cls(args).attribute_from_cache(tr.save_dir, te.save_dir)
    token = cls(args).attribute_from_cache(
        tr.save_dir, te.save_dir, attribution_granularity="token"
    )
    assert token.granularity == "token" and token.num_rows == 5 * 3
    assert token.row_token_ids == [0, 1, 2] * 5
    ids, summed = token.agnostic_matrix()
    assert ids == instance.agnostic_matrix()[0]
    scale = instance.scores.abs().max().item()
    torch.testing.assert_close(summed, instance.scores, rtol=1e-5, atol=1e-5 * scale)
    positions, per_pos = token.token_scores(ids[0])
    assert positions == [0, 1, 2] and per_pos.shape == (3, 3)
    assert per_pos.abs().sum() > 0


@pytest.mark.slow
def test_token_attribution_example_writes_html(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "tokens.html"
    subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--method", "kfac", "--output", str(out)],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    spans = page.count('<span class="tok"')
    assert spans > 10 and page.count('title="') >= spans
    assert "rgba(214, 39, 40" in page and "rgba(31, 119, 180" in page  # both signs shown

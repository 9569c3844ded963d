"""Token-level scores: per-token contributions sum to the sequence score; the HTML example runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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


def load_example() -> ModuleType:
    """Import ``examples/attribution/token_attribution.py`` as a module."""
    spec = importlib.util.spec_from_file_location("token_attribution_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_token_attribution_example_writes_html(tmp_path, monkeypatch, capsys):
    """The example's quick setting (1 epoch, 4 sentences per topic) writes a shaded page."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example prepends examples/
    example = load_example()
    out = tmp_path / "tokens.html"
    argv = ["--epochs", "1", "--sentences-per-topic", "4", "--top-k", "2", "--output", str(out)]
    threads = torch.get_num_threads()
    try:
        assert example.main([*argv, "--method", "kfac"]) == out
    finally:
        torch.set_num_threads(threads)  # main() runs single-threaded
    assert "(kfac, 20 training sentences)" in capsys.readouterr().out
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<h2>query [") == 10 and page.count("<li><b>") == 20
    spans = page.count('<span class="tok"')
    assert spans > 10 and page.count('title="') >= spans
    assert "rgba(214, 39, 40" in page and "rgba(31, 119, 180" in page  # both signs shown


def test_token_attribution_example_rejects_empty_corpus():
    pytest.importorskip("transformers")
    example = load_example()
    with pytest.raises(SystemExit):
        example.parse_args(["--sentences-per-topic", "0"])

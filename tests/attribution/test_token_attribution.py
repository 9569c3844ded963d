"""Token-level scores: per-token contributions sum to the sequence score; the HTML example runs."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from attribution_helpers import (
    MLP,
    MLP_LAYERS,
    capture_factors,
    dense_reference,
    mlp_data,
    mlp_loss,
    sample_ids,
    write_store,
)
from kfac_helpers import covariances, ekfac_operator, kfac_operator, linear_rows

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


def per_token_reference(model: MLP, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{layer: (B, T, d)}`` per-token gradients by autograd, in ``[W | b]`` row-major layout.

    Each token position uses its own copy of every weight, so the gradient of
    copy ``t`` is exactly position ``t``'s contribution (no hooks, no factors).
    """
    params = {n: p.detach() for n, p in model.named_parameters()}
    num_tokens = x.shape[1]
    out: dict[str, list[torch.Tensor]] = {name: [] for name in MLP_LAYERS}
    for i in range(x.shape[0]):
        copies = {
            n: p.unsqueeze(0).repeat(num_tokens, *([1] * p.dim())).requires_grad_(True)
            for n, p in params.items()
        }
        h = torch.tanh(torch.einsum("tok,tk->to", copies["fc1.weight"], x[i]) + copies["fc1.bias"])
        pred = torch.einsum("tok,tk->to", copies["fc2.weight"], h) + copies["fc2.bias"]
        ((pred - y[i]) ** 2).sum().backward()
        for name in MLP_LAYERS:
            w, b = copies[f"{name}.weight"].grad, copies[f"{name}.bias"].grad
            out[name].append(torch.cat([w, b.unsqueeze(-1)], dim=-1).flatten(1))
    return {name: torch.stack(rows) for name, rows in out.items()}


@pytest.mark.parametrize("method", ["tracin", "kfac", "ekfac"])
def test_token_scores_match_per_position_autograd(tmp_path, method):
    """Each (sample, position) row equals that position's own gradient scored by the method."""
    damping = 0.05
    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(5, 1, torch.float64), mlp_data(3, 2, torch.float64)
    tr = write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[3, 2])
    te = write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[1, 2])
    args = AttributionArguments(output_dir=str(tmp_path / "o"), use_cpu=True)
    tokens = per_token_reference(model, *train)
    g_te = dense_reference(model, MLP_LAYERS, mlp_loss, test)
    g_tr = dense_reference(model, MLP_LAYERS, mlp_loss, train)
    torch.testing.assert_close(tokens["fc1"].sum(1), g_tr["fc1"], rtol=1e-10, atol=1e-12)
    if method == "tracin":
        score = TracInAttributor(args).attribute_from_cache(
            tr.save_dir, te.save_dir, attribution_granularity="token"
        )
        ops = {name: None for name in MLP_LAYERS}
    else:
        cls = KFACAttributor if method == "kfac" else EKFACAttributor
        score = cls(args).attribute_from_cache(
            tr.save_dir, te.save_dir, attribution_granularity="token", damping=damping
        )
        factors = capture_factors(model, MLP_LAYERS, mlp_loss, train)
        ops = {}
        for name in MLP_LAYERS:
            f = factors.data[name]
            a_cov, g_cov = covariances(*linear_rows(f.activation, f.pre_activation_grad))
            ops[name] = (
                kfac_operator(a_cov, g_cov, damping)
                if method == "kfac"
                else ekfac_operator(a_cov, g_cov, g_tr[name], damping)
            )
    expected = sum(
        tokens[name] @ (g_te[name].T if ops[name] is None else ops[name] @ g_te[name].T)
        for name in MLP_LAYERS
    )  # (N_train, T, N_test)
    assert score.scores.dtype == torch.float32  # spec: scores are float32
    columns = [score.test_index[h] for h in sample_ids(test[0])]
    scale = expected.abs().max().item()
    for i, train_hash in enumerate(sample_ids(train[0])):
        positions, got = score.token_scores(train_hash)
        assert positions == [0, 1, 2]
        torch.testing.assert_close(
            got[:, columns].double(), expected[i], rtol=1e-6, atol=1e-6 * scale
        )


def load_example() -> ModuleType:
    """Import ``examples/attribution/token_attribution.py`` as a module."""
    spec = importlib.util.spec_from_file_location("token_attribution_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SHADED = {"graddot", "gradcos", "tracin", "kfac", "ekfac"}
QUICK = ["--epochs", "1", "--sentences-per-topic", "4", "--top-k", "2"]


def run_example(tmp_path, monkeypatch, method: str) -> str:
    """The page of the example's quick setting with ``--method method``."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example prepends examples/
    example = load_example()
    assert list(example.METHODS) == list(NAMES)  # every method of the example is tested
    out = tmp_path / "tokens.html"
    threads = torch.get_num_threads()
    try:
        assert example.main([*QUICK, "--output", str(out), "--method", method]) == out
    finally:
        torch.set_num_threads(threads)  # main() runs single-threaded
    return out.read_text(encoding="utf-8")


def check_page(page: str, method: str) -> None:
    """10 queries, 2 proponents each; shaded tokens that sum to the score, or unshaded ones."""
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>")
    assert page.count("<h2>query: [") == 10
    items = re.findall(r"<li><b>([^<]+)</b> (.*?)</li>", page)
    assert len(items) == 20
    if method not in SHADED:
        assert "the tokens are shown unshaded" in page and "background" not in page
        assert all('<span class="tok">' in tokens for _, tokens in items)
        return
    assert "rgba(214, 39, 40" in page and "rgba(31, 119, 180" in page  # both signs shown
    for value, tokens in items:
        token_values = [float(v) for v in re.findall(r'title="[^"]*: ([-+][^"]+)"', tokens)]
        assert token_values and tokens.count('<span class="tok"') == len(token_values)
        # the token rows sum to the ranked sequence score (both printed to 4 digits)
        total, scale = sum(token_values), sum(abs(v) for v in token_values)
        assert abs(total - float(value)) <= 2e-3 * scale + 1e-6, (value, token_values)


NAMES = {
    "graddot": "Grad-Dot",
    "gradcos": "Grad-Cos",
    "tracin": "TracIn",
    "kfac": "K-FAC",
    "ekfac": "EK-FAC",
    "lorif": "LoRIF",
    "less": "LESS",
    "trajectory-tracin": "trajectory TracIn",
    "dvemb": "DVEmb",
    "adamw-influence": "AdamW-influence",
}


@pytest.mark.parametrize("method", list(NAMES))
def test_token_attribution_example_writes_html(tmp_path, monkeypatch, capsys, method):
    """The quick setting (1 epoch, 4 sentences per topic) renders every method's top-k:
    shaded where the method has token scores, else unshaded (well under 1 s a method once
    the imports are warm)."""
    page = run_example(tmp_path, monkeypatch, method)
    shading = "shaded" if method in SHADED else "unshaded"
    assert f"({method}, 20 training sentences, {shading})" in capsys.readouterr().out
    assert f"<title>Token-level attribution ({NAMES[method]})</title>" in page
    check_page(page, method)
    if method == "adamw-influence":
        assert "polarity -1: a more negative score is more helpful" in page
        assert all(float(v) < 0 for v in re.findall(r"<li><b>([^<]+)</b>", page))


def test_token_attribution_example_rejects_empty_corpus():
    pytest.importorskip("transformers")
    example = load_example()
    with pytest.raises(SystemExit):
        example.parse_args(["--sentences-per-topic", "0"])

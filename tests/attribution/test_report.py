"""The token HTML report: order, shading, polarity, escaping, mismatch errors, atomic writes."""

from __future__ import annotations

import os
import re

import pytest
import torch

from dattri_llm.attribution.report import (
    HARMFUL_RGB,
    HELPFUL_RGB,
    render_token_report,
    write_token_report,
)
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.topk import TopK

TOKENS = {"a": ["alpha", "one"], "b": ["beta", "two"], "c": ["gamma", "three"]}


def topk(**kwargs) -> TopK:
    """Query q1 ranks b, a, c; query q2 ranks c, b, a."""
    options = {
        "test_ids": ["q1", "q2"],
        "train_ids": [["b", "a", "c"], ["c", "b", "a"]],
        "scores": torch.tensor([[3.0, 2.0, 1.0], [9.0, 8.0, 7.0]], dtype=torch.float64),
        "polarity": 1,
        "proponents": True,
        "algorithm": "TracIn",
    }
    return TopK(**{**options, **kwargs})


def token_score(values: list[list[float]], polarity: int = 1, **kwargs) -> AttributionScore:
    """Token rows: a at positions 0, 1 then b at 0, 1 (``values``: one row each, 2 queries)."""
    options = {
        "row_train_ids": ["a", "a", "b", "b"],
        "row_steps": [0, 0, 0, 0],
        "test_ids": ["q1", "q2"],
        "algorithm": "TracIn",
        "algorithm_meta": {},
        "layer_name": None,
        "row_token_ids": [0, 1, 0, 1],
    }
    return AttributionScore(torch.tensor(values), **{**options, **kwargs}, polarity=polarity)


def sections(page: str) -> list[str]:
    """The page's per-query sections, in order."""
    return re.findall(r"<section>.*?</section>", page)


def order(section: str) -> list[str]:
    """The first token of each listed sample, in the section's order."""
    return re.findall(r"<li><b>[^<]*</b> <span class=\"tok\"[^>]*>(\w+)</span>", section)


def spans(section: str) -> dict[str, str]:
    """``{token: its <span ...> opening tag}`` of a section."""
    return {m[2]: m[1] for m in re.finditer(r'(<span class="tok"[^>]*>)([^<]*)</span>', section)}


def test_topk_proponents_appear_in_ranking_order():
    page = render_token_report(topk(), TOKENS)
    first, second = sections(page)
    assert order(first) == ["beta", "alpha", "gamma"] and "<h2>query: q1</h2>" in first
    assert order(second) == ["gamma", "beta", "alpha"] and "<h2>query: q2</h2>" in second
    assert "<b>+3</b>" in first and "<b>+7</b>" in second  # scores as stored
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>")
    assert "unshaded" in page and "background" not in "".join(spans(first).values())


def test_topk_k_test_ids_and_query_text():
    page = render_token_report(
        topk(), TOKENS, k=2, test_ids=["q2"], query_text={"q2": ["how", None, "now"]}
    )
    (only,) = sections(page)
    assert order(only) == ["gamma", "beta"] and "<h2>query: how now</h2>" in only


def test_score_ranking_needs_k_and_applies_polarity():
    values = torch.tensor([[1.0], [-3.0], [2.0]])
    score = AttributionScore(values, ["a", "b", "c"], [0, 0, 0], ["q"], "X", {}, None)
    with pytest.raises(ValueError, match="needs k"):
        render_token_report(score, TOKENS)
    assert order(sections(render_token_report(score, TOKENS, k=3))[0]) == [
        "gamma",
        "alpha",
        "beta",
    ]
    harmful = render_token_report(score, TOKENS, k=1, proponents=False)
    assert order(sections(harmful)[0]) == ["beta"] and "opponents" in harmful
    negative = AttributionScore(
        values, ["a", "b", "c"], [0, 0, 0], ["q"], "X", {}, None, polarity=-1
    )
    page = render_token_report(negative, TOKENS, k=3)
    assert order(sections(page)[0]) == ["beta", "alpha", "gamma"] and "polarity -1" in page


def test_token_score_shades_each_token_and_sums_to_the_ranked_score():
    score = token_score([[2.0, 0.0], [-1.0, 0.0], [0.5, 0.0], [1.0, 0.0]])
    page = render_token_report(score, TOKENS, k=2, test_ids=["q1"])
    (section,) = sections(page)
    assert order(section) == ["beta", "alpha"]  # b sums to 1.5, a to 1.0
    assert "<b>+1.5</b>" in section and "<b>+1</b>" in section
    tags = spans(section)
    assert f"rgba({HELPFUL_RGB}, 1.000)" in tags["alpha"] and 'title="alpha: +2"' in tags["alpha"]
    assert f"rgba({HARMFUL_RGB}, 0.500)" in tags["one"] and 'title="one: -1"' in tags["one"]
    assert f"rgba({HELPFUL_RGB}, 0.500)" in tags["beta"] and "supports" in page


def test_polarity_minus_one_flips_the_shading():
    values = [[2.0, 0.0], [-1.0, 0.0], [0.5, 0.0], [1.0, 0.0]]
    plus = spans(render_token_report(token_score(values), TOKENS, k=2, test_ids=["q1"]))
    minus = render_token_report(token_score(values, polarity=-1), TOKENS, k=2, test_ids=["q1"])
    minus = spans(minus)
    assert HELPFUL_RGB in plus["alpha"] and HARMFUL_RGB in minus["alpha"]
    assert HARMFUL_RGB in plus["one"] and HELPFUL_RGB in minus["one"]
    assert 'title="alpha: +2"' in minus["alpha"]  # hovering shows the score as stored


def test_topk_shaded_by_a_separate_token_score():
    ranking = topk(test_ids=["q1"], train_ids=[["b", "a"]], scores=torch.tensor([[1.5, 1.0]]))
    score = token_score([[2.0, 0.0], [-1.0, 0.0], [0.5, 0.0], [1.0, 0.0]])
    tags = spans(render_token_report(ranking, TOKENS, token_score=score))
    assert f"rgba({HELPFUL_RGB}, 1.000)" in tags["alpha"]


def test_none_tokens_are_hidden_but_keep_their_position():
    score = token_score([[2.0, 0.0], [-1.0, 0.0], [0.5, 0.0], [1.0, 0.0]])
    tokens = {"a": ["alpha", None], "b": ["beta", "two"]}
    tags = spans(render_token_report(score, tokens, k=2, test_ids=["q1"]))
    assert "alpha" in tags and None not in tags and "one" not in tags


def test_everything_is_escaped():
    evil = "<script>alert(1)</script>"
    ranking = topk(test_ids=["q1"], train_ids=[["a"]], scores=torch.tensor([[1.0]]))
    page = render_token_report(
        ranking,
        {"a": [evil, '"quoted"']},
        query_text={"q1": evil},
        train_labels={"a": evil},
        title=evil,
        note=evil,
    )
    assert "<script>" not in page and page.count("&lt;script&gt;") == 6
    score = token_score([[1.0, 0.0], [2.0, 0.0], [0.5, 0.0], [1.0, 0.0]], algorithm="<b>")
    page = render_token_report(score, {"a": [evil, "x"], "b": ["y", "z"]}, k=1)
    assert "<script>" not in page and f'title="{evil}' not in page
    assert 'title="&lt;script&gt;alert(1)&lt;/script&gt;: +1"' in page
    assert "(&lt;b&gt;)" in page


def test_mismatches_raise_value_errors_naming_the_fix():
    score = token_score([[2.0, 0.0], [-1.0, 0.0], [0.5, 0.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match=r"training id 'b' is ranked but train_tokens has no"):
        render_token_report(score, {"a": ["x", "y"]}, k=2)
    with pytest.raises(ValueError, match=r"3 tokens; pass one token string per input position"):
        render_token_report(score, {**TOKENS, "a": ["x", "y", "z"]}, k=2)
    with pytest.raises(ValueError, match=r"2 positions \(0\.\.1\) for training id 'a'"):
        render_token_report(score, {**TOKENS, "a": ["x"]}, k=2)
    with pytest.raises(ValueError, match="is a string"):
        render_token_report(score, {**TOKENS, "a": "alpha one"}, k=2)
    with pytest.raises(ValueError, match="has no rows for it"):
        render_token_report(topk(), TOKENS, token_score=score)  # c has no token rows
    with pytest.raises(ValueError, match="not a column of token_score"):
        render_token_report(topk(test_ids=["q9", "q2"]), TOKENS, token_score=score, test_ids=["q9"])
    with pytest.raises(ValueError, match="GradCos's.*pass the token-granularity score of TracIn"):
        render_token_report(
            topk(), TOKENS, token_score=token_score([[0.0] * 2] * 4, algorithm="GradCos")
        )
    instance = AttributionScore(
        torch.ones(2, 2), ["a", "b"], [0, 0], ["q1", "q2"], "TracIn", {}, None
    )
    with pytest.raises(ValueError, match="attribution_granularity='token'"):
        render_token_report(topk(), TOKENS, token_score=instance)
    with pytest.raises(ValueError, match="proponents=False but the TopK holds the most helpful"):
        render_token_report(topk(), TOKENS, proponents=False)
    with pytest.raises(ValueError, match=r"test ids \['q3'\] are not queries of the TopK"):
        render_token_report(topk(), TOKENS, test_ids=["q3"])
    with pytest.raises(ValueError, match="query_text has no text for it"):
        render_token_report(topk(), TOKENS, query_text={"q1": "hi"})
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        render_token_report(topk(), TOKENS, k=0)
    with pytest.raises(TypeError, match="ranking must be a TopK"):
        render_token_report({"q1": []}, TOKENS)


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "report.html"
    assert write_token_report(path, topk(), TOKENS) == path
    assert path.read_text(encoding="utf-8") == render_token_report(topk(), TOKENS)
    before = path.read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)  # fails after the page was written
    with pytest.raises(OSError, match="disk full"):
        write_token_report(path, topk(), TOKENS, title="new")
    monkeypatch.undo()
    assert path.read_bytes() == before  # the previous page, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.html"]  # no temp file left
    with pytest.raises(ValueError, match="train_tokens has no tokens"):
        write_token_report(tmp_path / "none.html", topk(), {"a": ["x"]})
    assert not (tmp_path / "none.html").exists()

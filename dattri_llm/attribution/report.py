"""The token HTML report: each query's top training samples, every token shaded by its score.

:func:`render_token_report` turns a ranking (a :class:`~.topk.TopK` from
``top_k`` / ``top_k_from_cache``, or an :class:`~.score.AttributionScore` and
``k``) and the training samples' tokens into one self-contained HTML page (no
script, no external file). Per query it lists the ranked training samples,
best first, each with its sequence score and its tokens. Given a
token-granularity score (``attribution_granularity="token"``), every token is
shaded by its own score for that query on a diverging scale centred at zero,
the score's polarity applied: red supports the query (``polarity × score >
0``), blue opposes it; intensity is relative to the sample's largest token
score and hovering a token shows its score as stored. Without one the tokens
are shown unshaded and the page says so. :func:`write_token_report` writes the
page crash-safely.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.topk import TopK, check_k
from dattri_llm.utils.atomic import atomic_write

__all__ = ["HELPFUL_RGB", "HARMFUL_RGB", "render_token_report", "write_token_report"]

HELPFUL_RGB = "214, 39, 40"  # red: the token supports the query (polarity × score > 0)
HARMFUL_RGB = "31, 119, 180"  # blue: the token opposes it
_STYLE = (
    "body{font-family:sans-serif;max-width:60em;margin:2em auto}"
    ".tok{padding:1px 3px;border-radius:3px}li{margin:.4em 0}.label{color:#666}"
)


@dataclass(frozen=True)
class _Ranked:
    """One query's ranked training samples: ``[(train_id, score as stored), ...]``, best first."""

    test_id: str
    rows: list[tuple[str, float]]


def _ranked(
    ranking: TopK | AttributionScore,
    k: int | None,
    proponents: bool | None,
    test_ids: Sequence[str] | None,
) -> tuple[list[_Ranked], bool]:
    """The queries to show with their rows, and whether the rows are proponents."""
    if isinstance(test_ids, str):
        raise TypeError(f"test_ids must be a list of test ids, got the string {test_ids!r}")
    if k is not None:
        check_k(k)
    if isinstance(ranking, AttributionScore):
        if k is None:
            raise ValueError(
                "an AttributionScore ranking needs k (the training samples shown per query); "
                "pass k=..., or pass the TopK of attributor.top_k(...) instead"
            )
        proponents = True if proponents is None else proponents
        names = ranking.test_ids if test_ids is None else [str(h) for h in test_ids]
        missing = [h for h in names if h not in ranking.test_index]
        if missing:
            raise ValueError(
                f"test ids {missing} are not columns of the score (it has {ranking.num_test} "
                "columns); pass test_ids from score.test_ids"
            )
        top = ranking.top_k(k, proponents=proponents, test_ids=names)
        return [_Ranked(h, top[h]) for h in names], proponents
    if not isinstance(ranking, TopK):
        raise TypeError(
            "ranking must be a TopK (attributor.top_k / top_k_from_cache) or an "
            f"AttributionScore, got {type(ranking).__name__}"
        )
    if proponents is not None and proponents != ranking.proponents:
        raise ValueError(
            f"proponents={proponents} but the TopK holds the most "
            f"{'helpful' if ranking.proponents else 'harmful'} samples "
            f"(proponents={ranking.proponents}); rank again with proponents={proponents} or "
            "leave proponents out"
        )
    by_id = ranking.as_dict()
    names = ranking.test_ids if test_ids is None else [str(h) for h in test_ids]
    missing = [h for h in names if h not in by_id]
    if missing:
        raise ValueError(
            f"test ids {missing} are not queries of the TopK (it has {len(by_id)}); pass "
            "test_ids from topk.test_ids"
        )
    shown = ranking.k if k is None else k
    return [_Ranked(h, by_id[h][:shown]) for h in names], ranking.proponents


def _shading_score(
    ranking: TopK | AttributionScore, token_score: AttributionScore | None
) -> AttributionScore | None:
    """The token-granularity score that shades the tokens (``None``: unshaded)."""
    if token_score is None:
        if isinstance(ranking, AttributionScore) and ranking.granularity == "token":
            return ranking
        return None
    if not isinstance(token_score, AttributionScore):
        raise TypeError(
            f"token_score must be an AttributionScore, got {type(token_score).__name__}"
        )
    if token_score.granularity != "token":
        raise ValueError(
            "token_score has one row per training sample (attribution_granularity="
            "'instance'); pass the score of attribute(..., attribution_granularity='token') "
            "of the same method, or leave token_score out for unshaded tokens"
        )
    ranked_by, shaded_by = ranking.algorithm, token_score.algorithm
    if ranked_by and shaded_by and ranked_by != shaded_by:
        raise ValueError(
            f"the ranking is {ranked_by}'s but token_score is {shaded_by}'s: token scores "
            "shade a sample by the parts of its own score; pass the token-granularity score "
            f"of {ranked_by}, or leave token_score out for unshaded tokens"
        )
    return token_score


def _tokens_of(train_tokens: Mapping[str, Sequence[str | None]], train_id: str) -> list[str | None]:
    """``train_tokens[train_id]`` as a list (``ValueError`` when it is missing or a string)."""
    if train_id not in train_tokens:
        raise ValueError(
            f"training id {train_id!r} is ranked but train_tokens has no tokens for it; pass "
            "train_tokens={train id: [token, ...]} covering every training sample the ranking "
            "can name (ids as hash_sample gives them)"
        )
    tokens = train_tokens[train_id]
    if isinstance(tokens, str):
        raise ValueError(
            f"train_tokens[{train_id!r}] is a string; pass a list of token strings, one per "
            "input position (None for a position to hide, such as padding)"
        )
    return list(tokens)


def _token_values(
    shading: AttributionScore, train_id: str, test_id: str, num_tokens: int
) -> list[float]:
    """The stored score of each token of ``train_id`` for ``test_id`` (steps summed)."""
    if train_id not in shading.train_index:
        raise ValueError(
            f"training id {train_id!r} is ranked but token_score has no rows for it; pass the "
            "token-granularity score of the same training set"
        )
    column = shading.test_index.get(test_id)
    if column is None:
        raise ValueError(
            f"query {test_id!r} is ranked but is not a column of token_score; pass the "
            "token-granularity score of the same queries"
        )
    positions, values = shading.token_scores(train_id)
    if positions != list(range(num_tokens)):
        span = f"0..{positions[-1]}" if positions == list(range(len(positions))) else positions
        raise ValueError(
            f"token_score has {len(positions)} positions ({span}) for training id "
            f"{train_id!r} but train_tokens gives {num_tokens} tokens; pass one token string "
            "per input position of the sample as the model saw it (padding included, None to "
            "hide a position)"
        )
    return values[:, column].detach().to(device="cpu", dtype=torch.float64).tolist()


def _shade(value: float, scale: float) -> str:
    """Background of a token whose polarity-applied score is ``value``; ``scale`` is full colour."""
    finite = math.isfinite(value) and scale > 0
    alpha = min(abs(value) / scale, 1.0) if finite else 0.0
    rgb = HELPFUL_RGB if value >= 0 else HARMFUL_RGB
    return f"rgba({rgb}, {alpha:.3f})"


def _tokens_html(
    tokens: list[str | None], values: list[float] | None, shading: AttributionScore | None
) -> str:
    """One sample's tokens as ``<span class="tok">``, shaded by ``polarity × value`` if given."""
    if values is None or shading is None:
        return " ".join(
            f'<span class="tok">{html.escape(t)}</span>' for t in tokens if t is not None
        )
    shown = [(t, v) for t, v in zip(tokens, values) if t is not None]
    scale = max((abs(v) for _, v in shown if math.isfinite(v)), default=0.0)
    return " ".join(
        f'<span class="tok" style="background:{_shade(shading.polarity * v, scale)}" '
        f'title="{html.escape(t)}: {v:+.4g}">{html.escape(t)}</span>'
        for t, v in shown
    )


def _query_heading(test_id: str, query_text: Mapping[str, str | Sequence[str]] | None) -> str:
    """The query's text (or its joined tokens), else its id."""
    if query_text is None:
        return test_id
    if test_id not in query_text:
        raise ValueError(
            f"query {test_id!r} is ranked but query_text has no text for it; pass "
            "query_text={query id: text or [token, ...]} for every query shown, or leave "
            "query_text out to head each query with its id"
        )
    text = query_text[test_id]
    return text if isinstance(text, str) else " ".join(t for t in text if t is not None)


def _legend(shading: AttributionScore | None, proponents: bool, polarity: int) -> str:
    """The paragraph under the title: what is ranked and how the tokens are drawn."""
    which = "most helpful (proponents)" if proponents else "most harmful (opponents)"
    sign = "a larger score" if polarity == 1 else "a more negative score"
    lines = [
        f"Each query's {which} training samples, best first, with their scores as the method "
        f"defines them (polarity {polarity:+d}: {sign} is more helpful)."
    ]
    if shading is None:
        lines.append("No token-level scores were given: the tokens are shown unshaded.")
    else:
        lines.append(
            "Each training token is shaded by its contribution to the sample's score for the "
            f"query: <span class='tok' style='background:rgba({HELPFUL_RGB}, .8)'>supports"
            f"</span> / <span class='tok' style='background:rgba({HARMFUL_RGB}, .8)'>opposes"
            "</span> (the score's polarity applied), intensity relative to the sample's "
            "largest token score; hover a token for its score as stored. A sample's token "
            "scores sum to its score."
        )
    return f"<p>{' '.join(lines)}</p>"


def render_token_report(
    ranking: TopK | AttributionScore,
    train_tokens: Mapping[str, Sequence[str | None]],
    *,
    k: int | None = None,
    proponents: bool | None = None,
    test_ids: Sequence[str] | None = None,
    query_text: Mapping[str, str | Sequence[str]] | None = None,
    token_score: AttributionScore | None = None,
    train_labels: Mapping[str, str] | None = None,
    title: str | None = None,
    note: str | None = None,
) -> str:
    """The self-contained HTML page of each query's top training samples and their tokens.

    Args:
        ranking: a :class:`~.topk.TopK` (``attributor.top_k(...)`` /
            ``top_k_from_cache(...)``) or an :class:`~.score.AttributionScore`
            (ranked with its ``top_k(k, proponents=...)``, rows summed per
            sample). A token-granularity score also shades the tokens when
            ``token_score`` is not given.
        train_tokens: ``{train id: [token, ...]}``, one string per input
            position of the sample (position ``t`` is ``tokens[t]``); ``None``
            hides a position (padding). Must cover every ranked training id.
        k: samples shown per query; required for an ``AttributionScore``; a
            TopK shows its first ``min(k, topk.k)`` (``None``: all of them).
        proponents: the most helpful (``True``) or most harmful (``False``)
            samples; ``None`` means ``True`` for a score and the TopK's own
            choice for a TopK (which cannot be changed: ``ValueError``).
        test_ids: the queries shown, in this order (``None``: all, in the
            ranking's order).
        query_text: ``{query id: text or [token, ...]}`` for the headings;
            ``None`` heads each query with its id.
        token_score: a token-granularity score of the same method, training
            samples and queries (``attribute(..., attribution_granularity=
            "token")``); each token is shaded by its row, summed over steps.
        train_labels: an optional short label per training id (e.g. its
            topic), shown before its tokens.
        title: the page title (default ``"Token attribution (<algorithm>)"``).
        note: a sentence added under the title, e.g. why tokens are unshaded.

    Returns:
        The page, every text HTML-escaped. Scores are shown as stored (not
        multiplied by the polarity); the shading applies ``token_score``'s
        polarity, so red always means "supports the query".

    Raises:
        ValueError: an ``AttributionScore`` without ``k``; ``k`` not an
            ``int >= 1``; ``proponents`` other than a TopK's; a query not in the
            ranking (or, when given, ``query_text``); a ranked training id
            without tokens; ``token_score`` of instance granularity, of another
            method, or without the ranked ids; a token score whose positions
            are not ``0 .. len(tokens) - 1`` (the error names the id and both
            lengths).
        TypeError: a ranking that is neither; ``test_ids`` given as a string.
    """
    queries, proponents = _ranked(ranking, k, proponents, test_ids)
    shading = _shading_score(ranking, token_score)
    algorithm = ranking.algorithm or (shading.algorithm if shading is not None else "")
    title = title if title is not None else f"Token attribution ({algorithm or 'unknown method'})"
    sections = []
    for query in queries:
        items = []
        for train_id, value in query.rows:
            tokens = _tokens_of(train_tokens, train_id)
            values = (
                None
                if shading is None
                else _token_values(shading, train_id, query.test_id, len(tokens))
            )
            label = "" if train_labels is None else train_labels.get(train_id, "")
            label_html = f'<span class="label">[{html.escape(label)}]</span> ' if label else ""
            items.append(
                f"<li><b>{value:+.4g}</b> {label_html}{_tokens_html(tokens, values, shading)}</li>"
            )
        heading = html.escape(_query_heading(query.test_id, query_text))
        sections.append(f"<section><h2>query: {heading}</h2><ol>{''.join(items)}</ol></section>")
    note_html = f"<p>{html.escape(note)}</p>" if note else ""
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"{_legend(shading, proponents, ranking.polarity)}{note_html}"
        f"{''.join(sections)}</body></html>"
    )


def write_token_report(
    path: str | os.PathLike,
    ranking: TopK | AttributionScore,
    train_tokens: Mapping[str, Sequence[str | None]],
    *,
    k: int | None = None,
    proponents: bool | None = None,
    test_ids: Sequence[str] | None = None,
    query_text: Mapping[str, str | Sequence[str]] | None = None,
    token_score: AttributionScore | None = None,
    train_labels: Mapping[str, str] | None = None,
    title: str | None = None,
    note: str | None = None,
) -> Path:
    """Render the page (:func:`render_token_report`, same arguments) and write it to ``path``.

    The page is rendered first, then written crash-safely (temporary file
    beside ``path``, fsync, rename): a failed or killed write leaves the
    previous file, or none, never a partial page. Missing parent directories
    are created. Returns ``path`` as a ``Path``.
    """
    page = render_token_report(
        ranking,
        train_tokens,
        k=k,
        proponents=proponents,
        test_ids=test_ids,
        query_text=query_text,
        token_score=token_score,
        train_labels=train_labels,
        title=title,
        note=note,
    )
    data = page.encode("utf-8")
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(target, lambda handle: handle.write(data))

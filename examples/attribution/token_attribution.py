"""Token-level attribution: which training *tokens* pushed a tiny language model's answers?

Trains the quickstart's small GPT-2 on the five-topic corpus
(``examples/quickstart_corpus.py``), then scores every training token against
a few query sentences with ``attribution_granularity="token"``. A sequence's
score is the sum of its token contributions (paper appendix B.5): each
training token ``t`` contributes ``<g_t, F⁻¹ g_query>``, the part of the
sentence's gradient that flows through position ``t`` (the prediction of
token ``t+1``), against the preconditioned query gradient.

The result is a self-contained HTML page: for each query, its top proponents
(``score.top_k``, which ranks by ``polarity × score``) with every token shaded
on a diverging scale centred at zero (red pushes the query's loss down, i.e.
supports it; blue opposes it; the shading applies the score's polarity);
hovering a token shows its score as stored.

Methods: ``graddot`` (raw inner products), ``kfac`` and ``ekfac``
(curvature-preconditioned, relative damping).

Run:  python examples/attribution/token_attribution.py --method kfac --output tokens.html
Quick smoke run:  add ``--epochs 1 --sentences-per-topic 4``.
"""

from __future__ import annotations

import argparse
import html
import sys
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.task import AttributionTask
from dattri_llm.utils.hashing import hash_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quickstart import LEARNING_RATE, MAX_LEN, SEED, WordTokenizer, loss_fn  # noqa: E402
from quickstart_corpus import CORPUS, QUERIES  # noqa: E402

METHODS = ("graddot", "kfac", "ekfac")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=METHODS, default="kfac")
    parser.add_argument("--output", default="token_attribution.html", help="HTML file to write")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs")
    parser.add_argument("--top-k", type=int, default=3, help="proponents shown per query")
    parser.add_argument("--damping", type=float, default=0.1, help="relative damping (K-FAC)")
    parser.add_argument(
        "--sentences-per-topic",
        type=int,
        default=None,
        help="training sentences per topic (default: all 40); a few give a quick smoke run",
    )
    options = parser.parse_args(argv)
    if options.sentences_per_topic is not None and options.sentences_per_topic < 1:
        parser.error(f"--sentences-per-topic must be >= 1, got {options.sentences_per_topic}")
    return options


def build_model(vocab_size: int) -> GPT2LMHeadModel:
    """The quickstart's small untied GPT-2."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=MAX_LEN,
        n_embd=64,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def train(model: torch.nn.Module, train_set: list[dict], epochs: int) -> None:
    """A plain training loop: AdamW, shuffled mini-batches of 16, mean loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    loader = torch.utils.data.DataLoader(train_set, batch_size=16, shuffle=True)
    model.train()
    for _ in range(epochs):
        for batch in loader:
            optimizer.zero_grad()
            (loss_fn(model, batch) / len(batch["input_ids"])).backward()
            optimizer.step()


def token_scores(method: str, model, train_set, query_set, damping: float):
    """Token-level ``AttributionScore`` of ``method`` (rows: train sample × position)."""
    hook_config = HookManagerConfig(linear_io=[r"\.mlp\.", r"^lm_head$"])
    with tempfile.TemporaryDirectory() as out_dir:
        args = AttributionArguments(
            output_dir=out_dir, use_cpu=True, per_device_train_batch_size=32, seed=SEED
        )
        task = AttributionTask(loss_func=loss_fn, model=model)
        options = {"hook_config": hook_config, "attribution_granularity": "token"}
        if method == "graddot":
            return TracInAttributor(args, task=task).attribute(train_set, query_set, **options)
        cls = KFACAttributor if method == "kfac" else EKFACAttributor
        return cls(args, task=task).attribute(
            train_set, query_set, damping=damping, relative_damping=True, **options
        )


def shade(value: float, scale: float) -> str:
    """Diverging background colour centred at zero: red positive, blue negative."""
    alpha = min(abs(value) / scale, 1.0) if scale > 0 else 0.0
    rgb = "214, 39, 40" if value >= 0 else "31, 119, 180"
    return f"rgba({rgb}, {alpha:.3f})"


def sentence_html(words: list[str], values: list[float], scale: float, polarity: int = 1) -> str:
    """One training sentence as ``<span title=score>`` tokens, shaded by ``polarity × score``."""
    spans = [
        f'<span class="tok" style="background:{shade(polarity * v, scale)}" '
        f'title="{html.escape(w)}: {v:+.4g}">{html.escape(w)}</span>'
        for w, v in zip(words, values)
    ]
    return " ".join(spans)


def render(score, train_text: dict, query_ids: list[str], top_k: int, method: str) -> str:
    """The HTML page: per query, its top-``k`` proponents with shaded tokens."""
    # {query id: [(train id, sequence score), ...]}, most helpful first (``polarity`` applied).
    proponents = score.top_k(top_k, test_ids=query_ids)
    sections = []
    for (topic, query), query_id in zip(QUERIES, query_ids):
        rows = []
        for train_hash, value in proponents[query_id]:
            train_topic, sentence = train_text[train_hash]
            positions, per_pos = score.token_scores(train_hash)
            words = sentence.split()[:MAX_LEN]
            contributions = dict(zip(positions, per_pos[:, score.test_index[query_id]].tolist()))
            values = [contributions.get(t, 0.0) for t in range(len(words))]
            scale = max((abs(v) for v in values), default=0.0)
            rows.append(
                f"<li><b>{value:+.4g}</b> [{html.escape(train_topic)}] "
                f"{sentence_html(words, values, scale, score.polarity)}</li>"
            )
        sections.append(
            f"<h2>query [{html.escape(topic)}]: {html.escape(query)}</h2><ol>{''.join(rows)}</ol>"
        )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>token attribution ({method})</title><style>"
        "body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        ".tok{padding:1px 3px;border-radius:3px}li{margin:.4em 0}"
        "</style></head><body>"
        f"<h1>Token-level attribution ({html.escape(method)})</h1>"
        "<p>Each training token is shaded by its contribution to the sentence's score for the "
        "query: <span class='tok' style='background:rgba(214,39,40,.8)'>supports</span> / "
        "<span class='tok' style='background:rgba(31,119,180,.8)'>opposes</span>, intensity "
        "relative to the sentence's largest contribution; hover a token for its score. The "
        "token contributions of a sentence sum to its score.</p>"
        f"{''.join(sections)}</body></html>"
    )


def main(argv: list[str] | None = None) -> Path:
    """Train, attribute per token, write the HTML page; return its path."""
    options = parse_args(argv)
    torch.set_num_threads(1)  # a model this small runs fastest (and reproducibly) on one thread
    torch.manual_seed(SEED)
    pairs = [
        (topic, s)
        for topic, sentences in CORPUS.items()
        for s in sentences[: options.sentences_per_topic]
    ]
    tokenizer = WordTokenizer([s for _, s in pairs] + [q for _, q in QUERIES])
    train_set = [tokenizer.encode(s) for _, s in pairs]
    query_set = [tokenizer.encode(q) for _, q in QUERIES]
    train_text = {hash_sample(x): pair for x, pair in zip(train_set, pairs)}
    model = build_model(len(tokenizer.vocab) + 1)
    train(model, train_set, epochs=options.epochs)
    score = token_scores(options.method, model, train_set, query_set, options.damping)
    page = render(score, train_text, [hash_sample(q) for q in query_set], options.top_k,
                  options.method)  # fmt: skip
    path = Path(options.output)
    path.write_text(page, encoding="utf-8")
    print(f"wrote {path} ({options.method}, {score.num_train} training sentences)")
    return path


if __name__ == "__main__":
    main()

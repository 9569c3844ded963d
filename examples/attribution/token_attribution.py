"""Token-level attribution: which training *tokens* pushed a tiny language model's answers?

Trains the quickstart's small GPT-2 on the five-topic corpus
(``examples/quickstart_corpus.py``), ranks the training sentences for each
query sentence with one attribution method, and writes a self-contained HTML
page (``dattri_llm.attribution.report.write_token_report``): for each query,
its top proponents, best first, with their scores.

The ranking is the method's exact streaming top-k (``attributor.top_k``) where
the method has one (``streaming_top_k``), else ``attribute(...).top_k``. Where
the method scores tokens (``attribution_granularity="token"``), every training
token is shaded by its own contribution to the sentence's score (a sentence's
score is the sum of its token contributions, paper appendix B.5: token ``t``
contributes the part of the sentence's gradient that flows through position
``t``, the prediction of token ``t+1``, against the method's query vector):
red supports the query, blue opposes it (the score's polarity applied);
hovering a token shows its score as stored. Other methods list their top
proponents with unshaded tokens, and the page says why.

Methods (``--method``):

* ``graddot``, ``gradcos`` (Grad-Dot / Grad-Cos at the final weights),
  ``kfac``, ``ekfac`` (curvature-preconditioned, relative damping; one fit
  serves the ranking and the token scores): shaded;
* ``tracin`` (the TracIn checkpoint ensemble: up to three epoch-end
  checkpoints, cached into stores and ranked with ``top_k_from_cache``):
  shaded (token scores summed over the checkpoints);
* ``lorif`` (LoGRA-projected gradients, rank-1 training records, full-rank
  curvature): unshaded, a rank-1 record has no token axis;
* ``less``, ``trajectory-tracin``, ``dvemb``, ``adamw-influence`` (they score
  a recorded training run): the method trains and records the *last* epoch
  itself (a fresh AdamW at the same learning rate, batches of 16) after the
  plain loop has run the others; unshaded, these methods score whole samples
  only. AdamW-influence calls a more negative score more helpful (polarity
  -1); the ranking and the page apply that.

Run:  python examples/attribution/token_attribution.py --method kfac --output tokens.html
Quick smoke run:  add ``--epochs 1 --sentences-per-topic 4``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm.attribution.algorithm import (
    AdamWInfluenceAttributor,
    DVEmbAttributor,
    EKFACAttributor,
    KFACAttributor,
    LESSAttributor,
    LoRIFAttributor,
    TracInAttributor,
    TrajectoryTracInAttributor,
)
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.report import write_token_report
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.topk import TopK
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.task import AttributionTask
from dattri_llm.utils.hashing import hash_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quickstart import LEARNING_RATE, MAX_LEN, SEED, WordTokenizer, loss_fn  # noqa: E402
from quickstart_corpus import CORPUS, QUERIES  # noqa: E402

BATCH_SIZE = 16
HOOK_CONFIG = HookManagerConfig(linear_io=[r"\.mlp\.", r"^lm_head$"])
TRACIN_CHECKPOINTS = 3  # epoch-end checkpoints of the TracIn ensemble (at most)
# LoRIF fits a layer's curvature from its D x D Gram matrix: project each factor to 16
# (LoGRA style, D = 16 x 16) rather than fit the unprojected layers (D up to 64 x 256 and more).
LORIF_HOOK_CONFIG = HookManagerConfig(
    linear_io=HOOK_CONFIG.linear_io,
    projection_kwargs={"__default__": {"style": "logra", "proj_dim": 16}},
)


@dataclass(frozen=True)
class Method:
    """How one ``--method`` runs: its display name and what it needs."""

    name: str
    run: Callable[[Setup], Result]
    trains_last_epoch: bool = False  # records the run's last epoch itself
    checkpoints: bool = False  # TracIn: keeps epoch-end checkpoints


@dataclass
class Setup:
    """What a method runs on: the trained model, the data, the options, a scratch folder."""

    model: torch.nn.Module
    train_set: list[dict]
    query_set: list[dict]
    options: argparse.Namespace
    work: Path
    checkpoints: list[dict] | None = None

    def args(self) -> AttributionArguments:
        """CPU arguments writing into the scratch folder; the plain loop's optimizer settings."""
        settings = {
            "output_dir": str(self.work / "out"),
            "use_cpu": True,
            "per_device_train_batch_size": BATCH_SIZE,
            "per_device_eval_batch_size": len(self.query_set),
            "learning_rate": LEARNING_RATE,
            "weight_decay": 0.01,
            "lr_scheduler_type": "constant",
            "max_grad_norm": None,
            "seed": SEED,
        }
        return AttributionArguments(**settings)

    def task(self, checkpoints: object = None) -> AttributionTask:
        """The summed loss (each captured gradient is one sentence's own) on the model."""
        return AttributionTask(loss_func=loss_fn, model=self.model, checkpoints=checkpoints)


@dataclass
class Result:
    """A method's ranking, its token scores (``None``: unshaded) and a note for the page."""

    ranking: TopK | AttributionScore
    token_score: AttributionScore | None
    note: str


# ---------------------------------------------------------------------------- the methods
def rank(attributor, setup: Setup, **options) -> TopK | AttributionScore:
    """The method's exact streaming top-k where it has one, else its score (the report ranks it)."""
    if attributor.streaming_top_k:
        return attributor.top_k(
            setup.query_set, setup.options.top_k, train_source=setup.train_set, **options
        )
    return attributor.attribute(setup.train_set, setup.query_set, **options)


def grad_dot(setup: Setup, normalized: bool = False) -> Result:
    """Grad-Dot (Grad-Cos): streaming top-k, then the token scores."""
    attributor = TracInAttributor(setup.args(), task=setup.task())
    options = {"hook_config": HOOK_CONFIG, "normalized_grad": normalized}
    ranking = rank(attributor, setup, **options)
    tokens = attributor.attribute(
        setup.train_set, setup.query_set, attribution_granularity="token", **options
    )
    return Result(ranking, tokens, "Gradients at the final weights.")


def tracin(setup: Setup) -> Result:
    """The TracIn checkpoint ensemble: stores per checkpoint, ``top_k_from_cache`` over them."""
    attributor = TracInAttributor(setup.args(), task=setup.task(setup.checkpoints))
    stores = attributor.cache(
        setup.train_set, setup.query_set, cache_dir=str(setup.work / "stores"),
        hook_config=HOOK_CONFIG,
    )  # fmt: skip
    trains, tests = [train for train, _ in stores], [test for _, test in stores]
    ranking = attributor.top_k_from_cache(trains, tests, setup.options.top_k)
    tokens = attributor.attribute(
        setup.train_set, setup.query_set, hook_config=HOOK_CONFIG,
        attribution_granularity="token",
    )  # fmt: skip
    return Result(ranking, tokens, f"Sum over {len(stores)} epoch-end checkpoint(s), unit weights.")


def kronecker(cls: type) -> Callable[[Setup], Result]:
    """K-FAC / EK-FAC: one fit (``fit_dir``) for the streaming top-k and the token scores."""

    def run(setup: Setup) -> Result:
        options = {
            "hook_config": HOOK_CONFIG,
            "damping": setup.options.damping,
            "relative_damping": True,
            "fit_dir": str(setup.work / "fit"),
        }
        attributor = cls(setup.args(), task=setup.task())
        ranking = rank(attributor, setup, **options)
        tokens = attributor.attribute(
            setup.train_set, setup.query_set, attribution_granularity="token", **options
        )
        return Result(ranking, tokens, f"Relative damping {setup.options.damping}.")

    return run


def lorif(setup: Setup) -> Result:
    """LoRIF at rank 1: streaming top-k; rank-1 records have no token axis (unshaded)."""
    attributor = LoRIFAttributor(setup.args(), task=setup.task(), rank=1)
    ranking = rank(attributor, setup, hook_config=LORIF_HOOK_CONFIG)
    return Result(
        ranking,
        None,
        "LoGRA-projected gradients (16 x 16 per layer), rank-1 training records, full-rank "
        "curvature. A rank-1 record keeps no token axis, so LoRIF has token scores only at "
        "rank=None (uncompressed records).",
    )


SWEPT = (
    "Its scores come from a backward sweep over the recorded updates, whole samples per "
    "row (no streaming top-k, no token rows), so the tokens are unshaded."
)
WHY_UNSHADED = {
    LESSAttributor: "Its training rows are each sample's Adam update direction, a map of the "
    "whole gradient with no token axis (and rescaled after the pass: no streaming top-k), so "
    "the tokens are unshaded.",
    TrajectoryTracInAttributor: SWEPT,
    DVEmbAttributor: SWEPT,
    AdamWInfluenceAttributor: SWEPT,
}


def recorded_run(cls: type, **kwargs) -> Callable[[Setup], Result]:
    """A method scoring a recorded run (no streaming top-k): it trains the last epoch itself."""

    def run(setup: Setup) -> Result:
        attributor = cls(setup.args(), task=setup.task())
        ranking = rank(attributor, setup, hook_config=HOOK_CONFIG, **kwargs)
        note = f"The method trained and recorded the last epoch itself. {WHY_UNSHADED[cls]}"
        return Result(ranking, None, note)

    return run


METHODS: dict[str, Method] = {
    "graddot": Method("Grad-Dot", grad_dot),
    "gradcos": Method("Grad-Cos", lambda setup: grad_dot(setup, normalized=True)),
    "tracin": Method("TracIn", tracin, checkpoints=True),
    "kfac": Method("K-FAC", kronecker(KFACAttributor)),
    "ekfac": Method("EK-FAC", kronecker(EKFACAttributor)),
    "lorif": Method("LoRIF", lorif),
    "less": Method(
        "LESS",
        recorded_run(LESSAttributor, enable_update=True, loss_reduction="sum"),
        trains_last_epoch=True,
    ),
    "trajectory-tracin": Method(
        "trajectory TracIn", recorded_run(TrajectoryTracInAttributor), trains_last_epoch=True
    ),
    "dvemb": Method(
        "DVEmb",
        recorded_run(DVEmbAttributor, propagation="test", loss_reduction="sum", learning_rate=None),
        trains_last_epoch=True,
    ),
    "adamw-influence": Method(
        "AdamW-influence",
        recorded_run(AdamWInfluenceAttributor, propagation="test", loss_reduction="sum"),
        trains_last_epoch=True,
    ),
}


# ---------------------------------------------------------------------------- training
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=list(METHODS), default="kfac")
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
    if options.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {options.epochs}")
    if options.top_k < 1:
        parser.error(f"--top-k must be >= 1, got {options.top_k}")
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


def train(
    model: torch.nn.Module, train_set: list[dict], epochs: int, keep: Collection[int] = ()
) -> list[dict]:
    """A plain loop: AdamW, shuffled mini-batches of 16, mean loss; state dicts after ``keep``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    loader = torch.utils.data.DataLoader(train_set, batch_size=BATCH_SIZE, shuffle=True)
    kept = []
    model.train()
    for epoch in range(1, epochs + 1):
        for batch in loader:
            optimizer.zero_grad()
            (loss_fn(model, batch) / len(batch["input_ids"])).backward()
            optimizer.step()
        if epoch in keep:
            kept.append(copy.deepcopy(model.state_dict()))
    return kept


def padded(words: list[str]) -> list[str | None]:
    """One entry per input position: the words, then ``None`` at the (right) padding."""
    return words + [None] * (MAX_LEN - len(words))


def checkpoint_epochs(epochs: int) -> set[int]:
    """Up to ``TRACIN_CHECKPOINTS`` evenly spaced epoch ends, the last one included."""
    return {
        max(1, round(epochs * i / TRACIN_CHECKPOINTS)) for i in range(1, 1 + TRACIN_CHECKPOINTS)
    }


def main(argv: list[str] | None = None) -> Path:
    """Train, rank (and score tokens) with the method, write the HTML page; return its path."""
    options = parse_args(argv)
    method = METHODS[options.method]
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
    train_ids = [hash_sample(x) for x in train_set]
    # One token string per input position; None hides the padding after the sentence.
    train_tokens = {h: padded(s.split()[:MAX_LEN]) for h, (_, s) in zip(train_ids, pairs)}
    train_labels = {h: topic for h, (topic, _) in zip(train_ids, pairs)}
    query_text = {
        hash_sample(q): f"[{topic}] {text}" for q, (topic, text) in zip(query_set, QUERIES)
    }

    model = build_model(len(tokenizer.vocab) + 1)
    plain_epochs = options.epochs - 1 if method.trains_last_epoch else options.epochs
    keep = checkpoint_epochs(options.epochs) if method.checkpoints else set()
    checkpoints = train(model, train_set, plain_epochs, keep)
    with tempfile.TemporaryDirectory(prefix="token_attribution_") as work:
        setup = Setup(model, train_set, query_set, options, Path(work), checkpoints or None)
        result = method.run(setup)
    path = write_token_report(
        options.output,
        result.ranking,
        train_tokens,
        k=options.top_k,
        query_text=query_text,
        token_score=result.token_score,
        train_labels=train_labels,
        title=f"Token-level attribution ({method.name})",
        note=f"{len(train_set)} training sentences, {options.epochs} epoch(s). {result.note}",
    )
    shading = "shaded" if result.token_score is not None else "unshaded"
    print(f"wrote {path} ({options.method}, {len(train_set)} training sentences, {shading})")
    return path


if __name__ == "__main__":
    main()

"""The TSLOO setting: corpus splits, a small GPT-2, pretraining, and the fine-tuning trajectory.

Everything here is deterministic on CPU: one torch thread, deterministic
algorithms, dropout 0, a seeded data order. ``run_trajectory`` is the single
training loop used by the reference run, by every capture run and by every
leave-one-out replay, so a replay differs from the reference only by the
removed sample.

Loss convention: a batch's training loss is the SUM of its sequences' losses
(each sequence's loss is its mean next-token cross-entropy). Removing a sample
therefore removes exactly its term and leaves the other samples' weights
unchanged, which is the perturbation the first-order methods model
(``loss_reduction="sum"`` for the trajectory methods).

The "trainer defaults" setting (:data:`TRAINER`) trains as a Hugging Face
``Trainer`` does by default: the batch loss is the MEAN over the batch, the
global gradient norm is clipped at 1.0 (active on most steps), weight decay 0.1
goes to the weights only (biases and LayerNorm weights in a no-decay group, the
LayerNorms trained and hooked too), warm-up then linear decay. Removing a
sample sets its term's weight to 0 and keeps the batch's divisor ``B``: the
perturbation the methods' ``loss_reduction="mean"`` models.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from quickstart import MAX_LEN, WordTokenizer  # noqa: E402
from quickstart_corpus import CORPUS, QUERIES  # noqa: E402

Batch = dict[str, torch.Tensor]
# The cross-entropy runs in float32 whatever the model's dtype (``.float()`` on the logits),
# so a float64 replay's losses and gradients carry float32 rounding at the logits. True
# keeps a float64 model's loss in float64 (``error_proxy.py``: finite differences of the
# loss); False (default) is what ``tsloo.py``'s committed float64 references used.
FLOAT64_LOSS = False
# Fine-tuned (and hooked) layers: every Conv1D of the transformer blocks and the LM head.
HOOKED_LAYERS = [r"\.(c_attn|c_proj|c_fc)$", r"^lm_head$"]
# The trainer setting also trains the LayerNorms (no weight decay on their weights).
NORM_LAYERS = [r"\.ln_(1|2)$", r"^transformer\.ln_f$"]


@dataclass(frozen=True)
class Setting:
    """Sizes and hyperparameters of one TSLOO run."""

    seed: int = 0
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    pretrain_epochs: int = 8
    pretrain_lr: float = 3e-3
    pretrain_batch: int = 16
    num_finetune: int = 64
    # Sentences held out of pretraining for fine-tuning (None: ``num_finetune``). A larger
    # pool fine-tunes on its first ``num_finetune`` sentences with the pretraining split,
    # hence the pretrained model, unchanged (shorter trajectories, ``error_proxy.py``).
    finetune_pool: int | None = None
    finetune_batch: int = 4
    finetune_epochs: int = 1
    peak_lr: float = 1e-3
    warmup_fraction: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    num_queries: int = 32
    num_removed: int = 64
    removed_seed: int = 1
    name: str = "default"
    loss_reduction: str = "sum"
    max_grad_norm: float | None = None
    no_decay: bool = False  # biases and LayerNorm weights without weight decay
    train_norms: bool = False

    @property
    def num_steps(self) -> int:
        """Fine-tuning optimizer steps ``T``."""
        per_epoch = -(-self.num_finetune // self.finetune_batch)
        return per_epoch * self.finetune_epochs

    @property
    def hooked_layers(self) -> list[str]:
        """Patterns of the fine-tuned (and hooked) layers."""
        return HOOKED_LAYERS + (NORM_LAYERS if self.train_norms else [])


SMOKE = Setting(
    pretrain_epochs=2,
    num_finetune=8,
    finetune_batch=2,
    num_queries=6,
    num_removed=5,
    n_embd=32,
    n_layer=1,
    n_head=2,
)
TRAINER_DEFAULTS = {
    "name": "trainer",
    "weight_decay": 0.1,
    "loss_reduction": "mean",
    "max_grad_norm": 1.0,
    "no_decay": True,
    "train_norms": True,
}
TRAINER = Setting(**TRAINER_DEFAULTS)
TRAINER_SMOKE = Setting(**{**SMOKE.__dict__, **TRAINER_DEFAULTS})


@dataclass
class Data:
    """Tokenized splits: pretraining, fine-tuning (in corpus order) and queries."""

    pretrain: list[Batch]
    finetune: list[Batch]
    queries: list[Batch]
    finetune_text: list[str]
    query_text: list[str]
    vocab_size: int
    removed: list[int] = field(default_factory=list)


def make_data(setting: Setting) -> Data:
    """Split the quickstart corpus (shuffled with ``seed``) into pretrain / fine-tune / queries.

    The queries are the corpus' 10 held-out ``QUERIES`` plus held-out corpus
    sentences; the fine-tuning set follows; the rest is pretraining text.
    ``removed`` lists the fine-tuning indices whose leave-one-out replays are run.
    """
    sentences = [s for group in CORPUS.values() for s in group]
    rng = random.Random(setting.seed)
    rng.shuffle(sentences)
    extra_queries = max(0, setting.num_queries - len(QUERIES))
    query_text = [q for _, q in QUERIES][: setting.num_queries] + sentences[:extra_queries]
    rest = sentences[extra_queries:]
    pool = setting.num_finetune if setting.finetune_pool is None else setting.finetune_pool
    if pool < setting.num_finetune:
        raise ValueError(f"finetune_pool {pool} < num_finetune {setting.num_finetune}")
    finetune_text = rest[: setting.num_finetune]
    pretrain_text = rest[pool:]
    tokenizer = WordTokenizer(sentences + [q for _, q in QUERIES])
    removed = sorted(
        random.Random(setting.removed_seed).sample(
            range(setting.num_finetune), min(setting.num_removed, setting.num_finetune)
        )
    )
    return Data(
        pretrain=[tokenizer.encode(s) for s in pretrain_text],
        finetune=[tokenizer.encode(s) for s in finetune_text],
        queries=[tokenizer.encode(s) for s in query_text],
        finetune_text=finetune_text,
        query_text=query_text,
        vocab_size=len(tokenizer.vocab) + 1,
        removed=removed,
    )


def make_model(setting: Setting, vocab_size: int) -> torch.nn.Module:
    """A small GPT-2 from a config, dropout 0, untied LM head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(setting.seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=MAX_LEN,
        n_embd=setting.n_embd,
        n_layer=setting.n_layer,
        n_head=setting.n_head,
        tie_word_embeddings=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def sequence_losses(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``(B,)`` mean next-token cross-entropy of each (right-padded) sequence."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    logits = logits if FLOAT64_LOSS and logits.dtype == torch.float64 else logits.float()
    token_loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return token_loss.sum(1) / (targets != -100).sum(1)


def summed_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of the batch's sequence losses: each captured gradient is ``∇ℓ_i``."""
    return sequence_losses(model, batch).sum()


def collate(samples: Sequence[Batch]) -> Batch:
    """Stack samples into a batch."""
    return torch.utils.data.default_collate(list(samples))


def pretrain(model: torch.nn.Module, setting: Setting, data: Data) -> None:
    """Pretrain every parameter on the pretraining split (AdamW, shuffled, mean loss)."""
    gen = torch.Generator().manual_seed(setting.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setting.pretrain_lr)
    model.train()
    for _ in range(setting.pretrain_epochs):
        order = torch.randperm(len(data.pretrain), generator=gen).tolist()
        for start in range(0, len(order), setting.pretrain_batch):
            batch = collate(
                [data.pretrain[i] for i in order[start : start + setting.pretrain_batch]]
            )
            optimizer.zero_grad(set_to_none=True)
            (summed_loss(model, batch) / len(batch["input_ids"])).backward()
            optimizer.step()


def finetuned_parameters(model: torch.nn.Module, setting: Setting) -> list[torch.nn.Parameter]:
    """Freeze everything but the hooked layers; return those params.

    The methods see exactly the parameters that move, so a gap to the ground
    truth is the method's, not a coverage gap.
    """
    import re

    params = []
    for name, module in model.named_modules():
        hooked = any(re.search(p, name) for p in setting.hooked_layers)
        for param in module.parameters(recurse=False):
            param.requires_grad_(hooked)
            if hooked:
                params.append(param)
    return params


def batch_order(setting: Setting) -> list[list[int]]:
    """The fixed (seeded) fine-tuning batches: lists of fine-tuning indices, one per step."""
    gen = torch.Generator().manual_seed(setting.seed + 1)
    batches = []
    for _ in range(setting.finetune_epochs):
        order = torch.randperm(setting.num_finetune, generator=gen).tolist()
        batches += [
            order[start : start + setting.finetune_batch]
            for start in range(0, setting.num_finetune, setting.finetune_batch)
        ]
    return batches


def lr_schedule(setting: Setting) -> list[float]:
    """Linear warm-up over the first ``warmup_fraction`` of the steps, then linear decay."""
    steps = setting.num_steps
    warmup = max(1, round(setting.warmup_fraction * steps))
    return [
        setting.peak_lr * ((t + 1) / warmup if t < warmup else (steps - t) / (steps - warmup + 1))
        for t in range(steps)
    ]


def run_trajectory(
    model: torch.nn.Module,
    setting: Setting,
    data: Data,
    *,
    removed: int | None = None,
    removed_weight: float = 0.0,
    before_step: Callable[[int], None] | None = None,
    after_step: Callable[[int, torch.optim.Optimizer], None] | None = None,
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """Fine-tune ``model`` in place along the fixed trajectory, ``removed`` left out.

    Every step uses the schedule's learning rate and the fixed batch minus the
    removed sample (same order for the rest). A nonzero ``removed_weight``
    keeps the removed sample with its loss scaled by that weight instead
    (``1 − ε``: an infinitesimal removal). ``before_step(t)`` runs before
    the step's backward (and may call backward itself: gradients are zeroed
    after it); ``after_step(t, optimizer)`` after ``optimizer.step()``.
    """
    params = finetuned_parameters(model, setting)
    optimizer = (make_optimizer or adamw_for(setting))(params)
    model.train()
    for t, (indices, lr) in enumerate(zip(batch_order(setting), lr_schedule(setting))):
        kept = [i for i in indices if i != removed or removed_weight != 0.0]
        for group in optimizer.param_groups:
            group["lr"] = lr
        if before_step is not None:
            before_step(t)
        optimizer.zero_grad(set_to_none=True)
        if kept:
            losses = sequence_losses(model, collate([data.finetune[i] for i in kept]))
            if removed in kept:
                weights = [removed_weight if i == removed else 1.0 for i in kept]
                losses = losses * torch.tensor(weights, dtype=losses.dtype)
            batch_loss(losses, len(indices), setting).backward()
            if setting.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, setting.max_grad_norm)
            optimizer.step()
        if after_step is not None:
            after_step(t, optimizer)
    return optimizer


def batch_loss(losses: torch.Tensor, batch_size: int, setting: Setting) -> torch.Tensor:
    """The batch loss: the sum of ``losses``, or over ``batch_size`` for a mean loss (a removed
    sample keeps its place in the divisor)."""
    total = losses.sum()
    return total / batch_size if setting.loss_reduction == "mean" else total


def adamw_for(setting: Setting) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """The fine-tuning optimizer factory (AdamW with the setting's hyperparameters).

    With ``no_decay`` the 1-D parameters (biases, LayerNorm weights) form a
    second group without weight decay, as the Hugging Face ``Trainer`` builds it.
    """

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        groups: list[dict] = [{"params": params, "weight_decay": setting.weight_decay}]
        if setting.no_decay:
            groups = [
                {"params": [p for p in params if p.ndim > 1], "weight_decay": setting.weight_decay},
                {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
            ]
        return torch.optim.AdamW(groups, lr=setting.peak_lr, betas=setting.betas, eps=setting.eps)

    return make


@torch.no_grad()
def query_losses(model: torch.nn.Module, data: Data) -> torch.Tensor:
    """``(num_queries,)`` float64 losses of the queries under ``model``."""
    model.eval()
    losses = sequence_losses(model, collate(data.queries)).double()
    model.train()
    return losses


def run_subset_trajectory(
    model: torch.nn.Module, setting: Setting, data: Data, kept: Sequence[int]
) -> torch.optim.Optimizer:
    """Fine-tune ``model`` in place along the fixed trajectory restricted to the samples ``kept``.

    The same loop as :func:`run_trajectory` (same batches in the same order minus the
    samples not kept, same schedule, same optimizer); a step whose batch keeps no sample
    makes no update, as a removed sample's empty batch does there. With ``kept`` = all
    samples but ``i`` it is the leave-one-out replay of ``i`` (tested bit for bit).
    """
    keep = set(kept)
    params = finetuned_parameters(model, setting)
    optimizer = adamw_for(setting)(params)
    model.train()
    for indices, lr in zip(batch_order(setting), lr_schedule(setting)):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        batch = [i for i in indices if i in keep]
        if batch:
            losses = sequence_losses(model, collate([data.finetune[i] for i in batch]))
            batch_loss(losses, len(indices), setting).backward()
            if setting.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, setting.max_grad_norm)
            optimizer.step()
    return optimizer

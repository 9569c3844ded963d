"""Online data selection with ``DataSelectionCallback`` on a tiny Llama, full fine-tuning and LoRA.

The data is a mixture of two synthetic sources over the same 32 tokens:

* *count up* — ``s, s+1, s+2, …`` (mod 32): the target task;
* *random walk* — from a random start, each next token is ``+1`` or ``-1`` with
  equal odds: the same bigrams with conflicting continuations, so it teaches
  the model that a count goes either way, which hurts the target task.

Each training batch holds 8 sequences, half from each source. A tiny
``LlamaForCausalLM`` (built from a config, no download) is fine-tuned with
AdamW, once on all data and once with ``DataSelectionCallback``: at each step
the callback scores the batch against the gradient of one validation batch of
4 target sequences (Grad-Dot on the captured factors, ``target="val_loader"``),
drops those of the bottom half whose score is negative
(``"negative_bottom_fraction"``, threshold 0.5) and removes their exact
contribution from ``param.grad`` before ``optimizer.step()``
(``renormalize=True``: the kept samples' mean loss). The training loop is not
changed: it runs inside ``HookManager.collect()``. (Plain ``"bottom_fraction"``
helps full fine-tuning too but hurts LoRA here: once the count-up sequences are
fit their gradients are small, so their Grad-Dot scores are among the lowest
and half of every batch is dropped whatever its source.)

* Full fine-tuning: every ``nn.Linear`` and ``nn.Embedding`` is hooked
  (``linear_io=REGISTER_ALL``); only the RMSNorm weights (not a hookable type)
  keep the whole batch.
* LoRA (``peft``, rank 8 on the attention and MLP projections) over a base
  first trained on a neutral task (counting by 3): the base is frozen, so the
  default ``HookManagerConfig`` hooks only the adapter layers.

Outputs (next to this file): ``target_loss.png`` (held-out target loss per
step) and ``results.md`` (a table). Needs ``matplotlib`` and ``peft``.

Run:  python examples/data_selection/run.py [--steps 100] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dattri_llm.gradient.callbacks.data_selection_callback import DataSelectionCallback
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager

HERE = Path(__file__).parent
VOCAB, SEQ, BATCH = 32, 16, 8
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=SEQ,
    attention_dropout=0.0,
)


def counting(step: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``(n, SEQ)`` sequences counting by ``step`` from random starts (mod VOCAB)."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=gen)
    return (starts + step * torch.arange(SEQ)) % VOCAB


def random_walk(n: int, gen: torch.Generator) -> torch.Tensor:
    """``(n, SEQ)`` walks from random starts with steps ``±1`` of equal odds (mod VOCAB)."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=gen)
    steps = 2 * torch.randint(0, 2, (n, SEQ - 1), generator=gen) - 1
    return (starts + torch.cat([torch.zeros(n, 1, dtype=torch.long), steps.cumsum(1)], 1)) % VOCAB


def as_batch(ids: torch.Tensor) -> dict:
    return {"input_ids": ids, "labels": ids}


def training_batches(steps: int, seed: int) -> list[tuple[dict, torch.Tensor]]:
    """``(batch, is_walk)``: 4 count-up and 4 random-walk sequences, rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = torch.cat([counting(1, BATCH // 2, gen), random_walk(BATCH // 2, gen)])
        order = torch.randperm(BATCH, generator=gen)
        out.append((as_batch(rows[order]), (torch.arange(BATCH) >= BATCH // 2)[order]))
    return out


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean next-token cross-entropy (equal lengths: the mean of per-sequence means)."""
    return model(**batch).loss


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def lora_base(steps: int = 60) -> dict[str, torch.Tensor]:
    """State of a base model trained on a neutral task (counting by 3), for the LoRA runs."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        lm_loss(model, as_batch(counting(3, BATCH, gen))).backward()
        opt.step()
    return model.state_dict()


def build(base: dict | None) -> tuple[nn.Module, HookManagerConfig | None, float]:
    """Model, capture config and learning rate: full fine-tuning, or LoRA over ``base``."""
    model = llama()
    if base is None:
        return model, HookManagerConfig(linear_io=REGISTER_ALL), 3e-3
    from peft import LoraConfig, get_peft_model

    model.load_state_dict(base)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS))
    return model, None, 1e-2  # default config: only trainable (adapter) layers are hooked


def train(base: dict | None, select: bool, steps: int, eval_every: int) -> dict:
    """One fine-tuning run (LoRA over ``base`` when given); target losses per step, timing."""
    model, config, lr = build(base)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(1)
    target_eval = as_batch(counting(1, 64, gen))
    val_pool = [as_batch(counting(1, 4, gen)) for _ in range(16)]  # 4 target examples a step
    callbacks = []
    if select:
        callbacks.append(
            DataSelectionCallback(
                model,
                target="val_loader",
                val_loader=val_pool,
                val_loss_fn=lm_loss,
                renormalize=True,
                selection_kwargs={"threshold": 0.5, "threshold_mode": "negative_bottom_fraction"},
            )
        )
    manager = HookManager(model, config, callbacks=callbacks)
    losses: dict[int, float] = {0: evaluate(model, target_eval)}
    dropped_harmful = dropped = 0
    start = time.perf_counter()
    with manager.collect():
        for step, (batch, harmful) in enumerate(training_batches(steps, seed=2), start=1):
            opt.zero_grad(set_to_none=True)
            lm_loss(model, batch).backward()
            opt.step()
            if select:
                sel = callbacks[0]
                dropped += len(sel.last_dropped)
                dropped_harmful += int(harmful[sel.last_dropped].sum())
            if step % eval_every == 0:
                losses[step] = evaluate(model, target_eval)
    seconds = time.perf_counter() - start
    return {"losses": losses, "seconds": seconds, "dropped": dropped, "harmful": dropped_harmful}


@torch.no_grad()
def evaluate(model: nn.Module, batch: dict) -> float:
    """Target-task loss on held-out count-up sequences."""
    model.eval()
    loss = float(lm_loss(model, batch))
    model.train()
    return loss


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, regime in zip(axes, ("full", "LoRA")):
        for select, style in ((False, "--"), (True, "-")):
            run = runs[f"{regime}, {'selection' if select else 'all data'}"]
            steps, values = zip(*sorted(run["losses"].items()))
            ax.plot(steps, values, style, label="with selection" if select else "all data")
        ax.set_title(f"{regime} fine-tuning")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out target loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(runs: dict[str, dict], steps: int, threads: int) -> str:
    marks = sorted(next(iter(runs.values()))["losses"])
    shown = [m for m in marks if m in (0, steps) or m % (steps // 4 or 1) == 0]
    steps_head = " | ".join(f"step {m}" for m in shown)
    head = f"| run | {steps_head} | dropped (random-walk share) | s |"
    lines = [
        "# Online data selection on a tiny Llama",
        "",
        f"Held-out target (count-up) loss; batch {BATCH} (half count-up, half random walk), "
        f"{steps} AdamW steps, torch threads {threads}. Generated by `run.py`.",
        "",
        head,
        "|" + "---|" * (len(shown) + 3),
    ]
    for name, run in runs.items():
        cells = " | ".join(f"{run['losses'][m]:.3f}" for m in shown)
        share = (
            f"{run['dropped']} ({run['harmful'] / run['dropped']:.0%})" if run["dropped"] else "—"
        )
        lines.append(f"| {name} | {cells} | {share} | {run['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, report: Callable[[str], None] = print) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = {}
    for regime, base in (("full", None), ("LoRA", lora_base())):
        for select in (False, True):
            name = f"{regime}, {'selection' if select else 'all data'}"
            runs[name] = train(base, select, args.steps, args.eval_every)
            report(f"{name}: final target loss {runs[name]['losses'][args.steps]:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(runs, args.out / "target_loss.png")
    (args.out / "results.md").write_text(table(runs, args.steps, args.threads))
    return runs


if __name__ == "__main__":
    main()

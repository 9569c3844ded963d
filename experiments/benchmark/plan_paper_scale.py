"""The run plan at paper scale: Qwen 0.5B-110B on 4 x H200 with FSDP, from configs alone.

Every model is a ``Qwen2Config`` written below with the published dimensions of
its checkpoint (nothing is downloaded; ``plan_run`` builds it on the ``meta``
device, so no weights exist). Workload of the paper "dattri-LLM: A Unified and
Efficient Library for Training Data Attribution at LLM Scale" (section 4.1,
appendix B.1): 512 training sequences of 512 tokens in bf16, one query through
32B and four at 72B / 110B, the attention and MLP linear layers hooked (7 per
decoder layer; embeddings and the LM head excluded), the per-device batch of
the paper's dattri-LLM row at each scale.

Methods: Grad-Dot, K-FAC and EK-FAC unprojected, and each with LoGRA-style
factor projection ``k_a = k_g = 64`` (``projection={"__default__": {"style":
"logra", "proj_dim": 64}}``), the paper's configuration.

From one process to four GPUs (``plan_run`` plans one process):

* data: the training set is split four ways, so each rank plans
  ``512 / 4 = 128`` training records; every rank holds all queries;
* FSDP wraps the model, so its backward computes weight gradients
  (``weight_gradients=True``); parameters and gradients are sharded four ways,
  plus what is gathered at a time: the root unit (embeddings, final norm, LM
  head), unsharded throughout, and one decoder layer's parameters and
  gradients;
* activations, blocks, the fit and the scores are per rank as planned (the
  curvature is all-reduced: every rank holds all of it);
* per GPU = ``peak_memory_bytes - parameter_bytes - gradient_bytes +
  (parameter_bytes + gradient_bytes) / 4 + gathered``.

Time is rough: the plan's probe (seconds per record) is FLOP-scaled, not
measured: ``6 x (linear weights) x T`` (forward, input and weight gradients) +
``6 x 2 x T^2 x d`` per decoder layer for attention, divided by an assumed
``MFU x 989e12`` bf16 FLOP/s per H200 (``--mfu``, default 0.4). It leaves
out the K-FAC / EK-FAC covariance, eigendecomposition and rotation arithmetic,
the scoring, and communication.

Writes ``results/plan_paper_scale.md``.
Run:  python experiments/benchmark/plan_paper_scale.py [--mfu 0.4]
"""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GPUS, N_TRAIN, SEQ = 4, 512, 512
H200_BYTES = 141e9  # per device, as the paper gives it (GB)
H200_BF16_FLOPS = 989e12  # dense bf16 peak
K_PROJ = 64
HOOKS = ["self_attn", "mlp"]
GB = 1e9  # the paper reports decimal GB

# name: (checkpoint, hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
QWEN = {
    "0.5B": ("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True),
    "1.5B": ("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True),
    "3B": ("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, True),
    "7B": ("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, False),
    "14B": ("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064, False),
    "32B": ("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 152064, False),
    "72B": ("Qwen2.5-72B", 8192, 29568, 80, 64, 8, 152064, False),
    "110B": ("Qwen1.5-110B", 8192, 49152, 80, 64, 8, 152064, False),
}
# the paper's dattri-LLM rows (projected k = 64): per-device batch and throughput (samples/s)
# on 4 x H200 (its Table 4), peak per-device memory at that batch (GB, its Table 5), and
# memory at batch 1 with 64 training sequences and one query (GB, its Table 6: one H200
# through 32B, an aggregate over four sharded H200s at 72B / 110B).
PAPER_BATCH = {"0.5B": 128, "1.5B": 64, "3B": 32, "7B": 32, "14B": 16, "32B": 8, "72B": 8,
               "110B": 4}  # fmt: skip
PAPER_THROUGHPUT = {
    "graddot": [613, 299, 186, 110, 49.9, 22.0, 8.6, 6.9],
    "kfac": [375, 174, 120, 92.2, 40.3, 16.8, 7.4, 5.9],
    "ekfac": [337, 174, 116, 83.9, 38.6, 16.1, 7.2, 5.6],
}
PAPER_PEAK = {
    "graddot": [117.6, 93.0, 67.2, 88.4, 72.0, 79.0, 131.0, 127.8],
    "kfac": [117.6, 93.0, 67.2, 88.4, 72.0, 80.0, 132.1, 127.8],
    "ekfac": [117.6, 93.0, 67.2, 88.4, 72.0, 80.0, 132.1, 127.8],
}
# Grad-Dot 0.5B: the text gives two numbers (22.1, 23.7) whose columns cannot be told apart
PAPER_BATCH1 = {
    "graddot": [None, 4.8, 8.7, 18.8, 33.8, 72.1, 323, 476],
    "kfac": [2.4, 6.7, 12.9, 28.5, 55.4, 122.2, 324, 476],
    "ekfac": [2.4, 6.7, 12.9, 28.5, 55.4, 122.2, 324, 476],
}
SCALES = list(QWEN)


def qwen_config(scale: str):
    from transformers import Qwen2Config

    _, hidden, inter, layers, heads, kv, vocab, tied = QWEN[scale]
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
    )


def queries(scale: str) -> int:
    return 4 if scale in ("72B", "110B") else 1


def flops_per_record(scale: str) -> float:
    """Forward + backward (input and weight gradients) FLOPs of one sequence of ``SEQ`` tokens."""
    _, d, f, layers, heads, kv, vocab, _ = QWEN[scale]
    head = d // heads
    linear = layers * (d * d + 2 * d * kv * head + d * d + 3 * d * f) + d * vocab
    attention = layers * 2 * SEQ * SEQ * d  # QK^T and AV, forward
    return 6 * linear * SEQ + 3 * 2 * attention


def gathered_bytes(plan, scale: str) -> int:
    """FSDP's unsharded share: the root unit (embeddings, LM head) + one decoder layer x 2."""
    _, d, f, layers, heads, kv, vocab, tied = QWEN[scale]
    head = d // heads
    layer = d * d + 2 * d * kv * head + d * d + 3 * d * f + (d + 2 * kv * head)  # + qkv biases
    root = vocab * d * (1 if tied else 2)
    per_param = plan.parameter_bytes / sum_params(scale)
    return int((root + 2 * layer) * per_param)


def sum_params(scale: str) -> int:
    _, d, f, layers, heads, kv, vocab, tied = QWEN[scale]
    head = d // heads
    layer = d * d + 2 * d * kv * head + d * d + 3 * d * f + (d + 2 * kv * head) + 2 * d
    return layers * layer + vocab * d * (1 if tied else 2) + d


def per_gpu_bytes(plan, scale: str) -> int:
    sharded = (plan.parameter_bytes + plan.gradient_bytes) / GPUS
    rest = plan.peak_memory_bytes - plan.parameter_bytes - plan.gradient_bytes
    return int(rest + sharded + gathered_bytes(plan, scale))


def plan_for(scale: str, method: str, projected: bool, *, batch: int, n_train: int, mfu: float,
             fsdp: bool, num_test: int):  # fmt: skip
    import torch

    from dattri_llm.attribution.planning import plan_run
    from dattri_llm.gradient.hooks.config import HookManagerConfig

    projection = {"__default__": {"style": "logra", "proj_dim": K_PROJ}} if projected else None
    return plan_run(
        qwen_config(scale),
        num_train=n_train,
        num_test=num_test,
        seq_len=SEQ,
        method=method,
        hook_config=HookManagerConfig(linear_io=HOOKS),
        projection=projection,
        batch_size=batch,
        dtype=torch.bfloat16,
        kept_gradient_budget=1 << 30,  # the default on an H200: min(1 GiB, 0.25 x free)
        device="cpu",
        probe=flops_per_record(scale) / (mfu * H200_BF16_FLOPS),
        weight_gradients=fsdp,
    )


def _gb(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e12:,.1f} TB"
    return f"{n / GB:,.1f}"


def render(mfu: float) -> str:
    import torch
    import transformers

    when = datetime.date.today().isoformat()
    out = [
        "# The run plan at paper scale: Qwen 0.5B-110B, 4 x H200, FSDP",
        "",
        f"Date: {when}. Computed on a CPU machine from configs alone (Python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}): no weights, no GPU. See the script's docstring for the "
        "configs, the workload and how one process's plan is scaled to four GPUs.",
        "",
        'Paper figures are those of the paper "dattri-LLM: A Unified and Efficient Library for '
        'Training Data Attribution at LLM Scale" (section 4.1, appendix B.1, Tables 4-6) for its '
        "dattri-LLM rows, which use factor projection k_a = k_g = 64: compare them with the "
        "`logra` rows. GB = 10^9 bytes.",
        "",
        "## Models",
        "",
        "| scale | checkpoint | hidden | MLP | layers | heads / kv | vocab | parameters | "
        "hooked layers |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for scale in SCALES:
        name, d, f, layers, heads, kv, vocab, _ = QWEN[scale]
        plan = plan_for(scale, "graddot", True, batch=1, n_train=1, mfu=mfu, fsdp=False,
                        num_test=1)  # fmt: skip
        out.append(
            f"| {scale} | {name} | {d} | {f} | {layers} | {heads} / {kv} | {vocab} | "
            f"{plan.parameter_bytes / 2 / 1e9:.2f} B | {len(plan.layers)} |"
        )

    out += [
        "",
        "## Throughput workload: 512 x 512 tokens on 4 x H200 (FSDP), the paper's batch",
        "",
        f"Per rank: {N_TRAIN // GPUS} training records, all queries, the per-device batch of the "
        "paper's dattri-LLM row. Store = one rank's training store (x4 for the run). Time: "
        f"FLOP-scaled probe at an assumed {mfu:.0%} of the H200's dense bf16 peak, capture only "
        "(so K-FAC / EK-FAC times leave out their fit; see the docstring); samples/s = 512 / "
        "time. 'fits' = per-GPU memory within 141 GB.",
        "",
        "| scale | batch | method | store / rank | curvature | activations | per-GPU peak | fits | "
        "paper peak | est. samples/s | paper samples/s |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for i, scale in enumerate(SCALES):
        batch = PAPER_BATCH[scale]
        for method in ("graddot", "kfac", "ekfac"):
            for projected in (False, True):
                plan = plan_for(scale, method, projected, batch=batch, n_train=N_TRAIN // GPUS,
                                mfu=mfu, fsdp=True, num_test=queries(scale))  # fmt: skip
                gpu = per_gpu_bytes(plan, scale)
                curv = plan.covariance_bytes + plan.eigenbasis_bytes + plan.correction_bytes
                rate = N_TRAIN / plan.estimated_seconds
                paper_peak = f"{PAPER_PEAK[method][i]}" if projected else ""
                paper_rate = f"{PAPER_THROUGHPUT[method][i]}" if projected else ""
                label = method + ("-logra" if projected else "")
                out.append(
                    f"| {scale} | {batch} | {label} | {_gb(plan.train_store_bytes)} | "
                    f"{_gb(curv)} | {_gb(plan.activation_bytes)} | {_gb(gpu)} | "
                    f"{'yes' if gpu <= H200_BYTES else '**no**'} | {paper_peak} | "
                    f"{rate:,.0f} | {paper_rate} |"
                )

    out += [
        "",
        "## Memory at batch 1: 64 training sequences, one query",
        "",
        "Through 32B one process on one H200 (no FSDP: the frozen probe computes no weight "
        "gradients; the column '+ grads' adds a parameter-sized gradient, as standard capture "
        "does); 72B and 110B sharded over four H200s, reported as the aggregate over the four "
        "(4 x per-GPU), as the paper does. LoGRA k = 64 rows.",
        "",
        "| scale | method | parameters | plan peak | plan peak + grads | paper |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for i, scale in enumerate(SCALES):
        sharded = scale in ("72B", "110B")
        for method in ("graddot", "kfac", "ekfac"):
            plan = plan_for(scale, method, True, batch=1, n_train=64, mfu=mfu, fsdp=sharded,
                            num_test=1)  # fmt: skip
            if sharded:
                peak = GPUS * per_gpu_bytes(plan, scale)
                with_grads = "(FSDP: included)"
            else:
                peak = plan.peak_memory_bytes
                with_grads = _gb(peak + plan.parameter_bytes)
            paper = PAPER_BATCH1[method][i]
            out.append(
                f"| {scale} | {method}-logra | {_gb(plan.parameter_bytes)} | {_gb(peak)}"
                f"{' (4 GPUs)' if sharded else ''} | {with_grads} | "
                f"{'unclear' if paper is None else paper} |"
            )
    out += ["", "## Where the plan and the paper differ, and why", "", "DIFFER", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_paper_scale.md")
    opts = parser.parse_args(argv)
    opts.out.write_text(render(opts.mfu) + "\n")
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()

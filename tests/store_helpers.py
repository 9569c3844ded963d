"""Deterministic records for the gradient-store tests (importable from subprocesses)."""

from __future__ import annotations

import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.utils.hashing import hash_batch

KINDS = ("factorized", "dense", "mixed")
CONV_KWARGS = {
    "has_bias": True,
    "kernel_size": (2, 2),
    "stride": (1, 1),
    "padding": (0, 0),
    "dilation": (1, 1),
    "groups": 1,
}
EMB_KWARGS = {"has_bias": False, "num_embeddings": 11, "padding_idx": None}


def _factorized_layers(gen: torch.Generator, batch: int, tokens: int) -> dict:
    lin = Factorized(
        torch.randn(batch, tokens, 4, generator=gen),
        torch.randn(batch, tokens, 5, generator=gen),
        module_kwargs={"has_bias": True},
    )
    emb = Factorized(
        torch.randint(0, 11, (batch, tokens), generator=gen),
        torch.randn(batch, tokens, 3, generator=gen, dtype=torch.float64),
        module_kwargs=dict(EMB_KWARGS),
    )
    conv = Factorized(
        torch.randn(batch, 2, 4, 4, generator=gen),
        torch.randn(batch, 3, 3, 3, generator=gen),
        module_kwargs=dict(CONV_KWARGS),
    )
    seq_first = Factorized(
        torch.randn(tokens, batch, 4, generator=gen),
        torch.randn(tokens, batch, 2, generator=gen),
        module_kwargs={"has_bias": False},
        batch_first=False,
    )
    return {
        "lin": ("factorized", "nn.Linear", "batch_token", lin),
        "emb": ("factorized", "nn.Embedding", "batch_token", emb),
        "conv": ("factorized", "nn.Conv2d", "batch", conv),
        "seq": ("factorized", "nn.Linear", "batch_token", seq_first),
    }


def _dense_layers(gen: torch.Generator, batch: int, tokens: int) -> dict:
    return {
        "dense": (
            "materialized",
            "nn.Linear",
            "batch",
            torch.randn(batch, 6, generator=gen).to(torch.bfloat16),
        ),
        "dense_tok": (
            "materialized",
            "nn.Linear",
            "batch_token",
            torch.randn(batch, tokens, 2, generator=gen, dtype=torch.float64),
        ),
    }


def build_gradient(layers: dict) -> Gradient:
    return Gradient(
        representation={n: v[0] for n, v in layers.items()},
        data={n: v[3] for n, v in layers.items()},
        layer_types={n: v[1] for n, v in layers.items()},
        indexing={n: v[2] for n, v in layers.items()},
    )


def make_gradient(kind: str, seed: int, batch: int, tokens: int = 3) -> Gradient:
    gen = torch.Generator().manual_seed(seed)
    layers = {}
    if kind in ("factorized", "mixed"):
        layers.update(_factorized_layers(gen, batch, tokens))
    if kind in ("dense", "mixed"):
        layers.update(_dense_layers(gen, batch, tokens))
    return build_gradient(layers)


def make_records(kind: str, per_sample: bool, seed: int = 0) -> list[list[GradientRecord]]:
    """Three groups of records; group ``k`` holds steps ``2k`` and ``2k+1``."""
    groups = []
    for k in range(3):
        group = []
        for step in (2 * k, 2 * k + 1):
            batch = 2 + step % 2
            gradient = make_gradient(kind, seed * 100 + step, batch, tokens=2 + step % 3)
            ids = [f"id{step}_{i}" for i in range(batch)]
            if per_sample:
                group.extend(
                    GradientRecord(step, ids[i], gradient.slice("batch", i)) for i in range(batch)
                )
            else:
                group.append(GradientRecord(step, ids, gradient))
        groups.append(group)
    return groups


def payload_tensors(gradient: Gradient) -> dict[str, torch.Tensor]:
    """Every tensor of a gradient keyed ``layer/role``."""
    out = {}
    for name, value in gradient.data.items():
        if isinstance(value, Factorized):
            out[f"{name}/a"] = value.activation
            out[f"{name}/g"] = value.pre_activation_grad
        else:
            out[f"{name}/t"] = value
    return out


def assert_gradients_equal(got: Gradient, want: Gradient) -> None:
    assert got.representation == want.representation
    assert got.layer_types == want.layer_types
    assert got.indexing == want.indexing
    t_got, t_want = payload_tensors(got), payload_tensors(want)
    assert t_got.keys() == t_want.keys()
    for key in t_want:
        assert t_got[key].dtype == t_want[key].dtype, key
        assert torch.equal(t_got[key], t_want[key]), key
    for name, value in want.data.items():
        if isinstance(value, Factorized):
            assert got.data[name].module_kwargs == value.module_kwargs
            assert type(got.data[name].module_kwargs) is type(value.module_kwargs)
            assert got.data[name].batch_first == value.batch_first


def assert_records_equal(got: GradientRecord, want: GradientRecord) -> None:
    assert got.step == want.step
    assert got.input_hash == want.input_hash
    assert got.sample_id_key == want.sample_id_key
    assert_gradients_equal(got.gradient, want.gradient)


# ----------------------------------------------------------------- content-addressed dataset

DATASET_SIZE = 12
SEQ_LEN = 4


def dataset_rows() -> torch.Tensor:
    """A fixed token dataset ``(N, T)``."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, 50, (DATASET_SIZE, SEQ_LEN), generator=gen)


def sample_gradient(rows: torch.Tensor) -> Gradient:
    """Per-sample gradient that depends only on each row's content ``(B, T)``."""
    x = rows.to(torch.float32)
    a = torch.stack([torch.sin(x * (k + 1)) for k in range(4)], dim=-1)
    g = torch.stack([torch.cos(x * (k + 2)) for k in range(3)], dim=-1)
    dense = (x.sum(dim=1, keepdim=True) * torch.arange(1, 6)).to(torch.float32)
    return build_gradient(
        {
            "lin": ("factorized", "nn.Linear", "batch_token", Factorized(a, g, {"has_bias": True})),
            "head": ("materialized", "nn.Linear", "batch", dense),
        }
    )


def shuffled_records(order: list[int], batch_size: int) -> list[GradientRecord]:
    """Per-batch records over the dataset in ``order``, identified by ``hash_batch``."""
    rows = dataset_rows()
    records = []
    for step, start in enumerate(range(0, len(order), batch_size)):
        batch = rows[order[start : start + batch_size]]
        ids = hash_batch({"input_ids": batch})
        records.append(GradientRecord(step, ids, sample_gradient(batch)))
    return records


# ----------------------------------------------------------------- crash-test groups

CRASH_BATCH, CRASH_TOKENS = 16, 24


def crash_record(step: int) -> GradientRecord:
    """The deterministic record a crash-test writer saves at ``step`` (a few hundred KiB)."""
    ids = [f"g{step}_{i}" for i in range(CRASH_BATCH)]
    return GradientRecord(step, ids, make_gradient("mixed", step, CRASH_BATCH, CRASH_TOKENS))

"""LoRIFAttributor against explicit inverses built here from torch.func per-sample gradients."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import (
    MLP,
    MLP_LAYERS,
    dense_inverse_scores,
    mlp_data,
    mlp_loss,
    per_sample_rows,
    write_store,
)

import dattri_llm.attribution.algorithm.lorif as lorif
from dattri_llm.attribution.algorithm.lorif import FIT_FILE, LoRIFAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.task import AttributionTask

N_TRAIN, N_TEST = 6, 3


def _args(path, batch: int = 4) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=2,
    )


def truncated_rows(rows: torch.Tensor, out: int, rank: int) -> torch.Tensor:
    """Each row's ``(out, in)`` matrix cut to its top ``rank`` singular triplets."""
    m = rows.reshape(rows.shape[0], out, -1)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return (u[..., :rank] * s[..., None, :rank] @ vh[:, :rank]).reshape(rows.shape[0], -1)


def woodbury_scores(train: dict, test: dict, svd_rank: int) -> torch.Tensor:
    """``Σ_ℓ G [V_r diag(1/(σ²/N+λ)) V_rᵀ + (I − V_r V_rᵀ)/λ] Qᵀ`` from ``torch.linalg.svd``."""
    total = 0
    for name, g in train.items():
        g, q = g.double(), test[name].double()
        n, d = g.shape
        lam = 0.1 * g.square().sum() / (n * d)
        _, s, vh = torch.linalg.svd(g, full_matrices=True)
        v = vh[:svd_rank].T
        sig = torch.zeros(svd_rank, dtype=g.dtype)
        sig[: min(svd_rank, s.numel())] = s[:svd_rank]
        op = (
            v @ torch.diag(1 / (sig**2 / n + lam)) @ v.T
            + (torch.eye(d, dtype=g.dtype) - v @ v.T) / lam
        )
        total = total + g @ op @ q.T
    return total


def _mlp_case(tmp_path, dtype):
    torch.manual_seed(0)
    model = MLP().to(dtype)
    train, test = mlp_data(N_TRAIN, 1, dtype), mlp_data(N_TEST, 2, dtype)
    tr = write_store(tmp_path / "train", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4, 2])
    te = write_store(tmp_path / "test", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3])

    def rows(data):
        samples = [tuple(t[i : i + 1] for t in data) for i in range(data[0].shape[0])]
        return per_sample_rows(model, mlp_loss, samples, MLP_LAYERS)

    return tr, te, rows(train), rows(test)


def _scale_close(got, expected, rtol):
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_rank_equals_explicit_dense_inverse_mlp(tmp_path, dtype):
    tr, te, train_rows, test_rows = _mlp_case(tmp_path, dtype)
    expected = dense_inverse_scores(train_rows, test_rows)
    rtol = 1e-3 if dtype == torch.float32 else 1e-6  # scores are stored float32
    for rank in (None, 5):  # every per-sample matrix has rank <= 5: rank 5 is exact
        score = LoRIFAttributor(_args(tmp_path / f"r{rank}"), rank=rank).attribute_from_cache(
            tr, te
        )
        _scale_close(score.scores, expected, rtol)
    one_layer = LoRIFAttributor(_args(tmp_path / "d"), rank=None, svd_rank=18)  # fc2: D = 3·6
    score = one_layer.attribute_from_cache(tr, te, layer_name="fc2")
    fc2 = dense_inverse_scores({"fc2": train_rows["fc2"]}, {"fc2": test_rows["fc2"]})
    _scale_close(score.scores, fc2, rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_rank_equals_explicit_dense_inverse_gpt2(tmp_path, dtype):
    transformers = pytest.importorskip("transformers")
    from dattri_llm.gradient.hooks.config import HookManagerConfig

    config = transformers.GPT2Config(
        n_layer=2, n_embd=8, n_head=2, vocab_size=31, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(dtype).eval()
    gen = torch.Generator().manual_seed(5)
    train = [{"input_ids": torch.randint(0, 31, (6,), generator=gen)} for _ in range(5)]
    test = [{"input_ids": torch.randint(0, 31, (6,), generator=gen)} for _ in range(2)]

    def loss(m, batch):
        ids = batch["input_ids"]
        return m(input_ids=ids, labels=ids).loss * len(ids)

    layers = ("transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_proj")
    hooks = HookManagerConfig(linear_io=[r"h\.0\.mlp\.c_fc$", r"h\.1\.attn\.c_proj$"])
    attributor = LoRIFAttributor(_args(tmp_path), task=AttributionTask(loss, model), rank=None)
    score = attributor.attribute(train, test, hook_config=hooks)

    def rows(samples):
        batches = [{"input_ids": s["input_ids"][None]} for s in samples]
        return per_sample_rows(model, loss, batches, layers, transpose=layers)

    expected = dense_inverse_scores(rows(train), rows(test))
    _scale_close(score.agnostic_matrix()[1], expected, 2e-3 if dtype == torch.float32 else 1e-6)


@pytest.mark.parametrize("rank", [None, 2])
def test_truncation_equals_explicit_woodbury(tmp_path, rank):
    tr, te, train_rows, test_rows = _mlp_case(tmp_path, torch.float64)
    if rank is not None:
        train_rows = {
            "fc1": truncated_rows(train_rows["fc1"], 5, rank),
            "fc2": truncated_rows(train_rows["fc2"], 3, rank),
        }
    score = LoRIFAttributor(_args(tmp_path / "a"), rank=rank, svd_rank=4).attribute_from_cache(
        tr, te
    )
    _scale_close(score.scores, woodbury_scores(train_rows, test_rows, 4), 1e-6)


def _wide_store(path, n: int, seed: int) -> tuple[GradientStorageManager, torch.Tensor]:
    """Final (projected-like) factors ``(n, 1, 20)``/``(n, 1, 10)``: D = 200 per sample."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 1, 20, generator=gen, dtype=torch.float64)
    g = torch.randn(n, 1, 10, generator=gen, dtype=torch.float64)
    block = Gradient({"w": "factorized"}, {"w": Factorized(a, g, None)}, {"w": "nn.Linear"})
    store = GradientStorageManager(path)
    store.save_bulk([GradientRecord(0, [f"{seed}_{i}" for i in range(n)], block)])
    return store, torch.einsum("btd,btk->bdk", g, a).reshape(n, -1)


def test_randomized_range_finder_matches_woodbury_and_fit_persists(tmp_path):
    tr, train_rows = _wide_store(tmp_path / "train", 8, 0)
    te, test_rows = _wide_store(tmp_path / "test", 3, 1)
    expected = woodbury_scores({"w": train_rows}, {"w": test_rows}, 2)
    attributor = LoRIFAttributor(_args(tmp_path / "a"), rank=None, svd_rank=2)
    fit_dir = attributor.fit(tr, tmp_path / "fit")
    assert (fit_dir / FIT_FILE).is_file()
    reloaded = LoRIFAttributor(_args(tmp_path / "b"), rank=None, svd_rank=2)
    score = reloaded.attribute_from_cache(tr, te, fit_dir=str(fit_dir))
    _scale_close(score.scores, expected, 1e-6)
    fresh = LoRIFAttributor(_args(tmp_path / "c"), rank=None, svd_rank=2).attribute_from_cache(
        tr, te
    )
    _scale_close(fresh.scores, expected, 1e-6)


@pytest.mark.parametrize(("svd_rank", "gram"), [(2, False), (None, True)])
def test_only_gram_layers_accumulate_a_d_by_d_gram(tmp_path, monkeypatch, svd_rank, gram):
    """D = 200 > 8·(2 + 10): svd_rank=2 finds the range (D·(r + 10) memory, no D × D sum)."""
    tr, _ = _wide_store(tmp_path / "train", 8, 0)
    held, first_pass_sums = [], lorif._LayerSweep.first_pass_sums

    def spy(sweep):
        held.append(sweep.gram is not None)
        return first_pass_sums(sweep)

    monkeypatch.setattr(lorif._LayerSweep, "first_pass_sums", spy)
    LoRIFAttributor(_args(tmp_path / "a"), rank=None, svd_rank=svd_rank).fit(tr, tmp_path / "f")
    assert held == [gram]


def test_repeated_call_with_its_saved_fit_gives_the_same_bits(tmp_path):
    tr, _ = _wide_store(tmp_path / "train", 8, 0)
    te, _ = _wide_store(tmp_path / "test", 3, 1)
    attributor = LoRIFAttributor(_args(tmp_path / "a"), rank=None, svd_rank=2)
    fit_dir = str(tmp_path / "fit")
    first = attributor.attribute_from_cache(tr, te, fit_dir=fit_dir)  # fits, writes the fit
    assert (tmp_path / "fit" / FIT_FILE).is_file()
    again = attributor.attribute_from_cache(tr, te, fit_dir=fit_dir)  # reads it back
    assert torch.equal(again.scores, first.scores)


def test_cache_writes_rank_c_train_store_and_token_scores(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)

    def dict_loss(m, batch):
        return ((m(batch["x"]) - batch["y"]) ** 2).sum()

    samples = [{"x": x, "y": y} for x, y in zip(*train)]
    queries = [{"x": x, "y": y} for x, y in zip(*test)]
    task = AttributionTask(dict_loss, model)
    attributor = LoRIFAttributor(_args(tmp_path), task=task, rank=1, svd_rank=3)
    [(train_dir, test_dir)] = attributor.cache(samples, queries)
    assert GradientStorageManager(train_dir).low_rank == 1
    assert GradientStorageManager(test_dir).low_rank is None
    cached = attributor.attribute_from_cache(train_dir, test_dir)
    live = LoRIFAttributor(_args(tmp_path / "live"), task=task, rank=1, svd_rank=3).attribute(
        samples, queries
    )
    torch.testing.assert_close(cached.scores, live.scores, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="token-level LoRIF scores need"):
        attributor.attribute_from_cache(train_dir, test_dir, attribution_granularity="token")
    full = LoRIFAttributor(_args(tmp_path / "tok"), task=task, rank=None, svd_rank=3)
    tokens = full.attribute(samples, queries, attribution_granularity="token")
    instance = full.attribute(samples, queries)
    summed = tokens.scores.reshape(N_TRAIN, -1, N_TEST).sum(1)
    torch.testing.assert_close(summed, instance.scores, rtol=1e-4, atol=1e-5)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRIFAttributor(_args(tmp_path), rank=0)
    tr, te, _, _ = _mlp_case(tmp_path, torch.float64)
    with pytest.raises(ValueError, match=r"svd_rank=19 exceeds layer 'fc2'.*D=18"):
        LoRIFAttributor(_args(tmp_path), svd_rank=19).attribute_from_cache(tr, te, layer_name="fc2")
    low = tmp_path / "low"
    store = GradientStorageManager(low, low_rank=2)
    for location in tr.locations():
        store.save_bulk(tr.load_records(location))
    with pytest.raises(ValueError, match="rank c=2.*rank=3.*cannot be mixed"):
        LoRIFAttributor(_args(tmp_path), rank=3).attribute_from_cache(low, te)


def test_low_rank_store_is_refused_by_kfac(tmp_path):
    from dattri_llm.attribution.algorithm.kronecker import KFACAttributor

    tr, te, _, _ = _mlp_case(tmp_path, torch.float64)
    low = GradientStorageManager(tmp_path / "low", low_rank=2)
    for location in tr.locations():
        low.save_bulk(tr.load_records(location))
    with pytest.raises(ValueError, match="hold low-rank records"):
        KFACAttributor(_args(tmp_path)).attribute_from_cache(low, te)

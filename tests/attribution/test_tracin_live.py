"""Live TracIn (GradientStreamer + HookManager) against references and against the cache path."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, dense_gram, dense_reference

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.task import AttributionTask
from dattri_llm.utils.hashing import hash_batch

pytest.importorskip("transformers")

N_TRAIN, N_TEST = 5, 3


def as_dicts(x, y):
    return [{"x": x[i], "y": y[i]} for i in range(x.shape[0])]


def dict_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def tuple_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum()


def data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 4, generator=gen), torch.randn(n, 3, 3, generator=gen)


def reference_scores(model, train, test, layers=MLP_LAYERS):
    return dense_gram(
        dense_reference(model, layers, tuple_loss, train),
        dense_reference(model, layers, tuple_loss, test),
    )


def check_close(actual, expected, rtol=1e-5):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    train, test = data(N_TRAIN, 1), data(N_TEST, 2)
    args = AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
    )
    return model, train, test, args


def test_live_matches_reference_and_cache(setup, tmp_path):
    model, train, test, args = setup
    task = AttributionTask(dict_loss, model)
    expected = reference_scores(model, train, test)
    live = TracInAttributor(args, task=task).attribute(
        as_dicts(*train), as_dicts(*test), verbose=True
    )
    check_close(live.scores, expected)
    assert live.row_train_ids == hash_batch({"_arg0": train[0]}, N_TRAIN)
    assert live.test_ids == hash_batch({"_arg0": test[0]}, N_TEST)
    assert live.row_steps == [0] * N_TRAIN and sorted(live.layer_name) == list(MLP_LAYERS)
    assert live.algorithm_meta == {
        "n_checkpoints": 1,
        "enable_update": False,
        "query_at": "checkpoint",
        "attribution_granularity": "instance",
        "normalized_grad": False,
    }
    for residency in ("memory", "tiered", "disk"):
        args.output_dir = str(tmp_path / residency)
        cached = TracInAttributor(args, task=task).attribute(
            as_dicts(*train), as_dicts(*test), gradient_cache_residency=residency
        )
        assert torch.equal(cached.scores, live.scores), residency
        assert cached.row_train_ids == live.row_train_ids
    # the disk run left its stores behind: score them again without the model
    root = tmp_path / "disk" / "ckpt_0"
    from_cache = TracInAttributor(args).attribute_from_cache(
        root / "train_grads", root / "test_grads"
    )
    assert torch.equal(from_cache.scores, live.scores)


def test_live_loop_over_test_token_and_cosine(setup):
    model, train, test, args = setup
    attributor = TracInAttributor(args, task=AttributionTask(dict_loss, model))
    base = attributor.attribute(as_dicts(*train), as_dicts(*test))
    looped = attributor.attribute(as_dicts(*train), as_dicts(*test), loop_over_test=True)
    check_close(looped.scores, base.scores)
    token = attributor.attribute(as_dicts(*train), as_dicts(*test), attribution_granularity="token")
    assert token.num_rows == 3 * N_TRAIN
    check_close(token.agnostic_matrix()[1], base.scores)
    cos = attributor.attribute(as_dicts(*train), as_dicts(*test), normalized_grad=True)
    assert cos.algorithm == "GradCos"
    ref_tr = dense_reference(model, MLP_LAYERS, tuple_loss, train)
    ref_te = dense_reference(model, MLP_LAYERS, tuple_loss, test)
    tr = torch.cat([ref_tr[n] for n in MLP_LAYERS], 1)
    te = torch.cat([ref_te[n] for n in MLP_LAYERS], 1)
    check_close(cos.scores, tr @ te.T / (torch.outer(tr.norm(dim=1), te.norm(dim=1)) + 1e-8))


def test_checkpoint_ensemble_sums_unit_weights(setup, tmp_path):
    model, train, test, args = setup
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    sd1 = {k: v + 0.05 * torch.randn_like(v) for k, v in sd0.items()}
    task = AttributionTask(dict_loss, model, checkpoints=[sd0, sd1])
    score = TracInAttributor(args, task=task).attribute(as_dicts(*train), as_dicts(*test))
    assert score.row_steps == [0] * N_TRAIN + [1] * N_TRAIN
    assert score.algorithm_meta["n_checkpoints"] == 2
    expected = []
    for sd in (sd0, sd1):
        ref_model = MLP()
        ref_model.load_state_dict(sd)
        expected.append(reference_scores(ref_model, train, test))
    check_close(score.agnostic_matrix()[1], expected[0] + expected[1])
    steps, per_step = score.trajectory_aware(score.train_ids[2])
    assert steps == [0, 1]
    check_close(per_step, torch.stack([expected[0][2], expected[1][2]]))
    args.output_dir = str(tmp_path / "mem")
    cached = TracInAttributor(args, task=task).attribute(
        as_dicts(*train), as_dicts(*test), gradient_cache_residency="memory"
    )
    assert torch.equal(cached.scores, score.scores) and cached.row_steps == score.row_steps


def test_trajectory_live_equals_disk(setup, tmp_path):
    model, train, test, args = setup
    args.optim, args.learning_rate = "sgd", 0.05
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    task = AttributionTask(dict_loss, model, checkpoints=[sd0])
    attributor = TracInAttributor(args, task=task)
    live = attributor.attribute(as_dicts(*train), as_dicts(*test), enable_update=True)
    assert live.algorithm_meta["query_at"] == "theta_0"
    assert sorted(live.row_steps) == [0, 0, 1, 1, 2]
    assert not torch.equal(model.fc1.weight, sd0["fc1.weight"])  # the model trained
    args.output_dir = str(tmp_path / "disk")
    disk = attributor.attribute(
        as_dicts(*train), as_dicts(*test), enable_update=True, gradient_cache_residency="disk"
    )
    assert disk.row_train_ids == live.row_train_ids and disk.row_steps == live.row_steps
    check_close(disk.scores, live.scores)
    # step-0 rows are gradients at θ_0 against queries at θ_0
    ref_model = MLP()
    ref_model.load_state_dict(sd0)
    expected = reference_scores(ref_model, train, test)
    ids = hash_batch({"_arg0": train[0]}, N_TRAIN)
    for row in (r for r, s in enumerate(live.row_steps) if s == 0):
        check_close(live.scores[row], expected[ids.index(live.row_train_ids[row])])
    theta_t = attributor.attribute(
        as_dicts(*train), as_dicts(*test), enable_update=True, loop_over_test=True
    )
    assert theta_t.algorithm_meta["query_at"] == "theta_t"
    with pytest.raises(ValueError, match="live"):
        attributor.attribute(
            as_dicts(*train),
            as_dicts(*test),
            enable_update=True,
            loop_over_test=True,
            gradient_cache_residency="memory",
        )


def test_trajectory_uses_first_checkpoint_only(setup):
    model, train, test, args = setup
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    task = AttributionTask(dict_loss, model, checkpoints=[sd, sd])
    with pytest.warns(UserWarning, match="first checkpoint"):
        score = TracInAttributor(args, task=task).attribute(
            as_dicts(*train), as_dicts(*test), enable_update=True
        )
    assert score.algorithm_meta["n_checkpoints"] == 1


def test_gpt2_conv1d_layernorm_matches_reference(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=97,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(5)
    train_ids = torch.randint(0, 97, (4, 9), generator=gen)
    test_ids = torch.randint(0, 97, (2, 9), generator=gen)

    def loss(m, batch):
        ids = batch["input_ids"]
        return m(input_ids=ids, labels=ids).loss * len(ids)

    layers = ("transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "transformer.ln_f")
    from dattri_llm.gradient.hooks.config import HookManagerConfig

    hook_config = HookManagerConfig(linear_io=[r"h\.0\.attn\.c_attn$", r"h\.1\.mlp\.c_fc$", "ln_f"])
    args = AttributionArguments(output_dir=str(tmp_path), use_cpu=True)
    score = TracInAttributor(args, task=AttributionTask(loss, model)).attribute(
        [{"input_ids": r} for r in train_ids],
        [{"input_ids": r} for r in test_ids],
        hook_config=hook_config,
    )
    assert sorted(score.layer_name) == sorted(layers)
    ref_loss = lambda m, b: loss(m, {"input_ids": b[0]})  # noqa: E731
    transpose = layers[:2]
    expected = dense_gram(
        dense_reference(model, layers, ref_loss, (train_ids,), transpose),
        dense_reference(model, layers, ref_loss, (test_ids,), transpose),
    )
    check_close(score.scores, expected, rtol=1e-4)


# ------------------------------------------------------------------------------- errors
def test_live_errors(setup):
    model, train, test, args = setup
    attributor = TracInAttributor(args, task=AttributionTask(dict_loss, model))
    with pytest.raises(ValueError, match="training dataset is empty"):
        attributor.attribute([], as_dicts(*test))
    with pytest.raises(ValueError, match="test dataset is empty"):
        attributor.attribute(as_dicts(*train), [])
    with pytest.raises(KeyError, match="'y'"):
        attributor.attribute([{"x": train[0][i]} for i in range(2)], as_dicts(*test))
    nonscalar = TracInAttributor(
        args, task=AttributionTask(lambda m, b: (m(b["x"]) - b["y"]) ** 2, model)
    )
    with pytest.raises(ValueError, match="batch 0"):
        nonscalar.attribute(as_dicts(*train), as_dicts(*test))
    nonfinite = TracInAttributor(
        args, task=AttributionTask(lambda m, b: dict_loss(m, b) * float("inf"), model)
    )
    with pytest.raises(ValueError, match="non-finite"):
        nonfinite.attribute(as_dicts(*train), as_dicts(*test))
    default = TracInAttributor(args, task=AttributionTask(None, model))
    with pytest.raises(TypeError):  # MLP.forward takes no 'y' keyword
        default.attribute(as_dicts(*train), as_dicts(*test))
    with pytest.raises(ValueError, match="needs a task"):
        TracInAttributor(args).attribute(as_dicts(*train), as_dicts(*test))
    with pytest.raises(ValueError, match="gradient_cache_residency"):
        attributor.attribute(as_dicts(*train), as_dicts(*test), gradient_cache_residency="gpu")
    with pytest.raises(ValueError, match="attribution_granularity"):
        attributor.attribute(as_dicts(*train), as_dicts(*test), attribution_granularity="x")


def test_cache_writes_per_checkpoint_stores(setup, tmp_path):
    model, train, test, args = setup
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    attributor = TracInAttributor(args, task=AttributionTask(dict_loss, model, [sd, None]))
    pairs = attributor.cache(as_dicts(*train), as_dicts(*test), cache_dir=str(tmp_path / "c"))
    assert pairs == [
        (
            str(tmp_path / "c" / f"ckpt_{k}" / "train_grads"),
            str(tmp_path / "c" / f"ckpt_{k}" / "test_grads"),
        )
        for k in (0, 1)
    ]
    score = attributor.attribute_from_cache(*pairs[1])
    assert score.row_steps == [1] * N_TRAIN
    check_close(score.scores, reference_scores(model, train, test))
    with pytest.raises(ValueError, match="already holds records"):
        attributor.cache(as_dicts(*train), as_dicts(*test), cache_dir=str(tmp_path / "c"))

"""Grad-Dot / Grad-Cos / TracIn from gradient stores against torch reference gradients."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import (
    MLP,
    MLP_LAYERS,
    append_store,
    capture_factors,
    dense_gram,
    dense_reference,
    mlp_data,
    mlp_loss,
    sample_ids,
    write_store,
)

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.ops.dot import layerwise_cross_dot
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.gradient.streaming import DiskGradientSource

N_TRAIN, N_TEST = 7, 3


def make_args(tmp_path, **kwargs) -> AttributionArguments:
    kwargs.setdefault("per_device_train_batch_size", 3)
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kwargs)


@pytest.fixture(scope="module")
def mlp_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlp")
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    write_store(root / "train", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[3, 2, 2])
    write_store(root / "test", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[2, 1])
    ref_train = dense_reference(model, MLP_LAYERS, mlp_loss, train)
    ref_test = dense_reference(model, MLP_LAYERS, mlp_loss, test)
    return {
        "root": root,
        "model": model,
        "train": train,
        "test": test,
        "ref_train": ref_train,
        "ref_test": ref_test,
        "train_ids": sample_ids(train[0]),
        "test_ids": sample_ids(test[0]),
    }


def check_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=rtol * scale)


def test_grad_dot_matches_reference(mlp_setup, tmp_path):
    s = mlp_setup
    score = TracInAttributor(make_args(tmp_path)).attribute_from_cache(
        s["root"] / "train", s["root"] / "test"
    )
    assert score.algorithm == "TracIn" and score.scores.dtype == torch.float32
    assert score.row_train_ids == s["train_ids"] and score.test_ids == s["test_ids"]
    assert score.row_steps == [0] * N_TRAIN and score.granularity == "instance"
    check_close(score.scores, dense_gram(s["ref_train"], s["ref_test"]))
    assert sorted(score.layer_name) == list(MLP_LAYERS)
    meta = score.algorithm_meta
    assert meta["normalized_grad"] is False and meta["selected_training_steps"] is None
    assert meta["sample_id_key"] == {"train": None, "test": None}
    loaded = AttributionScore.load(tmp_path / "out")
    assert torch.equal(loaded.scores, score.scores)


def test_grad_cos_matches_reference(mlp_setup, tmp_path):
    s = mlp_setup
    attributor = TracInAttributor(make_args(tmp_path))
    score = attributor.attribute_from_cache(
        str(s["root"] / "train"), str(s["root"] / "test"), normalized_grad=True
    )
    tr = torch.cat([s["ref_train"][n] for n in MLP_LAYERS], dim=1)
    te = torch.cat([s["ref_test"][n] for n in MLP_LAYERS], dim=1)
    expected = (tr @ te.T) / (torch.outer(tr.norm(dim=1), te.norm(dim=1)) + 1e-8)
    check_close(score.scores, expected)
    assert score.algorithm == "GradCos" and attributor.algorithm == "GradCos"
    assert score.algorithm_meta["normalized_grad"] is True
    # the next plain call switches back
    assert attributor.attribute_from_cache(s["root"] / "train", s["root"] / "test").algorithm == (
        "TracIn"
    )


class PinnedRoute(TracInAttributor):
    route = "auto"

    def inner_product(self, train_rep, test_rep, *, dense_cache=None):
        return layerwise_cross_dot(train_rep, test_rep, mode=self.route)


@pytest.mark.parametrize("route", ["factorized", "materialized", "auto"])
def test_all_routes_identical(mlp_setup, tmp_path, route):
    s = mlp_setup
    attributor = PinnedRoute(make_args(tmp_path))
    attributor.route = route
    score = attributor.attribute_from_cache(s["root"] / "train", s["root"] / "test")
    check_close(score.scores, dense_gram(s["ref_train"], s["ref_test"]))


@pytest.mark.parametrize("batch_size", [1, 2, 8])
@pytest.mark.parametrize("loop_over_test", [False, True])
def test_independent_of_batch_size_and_loop(mlp_setup, tmp_path, batch_size, loop_over_test):
    s = mlp_setup
    model, train = s["model"], s["train"]
    dense_store = write_store(
        tmp_path / f"dense_{batch_size}",
        model,
        MLP_LAYERS,
        mlp_loss,
        train,
        batch_sizes=[3, 2, 2],
        materialize=True,
    )
    args = make_args(tmp_path, per_device_train_batch_size=batch_size)
    expected = dense_gram(s["ref_train"], s["ref_test"])
    for train_source in (s["root"] / "train", dense_store):
        score = TracInAttributor(args).attribute_from_cache(
            train_source, s["root"] / "test", loop_over_test=loop_over_test
        )
        check_close(score.scores, expected)
        assert score.row_train_ids == s["train_ids"]


def test_shuffled_store_permutes_rows(mlp_setup, tmp_path):
    s = mlp_setup
    order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(3))
    write_store(
        tmp_path / "shuffled",
        s["model"],
        MLP_LAYERS,
        mlp_loss,
        s["train"],
        batch_sizes=[4, 3],
        order=order,
    )
    score = TracInAttributor(make_args(tmp_path)).attribute_from_cache(
        tmp_path / "shuffled", s["root"] / "test"
    )
    assert score.row_train_ids == [s["train_ids"][i] for i in order.tolist()]
    expected = dense_gram(s["ref_train"], s["ref_test"])
    check_close(score.scores, expected[order])
    for i in (0, 4, 6):
        h = s["train_ids"][i]
        check_close(score.query([h]), expected[i : i + 1])
        check_close(score.query([h], [s["test_ids"][2]]), expected[i : i + 1, 2:3])


def test_fp64_tight(tmp_path):
    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(5, 1, torch.float64), mlp_data(2, 2, torch.float64)
    write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[3, 2])
    write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[2])
    score = TracInAttributor(make_args(tmp_path)).attribute_from_cache(
        tmp_path / "tr", tmp_path / "te"
    )
    expected = dense_gram(
        dense_reference(model, MLP_LAYERS, mlp_loss, train),
        dense_reference(model, MLP_LAYERS, mlp_loss, test),
    )
    # scores are stored float32: the float64 computation is exact up to that cast
    torch.testing.assert_close(score.scores, expected.float(), rtol=1e-6, atol=0)


def test_bf16_loose(tmp_path):
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    train, test = mlp_data(4, 1, torch.bfloat16), mlp_data(2, 2, torch.bfloat16)
    write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4])
    write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[2])
    score = TracInAttributor(make_args(tmp_path)).attribute_from_cache(
        tmp_path / "tr", tmp_path / "te"
    )
    model32 = MLP()
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    cast = lambda d: tuple(t.float() for t in d)  # noqa: E731
    expected = dense_gram(
        dense_reference(model32, MLP_LAYERS, mlp_loss, cast(train)),
        dense_reference(model32, MLP_LAYERS, mlp_loss, cast(test)),
    )
    scale = expected.abs().max().item()
    torch.testing.assert_close(score.scores, expected, rtol=5e-2, atol=5e-2 * scale)


def test_two_checkpoint_ensemble_and_selected_steps(mlp_setup, tmp_path):
    """Rows at two steps, each scored against the test gradients of its checkpoint."""
    s = mlp_setup
    model0 = s["model"]
    model1 = MLP()
    model1.load_state_dict({k: v + 0.1 for k, v in model0.state_dict().items()})
    train, test = s["train"], s["test"]
    args = make_args(tmp_path)
    pairs, expected = [], []
    for k, model in enumerate((model0, model1)):
        tr = write_store(
            tmp_path / f"ckpt_{k}" / "train",
            model,
            MLP_LAYERS,
            mlp_loss,
            train,
            batch_sizes=[7],
            step=k,
        )
        te = write_store(
            tmp_path / f"ckpt_{k}" / "test",
            model,
            MLP_LAYERS,
            mlp_loss,
            test,
            batch_sizes=[3],
            step=k,
        )
        pairs.append((tr, te))
        expected.append(
            dense_gram(
                dense_reference(model, MLP_LAYERS, mlp_loss, train),
                dense_reference(model, MLP_LAYERS, mlp_loss, test),
            )
        )
    single = [TracInAttributor(args).attribute_from_cache(tr, te) for tr, te in pairs]
    for k in range(2):
        assert single[k].row_steps == [k] * N_TRAIN
        check_close(single[k].scores, expected[k])
    # the ensemble sums checkpoint rows with unit weights
    combined = AttributionScore(
        torch.cat([single[0].scores, single[1].scores]),
        single[0].row_train_ids + single[1].row_train_ids,
        single[0].row_steps + single[1].row_steps,
        single[0].test_ids,
        "TracIn",
        {},
        None,
    )
    ids, agnostic = combined.agnostic_matrix()
    check_close(agnostic, expected[0] + expected[1])
    # both steps in one train store: selected_training_steps filters rows
    both = GradientStorageManager(str(tmp_path / "both"))
    for k, model in enumerate((model0, model1)):
        append_store(both, model, MLP_LAYERS, mlp_loss, train, batch_sizes=[7], step=k)
    only1 = TracInAttributor(args).attribute_from_cache(
        both, pairs[1][1], selected_training_steps=[1, 5]
    )
    assert only1.row_steps == [1] * N_TRAIN
    check_close(only1.scores, expected[1])
    assert only1.algorithm_meta["selected_training_steps"] == [1, 5]
    all_rows = TracInAttributor(args).attribute_from_cache(both, pairs[1][1])
    assert all_rows.row_steps == [0] * N_TRAIN + [1] * N_TRAIN


def test_layer_name_filter(mlp_setup, tmp_path):
    s = mlp_setup
    score = TracInAttributor(make_args(tmp_path)).attribute_from_cache(
        s["root"] / "train", s["root"] / "test", layer_name="fc2"
    )
    check_close(score.scores, dense_gram(s["ref_train"], s["ref_test"], ["fc2"]))
    assert score.layer_name == ["fc2"]


def test_sources_any_residency_and_disk_source(mlp_setup, tmp_path):
    s = mlp_setup
    args = make_args(tmp_path)
    mem = write_store(
        tmp_path / "mem",
        s["model"],
        MLP_LAYERS,
        mlp_loss,
        s["train"],
        batch_sizes=[7],
        residency="memory",
    )
    test_source = DiskGradientSource(GradientStorageManager(str(s["root"] / "test")), args)
    score = TracInAttributor(args).attribute_from_cache(mem, test_source)
    check_close(score.scores, dense_gram(s["ref_train"], s["ref_test"]))


def test_token_level_rows_sum_to_instance(mlp_setup, tmp_path):
    s = mlp_setup
    args = make_args(tmp_path)
    for normalized in (False, True):
        attributor = TracInAttributor(args)
        inst = attributor.attribute_from_cache(
            s["root"] / "train", s["root"] / "test", normalized_grad=normalized
        )
        tok = attributor.attribute_from_cache(
            s["root"] / "train",
            s["root"] / "test",
            attribution_granularity="token",
            normalized_grad=normalized,
        )
        assert tok.granularity == "token" and tok.num_rows == N_TRAIN * 3
        assert tok.row_token_ids == [0, 1, 2] * N_TRAIN
        assert tok.algorithm_meta["attribution_granularity"] == "token"
        ids, summed = tok.agnostic_matrix()
        check_close(summed, inst.scores)
        positions, per = tok.token_scores(s["train_ids"][1])
        assert positions == [0, 1, 2]
        check_close(per.sum(0), inst.scores[1])
    # one token contribution by hand: fc2 layer, s_t = g_t^T R a_t with R the test gradient
    train_block = capture_factors(s["model"], ("fc2",), mlp_loss, tuple(t[:1] for t in s["train"]))
    f = train_block.data["fc2"]
    r = s["ref_test"]["fc2"][0].reshape(3, 6)
    a = torch.cat([f.activation[0], torch.ones(3, 1)], dim=1)
    manual = torch.einsum("to,oi,ti->t", f.pre_activation_grad[0], r, a)
    only_fc2 = TracInAttributor(args).attribute_from_cache(
        s["root"] / "train",
        s["root"] / "test",
        layer_name="fc2",
        attribution_granularity="token",
    )
    check_close(only_fc2.token_scores(s["train_ids"][0])[1][:, 0], manual)


# ------------------------------------------------------------------------------- errors
def test_missing_and_empty_cache(mlp_setup, tmp_path):
    s = mlp_setup
    attributor = TracInAttributor(make_args(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        attributor.attribute_from_cache(tmp_path / "nope", s["root"] / "test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no records"):
        attributor.attribute_from_cache(s["root"] / "train", tmp_path / "empty")
    with pytest.raises(TypeError, match="gradient store"):
        attributor.attribute_from_cache(42, s["root"] / "test")


def test_option_errors(mlp_setup, tmp_path):
    s = mlp_setup
    attributor = TracInAttributor(make_args(tmp_path))
    with pytest.raises(ValueError, match="attribution_granularity"):
        attributor.attribute_from_cache(
            s["root"] / "train", s["root"] / "test", attribution_granularity="word"
        )
    with pytest.raises(ValueError):
        attributor.attribute_from_cache(
            s["root"] / "train", s["root"] / "test", selected_training_steps=[9]
        )
    with pytest.raises(TypeError):
        attributor.attribute_from_cache(s["root"] / "train", s["root"] / "test", damping=1.0)


class OneShot:
    """A non-reusable source wrapper."""

    reusable = False

    def __init__(self, source):
        self.source = source

    def __iter__(self):
        return iter(self.source)

    def __len__(self):
        return len(self.source)


def test_loop_over_test_needs_reusable_source(mlp_setup, tmp_path):
    s = mlp_setup
    args = make_args(tmp_path)
    attributor = TracInAttributor(args)
    train = attributor.load_train_rep(s["root"] / "train")
    test = OneShot(attributor.load_test_rep(s["root"] / "test"))
    with pytest.raises(ValueError, match="reusable"):
        attributor.score_sources(train, test, loop_over_test=True)
    scores, *_ = attributor.score_sources(train, test)
    check_close(scores, dense_gram(s["ref_train"], s["ref_test"]))


def _single_layer_store(path, width: int, dtype=torch.float32, name="fc1"):
    store = GradientStorageManager(str(path))
    x = torch.randn(2, width, dtype=dtype)
    grad = Gradient({name: "materialized"}, {name: x}, {name: "nn.Linear"})
    store.save_bulk([GradientRecord(0, sample_ids(x), grad)])
    return store


def test_mismatched_caches(tmp_path):
    attributor = TracInAttributor(make_args(tmp_path))
    train = _single_layer_store(tmp_path / "a", 6)
    with pytest.raises(ValueError, match=r"layer 'fc1'.*\(6,\).*\(8,\)"):
        attributor.attribute_from_cache(train, _single_layer_store(tmp_path / "b", 8))
    with pytest.raises(ValueError, match=r"layer 'fc1'.*float64"):
        attributor.attribute_from_cache(
            train, _single_layer_store(tmp_path / "c", 6, torch.float64)
        )
    with pytest.raises(ValueError, match="share no layer"):
        attributor.attribute_from_cache(train, _single_layer_store(tmp_path / "d", 6, name="x"))


def test_mismatched_factor_widths(mlp_setup, tmp_path):
    s = mlp_setup
    other = MLP()
    other.fc1 = torch.nn.Linear(4, 5, bias=False)
    other.fc2 = torch.nn.Linear(5, 2)
    x, _ = s["test"]
    write_store(
        tmp_path / "other",
        other,
        MLP_LAYERS,
        mlp_loss,
        (x, torch.randn(3, 3, 2)),
        batch_sizes=[3],
    )
    with pytest.raises(ValueError, match=r"layer 'fc2'.*\(5, 3\).*\(5, 2\)"):
        TracInAttributor(make_args(tmp_path)).attribute_from_cache(
            s["root"] / "train", tmp_path / "other", layer_name="fc2"
        )


def test_partial_layer_overlap_warns(mlp_setup, tmp_path):
    s = mlp_setup
    write_store(tmp_path / "fc2only", s["model"], ("fc2",), mlp_loss, s["test"], batch_sizes=[3])
    with pytest.warns(UserWarning, match="fc1"):
        score = TracInAttributor(make_args(tmp_path)).attribute_from_cache(
            s["root"] / "train", tmp_path / "fc2only"
        )
    check_close(score.scores, dense_gram(s["ref_train"], s["ref_test"], ["fc2"]))
    assert score.layer_name == ["fc2"]


def test_hook_manager_offload_store_matches_reference(mlp_setup, tmp_path):
    """The examples.md pattern: capture with HookManager + OffloadCallback, score from disk."""
    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.utils.hashing import hash_sample

    s = mlp_setup
    model = s["model"]
    for name, (x, y), sizes in (("tr", s["train"], [4, 3]), ("te", s["test"], [3])):
        store = GradientStorageManager(str(tmp_path / name))
        offload = OffloadCallback(
            offload_interval=4, file_manager=store, recording_type="per_sample"
        )
        manager = HookManager(
            model, config=HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[offload]
        )
        with manager.collect(deregister_on_exit=True):
            start = 0
            for size in sizes:
                model.zero_grad()
                mlp_loss(model, (x[start : start + size], y[start : start + size])).backward()
                start += size
    score = TracInAttributor(make_args(tmp_path)).attribute_from_cache(
        tmp_path / "tr", tmp_path / "te"
    )
    expected = dense_gram(s["ref_train"], s["ref_test"])
    check_close(score.scores, expected)
    h = hash_sample({"_arg0": s["train"][0][5]})
    check_close(score.query([h]), expected[5:6])


def test_tiny_gpt2_store_all_routes(tmp_path):
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
    train = (torch.randint(0, 97, (4, 7), generator=gen),)
    test = (torch.randint(0, 97, (2, 7), generator=gen),)

    def loss(m, batch):
        ids = batch[0]
        return m(input_ids=ids, labels=ids).loss * len(ids)

    layers = ("transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_attn", "transformer.h.0.ln_1")
    write_store(tmp_path / "tr", model, layers, loss, train, batch_sizes=[3, 1])
    write_store(tmp_path / "te", model, layers, loss, test, batch_sizes=[2])
    expected = dense_gram(
        dense_reference(model, layers, loss, train, layers[:2]),
        dense_reference(model, layers, loss, test, layers[:2]),
    )
    args = make_args(tmp_path)
    for route in ("factorized", "materialized", "auto"):
        attributor = PinnedRoute(args)
        attributor.route = route
        score = attributor.attribute_from_cache(tmp_path / "tr", tmp_path / "te")
        check_close(score.scores, expected, rtol=1e-4)
    token = TracInAttributor(args).attribute_from_cache(
        tmp_path / "tr", tmp_path / "te", attribution_granularity="token"
    )
    check_close(token.agnostic_matrix()[1], expected, rtol=1e-4)


def test_cache_representations_and_utils(mlp_setup, tmp_path):
    from dattri_llm.attribution.utils import (
        collect_gradients,
        normalize_layer_names,
        read_lr_schedule,
        write_lr_schedule,
    )

    s = mlp_setup
    attributor = TracInAttributor(make_args(tmp_path))
    dense = GradientStorageManager(str(tmp_path / "dense_test"))
    attributor.cache_representations(attributor.load_test_rep(s["root"] / "test"), dense)
    assert all(
        rec.gradient.representation == {"fc1": "materialized", "fc2": "materialized"}
        for loc in dense.locations()
        for rec in dense.load_records(loc)
    )
    score = attributor.attribute_from_cache(s["root"] / "train", dense)
    check_close(score.scores, dense_gram(s["ref_train"], s["ref_test"]))
    assert attributor.resolve_store(dense) is dense
    source = attributor.load_test_rep(dense)
    assert attributor.resolve_store(source) is dense
    assert TracInAttributor.stores_meta(dense, dense) == {
        "sample_id_key": {"train": None, "test": None}
    }
    assert write_lr_schedule(tmp_path / "lr", {2: 0.5, 0: 1.0}).name == "lr_schedule.json"
    assert read_lr_schedule(tmp_path / "lr") == {0: 1.0, 2: 0.5}
    assert read_lr_schedule(tmp_path / "nothing") is None
    assert normalize_layer_names(None) is None and normalize_layer_names("a") == ["a"]
    assert normalize_layer_names(("a", "b")) == ["a", "b"]
    with pytest.raises(ValueError, match="empty"):
        normalize_layer_names([])
    with pytest.raises(ValueError, match="offload_interval"):
        collect_gradients(object(), dense, offload_interval=0)


# ------------------------------------------------------------------ projection records


def _logra(seed: int, proj_dim: int = 4) -> dict:
    return {"__default__": {"style": "logra", "proj_dim": proj_dim, "proj_seed": seed}}


def _capture_store(path, model, data, projection_kwargs, *, capture_style="factorized"):
    """Capture ``data`` (batches of 2) with HookManager + OffloadCallback into a disk store."""
    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager

    store = GradientStorageManager(str(path))
    config = HookManagerConfig(
        linear_io=REGISTER_ALL, projection_kwargs=projection_kwargs, capture_style=capture_style
    )
    offload = OffloadCallback(offload_interval=2, file_manager=store)
    manager = HookManager(model, config=config, callbacks=[offload])
    x, y = data
    with manager.collect(deregister_on_exit=True):
        for start in range(0, x.shape[0], 2):
            model.zero_grad()
            mlp_loss(model, (x[start : start + 2], y[start : start + 2])).backward()
    return store


def _logra_reference(ref: dict, model, seed: int, proj_dim: int = 4) -> dict:
    """Per-sample ``P_gᵀ dW P_a`` (``P_g`` seeded ``seed``, ``P_a`` ``seed + 1`` on ``[a, 1]``)."""
    from dattri_llm.gradient.ops.projection import DattriProjector

    projector = DattriProjector()
    out = {}
    for name in MLP_LAYERS:
        layer = getattr(model, name)
        d_out, d_in = layer.out_features, layer.in_features + 1
        kw = {"proj_dim": proj_dim, "device": "cpu", "dtype": torch.float64}
        p_g = projector.matrix(d_out, proj_seed=seed, **kw)
        p_a = projector.matrix(d_in, proj_seed=seed + 1, **kw)
        dw = ref[name].double().reshape(-1, d_out, d_in)
        out[name] = (p_g.T @ dw @ p_a).reshape(dw.shape[0], -1)
    return out


def test_projection_seed_mismatch_is_refused(mlp_setup, tmp_path):
    from dattri_llm.utils.hashing import hash_batch

    s = mlp_setup
    model = s["model"]
    _capture_store(tmp_path / "tr0", model, s["train"], _logra(0))
    _capture_store(tmp_path / "te0", model, s["test"], _logra(0))
    _capture_store(tmp_path / "te1", model, s["test"], _logra(1))
    attributor = TracInAttributor(make_args(tmp_path))
    # equal widths (4 x 4 final factors on both sides): only the record tells them apart
    with pytest.raises(ValueError, match=r"layer 'fc1'.*proj_seed=0.*proj_seed=1.*proj_seed"):
        attributor.attribute_from_cache(tmp_path / "tr0", tmp_path / "te1")
    score = attributor.attribute_from_cache(tmp_path / "tr0", tmp_path / "te0")
    expected = dense_gram(
        _logra_reference(s["ref_train"], model, 0), _logra_reference(s["ref_test"], model, 0)
    )
    check_close(score.scores, expected.float())
    assert score.row_train_ids == hash_batch({"_arg0": s["train"][0]}, N_TRAIN)


def test_projection_style_mismatch_is_refused(mlp_setup, tmp_path):
    s = mlp_setup
    model = s["model"]
    dense = {"__default__": {"style": "dense", "proj_dim": 4}}
    mask = {"__default__": {"style": "mask", "proj_dim": 4}}
    _capture_store(tmp_path / "dense", model, s["train"], dense)
    _capture_store(tmp_path / "mask", model, s["test"], mask)
    attributor = TracInAttributor(make_args(tmp_path))
    with pytest.raises(ValueError, match=r"layer 'fc1'.*style='dense'.*style='mask'"):
        attributor.attribute_from_cache(tmp_path / "dense", tmp_path / "mask")


def test_projected_against_unprojected_is_refused(mlp_setup, tmp_path):
    s = mlp_setup
    model = s["model"]
    mask = {"__default__": {"style": "mask", "proj_dim": 4}}
    _capture_store(tmp_path / "mask", model, s["test"], mask)
    _capture_store(tmp_path / "dense", model, s["train"], None, capture_style="materialized")
    _capture_store(tmp_path / "raw", model, s["train"], None)
    attributor = TracInAttributor(make_args(tmp_path))
    # both sides dense: the width check names the layer and both widths
    with pytest.raises(ValueError, match=r"layer 'fc1'.*\(25,\).*\(4,\)"):
        attributor.attribute_from_cache(tmp_path / "dense", tmp_path / "mask")
    # raw factors against a dense mask: the projection record names both settings
    with pytest.raises(ValueError, match=r"layer 'fc1'.*\(unprojected\).*style='mask'"):
        attributor.attribute_from_cache(tmp_path / "raw", tmp_path / "mask")


def test_virtual_and_per_layer_projection_entries(tmp_path):
    from dattri_llm.attribution.checks import check_layer_compatibility
    from dattri_llm.gradient.storage_manager import projection_record

    x = torch.randn(2, 4)
    grad = Gradient(
        {"fc1": "materialized", "fc1@2": "materialized"},
        {"fc1": x, "fc1@2": x},
        {"fc1": "nn.Linear", "fc1@2": "nn.Linear"},
    )
    per_layer = projection_record({"fc1": _logra(0)["__default__"], "__default__": {"proj_dim": 9}})
    default = projection_record(_logra(0))
    check_layer_compatibility(
        grad, grad, ["fc1", "fc1@2"], train_projection=per_layer, test_projection=default
    )
    with pytest.raises(ValueError, match=r"layer 'fc1@2'.*proj_seed=1.*proj_seed=0"):
        check_layer_compatibility(
            grad,
            grad,
            ["fc1@2"],
            train_projection=projection_record(_logra(1)),
            test_projection=default,
        )
    # an undeclared side (None) is not checked
    check_layer_compatibility(grad, grad, ["fc1"], train_projection=None, test_projection=default)


def test_collected_caches_record_their_projection(mlp_setup, tmp_path):
    from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
    from dattri_llm.gradient.storage_manager import projection_record
    from dattri_llm.task import AttributionTask

    s = mlp_setup
    task = AttributionTask(mlp_loss, s["model"])
    train_ds = [(s["train"][0][i], s["train"][1][i]) for i in range(N_TRAIN)]
    test_ds = [(s["test"][0][i], s["test"][1][i]) for i in range(N_TEST)]
    dirs = {}
    for seed in (0, 1):
        config = HookManagerConfig(linear_io=REGISTER_ALL, projection_kwargs=_logra(seed))
        attributor = TracInAttributor(make_args(tmp_path), task=task)
        [dirs[seed]] = attributor.cache(
            train_ds, test_ds, cache_dir=str(tmp_path / f"c{seed}"), hook_config=config
        )
        for path in dirs[seed]:
            assert GradientStorageManager(path).projection == projection_record(_logra(seed))
    attributor = TracInAttributor(make_args(tmp_path))
    with pytest.raises(ValueError, match=r"layer 'fc1'.*proj_seed=0.*proj_seed=1"):
        attributor.attribute_from_cache(dirs[0][0], dirs[1][1])
    score = attributor.attribute_from_cache(*dirs[1])
    expected = dense_gram(
        _logra_reference(s["ref_train"], s["model"], 1),
        _logra_reference(s["ref_test"], s["model"], 1),
    )
    check_close(score.agnostic_matrix()[1], expected.float())


def test_offload_callback_refuses_a_store_of_another_projection(mlp_setup, tmp_path):
    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager

    def projector(feature, feature_batch_size, proj_dim, **kwargs):
        raise AssertionError("never called: nothing is captured")

    s = mlp_setup
    store = _capture_store(tmp_path / "s", s["model"], s["test"], _logra(0))
    offload = OffloadCallback(
        offload_interval=1, file_manager=GradientStorageManager(store.save_dir)
    )
    for config in (
        HookManagerConfig(linear_io=REGISTER_ALL, projection_kwargs=_logra(1)),
        HookManagerConfig(linear_io=REGISTER_ALL),
        HookManagerConfig(linear_io=REGISTER_ALL, projection_kwargs=_logra(0), projector=projector),
    ):
        with pytest.raises(ValueError, match=r"captured with projection .*proj_seed.*0"):
            HookManager(s["model"], config=config, callbacks=[offload])
    same = HookManagerConfig(linear_io=REGISTER_ALL, projection_kwargs=_logra(0))
    HookManager(s["model"], config=same, callbacks=[offload]).remove()

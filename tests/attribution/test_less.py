"""LESS against an independent dense implementation (torch.func gradients, Adam by hand).

The stores are written by the test: per-sample gradients of a tiny MLP over a
short AdamW trajectory, mapped through the Adam update rule written here, saved
as dense records; queries are raw factorized captures. The reference score of
row (sample i, step t) and query j is ``lr_t · cos(Γ_i^t, q_j)`` over the
concatenated layers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, capture_factors, mlp_data, mlp_loss, sample_ids
from reference import call, per_sample_loop_grads, per_sample_param_grads

from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.utils import LR_SCHEDULE_FILE, read_lr_schedule, write_lr_schedule
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.task import AttributionTask
from dattri_llm.utils.hashing import hash_batch

N_TRAIN, N_TEST, BATCH, EPOCHS = 6, 3, 3, 2
BETAS, EPS = (0.9, 0.999), 1e-8


def make_args(tmp_path, **kwargs) -> AttributionArguments:
    kwargs.setdefault("per_device_train_batch_size", 2)
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kwargs)


def layer_rows(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per-sample gradients ``{layer: (B, out·(in+1))}`` in ``[W | b]`` layout (torch.func)."""

    def loss_of_sample(module, params, sample):
        xs, ys = sample
        return ((call(module, params, xs) - ys) ** 2).sum()

    grads = per_sample_param_grads(model, loss_of_sample, (x, y))
    return {
        name: torch.cat([grads[f"{name}.weight"], grads[f"{name}.bias"][..., None]], dim=2).flatten(
            1
        )
        for name in MLP_LAYERS
    }


def adam_state(opt: torch.optim.Optimizer, model: torch.nn.Module, name: str, key: str):
    """The optimizer's ``key`` moment of layer ``name`` in ``[W | b]`` layout (zeros if unset)."""
    layer = dict(model.named_modules())[name]
    parts = []
    for param in (layer.weight, layer.bias):
        state = opt.state.get(param, {})
        parts.append(state.get(key, torch.zeros_like(param)))
    return torch.cat([parts[0], parts[1][:, None]], dim=1).flatten()


def adam_direction(g, m, v, t):
    """Adam's update direction for a one-sample batch ``g`` from pre-step moments ``m, v``."""
    b1, b2 = BETAS
    m_new = b1 * m + (1 - b1) * g
    v_new = b2 * v + (1 - b2) * g * g
    return (m_new / (1 - b1**t)) / ((v_new / (1 - b2**t)).sqrt() + EPS)


def dense_block(rows: dict) -> Gradient:
    return Gradient(
        representation=dict.fromkeys(rows, "materialized"),
        data=dict(rows),
        layer_types=dict.fromkeys(rows, "nn.Linear"),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step AdamW trajectory (2 epochs × 2 batches), its stores and its dense reference."""
    root = tmp_path_factory.mktemp("less")
    torch.manual_seed(0)
    model = MLP()
    model0 = copy.deepcopy(model)
    x, y = mlp_data(N_TRAIN, 1)
    xq, yq = mlp_data(N_TEST, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=BETAS, eps=EPS, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.2 * s)
    train_store = GradientStorageManager(str(root / "train"))
    order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(3))
    batches = [order[i : i + BATCH] for _ in range(EPOCHS) for i in range(0, N_TRAIN, BATCH)]
    rows, lrs = {}, {}
    for t, idx in enumerate(batches):
        xb, yb = x[idx], y[idx]
        grads = layer_rows(model, xb, yb)
        dirs = {}
        for name in MLP_LAYERS:
            step = float(opt.state.get(dict(model.named_modules())[name].weight, {}).get("step", 0))
            m = adam_state(opt, model, name, "exp_avg")
            v = adam_state(opt, model, name, "exp_avg_sq")
            dirs[name] = adam_direction(grads[name], m, v, step + 1)
        ids = sample_ids(xb)
        train_store.save_bulk([GradientRecord(t, ids, dense_block(dirs))])
        rows[t] = (ids, torch.cat([dirs[n] for n in MLP_LAYERS], dim=1))
        lrs[t] = opt.param_groups[0]["lr"]
        opt.zero_grad()
        mlp_loss(model, (xb, yb)).backward()
        opt.step()
        sched.step()
    test_store = GradientStorageManager(str(root / "test"))
    query = capture_factors(model0, MLP_LAYERS, mlp_loss, (xq, yq))
    test_store.save_bulk([GradientRecord(0, sample_ids(xq), query)])
    q = layer_rows(model0, xq, yq)
    queries = torch.cat([q[n] for n in MLP_LAYERS], dim=1)
    return {
        "root": root,
        "rows": rows,
        "lrs": lrs,
        "queries": queries,
        "test_ids": sample_ids(xq),
    }


def reference_step(run: dict, step: int, weight: float) -> tuple[list[str], torch.Tensor]:
    """``weight · cos(Γ_i^step, q_j)`` for the rows of ``step``."""
    ids, dirs = run["rows"][step]
    cos = (
        torch.nn.functional.normalize(dirs, dim=1)
        @ torch.nn.functional.normalize(run["queries"], dim=1).T
    )
    return ids, weight * cos


def check_scores(score, run: dict, weights: dict[int, float]) -> None:
    """Every step's rows equal the reference with ``weights[step]``; columns in test order."""
    assert score.test_ids == run["test_ids"]
    assert sorted(score.step_matrices()) == sorted(weights)
    for step, weight in weights.items():
        ids, matrix = score.step_matrix(step)
        want_ids, want = reference_step(run, step, weight)
        assert ids == want_ids
        torch.testing.assert_close(matrix, want, rtol=1e-4, atol=1e-5)


def copy_store(run: dict, tmp_path, name: str = "train"):
    """A copy of the train store in ``tmp_path`` (no schedule file beside it)."""
    import shutil

    target = tmp_path / name
    shutil.copytree(run["root"] / "train", target)
    (target / LR_SCHEDULE_FILE).unlink(missing_ok=True)
    return target


def test_from_cache_weights_from_schedule_file(run, tmp_path):
    train = copy_store(run, tmp_path)
    write_lr_schedule(train, run["lrs"])
    score = LESSAttributor(make_args(tmp_path)).attribute_from_cache(train, run["root"] / "test")
    assert score.algorithm == "LESS"
    check_scores(score, run, run["lrs"])
    assert score.algorithm_meta["weights_from"] == "lr_schedule"


def test_agnostic_sums_weighted_cosines_over_steps(run, tmp_path):
    train = copy_store(run, tmp_path)
    write_lr_schedule(train, run["lrs"])
    score = LESSAttributor(make_args(tmp_path)).attribute_from_cache(train, run["root"] / "test")
    expected: dict[str, torch.Tensor] = {}
    for step, lr in run["lrs"].items():
        ids, matrix = reference_step(run, step, lr)
        for i, sample in enumerate(ids):
            expected[sample] = expected.get(sample, 0) + matrix[i]
    train_ids, agnostic = score.agnostic_matrix()
    want = torch.stack([expected[s] for s in train_ids])
    torch.testing.assert_close(agnostic, want, rtol=1e-4, atol=1e-5)
    assert all(len(score.trajectory_aware(s)[0]) == EPOCHS for s in train_ids)


def test_learning_rates_mapping_overrides_schedule_file(run, tmp_path):
    train = copy_store(run, tmp_path)
    write_lr_schedule(train, run["lrs"])
    chosen = {t: 2.0 + t for t in run["lrs"]}
    score = LESSAttributor(make_args(tmp_path)).attribute_from_cache(
        train, run["root"] / "test", learning_rates=chosen, checkpoint_weight=7.0
    )
    check_scores(score, run, chosen)


@pytest.mark.parametrize(
    ("kwargs", "weight"),
    [({"learning_rates": 0.5}, 0.5), ({"checkpoint_weight": 3.0}, 3.0), ({}, 1.0)],
)
def test_constant_weights(run, tmp_path, kwargs, weight):
    train = copy_store(run, tmp_path)
    score = LESSAttributor(make_args(tmp_path)).attribute_from_cache(
        train, run["root"] / "test", **kwargs
    )
    check_scores(score, run, dict.fromkeys(run["lrs"], weight))


def test_selected_steps_need_weights_for_those_steps_only(run, tmp_path):
    train = copy_store(run, tmp_path)
    score = LESSAttributor(make_args(tmp_path)).attribute_from_cache(
        train, run["root"] / "test", learning_rates={1: 0.3, 2: 0.7}, selected_training_steps=[1, 2]
    )
    check_scores(score, run, {1: 0.3, 2: 0.7})


def test_step_without_learning_rate_is_refused(run, tmp_path):
    train = copy_store(run, tmp_path)
    attributor = LESSAttributor(make_args(tmp_path))
    with pytest.raises(ValueError, match="no learning rate for training step 3"):
        attributor.attribute_from_cache(
            train, run["root"] / "test", learning_rates={0: 1.0, 1: 1.0, 2: 1.0}
        )
    write_lr_schedule(train, {0: 1.0, 1: 1.0})
    with pytest.raises(ValueError, match=r"no learning rate for training step 2.*lr_schedule"):
        attributor.attribute_from_cache(train, run["root"] / "test")


def test_checkpoint_weights_must_match_optimizers(tmp_path):
    model = MLP()
    optimizers = [torch.optim.AdamW(model.parameters()) for _ in range(2)]
    with pytest.raises(ValueError, match="checkpoint_weights has 3 entries but optimizers has 2"):
        LESSAttributor(make_args(tmp_path), optimizers=optimizers, checkpoint_weights=[1, 2, 3])
    empty = LESSAttributor(make_args(tmp_path), optimizers=optimizers, checkpoint_weights=[])
    assert empty.checkpoint_weight(1) == 1.0


# ---------------------------------------------------------------------------- live forms
# The live tests drive LESSAttributor through GradientStreamer(precondition=True) and
# compare with the same dense formula: per-sample gradients by a loop of one-sample
# backward passes, Adam's direction written above from the optimizer state, cosine
# against raw query gradients, weight w_t (LR applied at step t) or w_k.

LR = 0.05


class Case:
    """A model, its hooked layers (``[W | b]`` layout, Conv1D transposed) and its data.

    ``train`` / ``test`` are tuples of tensors; ``loss_of_tuple(model, batch)``
    is the sum-convention loss of such a tuple; ``as_dict(batch)`` is the dict
    the live loss receives (one sample: leading axis dropped), ``id_fields`` the
    inputs the capture hashes into sample identifiers.
    """

    def __init__(self, model, layers, conv1d, loss_of_tuple, train, test, as_dict, id_fields):
        self.model, self.layers, self.conv1d = model, layers, conv1d
        self.loss_of_tuple, self.train, self.test = loss_of_tuple, train, test
        self.as_dict, self.id_fields = as_dict, id_fields

    def dicts(self, data):
        return [self.as_dict(tuple(t[i] for t in data)) for i in range(len(data[0]))]

    def loss_func(self, model, batch):
        return self.loss_of_tuple(model, tuple(batch.values())[: len(self.train)])

    def ids(self, data):
        return hash_batch(self.id_fields(data), len(data[0]))

    def flat(self, tensors, batched: bool):
        out = []
        for layer in self.layers:
            w, b = tensors[f"{layer}.weight"], tensors[f"{layer}.bias"]
            if self.conv1d:
                w = w.transpose(-1, -2)
            out.append(torch.cat([w, b[..., None]], dim=-1).flatten(1 if batched else 0))
        return torch.cat(out, dim=-1)

    def grads(self, model, data):
        return self.flat(per_sample_loop_grads(model, self.loss_of_tuple, data), batched=True)

    def direction(self, model, opt, data):
        """Adam directions of each sample of ``data`` from ``opt``'s state over ``model``."""
        params = dict(model.named_parameters())
        names = [f"{layer}.{p}" for layer in self.layers for p in ("weight", "bias")]

        def moment(key):
            zeros = {n: torch.zeros_like(params[n]) for n in names}
            return self.flat(
                {n: opt.state.get(params[n], zeros).get(key, zeros[n]) for n in names}, False
            )

        step = float(opt.state.get(params[names[0]], {}).get("step", 0)) + 1
        return adam_direction(
            self.grads(model, data), moment("exp_avg"), moment("exp_avg_sq"), step
        )


def cosine(a, b):
    return torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T


def mlp_case():
    torch.manual_seed(0)
    return Case(
        MLP(),
        MLP_LAYERS,
        False,
        mlp_loss,
        mlp_data(N_TRAIN, 1),
        mlp_data(N_TEST, 2),
        as_dict=lambda sample: {"x": sample[0], "y": sample[1]},
        id_fields=lambda data: {"_arg0": data[0]},
    )


def gpt2_case():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=8,
        vocab_size=16,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)

    def loss(model, batch):
        return model(input_ids=batch[0], labels=batch[0]).loss * batch[0].shape[0]

    gen = torch.Generator().manual_seed(5)
    return Case(
        transformers.GPT2LMHeadModel(config),
        ["transformer.h.0.mlp.c_fc", "transformer.h.0.attn.c_proj"],
        True,
        loss,
        (torch.randint(0, 16, (N_TRAIN, 6), generator=gen),),
        (torch.randint(0, 16, (N_TEST, 6), generator=gen),),
        as_dict=lambda sample: {"input_ids": sample[0]},
        id_fields=lambda data: {"input_ids": data[0], "labels": data[0]},
    )


CASES = {"mlp": mlp_case, "gpt2": gpt2_case}


def live_args(tmp_path, **kwargs):
    return make_args(
        tmp_path,
        per_device_eval_batch_size=2,
        learning_rate=LR,
        max_grad_norm=None,
        weight_decay=0.0,
        **kwargs,
    )


def hook_config(case):
    return HookManagerConfig(hook_types=dict.fromkeys(case.layers, "linear_io"))


def check_rows(score, case, expected: dict[int, torch.Tensor], ids_of: dict[int, list[str]]):
    assert score.test_ids == case.ids(case.test)
    for step, want in expected.items():
        ids, matrix = score.step_matrix(step)
        assert ids == ids_of[step]
        torch.testing.assert_close(matrix, want.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_live_frozen_form_equals_reference_and_cache(name, tmp_path):
    case = CASES[name]()
    model = case.model
    states = []
    optimizers = []
    for k in range(2):  # checkpoint k: parameters after k+1 AdamW steps, and that optimizer
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for _ in range(k + 1):
            opt.zero_grad()
            case.loss_of_tuple(model, case.train).backward()
            opt.step()
        opt.zero_grad()
        optimizers.append(opt)
        states.append({key: v.clone() for key, v in model.state_dict().items()})
    weights = [0.25, 2.0]
    expected, ids_of = {}, {}
    for k, state in enumerate(states):
        model.load_state_dict(state)
        train_dirs = case.direction(model, optimizers[k], case.train)
        expected[k] = weights[k] * cosine(train_dirs, case.grads(model, case.test))
        ids_of[k] = case.ids(case.train)
    task = AttributionTask(case.loss_func, model, checkpoints=states)
    attributor = LESSAttributor(
        live_args(tmp_path), task=task, optimizers=optimizers, checkpoint_weights=weights
    )
    config = hook_config(case)
    live = attributor.attribute(
        case.dicts(case.train), case.dicts(case.test), hook_config=config, loss_reduction="sum"
    )
    check_rows(live, case, expected, ids_of)
    assert live.algorithm_meta["learning_rates"] == {0: 0.25, 1: 2.0}
    memory = attributor.attribute(
        case.dicts(case.train),
        case.dicts(case.test),
        hook_config=config,
        gradient_cache_residency="memory",
        loss_reduction="sum",
    )
    torch.testing.assert_close(memory.scores, live.scores, rtol=1e-5, atol=1e-7)
    pairs = attributor.cache(
        case.dicts(case.train),
        case.dicts(case.test),
        cache_dir=str(tmp_path / "c"),
        hook_config=config,
        loss_reduction="sum",
    )
    for k, (train_dir, test_dir) in enumerate(pairs):
        cached = LESSAttributor(live_args(tmp_path)).attribute_from_cache(
            train_dir, test_dir, checkpoint_weight=weights[k]
        )
        check_rows(cached, case, {k: expected[k]}, ids_of)


def trajectory_reference(case, initial_state, rows_of_step, *, query_at_step: bool):
    """``lr_t · cos(Γ(θ_t), q)`` per step, replaying AdamW with the linear schedule by hand."""
    model = case.model
    model.load_state_dict(initial_state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    index = {sample: i for i, sample in enumerate(case.ids(case.train))}
    queries = case.grads(model, case.test)
    total = len(rows_of_step)
    expected, lrs = {}, {}
    for t in range(total):
        lr = LR * (total - t) / total
        for group in opt.param_groups:
            group["lr"] = lr
        batch = tuple(x[[index[s] for s in rows_of_step[t]]] for x in case.train)
        if query_at_step:
            queries = case.grads(model, case.test)
        expected[t] = lr * cosine(case.direction(model, opt, batch), queries)
        lrs[t] = lr
        opt.zero_grad()
        case.loss_of_tuple(model, batch).backward()
        opt.step()
    return expected, lrs


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("loop_over_test", [False, True])
def test_live_trajectory_form_equals_reference_and_cache(name, loop_over_test, tmp_path):
    case = CASES[name]()
    initial = {key: v.clone() for key, v in case.model.state_dict().items()}
    task = AttributionTask(case.loss_func, case.model, checkpoints=[initial])
    config = hook_config(case)
    live = LESSAttributor(live_args(tmp_path), task=task).attribute(
        case.dicts(case.train),
        case.dicts(case.test),
        hook_config=config,
        enable_update=True,
        loop_over_test=loop_over_test,
        loss_reduction="sum",
    )
    assert live.algorithm_meta["loss_reduction"] == "sum"  # the capture's convention, recorded
    rows_of_step = {t: live.step_matrix(t)[0] for t in sorted(live.step_matrices())}
    assert sorted(sum(rows_of_step.values(), [])) == sorted(case.ids(case.train))
    expected, lrs = trajectory_reference(case, initial, rows_of_step, query_at_step=loop_over_test)
    check_rows(live, case, expected, rows_of_step)
    if loop_over_test:
        return
    memory = LESSAttributor(live_args(tmp_path), task=task).attribute(
        case.dicts(case.train),
        case.dicts(case.test),
        hook_config=config,
        enable_update=True,
        gradient_cache_residency="memory",
        loss_reduction="sum",
    )
    torch.testing.assert_close(memory.scores, live.scores, rtol=1e-5, atol=1e-7)
    ((train_dir, test_dir),) = LESSAttributor(live_args(tmp_path), task=task).cache(
        case.dicts(case.train),
        case.dicts(case.test),
        cache_dir=str(tmp_path / "c"),
        hook_config=config,
        enable_update=True,
        loss_reduction="sum",
    )
    assert read_lr_schedule(train_dir) == pytest.approx(lrs)
    cached = LESSAttributor(live_args(tmp_path)).attribute_from_cache(train_dir, test_dir)
    check_rows(cached, case, expected, rows_of_step)


def test_frozen_form_needs_one_optimizer_per_checkpoint(tmp_path):
    case = mlp_case()
    state = case.model.state_dict()
    task = AttributionTask(case.loss_func, case.model, checkpoints=[state, state])
    data = (case.dicts(case.train), case.dicts(case.test))
    with pytest.raises(ValueError, match="pass optimizers=\\[one torch.optim optimizer"):
        LESSAttributor(live_args(tmp_path), task=task).attribute(*data)
    opt = torch.optim.AdamW(case.model.parameters())
    with pytest.raises(ValueError, match="got 1 optimizers for 2 task checkpoints"):
        LESSAttributor(live_args(tmp_path), task=task, optimizers=[opt]).attribute(*data)
    with pytest.raises(ValueError, match="checkpoint_weights has 1 entries but optimizers has 2"):
        LESSAttributor(
            live_args(tmp_path), task=task, optimizers=[opt, opt], checkpoint_weights=[1]
        )


def test_logra_projection_with_preconditioning_is_refused(tmp_path):
    case = mlp_case()
    opt = torch.optim.AdamW(case.model.parameters())
    task = AttributionTask(case.loss_func, case.model)
    config = HookManagerConfig(
        linear_io=list(MLP_LAYERS),
        projection_kwargs={"__default__": {"style": "logra", "proj_dim": 2}},
    )
    with pytest.raises(ValueError, match="logra"):
        LESSAttributor(live_args(tmp_path), task=task, optimizers=[opt]).attribute(
            case.dicts(case.train), case.dicts(case.test), hook_config=config
        )


def test_trajectory_form_warns_that_optimizers_are_unused(tmp_path):
    case = mlp_case()
    opt = torch.optim.AdamW(case.model.parameters())
    task = AttributionTask(case.loss_func, case.model)
    attributor = LESSAttributor(live_args(tmp_path), task=task, optimizers=[opt])
    with pytest.warns(UserWarning, match="frozen form only"):
        streamer = attributor.generate_train_rep(case.dicts(case.train), enable_update=True)
    streamer.hook_manager.remove()

"""AdamWInfluenceAttributor against a dense reference of the AdamW dynamics.

The reference is built here from the math: per-sample gradients from
``torch.func`` at every recorded ``θ_t`` (read from the run's snapshots), the
Adam moments recomputed by hand from them, and the recurrence unrolled with
explicit matrices: each step's state Jacobian ``J_t = ∂(θ', m', v')/∂(θ, m, v)``
and up-weighting derivative ``P_t = ∂(θ', m', v')/∂w`` are taken with
``torch.func.jacrev`` of the AdamW update written out below (the batch
gradient linearized with the Gauss–Newton matrix ``c·Σ_b g_b g_bᵀ``). The
score of sample ``b`` at step ``t`` against query ``q`` is
``qᵀ [I 0 0] J_{T-1}···J_{t+1} P_t[:, b]``, the first-order change of the
query loss when ``b`` is up-weighted at step ``t`` (= ``−qᵀ W·push``, push being
the removal perturbation).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from dattri_llm.attribution.algorithm.adamw_influence import (
    ADAMW_DYNAMICS_FILE,
    AdamWInfluenceAttributor,
    coordinate_groups,
)
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.utils import read_lr_schedule
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.ops.projection import DattriProjector
from dattri_llm.gradient.snapshots import TrajectorySnapshots
from dattri_llm.task import AttributionTask

BETAS, EPS, WD, LR = (0.8, 0.9), 1e-3, 0.1, 0.05
N_TRAIN, N_TEST = 8, 3


def make_args(tmp_path, **kwargs) -> AttributionArguments:
    options = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 1,
        "learning_rate": LR,
        "weight_decay": WD,
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "max_grad_norm": None,
        "lr_scheduler_type": "linear",
        **kwargs,
    }
    return AttributionArguments(**options)


# ---------------------------------------------------------------------------- models
class MLP(nn.Module):
    """Bias-free layers: every parameter is in the decayed group."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5, bias=False)
        self.fc2 = nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


MLP_PARAMS = {"fc1": "fc1.weight", "fc2": "fc2.weight"}


def mlp_loss(model, batch):
    """Sum over samples: per-sample shares are the per-sample gradients."""
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def mlp_data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen), torch.randn(n, 3, generator=gen)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


GPT2_LAYERS = ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc")


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt2_loss(model, batch):
    """HF mean loss: per-sample shares are ``∇ℓ_b / B``."""
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def gpt2_data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 13, (n, 5), generator=gen)
    return [{"input_ids": ids[i]} for i in range(n)]


# ---------------------------------------------------------------------------- dense reference
def flat_grads(model, loss_of, batch, params: dict[str, str], transposed=()) -> torch.Tensor:
    """``(B, P)`` float64 per-sample gradients of ``loss_of(model, one-sample batch)``, the
    layers' weights in sorted layer order, materialize layout (Conv1D transposed)."""
    names = [params[layer] for layer in sorted(params)]
    weights = {name: p.detach().double() for name, p in model.named_parameters()}
    model64 = copy.deepcopy(model).double()

    def loss(w, sample):
        batched = {k: v.unsqueeze(0) for k, v in sample.items()}

        def call(*args, **kwargs):
            return functional_call(model64, {**weights, **w}, args, kwargs)

        return loss_of(call, batched)

    sample_batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    per_sample = vmap(grad(loss), in_dims=(None, 0))({n: weights[n] for n in names}, sample_batch)
    columns = []
    for layer in sorted(params):
        g = per_sample[params[layer]]
        g = g.transpose(1, 2) if layer in transposed else g
        columns.append(g.reshape(g.shape[0], -1))
    return torch.cat(columns, dim=1)


def adamw_reference(per_step: list[torch.Tensor], lrs: list[float], queries, c_of) -> list:
    """``[(B_t, n_test)]`` reference scores per step (ascending) — see the module docstring."""
    (b1, b2), p = BETAS, per_step[0].shape[1]
    m, v = torch.zeros(p, dtype=torch.float64), torch.zeros(p, dtype=torch.float64)
    jacobians, pushes = [], []
    for t, g_rows in enumerate(per_step):
        n, lr, g_t = t + 1, lrs[t], g_rows.sum(0)
        hessian = c_of(g_rows) * g_rows.T @ g_rows

        def update(theta, m_, v_, w, g_rows=g_rows, g_t=g_t, hessian=hessian, n=n, lr=lr):
            g = g_t + hessian @ theta + g_rows.T @ w
            m2 = b1 * m_ + (1 - b1) * g
            v2 = b2 * v_ + (1 - b2) * g * g
            direction = (m2 / (1 - b1**n)) / ((v2 / (1 - b2**n)).sqrt() + EPS)
            return torch.cat([(1 - lr * WD) * theta - lr * direction, m2, v2])

        point = (torch.zeros(p, dtype=torch.float64), m, v, torch.zeros(g_rows.shape[0]).double())
        jac = jacrev(update, argnums=(0, 1, 2, 3))(*point)
        jacobians.append(torch.cat(jac[:3], dim=1))
        pushes.append(jac[3])
        m, v = b1 * m + (1 - b1) * g_t, b2 * v + (1 - b2) * g_t * g_t
    phi = torch.cat([torch.eye(p), torch.zeros(p, 2 * p)], dim=1).double()
    out = [None] * len(per_step)
    for t in reversed(range(len(per_step))):
        out[t] = (queries @ phi @ pushes[t]).T
        phi = phi @ jacobians[t]
    return out


def run_reference(
    snap_dir, final_model, test, loss_fn, params, c_of, transposed=(), index=None, mean=False
):
    """Reference scores per step from a snapshot run; ``index`` restricts the coordinates.

    ``mean``: the training loss averages over the batch, so a sample's share of the
    batch gradient (what the store holds) is its gradient over ``B``.
    """
    snapshots = TrajectorySnapshots(snap_dir)
    model = copy.deepcopy(final_model)
    lrs = read_lr_schedule(snap_dir)
    per_step = []
    for step in snapshots.steps():
        snapshots.load_parameters(step, model)
        rows = flat_grads(model, loss_fn, snapshots.load_batch(step), params, transposed)
        per_step.append(rows / rows.shape[0] if mean else rows)
    test_batch = {k: torch.stack([row[k] for row in test]) for k in test[0]}
    queries = flat_grads(final_model, loss_fn, test_batch, params, transposed)
    if index is not None:
        per_step = [g[:, index] for g in per_step]
        queries = queries[:, index]
    return adamw_reference(per_step, [lrs[s] for s in snapshots.steps()], queries, c_of)


def rows_of(score, step):
    keep = [i for i, s in enumerate(score.row_steps) if s == step]
    return score.scores[keep].double()


def assert_matches(score, reference, rtol=2e-4):
    assert score.row_steps == sorted(score.row_steps, reverse=True)  # latest first
    scale = max(float(r.abs().max()) for r in reference)
    for step, want in enumerate(reference):
        torch.testing.assert_close(rows_of(score, step), want, rtol=rtol, atol=rtol * scale)


# ---------------------------------------------------------------------------- runs
def collect(tmp_path, name, model_fn, loss_fn, train, test, *, recompute, **kwargs):
    torch.manual_seed(0)
    model = model_fn()
    projection = kwargs.pop("projection_kwargs", None)
    args = make_args(tmp_path / name, recompute_gradients=recompute, **kwargs.pop("args", {}))
    attributor = AdamWInfluenceAttributor(
        args, task=AttributionTask(loss_fn, model), projection_kwargs=projection
    )
    ((train_dir, test_dir),) = attributor.cache(
        train, test, cache_dir=str(tmp_path / name), **kwargs
    )
    return attributor, model, train_dir, test_dir


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlp")
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    runs = {
        recompute: collect(tmp, str(recompute), MLP, mlp_loss, train, test, recompute=recompute)
        for recompute in (False, True)
    }
    _, final, snap_dir, _ = runs[True]
    reference = run_reference(snap_dir, final, test, mlp_loss, MLP_PARAMS, lambda g: 1.0)
    return {"runs": runs, "reference": reference, "train": train, "test": test, "tmp": tmp}


@pytest.mark.parametrize("propagation", ["train", "test"])
@pytest.mark.parametrize("recompute", [False, True], ids=["store", "snapshots"])
def test_mlp_matches_dense_reference(mlp_runs, propagation, recompute):
    attributor, _model, train_dir, test_dir = mlp_runs["runs"][recompute]
    score = attributor.attribute_from_cache(
        train_dir, test_dir, loss_reduction="sum", propagation=propagation
    )
    assert score.algorithm == "AdamWInfluence" and score.num_test == N_TEST
    assert sorted(set(score.row_steps)) == [0, 1, 2, 3]  # 8 samples, batches of 2: 4 steps
    assert score.algorithm_meta["train_source"] == ("snapshots" if recompute else "gradients")
    assert_matches(score, mlp_runs["reference"])


def test_propagations_agree_and_steps_select_rows(mlp_runs):
    attributor, _model, train_dir, test_dir = mlp_runs["runs"][False]
    train_side = attributor.attribute_from_cache(train_dir, test_dir, loss_reduction="sum")
    test_side = attributor.attribute_from_cache(
        train_dir, test_dir, loss_reduction="sum", propagation="test", loop_over_test=True
    )
    torch.testing.assert_close(test_side.scores, train_side.scores, rtol=1e-4, atol=1e-6)
    assert test_side.test_ids == train_side.test_ids
    picked = attributor.attribute_from_cache(
        train_dir, test_dir, loss_reduction="sum", selected_training_steps=[0, 2]
    )
    assert sorted(set(picked.row_steps)) == [0, 2]  # rows filtered, every step propagated
    torch.testing.assert_close(rows_of(picked, 0), rows_of(train_side, 0))


def test_dynamics_from_a_file_and_a_mapping(mlp_runs, tmp_path):
    attributor, _model, train_dir, test_dir = mlp_runs["runs"][False]
    beside = attributor.attribute_from_cache(train_dir, test_dir, loss_reduction="sum")
    path = f"{train_dir}/{ADAMW_DYNAMICS_FILE}"
    mapping = AdamWInfluenceAttributor.load_dynamics(None, path)
    assert sorted(mapping) == [0, 1, 2, 3] and mapping[1]["step"] == 2
    for dynamics in (path, mapping):
        again = attributor.attribute_from_cache(
            train_dir, test_dir, loss_reduction="sum", dynamics=dynamics
        )
        torch.testing.assert_close(again.scores, beside.scores)


def test_mean_reduction_scales_the_coupling(mlp_runs):
    """``"mean"`` uses ``c = |B|`` in the Gauss–Newton coupling (reference with ``c = 2``)."""
    attributor, final, snap_dir, test_dir = mlp_runs["runs"][True]
    reference = run_reference(
        snap_dir, final, mlp_runs["test"], mlp_loss, MLP_PARAMS, lambda g: float(g.shape[0])
    )
    score = attributor.attribute_from_cache(snap_dir, test_dir, loss_reduction="mean")
    assert_matches(score, reference)


@pytest.mark.parametrize("propagation", ["train", "test"])
def test_masked_scores_are_the_restricted_reference(mlp_runs, propagation):
    mask = {"__default__": {"style": "mask", "proj_dim": 7, "proj_seed": 3}}
    tmp, train, test = mlp_runs["tmp"], mlp_runs["train"], mlp_runs["test"]
    name = f"mask_{propagation}"
    attributor, final, snap_dir, test_dir = collect(
        tmp, name, MLP, mlp_loss, train, test, recompute=True, projection_kwargs=mask
    )
    projector = DattriProjector()
    index = torch.cat(
        [
            projector.mask_indices(20, proj_dim=7, proj_seed=3, device="cpu"),
            20 + projector.mask_indices(15, proj_dim=7, proj_seed=3, device="cpu"),
        ]
    )
    reference = run_reference(
        snap_dir, final, test, mlp_loss, MLP_PARAMS, lambda g: 1.0, index=index
    )
    score = attributor.attribute_from_cache(
        snap_dir, test_dir, loss_reduction="sum", propagation=propagation
    )
    assert_matches(score, reference)
    # several disjoint masks: the average of the per-group restricted references
    groups = coordinate_groups({"fc1": 7, "fc2": 7}, 2)
    assert torch.equal(torch.cat(groups).sort().values, torch.arange(14))  # disjoint, covering
    averaged = attributor.attribute_from_cache(
        snap_dir, test_dir, loss_reduction="sum", propagation=propagation, num_masks=2
    )
    per_group = [
        run_reference(
            snap_dir, final, test, mlp_loss, MLP_PARAMS, lambda g: 1.0, index=index[group]
        )
        for group in groups
    ]
    assert_matches(averaged, [(a + b) / 2 for a, b in zip(*per_group, strict=True)])


def test_live_attribute_equals_cache(mlp_runs, tmp_path):
    _attributor, _model, train_dir, test_dir = mlp_runs["runs"][False]
    torch.manual_seed(0)
    model = MLP()
    live = AdamWInfluenceAttributor(make_args(tmp_path), task=AttributionTask(mlp_loss, model))
    score = live.attribute(
        mlp_runs["train"], mlp_runs["test"], loss_reduction="sum", propagation="test"
    )
    cached = live.attribute_from_cache(train_dir, test_dir, loss_reduction="sum")
    torch.testing.assert_close(score.scores, cached.scores, rtol=1e-4, atol=1e-6)
    assert score.row_train_ids == cached.row_train_ids


@pytest.mark.slow
def test_gpt2_masked_matches_dense_reference(tmp_path):
    """Conv1D weights (bias left out, so every coordinate is decayed) under a mask."""
    train, test = gpt2_data(N_TRAIN, 3), gpt2_data(N_TEST, 4)
    mask = {name: {"style": "mask", "proj_dim": 40, "include_bias": False} for name in GPT2_LAYERS}
    config = HookManagerConfig(linear_io=list(GPT2_LAYERS), projection_kwargs=mask)
    attributor, final, snap_dir, test_dir = collect(
        tmp_path, "gpt2", tiny_gpt2, gpt2_loss, train, test, recompute=True, hook_config=config
    )
    params = {name: f"{name}.weight" for name in GPT2_LAYERS}
    projector = DattriProjector()
    index = torch.cat(
        [
            projector.mask_indices(192, proj_dim=40, proj_seed=0, device="cpu"),
            192 + projector.mask_indices(256, proj_dim=40, proj_seed=0, device="cpu"),
        ]
    )
    # c_attn (8 -> 24) and c_fc (8 -> 32) in sorted order; the HF mean loss gives shares ∇ℓ/B
    reference = run_reference(
        snap_dir, final, test, gpt2_loss, params, lambda g: float(g.shape[0]),
        transposed=GPT2_LAYERS, index=index, mean=True,
    )  # fmt: skip
    for propagation in ("train", "test"):
        score = attributor.attribute_from_cache(
            snap_dir, test_dir, propagation=propagation, hook_config=config
        )
        assert_matches(score, reference, rtol=1e-3)


# ---------------------------------------------------------------------------- errors
def test_clear_errors(mlp_runs, tmp_path):
    attributor, _model, train_dir, test_dir = mlp_runs["runs"][False]
    with pytest.raises(ValueError, match=r"loss_reduction must be one of \['mean', 'sum'\]"):
        attributor.attribute_from_cache(train_dir, test_dir, loss_reduction="avg")
    with pytest.raises(ValueError, match="propagation must be one of"):
        attributor.attribute_from_cache(train_dir, test_dir, propagation="both")
    with pytest.raises(ValueError, match="num_masks must be an int >= 1"):
        attributor.attribute_from_cache(train_dir, test_dir, num_masks=0)
    dynamics = AdamWInfluenceAttributor.load_dynamics(train_dir, None)
    partial = {step: entry for step, entry in dynamics.items() if step != 2}
    with pytest.raises(ValueError, match=r"lack propagated step\(s\) \[2\]"):
        attributor.attribute_from_cache(train_dir, test_dir, dynamics=partial)
    with pytest.raises(ValueError, match="no AdamW dynamics recorded"):
        AdamWInfluenceAttributor.load_dynamics(test_dir, None)
    from dattri_llm.gradient.storage_manager import GradientStorageManager

    empty = GradientStorageManager(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="test gradient store .* holds no records"):
        attributor.attribute_from_cache(train_dir, empty)


def test_another_optimizer_is_refused_before_training(tmp_path):
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = make_args(tmp_path, optim="sgd")
    attributor = AdamWInfluenceAttributor(args, task=AttributionTask(mlp_loss, model))
    with pytest.raises(ValueError, match=r"args.optim='sgd'.*optim='adamw_torch'"):
        attributor.cache(mlp_data(4, 1), mlp_data(2, 2), cache_dir=str(tmp_path / "c"))
    for key, value in before.items():  # nothing trained
        assert torch.equal(model.state_dict()[key], value)


def test_mismatched_masks_are_refused(tmp_path):
    mask = {"__default__": {"style": "mask", "proj_dim": 3}}
    other = HookManagerConfig(projection_kwargs={"__default__": {"style": "mask", "proj_dim": 4}})
    attributor = AdamWInfluenceAttributor(make_args(tmp_path), projection_kwargs=mask)
    assert attributor.capture_config(None).projection_kwargs == mask
    with pytest.raises(ValueError, match="same coordinates"):
        attributor.capture_config(other)

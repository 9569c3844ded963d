"""DVEmbAttributor against the dense formula of attribution.md §10, built here.

A short SGD run of a tiny MLP (sum loss) and a short AdamW run of a tiny GPT-2
(HF mean loss) are recorded by the attributor; the test replays each run by
hand, takes per-sample gradients with ``torch.func`` and writes out
``η_s qᵀ [Π_{k=s+1}^{T-1}(I − η_k H_k)] ĝ`` with explicit ``(d, d)`` matrices.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from attribution_helpers import MLP, mlp_data
from torch.func import functional_call, grad, vmap

from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.algorithm.trajectory import sweep as trajectory_sweep
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.utils import read_lr_schedule
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.task import AttributionTask
from dattri_llm.utils.hashing import hash_batch

LR = 0.05
N_TRAIN, N_TEST = 6, 3  # batch 2 → 3 steps
ATOL = 1e-6


class Case:
    """A model, its hooked layers, its losses and data (lists of dict samples)."""

    def __init__(self, model, layers, optim, reduction, train, test, single_loss, loss, target):
        self.model, self.layers, self.optim, self.reduction = model, layers, optim, reduction
        self.train, self.test = train, test
        self.single_loss, self.loss, self.target = single_loss, loss, target
        self.id_fields = None  # samples -> the forward inputs the capture hashes

    def ids(self, samples: list[dict]) -> list[str]:
        return hash_batch(self.id_fields(samples), len(samples))

    def per_sample(self, samples: list[dict]) -> torch.Tensor:
        """``(B, d)`` per-sample gradients ``∇ℓ_i`` of the hooked layers (torch.func)."""
        names = [f"{layer}.{p}" for layer in self.layers for p in ("weight", "bias")]
        params = {n: p.detach() for n, p in self.model.named_parameters()}
        batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

        def loss_of(trained, sample):
            return self.single_loss(self.model, {**params, **trained}, sample)

        grads = vmap(grad(loss_of), in_dims=(None, 0))({n: params[n] for n in names}, batch)
        return torch.cat([grads[n].flatten(1) for n in names], dim=1).double()

    def widths(self) -> list[int]:
        modules = dict(self.model.named_modules())
        return [sum(p.numel() for p in modules[layer].parameters()) for layer in self.layers]


def mlp_case() -> Case:
    torch.manual_seed(0)
    x, y = mlp_data(N_TRAIN, 1)
    tx, ty = mlp_data(N_TEST, 2)

    def single(model, params, sample):
        out = functional_call(model, params, (sample["x"][None],))
        return ((out - sample["y"][None]) ** 2).sum()

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    case = Case(
        MLP(),
        ["fc1", "fc2"],
        "sgd",
        "sum",
        [{"x": x[i], "y": y[i]} for i in range(N_TRAIN)],
        [{"x": tx[i], "y": ty[i]} for i in range(N_TEST)],
        single,
        loss,
        loss,
    )
    case.id_fields = lambda samples: {"_arg0": torch.stack([s["x"] for s in samples])}
    return case


def gpt2_case() -> Case:
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
    config._attn_implementation = "eager"  # vmap-friendly attention
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    train = torch.randint(0, 16, (N_TRAIN, 6), generator=gen)
    test = torch.randint(0, 16, (N_TEST, 6), generator=gen)

    def single(model, params, sample):
        ids = sample["input_ids"][None]
        return functional_call(model, params, (), {"input_ids": ids, "labels": ids}).loss

    def loss(model, batch):  # HF mean loss: per-sample share ∇ℓ_i / B
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def target(model, batch):  # sum convention on the query side: ∇ℓ_j
        return loss(model, batch) * batch["input_ids"].shape[0]

    case = Case(
        transformers.GPT2LMHeadModel(config),
        ["transformer.h.0.mlp.c_fc", "transformer.h.0.attn.c_proj"],
        "adamw_torch",
        "mean",
        [{"input_ids": train[i]} for i in range(N_TRAIN)],
        [{"input_ids": test[i]} for i in range(N_TEST)],
        single,
        loss,
        target,
    )

    def id_fields(samples):
        ids = torch.stack([s["input_ids"] for s in samples])
        return {"input_ids": ids, "labels": ids}

    case.id_fields = id_fields
    return case


CASES = {"mlp": mlp_case, "gpt2": gpt2_case}


def make_args(path, case: Case, **kwargs) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=LR,
        optim=case.optim,
        max_grad_norm=None,
        **kwargs,
    )


def hook_config(case: Case) -> HookManagerConfig:
    return HookManagerConfig(hook_types=dict.fromkeys(case.layers, "linear_io"))


def replay_by_hand(case: Case, initial: dict, batches: dict[int, list[int]]) -> dict:
    """Re-run the recorded run: per step ``ĝ`` (share convention) and ``η``; queries at θ_T."""
    model = case.model
    model.load_state_dict(initial)
    optimizer_cls = torch.optim.SGD if case.optim == "sgd" else torch.optim.AdamW
    kwargs = {} if case.optim == "sgd" else {"weight_decay": 0.0}
    opt = optimizer_cls(model.parameters(), lr=LR, **kwargs)
    total = len(batches)
    grads, lrs = {}, {}
    for t in range(total):
        lrs[t] = LR * (total - t) / total  # linear schedule, no warm-up
        for group in opt.param_groups:
            group["lr"] = lrs[t]
        samples = [case.train[i] for i in batches[t]]
        share = len(samples) if case.reduction == "mean" else 1
        grads[t] = case.per_sample(samples) / share
        opt.zero_grad()
        batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        case.loss(model, batch).backward()
        opt.step()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    return {"grads": grads, "lrs": lrs, "queries": case.per_sample(case.test), "final": final}


def dense_formula(ref: dict, case: Case, mode: str, lrs=None) -> dict[int, torch.Tensor]:
    """``{step: (B, Q)}`` = ``η_s ĝ_bᵀ Pᵀ q`` with ``P = Π_{k>s}(I − η_k H_k)`` written out."""
    lrs = lrs or ref["lrs"]
    grads = ref["grads"]
    d = ref["queries"].shape[1]
    mask = torch.ones(d, d, dtype=torch.float64)
    if mode == "diagonal":
        mask = torch.block_diag(*[torch.ones(w, w, dtype=torch.float64) for w in case.widths()])
    eye = torch.eye(d, dtype=torch.float64)
    total = len(grads)
    out = {}
    for s in range(total):
        product = eye
        for k in range(s + 1, total):
            c = grads[k].shape[0] if case.reduction == "mean" else 1
            hessian = c * (grads[k].T @ grads[k]) * mask
            product = (eye - lrs[k] * hessian) @ product
        out[s] = lrs[s] * grads[s] @ product.T @ ref["queries"].T
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request, tmp_path_factory):
    """One recorded run per case (gradients and snapshots) and its hand-built reference."""
    case = CASES[request.param]()
    root = tmp_path_factory.mktemp(request.param)
    initial = copy.deepcopy(case.model.state_dict())
    task = AttributionTask(case.loss, case.model, checkpoints=[initial], target_func=case.target)
    attributor = DVEmbAttributor(make_args(root / "out", case), task=task)
    ((train_dir, test_dir),) = attributor.cache(
        case.train, case.test, cache_dir=str(root / "grads"), hook_config=hook_config(case)
    )
    after_run = {k: v.clone() for k, v in case.model.state_dict().items()}
    snapshots = DVEmbAttributor(make_args(root / "out", case, recompute_gradients=True), task=task)
    ((snap_dir, _),) = snapshots.cache(
        case.train, case.test, cache_dir=str(root / "snaps"), hook_config=hook_config(case)
    )
    index = {sample: i for i, sample in enumerate(case.ids(case.train))}
    batches = {
        step: [index[sample] for sample in ids]
        for step, _b, ids in attributor.load_train_rep(train_dir)
    }
    ref = replay_by_hand(case, initial, batches)
    for key, value in after_run.items():  # the hand replay is the recorded run
        torch.testing.assert_close(ref["final"][key], value, rtol=1e-5, atol=1e-6)
    test_ids = case.ids(case.test)
    return {
        "case": case,
        "root": root,
        "task": task,
        "initial": initial,
        "train": train_dir,
        "test": test_dir,
        "snaps": snap_dir,
        "ref": ref,
        "test_ids": test_ids,
        "train_ids": {
            step: [case.ids(case.train)[i] for i in rows] for step, rows in batches.items()
        },
    }


def cached(run, name, **kwargs):
    attributor = DVEmbAttributor(make_args(run["root"] / name, run["case"]))
    kwargs.setdefault("learning_rate", None)
    return attributor.attribute_from_cache(run["train"], run["test"], **kwargs)


def check_against(score, run, expected: dict[int, torch.Tensor]) -> None:
    assert score.test_ids == run["test_ids"]
    assert score.row_steps == sorted(score.row_steps, reverse=True)  # latest first
    for step, want in expected.items():
        ids, matrix = score.step_matrix(step)
        assert ids == run["train_ids"][step]
        torch.testing.assert_close(matrix.double(), want, rtol=1e-4, atol=ATOL)


# ---------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("mode", ["full", "diagonal"])
@pytest.mark.parametrize("propagation", ["train", "test"])
def test_matches_dense_formula(run, mode, propagation):
    case = run["case"]
    expected = dense_formula(run["ref"], case, mode)
    score = cached(
        run,
        f"{mode}_{propagation}",
        hessian_mode=mode,
        propagation=propagation,
        loss_reduction=case.reduction,
    )
    check_against(score, run, expected)
    assert score.algorithm == "DVEmb"
    assert score.layer_name == sorted(case.layers)
    # the curvature matters here: the earliest step is 10x the tolerance away from η·TracIn
    tracin = run["ref"]["lrs"][0] * run["ref"]["grads"][0] @ run["ref"]["queries"].T
    assert not torch.allclose(expected[0], tracin, rtol=1e-3, atol=10 * ATOL)


def test_modes_differ_and_loop_over_test_is_identical(run):
    case = run["case"]
    lrs = dict.fromkeys(range(3), 2.0)  # a schedule strong enough to couple the layers
    full = dense_formula(run["ref"], case, "full", lrs=lrs)
    diagonal = dense_formula(run["ref"], case, "diagonal", lrs=lrs)
    assert not torch.allclose(full[0], diagonal[0], rtol=1e-3, atol=10 * ATOL)
    for mode, expected in (("full", full), ("diagonal", diagonal)):
        score = cached(
            run,
            f"loop_{mode}",
            propagation="test",
            loop_over_test=True,
            hessian_mode=mode,
            loss_reduction=case.reduction,
            recorded_lr=lrs,
        )
        check_against(score, run, expected)


def test_without_curvature_is_learning_rate_weighted_tracin(run):
    case = run["case"]
    tracin = TracInAttributor(make_args(run["root"] / "tracin", case)).attribute_from_cache(
        run["train"], run["test"]
    )
    lrs = run["ref"]["lrs"]
    last = max(lrs)
    latest = cached(run, "latest", selected_training_steps=[last], loss_reduction=case.reduction)
    assert latest.row_steps == [last] * 2
    torch.testing.assert_close(
        latest.step_matrix(last)[1], lrs[last] * tracin.step_matrix(last)[1], rtol=1e-5, atol=1e-7
    )
    with pytest.warns(UserWarning, match="configured value is used"):
        first = cached(run, "first", final_step=1, learning_rate={0: 0.5})
    assert first.algorithm_meta["propagated_steps"] == [0]
    torch.testing.assert_close(first.scores, 0.5 * tracin.step_matrix(0)[1], rtol=1e-5, atol=1e-7)


def test_selected_steps_filter_rows_only(run):
    case = run["case"]
    full = cached(run, "all", loss_reduction=case.reduction)
    some = cached(run, "some", selected_training_steps=[0, 2], loss_reduction=case.reduction)
    assert sorted(set(some.row_steps)) == [0, 2]
    for step in (0, 2):
        torch.testing.assert_close(some.step_matrix(step)[1], full.step_matrix(step)[1])
    meta = some.algorithm_meta
    assert meta["selected_training_steps"] == [0, 2]
    assert meta["propagated_steps"] == [2, 1, 0]
    assert meta["final_step"] == 3
    assert meta["learning_rate"] == pytest.approx(run["ref"]["lrs"])
    assert set(meta) >= {
        "final_step",
        "selected_training_steps",
        "propagated_steps",
        "learning_rate",
        "loss_reduction",
        "propagation",
        "loop_over_test",
        "block_dtype",
        "dvemb_dir",
        "hessian_mode",
        "train_source",
        "sample_id_key",
    }
    assert meta["train_source"] == "gradients" and meta["block_dtype"] == "torch.float32"


# ---------------------------------------------------------------------------- stored forms
@pytest.mark.parametrize("mode", ["full", "diagonal"])
def test_cache_dvemb_scored_by_tracin_equals_dvemb(run, mode):
    case = run["case"]
    root = run["root"]
    options = {"hessian_mode": mode, "loss_reduction": case.reduction}
    dvemb = cached(run, f"with_dir_{mode}", dvemb_dir=str(root / f"kept_{mode}"), **options)
    attributor = DVEmbAttributor(make_args(root / f"emb_{mode}", case))
    directory = attributor.cache_dvemb(run["train"], learning_rate=run["ref"]["lrs"], **options)
    assert directory == str(root / f"emb_{mode}" / "dvemb_grads")
    for stored in (directory, root / f"kept_{mode}"):
        tracin = TracInAttributor(make_args(root / "tracin_emb", case)).attribute_from_cache(
            stored, run["test"]
        )
        assert tracin.row_train_ids == dvemb.row_train_ids
        assert tracin.row_steps == dvemb.row_steps
        torch.testing.assert_close(tracin.scores, dvemb.scores, rtol=1e-5, atol=1e-7)
    check_against(dvemb, run, dense_formula(run["ref"], case, mode))


def test_replay_from_snapshots_equals_stored_gradients(run):
    case = run["case"]
    stored = cached(run, "stored", loss_reduction=case.reduction)
    attributor = DVEmbAttributor(make_args(run["root"] / "replay", case), task=run["task"])
    replayed = attributor.attribute_from_cache(
        run["snaps"],
        run["test"],
        learning_rate=None,
        loss_reduction=case.reduction,
        hook_config=hook_config(case),
    )
    assert replayed.algorithm_meta["train_source"] == "snapshots"
    assert replayed.row_train_ids == stored.row_train_ids
    torch.testing.assert_close(replayed.scores, stored.scores, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("residency", ["memory", "disk"])
def test_live_attribute_equals_cache(run, residency, tmp_path):
    case = run["case"]
    stored = cached(run, "stored_live", loss_reduction=case.reduction)
    attributor = DVEmbAttributor(make_args(tmp_path / "live", case), task=run["task"])
    live = attributor.attribute(
        case.train,
        case.test,
        hook_config=hook_config(case),
        gradient_cache_residency=residency,
        loss_reduction=case.reduction,
        learning_rate=None,
        propagation="test",
    )
    assert live.row_train_ids == stored.row_train_ids and live.test_ids == stored.test_ids
    torch.testing.assert_close(live.scores, stored.scores, rtol=1e-4, atol=1e-6)
    for key, value in run["ref"]["final"].items():  # the same run again
        torch.testing.assert_close(case.model.state_dict()[key], value, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- learning rates
def test_learning_rates_from_the_store_or_given(run):
    case = run["case"]
    recorded = read_lr_schedule(run["train"])
    assert recorded == pytest.approx(run["ref"]["lrs"])
    from_store = cached(run, "lr_store", loss_reduction=case.reduction)
    given = cached(run, "lr_given", loss_reduction=case.reduction, learning_rate=recorded)
    torch.testing.assert_close(given.scores, from_store.scores)
    with pytest.warns(UserWarning, match="differs from the run's recorded schedule"):
        constant = cached(run, "lr_const", loss_reduction=case.reduction, learning_rate=0.01)
    lrs = dict.fromkeys(range(3), 0.01)
    check_against(constant, run, dense_formula(run["ref"], case, "full", lrs=lrs))
    with pytest.warns(UserWarning, match=r"\(0: 1 vs 0.01, 1: 1 vs 0.01, 2: 1 vs 0.01"):
        override = cached(
            run, "lr_override", loss_reduction=case.reduction, learning_rate=1.0, recorded_lr=lrs
        )
    assert override.algorithm_meta["learning_rate"] == {2: 1.0, 1: 1.0, 0: 1.0}


# ---------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    case = mlp_case()
    root = tmp_path_factory.mktemp("errors")
    task = AttributionTask(case.loss, case.model)
    attributor = DVEmbAttributor(make_args(root / "out", case), task=task)
    ((train_dir, test_dir),) = attributor.cache(case.train, case.test, cache_dir=str(root))
    return {"case": case, "root": root, "train": train_dir, "test": test_dir, "task": task}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"propagation": "both"}, r"propagation must be one of \['train', 'test'\]"),
        ({"loop_over_test": True}, "loop_over_test.*propagation='test'"),
        ({"hessian_mode": "block"}, r"hessian_mode must be one of \['full', 'diagonal'\]"),
        ({"loss_reduction": "avg"}, r"loss_reduction must be one of \['mean', 'sum'\]"),
        ({"learning_rate": {0: 0.1, 2: 0.1}}, r"no learning rate for propagated step\(s\) \[1\]"),
        ({"learning_rate": -0.1}, "finite learning rate >= 0"),
        ({"learning_rate": None, "recorded_lr": {0: 0.1}}, r"propagated step\(s\) \[1, 2\]"),
        ({"dvemb_dir": "x", "propagation": "test"}, "dvemb_dir.*propagation='train'"),
        ({"selected_training_steps": [7]}, r"selected_training_steps \[7\] match none"),
    ],
)
def test_clear_errors(mlp_run, kwargs, match):
    attributor = DVEmbAttributor(make_args(mlp_run["root"] / "e", mlp_run["case"]))
    with pytest.raises(ValueError, match=match):
        attributor.attribute_from_cache(mlp_run["train"], mlp_run["test"], **kwargs)


def test_learning_rates_need_cover_only_selected_sweep(mlp_run):
    attributor = DVEmbAttributor(make_args(mlp_run["root"] / "cover", mlp_run["case"]))
    score = attributor.attribute_from_cache(
        mlp_run["train"],
        mlp_run["test"],
        selected_training_steps=[1],
        learning_rate={1: 1, 2: 1},
        recorded_lr={1: 1, 2: 1},
    )
    assert score.algorithm_meta["propagated_steps"] == [2, 1]


def test_empty_test_source_is_refused(mlp_run, tmp_path):
    (tmp_path / "empty").mkdir()
    attributor = DVEmbAttributor(make_args(tmp_path / "out", mlp_run["case"]))
    with pytest.raises(ValueError, match="test gradient store .* holds no records"):
        attributor.attribute_from_cache(mlp_run["train"], tmp_path / "empty")


def test_attribute_refuses_bad_residency_before_training(mlp_run, tmp_path):
    case = mlp_run["case"]
    attributor = DVEmbAttributor(make_args(tmp_path, case), task=mlp_run["task"])
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    with pytest.raises(ValueError, match="gradient_cache_residency must be one of"):
        attributor.attribute(case.train, case.test, gradient_cache_residency=None)
    with pytest.raises(ValueError, match="dvemb_dir"):
        attributor.attribute(case.train, case.test, dvemb_dir="d", propagation="test")
    for key, value in before.items():
        assert torch.equal(case.model.state_dict()[key], value)


def test_large_operator_warns(mlp_run, monkeypatch):
    monkeypatch.setattr(trajectory_sweep, "SUMMARY_WARN_BYTES", 43 * 43 * 4 - 1)
    attributor = DVEmbAttributor(make_args(mlp_run["root"] / "warn", mlp_run["case"]))
    with pytest.warns(UserWarning, match=r"train-side summary holds .* \(43, 43\)"):
        attributor.attribute_from_cache(mlp_run["train"], mlp_run["test"], learning_rate=None)
    with warnings.catch_warnings():  # the diagonal blocks are smaller: no warning
        warnings.simplefilter("error")
        attributor.attribute_from_cache(
            mlp_run["train"], mlp_run["test"], hessian_mode="diagonal", learning_rate=None
        )


def test_dvemb_dir_must_be_fresh(mlp_run):
    root = mlp_run["root"]
    attributor = DVEmbAttributor(make_args(root / "fresh", mlp_run["case"]))
    directory = attributor.cache_dvemb(mlp_run["train"], str(root / "emb"), learning_rate=None)
    assert GradientStorageManager(directory).available_steps() == [0, 1, 2]
    with pytest.raises(ValueError, match="already holds records"):
        attributor.cache_dvemb(mlp_run["train"], directory, learning_rate=None)

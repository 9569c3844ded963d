"""Pass planning of K-FAC / EK-FAC: kept, re-run and part-kept first-pass gradients.

Every plan must give the scores of explicit dense curvature operators built in
the test (``kfac_helpers``), at instance and token level, and the same scores
as each other; the plan run is recorded in ``algorithm_meta["pass_plan"]``.
"""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, mlp_data, mlp_loss
from kfac_helpers import (
    dict_loss,
    dict_samples,
    linear_kronecker_scores,
    linear_kronecker_token_scores,
)

from dattri_llm.attribution.algorithm.kronecker import (
    FISHER_FILE,
    EKFACAttributor,
    KFACAttributor,
)
from dattri_llm.attribution.algorithm.kronecker.plan import (
    DEFAULT_KEPT_GRADIENT_BUDGET,
    KeptPasses,
)
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.task import AttributionTask

N_TRAIN, N_TEST, BATCH, DAMPING = 6, 3, 2, 0.05
METHODS = [(KFACAttributor, "kfac", 2), (EKFACAttributor, "ekfac", 3)]  # (cls, method, passes)


def _setup():
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    return model, train, test


def _attribute(tmp_path, cls, model, train, test, budget, granularity="instance"):
    args = AttributionArguments(
        output_dir=str(tmp_path / f"{budget}_{granularity}"),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=2,
    )
    attributor = cls(args, task=AttributionTask(dict_loss, model))
    return attributor.attribute(
        dict_samples(train),
        dict_samples(test),
        damping=DAMPING,
        kept_gradient_budget=budget,
        attribution_granularity=granularity,
    )


def _reference(model, train, test, method, token=False):
    model64 = MLP().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    train64 = tuple(t.double() for t in train)
    test64 = tuple(t.double() for t in test)
    fn = linear_kronecker_token_scores if token else linear_kronecker_scores
    return fn(model64, MLP_LAYERS, mlp_loss, train64, test64, method, DAMPING)


def _close(got, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4 * scale)


def _same(got, expected, method):
    """K-FAC plans run the same arithmetic: equal to 1e-6. An EK-FAC plan that keeps every
    block scores in the eigenbasis (no rotate-back), the others rotate the queries back:
    equal to float32 rounding (both within ~2e-6 of the float64 reference's scale and
    ~5e-7 of each other here)."""
    if method == "kfac":
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        return
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(("cls", "method", "passes"), METHODS)
def test_kept_rerun_and_part_kept_plans_score_identically(tmp_path, cls, method, passes):
    model, train, test = _setup()
    expected = _reference(model, train, test, method)
    kept = _attribute(tmp_path, cls, model, train, test, None)
    plan = kept.algorithm_meta["pass_plan"]
    blocks = N_TRAIN // BATCH
    assert plan["passes"] == passes and plan["source_passes"] == 1
    assert plan["kept_blocks"] == blocks and plan["recomputed_blocks"] == 0
    assert 0 < plan["budget_bytes"] <= DEFAULT_KEPT_GRADIENT_BUDGET  # min(1 GiB, share of free)
    block_bytes = plan["kept_bytes"] // blocks
    _close(kept.scores, expected)

    rerun = _attribute(tmp_path, cls, model, train, test, 0)
    assert rerun.algorithm_meta["pass_plan"]["source_passes"] == passes
    assert rerun.algorithm_meta["pass_plan"]["kept_bytes"] == 0
    _close(rerun.scores, expected)
    _same(rerun.scores, kept.scores, method)

    part = _attribute(tmp_path, cls, model, train, test, block_bytes + 1)  # one block fits
    plan = part.algorithm_meta["pass_plan"]
    assert (plan["kept_blocks"], plan["kept_bytes"]) == (1, block_bytes)
    assert plan["source_passes"] == passes
    assert plan["recomputed_blocks"] == (blocks - 1) * (passes - 1)
    _same(part.scores, kept.scores, method)
    assert part.train_ids == kept.train_ids == rerun.train_ids


@pytest.mark.parametrize(("cls", "method", "passes"), METHODS)
def test_budget_below_one_block_runs_the_rerun_plan(tmp_path, cls, method, passes):
    model, train, test = _setup()
    kept = _attribute(tmp_path, cls, model, train, test, None)
    block_bytes = kept.algorithm_meta["pass_plan"]["kept_bytes"] // (N_TRAIN // BATCH)
    small = _attribute(tmp_path, cls, model, train, test, block_bytes - 1)
    plan = small.algorithm_meta["pass_plan"]
    assert (plan["kept_blocks"], plan["kept_bytes"]) == (0, 0)
    assert plan["source_passes"] == passes == plan["passes"]
    _same(small.scores, kept.scores, method)


@pytest.mark.parametrize(("cls", "method", "passes"), METHODS)
def test_token_scores_identical_under_every_plan(tmp_path, cls, method, passes):
    model, train, test = _setup()
    expected = _reference(model, train, test, method, token=True)  # (N, T, n_test)
    tokens = expected.shape[1]
    results = [
        _attribute(tmp_path, cls, model, train, test, budget, "token")
        for budget in (None, 0, 500)  # all kept, re-run, one block of 408 bytes kept
    ]
    assert results[2].algorithm_meta["pass_plan"]["kept_blocks"] == 1
    for score in results:
        _close(score.scores.reshape(N_TRAIN, tokens, N_TEST), expected)
        _same(score.scores, results[0].scores, method)
    assert results[1].algorithm_meta["pass_plan"]["source_passes"] == passes


@pytest.mark.parametrize(("cls", "method", "passes"), METHODS)
def test_covariances_accumulated_once_per_layer_and_batch(
    tmp_path, cls, method, passes, monkeypatch
):
    from dattri_llm.gradient.ops import kronecker as ops_kronecker

    calls = []
    original = ops_kronecker.LayerKroneckerAccumulator.update

    def counted(self, *args, **kwargs):
        calls.append(args[2])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ops_kronecker.LayerKroneckerAccumulator, "update", counted)
    model, train, test = _setup()
    score = _attribute(tmp_path, cls, model, train, test, 0)  # every pass re-runs the model
    assert score.algorithm_meta["pass_plan"]["source_passes"] == passes
    assert len(calls) == len(MLP_LAYERS) * (N_TRAIN // BATCH)


@pytest.mark.parametrize("budget", [None, 0])
@pytest.mark.parametrize("factors", [True, False])
def test_ekfac_rotation_routes_give_identical_scores(tmp_path, factors, budget, monkeypatch):
    from dattri_llm.attribution.algorithm.kronecker import ekfac

    routes = []

    def rule(s, k, d):
        routes.append((s, k, d))
        return factors

    monkeypatch.setattr(ekfac, "ekfac_rotation_prefers_factors", rule)
    model, train, test = _setup()
    score = _attribute(tmp_path, EKFACAttributor, model, train, test, budget)
    assert routes  # the eigenvalue pass asked the cost rule for each factorized layer
    _close(score.scores, _reference(model, train, test, "ekfac"))


@pytest.mark.parametrize(
    ("budget", "granularity", "rotated_back"),
    [
        (None, "instance", False),
        (None, "token", False),
        (0, "instance", True),
        (500, "instance", True),
    ],
)
def test_ekfac_scores_kept_blocks_in_the_eigenbasis(
    tmp_path, budget, granularity, rotated_back, monkeypatch
):
    """Every block kept: the eigenvalue pass rotates them and the queries are not rotated
    back; a re-run or part-kept plan rotates the queries back. Scores match the reference."""
    from dattri_llm.attribution.algorithm.kronecker import ekfac

    calls = []
    original = ekfac.ekfac_precondition
    monkeypatch.setattr(
        ekfac, "ekfac_precondition", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    model, train, test = _setup()
    score = _attribute(tmp_path, EKFACAttributor, model, train, test, budget, granularity)
    assert bool(calls) == rotated_back
    expected = _reference(model, train, test, "ekfac", token=granularity == "token")
    _close(score.scores.reshape(expected.shape), expected)


def test_ekfac_rotates_only_the_gradient_side_when_full_rotations_exceed_the_budget(
    tmp_path, monkeypatch
):
    """Rotated factors gain the bias column (token scores keep factors): a budget that
    holds the captured blocks but not their full rotations keeps ``g·U_G`` only, and the
    queries are rotated back on the activation side; scores are unchanged."""
    from dattri_llm.attribution.algorithm.kronecker import ekfac

    model, train, test = _setup()
    first = _attribute(tmp_path, EKFACAttributor, model, train, test, None, "token")
    kept_bytes = first.algorithm_meta["pass_plan"]["kept_bytes"]
    modes = []
    original = ekfac.precondition_in_eigenbasis
    monkeypatch.setattr(
        ekfac,
        "precondition_in_eigenbasis",
        lambda coords, u_a, lam, mode: modes.append(mode) or original(coords, u_a, lam, mode),
    )
    tight = _attribute(tmp_path, EKFACAttributor, model, train, test, kept_bytes, "token")
    assert tight.algorithm_meta["pass_plan"]["kept_blocks"] == N_TRAIN // BATCH
    assert modes and set(modes) == {"gradient"}
    _same(tight.scores, first.scores, "ekfac")
    expected = _reference(model, train, test, "ekfac", token=True)
    _close(tight.scores.reshape(expected.shape), expected)


@pytest.mark.parametrize(("cls", "method", "passes"), METHODS)
@pytest.mark.parametrize("granularity", ["instance", "token"])
@pytest.mark.parametrize("budget", [None, 0])
def test_repeated_call_with_its_saved_fit_gives_the_same_bits(
    tmp_path, cls, method, passes, granularity, budget
):
    """A call that reads back the fit its first call wrote (same damping) returns that call's
    scores bit for bit: an EK-FAC fit whose plan kept every block is scored in the eigenbasis
    again. The repeat runs the model once."""
    model, train, test = _setup()
    args = AttributionArguments(
        output_dir=str(tmp_path / "o"),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=2,
    )
    attributor = cls(args, task=AttributionTask(dict_loss, model))

    def call():
        return attributor.attribute(
            dict_samples(train),
            dict_samples(test),
            damping=DAMPING,
            kept_gradient_budget=budget,
            attribution_granularity=granularity,
            fit_dir=str(tmp_path / "fit"),
        )

    first = call()
    assert first.algorithm_meta["pass_plan"]["source_passes"] == (1 if budget is None else passes)
    assert (tmp_path / "fit" / FISHER_FILE).is_file()
    again = call()
    assert torch.equal(again.scores, first.scores)
    assert again.algorithm_meta["pass_plan"]["source_passes"] == 1


def test_kept_passes_replay_without_recomputing_the_kept_suffix():
    class Source:
        reusable = True

        def __init__(self):
            self.produced = []

        def __len__(self):
            return 4

        def __iter__(self):
            for i in range(4):
                self.produced.append(i)
                yield i, _Block(100), [str(i)]

    source = Source()
    planned = KeptPasses(source, budget=250)  # the last two blocks fit
    assert [s for s, _, _ in planned] == [0, 1, 2, 3]
    assert [s for s, _, _ in planned] == [0, 1, 2, 3]
    planned.last_pass_next()
    assert [s for s, _, _ in planned] == [0, 1, 2, 3]
    assert source.produced == [0, 1, 2, 3, 0, 1, 0, 1]  # blocks 2, 3 never recomputed
    assert planned.plan() == {
        "passes": 3,
        "source_passes": 3,
        "kept_blocks": 2,
        "kept_bytes": 200,
        "recomputed_blocks": 4,
        "budget_bytes": 250,
    }
    assert len(planned) == 4 and planned.reusable


class _Block:
    def __init__(self, nbytes):
        self.nbytes = nbytes


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_budget_is_refused(tmp_path, bad):
    model, train, test = _setup()
    with pytest.raises(ValueError, match="kept_gradient_budget must be None"):
        _attribute(tmp_path, KFACAttributor, model, train, test, bad)


def test_default_budget_is_a_share_of_free_memory_capped_at_one_gib(monkeypatch):
    from dattri_llm.attribution.algorithm.kronecker import plan as plan_module

    free = {"bytes": 100 << 20}
    monkeypatch.setattr(plan_module, "free_memory_bytes", lambda device=None: free["bytes"])
    share = plan_module.KEPT_BUDGET_FREE_FRACTION
    assert plan_module.resolve_kept_budget(None) == int(share * (100 << 20))
    assert plan_module.resolve_kept_budget(None, "cuda:0") == int(share * (100 << 20))
    free["bytes"] = 64 << 30  # plenty free: the 1 GiB cap
    assert plan_module.resolve_kept_budget(None) == DEFAULT_KEPT_GRADIENT_BUDGET
    free["bytes"] = None  # unknown: the fixed value
    assert plan_module.resolve_kept_budget(None) == DEFAULT_KEPT_GRADIENT_BUDGET
    free["bytes"] = 1 << 20
    assert plan_module.resolve_kept_budget(12345) == 12345  # an explicit int is honoured
    assert plan_module.resolve_kept_budget(0) == 0


def test_attribute_resolves_the_default_budget_from_free_memory(tmp_path, monkeypatch):
    from dattri_llm.attribution.algorithm.kronecker import plan as plan_module

    model, train, test = _setup()
    monkeypatch.setattr(plan_module, "free_memory_bytes", lambda device=None: 4000)
    score = _attribute(tmp_path, KFACAttributor, model, train, test, None)
    assert score.algorithm_meta["pass_plan"]["budget_bytes"] == int(
        plan_module.KEPT_BUDGET_FREE_FRACTION * 4000
    )

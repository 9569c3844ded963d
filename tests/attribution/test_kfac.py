"""K-FAC / EK-FAC attributors against explicit dense curvature operators.

Covariances are formed in the test from hand-captured layer inputs / output
gradients, the curvature as an explicit dense matrix (``torch.kron``), and the
per-sample gradients from a loop of single-sample backwards (reference.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from attribution_helpers import (
    MLP,
    MLP_LAYERS,
    capture_factors,
    dense_reference,
    mlp_data,
    mlp_loss,
    sample_ids,
    write_store,
)
from kfac_helpers import (
    conv_rows,
    covariances,
    damped_inverse,
    dict_loss,
    dict_samples,
    ekfac_operator,
    kfac_operator,
    linear_rows,
)
from ops_helpers import expected_layout
from reference import per_sample_loop_grads
from torch import nn

from dattri_llm.attribution.algorithm.kronecker import (
    COVARIANCES_FILE,
    FISHER_FILE,
    EKFACAttributor,
    KFACAttributor,
)
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.task import AttributionTask

N_TRAIN, N_TEST, DAMPING = 6, 3, 0.05


def _args(path, **kw):
    return AttributionArguments(
        output_dir=str(path),
        use_cpu=True,
        per_device_train_batch_size=kw.pop("batch", 4),
        per_device_eval_batch_size=2,
        **kw,
    )


def _explicit_covariances(model, data):
    """``{layer: (A, G)}`` from hand-captured factors of the whole training set."""
    grad = capture_factors(model, MLP_LAYERS, mlp_loss, data)
    return {
        n: covariances(*linear_rows(grad.data[n].activation, grad.data[n].pre_activation_grad))
        for n in MLP_LAYERS
    }


def _reference(model, train, test, method, damping=DAMPING, relative=False):
    """Dense ``Σ_l g_tr F_l⁻¹ g_teᵀ`` with explicit operators (float64)."""
    model64 = MLP().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    train64 = tuple(t.double() for t in train)
    test64 = tuple(t.double() for t in test)
    g_tr = dense_reference(model64, MLP_LAYERS, mlp_loss, train64)
    g_te = dense_reference(model64, MLP_LAYERS, mlp_loss, test64)
    covs = _explicit_covariances(model64, train64)
    total = 0
    for name in MLP_LAYERS:
        A, G = covs[name]
        if method == "kfac":
            if relative:
                op = torch.kron(
                    damped_inverse(G, damping * G.trace() / G.shape[0]),
                    damped_inverse(A, damping * A.trace() / A.shape[0]),
                )
            else:
                op = kfac_operator(A, G, damping)
        else:
            op = ekfac_operator(A, G, g_tr[name], damping)
        total = total + g_tr[name] @ op @ g_te[name].T
    return total


def _check(score, expected, train, test, rtol):
    got = score.query(sample_ids(train[0]), sample_ids(test[0]))
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=rtol * scale)


@pytest.fixture
def stores(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    tr = write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4, 2])
    te = write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[2, 1])
    return model, train, test, tr.save_dir, te.save_dir


@pytest.mark.parametrize(("cls", "method"), [(KFACAttributor, "kfac"), (EKFACAttributor, "ekfac")])
def test_from_cache_matches_dense_operator(stores, tmp_path, cls, method):
    model, train, test, tr, te = stores
    score = cls(_args(tmp_path / "o")).attribute_from_cache(tr, te, damping=DAMPING)
    _check(score, _reference(model, train, test, method), train, test, 1e-4)
    assert score.algorithm == cls.algorithm
    assert score.algorithm_meta["damping"] == DAMPING
    assert score.algorithm_meta["direct_fim_layers"] == []


def test_fp64_tight(tmp_path):
    torch.manual_seed(0)
    model = MLP().double()
    train, test = mlp_data(N_TRAIN, 1, torch.float64), mlp_data(N_TEST, 2, torch.float64)
    tr = write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[3, 3])
    te = write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3])
    for cls, method in ((KFACAttributor, "kfac"), (EKFACAttributor, "ekfac")):
        score = cls(_args(tmp_path / method)).attribute_from_cache(tr.save_dir, te.save_dir)
        # The damped inverses are float32 by contract (ops.sym_inverse / dense_inverse),
        # so float64 stores agree with the float64 reference to float32 inverse accuracy.
        _check(score, _reference(model, train, test, method, 1e-3), train, test, 5e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stores_loose(tmp_path, dtype):
    """16-bit stores (accumulated in float32) stay within 5e-2 of the fp64 dense operator."""
    torch.manual_seed(0)
    model = MLP().to(dtype)
    train, test = mlp_data(N_TRAIN, 1, dtype), mlp_data(N_TEST, 2, dtype)
    tr = write_store(tmp_path / "tr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4, 2])
    te = write_store(tmp_path / "te", model, MLP_LAYERS, mlp_loss, test, batch_sizes=[3])
    for cls, method in ((KFACAttributor, "kfac"), (EKFACAttributor, "ekfac")):
        score = cls(_args(tmp_path / method)).attribute_from_cache(
            tr.save_dir, te.save_dir, damping=DAMPING
        )
        assert score.scores.dtype == torch.float32
        expected = _reference(model, train, test, method)
        got = score.query(sample_ids(train[0]), sample_ids(test[0])).double()
        assert ((got - expected).norm() / expected.norm()).item() < 5e-2, (cls, dtype)


def test_relative_damping_and_ekfac_modes(stores, tmp_path):
    model, train, test, tr, te = stores
    score = KFACAttributor(_args(tmp_path / "k")).attribute_from_cache(
        tr, te, damping=0.1, relative_damping=True
    )
    _check(score, _reference(model, train, test, "kfac", 0.1, relative=True), train, test, 1e-4)
    exact = EKFACAttributor(_args(tmp_path / "e")).attribute_from_cache(tr, te)
    approx = EKFACAttributor(_args(tmp_path / "a"), mode="approx").attribute_from_cache(tr, te)
    torch.testing.assert_close(approx.scores, exact.scores, rtol=1e-5, atol=1e-6)
    assert approx.algorithm_meta["mode"] == "approx"


@pytest.mark.parametrize("cls", [KFACAttributor, EKFACAttributor])
def test_materialized_store_with_covariances_equals_factorized(stores, tmp_path, cls):
    model, train, test, tr, te = stores
    dense_tr = write_store(
        tmp_path / "dtr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[4, 2], materialize=True
    )
    factorized = cls(_args(tmp_path / "f")).attribute_from_cache(tr, te)
    attributor = cls(_args(tmp_path / "d"))
    fisher_dir = attributor.fit(dense_tr.save_dir, covariances=_explicit_covariances(model, train))
    dense = attributor.attribute_from_cache(dense_tr.save_dir, te, fisher_dir=fisher_dir)
    torch.testing.assert_close(dense.scores, factorized.scores, rtol=1e-4, atol=1e-5)


def test_dense_layer_without_covariances_uses_dense_fisher(stores, tmp_path):
    model, train, test, _, te = stores
    dense_tr = write_store(
        tmp_path / "dtr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[6], materialize=True
    )
    with pytest.warns(UserWarning, match="dense empirical Fisher"):
        score = KFACAttributor(_args(tmp_path / "o")).attribute_from_cache(
            dense_tr.save_dir, te, damping=0.1
        )
    g_tr = dense_reference(model, MLP_LAYERS, mlp_loss, train)
    g_te = dense_reference(model, MLP_LAYERS, mlp_loss, test)
    expected = sum(
        g_tr[n] @ damped_inverse(g_tr[n].T @ g_tr[n] / N_TRAIN, 0.1) @ g_te[n].T for n in MLP_LAYERS
    )
    _check(score, expected, train, test, 1e-3)
    assert score.algorithm_meta["direct_fim_layers"] == sorted(MLP_LAYERS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        only_fc2 = KFACAttributor(_args(tmp_path / "p")).attribute_from_cache(
            dense_tr.save_dir, te, damping=0.1, direct_fim_max_params=20
        )
    assert any("exceed direct_fim_max_params=20" in str(w.message) for w in caught)
    assert only_fc2.algorithm_meta["direct_fim_layers"] == ["fc2"]


def test_pinned_materialized_pass_with_ekfac_needs_all_covariances(stores, tmp_path):
    model, train, _, _, _ = stores
    dense_tr = write_store(
        tmp_path / "dtr", model, MLP_LAYERS, mlp_loss, train, batch_sizes=[6], materialize=True
    )
    covs = _explicit_covariances(model, train)
    with pytest.raises(ValueError, match=r"eligible layers \['fc2'\]"):
        EKFACAttributor(_args(tmp_path / "o")).fit(
            dense_tr.save_dir, covariances={"fc1": covs["fc1"]}
        )


def test_fisher_dir_roundtrip_and_redamping(stores, tmp_path):
    model, train, test, tr, te = stores
    attributor = KFACAttributor(_args(tmp_path / "o"))
    fisher_dir = attributor.fit(tr)
    assert fisher_dir == tmp_path / "o" / "kfac_fisher"
    assert (fisher_dir / FISHER_FILE).is_file()
    score = attributor.attribute_from_cache(tr, te, fisher_dir=fisher_dir, damping=0.2)
    _check(score, _reference(model, train, test, "kfac", 0.2), train, test, 1e-4)
    # a call that fits writes its fit there; a second call re-damps it
    other = tmp_path / "fit2"
    first = attributor.attribute_from_cache(tr, te, fisher_dir=str(other))
    assert (other / FISHER_FILE).is_file()
    again = attributor.attribute_from_cache(tr, te, fisher_dir=str(other))
    assert torch.equal(first.scores, again.scores)
    with pytest.raises(ValueError, match="non_kfac_strategy"):
        attributor.attribute_from_cache(tr, te, fisher_dir=fisher_dir, non_kfac_strategy="direct")
    with pytest.raises(ValueError, match="KFAC fit, not EKFAC"):
        EKFACAttributor(_args(tmp_path / "e")).load_fisher(fisher_dir)
    with pytest.raises(ValueError, match="no fit"):
        attributor.load_fisher(tmp_path / "missing")


def test_cached_preconditioned_queries_equal_score(stores, tmp_path):
    _, _, _, tr, te = stores
    for cls in (KFACAttributor, EKFACAttributor):
        attributor = cls(_args(tmp_path / cls.algorithm))
        score = attributor.attribute_from_cache(tr, te)
        directory = attributor.cache_preconditioned_test(tr, te)
        assert directory.name == f"{cls.algorithm.lower()}_preconditioned_test"
        tracin = TracInAttributor(_args(tmp_path / "t")).attribute_from_cache(tr, directory)
        torch.testing.assert_close(tracin.scores, score.scores, rtol=1e-5, atol=1e-6)
        looped = attributor.attribute_from_cache(
            tr, te, loop_over_test=True, preconditioned_test_cache_residency="memory"
        )
        torch.testing.assert_close(looped.scores, score.scores, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="loop_over_test=True"):
        attributor.attribute_from_cache(tr, te, preconditioned_test_dir=str(tmp_path / "p"))


def test_factor_cache_residency_and_routes_identical(stores, tmp_path):
    _, _, _, tr, te = stores
    base = EKFACAttributor(_args(tmp_path / "a")).attribute_from_cache(tr, te)
    for residency in ("memory", "disk"):
        held = EKFACAttributor(_args(tmp_path / residency)).attribute_from_cache(
            tr, te, factor_cache_residency=residency
        )
        assert torch.equal(held.scores, base.scores)
    small = KFACAttributor(_args(tmp_path / "b", batch=1)).attribute_from_cache(tr, te)
    looped = KFACAttributor(_args(tmp_path / "c")).attribute_from_cache(tr, te, loop_over_test=True)
    torch.testing.assert_close(small.scores, looped.scores, rtol=1e-5, atol=1e-6)


def test_option_and_curvature_errors(stores, tmp_path):
    model, train, _, tr, te = stores
    attributor = KFACAttributor(_args(tmp_path / "o"))
    for bad in (
        {"damping": -1.0},
        {"non_kfac_strategy": "all"},
        {"direct_fim_max_params": 0},
        {"factor_cache_residency": "gpu"},
    ):
        with pytest.raises(ValueError):
            attributor.attribute_from_cache(tr, te, **bad)
    for bad in (float("nan"), float("inf")):  # rejected up front, before any fit pass
        with pytest.raises(ValueError, match=rf"damping must be a finite float >= 0, got {bad}"):
            attributor.attribute_from_cache(tr, te, damping=bad)
    with pytest.raises(ValueError, match="mode"):
        EKFACAttributor(_args(tmp_path / "e"), mode="fast")
    one = write_store(
        tmp_path / "one", model, MLP_LAYERS, mlp_loss, tuple(t[:1] for t in train), batch_sizes=[1]
    )
    for cls in (KFACAttributor, EKFACAttributor):
        with pytest.raises(ValueError, match="'fc1'.*singular|singular.*'fc1'|layer 'fc"):
            cls(_args(tmp_path / "s")).attribute_from_cache(one.save_dir, te, damping=0.0)
    covs = _explicit_covariances(model, train)
    covs["fc1"] = (covs["fc1"][0][:4, :4], covs["fc1"][1])
    with pytest.raises(ValueError, match=r"layer 'fc1'.*\(4, 4\)"):
        attributor.fit(tr, covariances=covs)


def test_live_cache_and_callback_covariances_identical(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    task = AttributionTask(dict_loss, model)
    train_ds, test_ds = dict_samples(train), dict_samples(test)
    for cls, method in ((KFACAttributor, "kfac"), (EKFACAttributor, "ekfac")):
        expected = _reference(model, train, test, method)
        live = cls(_args(tmp_path / f"{method}_live"), task=task).attribute(
            train_ds, test_ds, damping=DAMPING
        )
        got = live.agnostic_matrix()[1]
        scale = expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4 * scale)
        attributor = cls(_args(tmp_path / f"{method}_disk"), task=task)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # covariances recorded at capture: no Fisher fallback
            disk = attributor.attribute(
                train_ds, test_ds, gradient_cache_residency="disk", damping=DAMPING
            )
        torch.testing.assert_close(disk.scores, live.scores, rtol=1e-5, atol=1e-6)
        train_dir = tmp_path / f"{method}_disk" / "ckpt_0" / "train_grads"
        assert (train_dir / COVARIANCES_FILE).is_file()
        memory = cls(_args(tmp_path / f"{method}_mem"), task=task).attribute(
            train_ds, test_ds, gradient_cache_residency="memory", damping=DAMPING
        )
        torch.testing.assert_close(memory.scores, live.scores, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("residency", [None, "memory"])
def test_materialized_capture_uses_covariances_recorded_at_capture(tmp_path, residency):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    task = AttributionTask(dict_loss, model)
    train_ds, test_ds = dict_samples(train), dict_samples(test)
    pinned = HookManagerConfig(linear_io=list(MLP_LAYERS), capture_style="materialized")
    for cls, method in ((KFACAttributor, "kfac"), (EKFACAttributor, "ekfac")):
        attributor = cls(_args(tmp_path / method), task=task)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            score = attributor.attribute(
                train_ds,
                test_ds,
                hook_config=pinned,
                gradient_cache_residency=residency,
                damping=DAMPING,
            )
        expected = _reference(model, train, test, method)
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            score.agnostic_matrix()[1].double(), expected, rtol=1e-4, atol=1e-4 * scale
        )
        with pytest.raises(ValueError, match="capture_style='materialized'"):
            attributor.attribute(
                train_ds, test_ds, hook_config=pinned, covariances_at_capture=False
            )


class _NormNet(nn.Module):
    """fc1 → LayerNorm → fc2 on ``(B, 3, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.ln = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.fc1(x)))


class _ConvNet(nn.Module):
    """conv on ``(B, 2, 5, 5)`` → 9 patch tokens → linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 2, padding=1, stride=2)
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).flatten(2).transpose(1, 2))


def _net_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).sum()


@pytest.mark.parametrize("cls", [KFACAttributor, EKFACAttributor])
def test_norm_layers_use_dense_fisher_only_with_direct_strategy(tmp_path, cls):
    torch.manual_seed(0)
    model = _NormNet()
    layers = ("fc1", "ln", "fc2")
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    tr = write_store(tmp_path / "tr", model, layers, _net_loss, train, batch_sizes=[4, 2])
    te = write_store(tmp_path / "te", model, layers, _net_loss, test, batch_sizes=[3])
    g_tr = dense_reference(model, layers, _net_loss, train)
    g_te = dense_reference(model, layers, _net_loss, test)
    grad = capture_factors(model, layers, _net_loss, train)
    kfac_part = 0
    for name in ("fc1", "fc2"):
        f = grad.data[name]
        A, G = covariances(*linear_rows(f.activation, f.pre_activation_grad))
        op = kfac_operator(A, G, DAMPING) if cls is KFACAttributor else None
        if op is None:
            op = ekfac_operator(A, G, g_tr[name], DAMPING)
        kfac_part = kfac_part + g_tr[name] @ op @ g_te[name].T
    fisher = g_tr["ln"].T @ g_tr["ln"] / N_TRAIN
    norm_part = g_tr["ln"] @ damped_inverse(fisher, DAMPING) @ g_te["ln"].T
    ignore = cls(_args(tmp_path / "i")).attribute_from_cache(
        tr.save_dir, te.save_dir, damping=DAMPING
    )
    _check(ignore, kfac_part, train, test, 1e-4)
    direct = cls(_args(tmp_path / "d")).attribute_from_cache(
        tr.save_dir, te.save_dir, damping=DAMPING, non_kfac_strategy="direct"
    )
    _check(direct, kfac_part + norm_part, train, test, 1e-4)
    assert direct.algorithm_meta["direct_fim_layers"] == ["ln"]


def _conv_net_reference(model: _ConvNet, batch: tuple) -> dict[str, torch.Tensor]:
    """Per-sample ``{layer: (B, d)}`` in materialize layout (loop of single-sample backwards)."""
    grads = per_sample_loop_grads(model, _net_loss, batch)
    return {
        name: expected_layout(
            layer_type, {"weight": grads[f"{name}.weight"], "bias": grads[f"{name}.bias"]}
        )
        for name, layer_type in (("conv", "nn.Conv2d"), ("fc", "nn.Linear"))
    }


@pytest.mark.parametrize("cls", [KFACAttributor, EKFACAttributor])
def test_conv_layer_matches_dense_operator(tmp_path, cls):
    torch.manual_seed(0)
    model = _ConvNet()
    layers = ("conv", "fc")
    gen = torch.Generator().manual_seed(1)
    train = (
        torch.randn(N_TRAIN, 2, 5, 5, generator=gen),
        torch.randn(N_TRAIN, 9, 2, generator=gen),
    )
    test = (torch.randn(N_TEST, 2, 5, 5, generator=gen), torch.randn(N_TEST, 9, 2, generator=gen))
    tr = write_store(tmp_path / "tr", model, layers, _net_loss, train, batch_sizes=[3, 3])
    te = write_store(tmp_path / "te", model, layers, _net_loss, test, batch_sizes=[3])
    g_tr, g_te = _conv_net_reference(model, train), _conv_net_reference(model, test)
    grad = capture_factors(model, layers, _net_loss, train)
    f_conv, f_fc = grad.data["conv"], grad.data["fc"]
    covs = {
        "conv": covariances(*conv_rows(model.conv, f_conv.activation, f_conv.pre_activation_grad)),
        "fc": covariances(*linear_rows(f_fc.activation, f_fc.pre_activation_grad)),
    }
    expected = 0
    for name, (A, G) in covs.items():
        if cls is KFACAttributor:
            op = kfac_operator(A, G, DAMPING)
        else:
            op = ekfac_operator(A, G, g_tr[name], DAMPING)
        expected = expected + g_tr[name] @ op @ g_te[name].T
    score = cls(_args(tmp_path / "o")).attribute_from_cache(
        tr.save_dir, te.save_dir, damping=DAMPING
    )
    _check(score, expected, train, test, 1e-4)


def test_scoring_before_fit_and_foreign_fit_errors(stores, tmp_path):
    model, train, _, tr, te = stores
    attributor = KFACAttributor(_args(tmp_path / "o"))
    block = capture_factors(model, MLP_LAYERS, mlp_loss, train)
    with pytest.raises(ValueError, match="not fitted"):
        attributor.transform_test_rep(block)

    class _OneShot:
        reusable = False

        def __iter__(self):
            return iter([(0, block, sample_ids(train[0]))])

    with pytest.raises(ValueError, match="not reusable"):
        attributor.fit_raw(_OneShot())
    # a fit of another model (other widths) applied to these stores names the layer
    torch.manual_seed(0)
    wide = _NormNet()
    wide.fc1 = nn.Linear(4, 7)
    wide.ln = nn.LayerNorm(7)
    wide.fc2 = nn.Linear(7, 3)
    other = write_store(
        tmp_path / "other", wide, MLP_LAYERS, _net_loss, train, batch_sizes=[N_TRAIN]
    )
    fisher_dir = attributor.fit(other.save_dir)
    with pytest.raises(ValueError, match=r"layer 'fc1'.*A_inv is \(5, 5\)"):
        attributor.attribute_from_cache(tr, te, fisher_dir=fisher_dir)


def test_curvature_methods_score_the_first_checkpoint_only(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = MLP()
    train, test = mlp_data(N_TRAIN, 1), mlp_data(N_TEST, 2)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    other = {k: torch.randn_like(v) for k, v in first.items()}
    task = AttributionTask(dict_loss, model, checkpoints=[first, other])
    train_ds, test_ds = dict_samples(train), dict_samples(test)
    expected = _reference(model, train, test, "kfac")
    attributor = KFACAttributor(_args(tmp_path), task=task)
    assert attributor.num_checkpoints() == 2
    with pytest.warns(UserWarning, match="first checkpoint only"):
        assert attributor.checkpoints() == [0]
    with pytest.warns(UserWarning, match="first checkpoint only"):
        score = attributor.attribute(train_ds, test_ds, damping=DAMPING)
    assert score.row_steps == [0] * N_TRAIN and score.algorithm_meta["n_checkpoints"] == 1
    scale = expected.abs().max().item()
    torch.testing.assert_close(
        score.agnostic_matrix()[1].double(), expected, rtol=1e-4, atol=1e-4 * scale
    )

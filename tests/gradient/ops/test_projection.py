"""Projection, masking and the seeded projector (dattri_llm.gradient.ops.projection)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
from projection_helpers import capture_factors, reference_grads, reference_layout
from torch import nn

from dattri_llm.gradient.gradient import Factorized
from dattri_llm.gradient.ops import projector as proj_mod
from dattri_llm.gradient.ops.materialize import materialize_factors
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.gradient.ops.projection import (
    CAPTURE_STYLES,
    MASK_KEYS,
    PROJECTION_STYLES,
    DattriProjector,
    ProjectionMatrix,
    apply_projection,
    mask_coordinates,
    mask_factorized,
    mask_factors,
    mask_materialized,
    maybe_materialize_projected,
    project_activation,
    project_factorized,
    project_factors,
    project_gradient,
    project_layer,
    project_materialized,
    project_materialized_factors,
    random_project,
    should_materialize,
)
from dattri_llm.utils.cache import TensorCache

TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}
PROJ_TYPES = ("normal", "rademacher", "sjlt", "grass")


def _randn(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ids(high, *shape, seed=2):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _module(factory, dtype):
    torch.manual_seed(0)
    return factory().to(dtype)


# name -> (module factory, input factory(dtype), layer_type)
LAYERS = {
    "linear_bias": (lambda: nn.Linear(5, 4), lambda dt: _randn(3, 6, 5, dtype=dt), "nn.Linear"),
    "linear_nobias_2d": (
        lambda: nn.Linear(5, 4, bias=False),
        lambda dt: _randn(3, 5, dtype=dt),
        "nn.Linear",
    ),
    "conv2d_grouped": (
        lambda: nn.Conv2d(4, 6, 3, padding=1, stride=2, groups=2),
        lambda dt: _randn(2, 4, 5, 5, dtype=dt),
        "nn.Conv2d",
    ),
    "conv_transpose1d": (
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1),
        lambda dt: _randn(2, 3, 5, dtype=dt),
        "nn.ConvTranspose1d",
    ),
    "conv_transpose2d_grouped_nobias": (
        lambda: nn.ConvTranspose2d(4, 2, 2, groups=2, bias=False),
        lambda dt: _randn(2, 4, 3, 3, dtype=dt),
        "nn.ConvTranspose2d",
    ),
    "embedding_padding": (
        lambda: nn.Embedding(11, 4, padding_idx=0),
        lambda dt: _ids(11, 3, 7),
        "nn.Embedding",
    ),
    "layer_norm": (lambda: nn.LayerNorm(6), lambda dt: _randn(3, 4, 6, dtype=dt), "nn.LayerNorm"),
}
OUTER_LAYERS = [k for k in LAYERS if not k.startswith(("layer_norm", "embedding"))]


def _case(name, dtype=torch.float32):
    factory, make_x, layer_type = LAYERS[name]
    module = _module(factory, dtype)
    x = make_x(dtype)
    a, g = capture_factors(module, x)
    ref = reference_layout(module, reference_grads(module, x))
    return a, g, layer_type, extract_module_kwargs(module, layer_type), ref


# =========================================================================== constants / rules


def test_constants():
    assert PROJECTION_STYLES == ("logra", "dense", "mask")
    assert CAPTURE_STYLES == ("factorized", "materialized", "auto")
    assert MASK_KEYS == frozenset({"style", "proj_dim", "proj_seed", "include_bias", "device"})


def test_capture_style_rule():
    assert maybe_materialize_projected(2, 4, 4)  # threshold 4·4/8 = 2
    assert not maybe_materialize_projected(1, 4, 4)
    assert not maybe_materialize_projected(3, 4, 4, kappa=2.0)
    assert not maybe_materialize_projected(100, 0, 0)
    assert not should_materialize("factorized", 10**6, 1, 1)
    assert should_materialize("materialized", 1, 10**6, 10**6)
    assert should_materialize("auto", 2, 4, 4) and not should_materialize("auto", 1, 4, 4)
    with pytest.raises(ValueError, match="capture_style"):
        should_materialize("dense", 1, 1, 1)


# =========================================================================== seeding


_DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from dattri_llm.gradient.ops.projection import DattriProjector, random_project
    p = DattriProjector(random_project)
    out = {t: p.matrix(37, proj_dim=6, proj_seed=5, device="cpu", dtype=torch.float32,
                       proj_type=t) for t in PROJ_TYPES}
    out["mask"] = p.mask_indices(1000, proj_dim=17, proj_seed=5, device="cpu")
    torch.save(out, sys.argv[1])
    """
)


@pytest.mark.slow
def test_same_seed_same_matrices_in_another_process(tmp_path):
    path = tmp_path / "matrices.pt"
    script = _DETERMINISM_SCRIPT.replace("PROJ_TYPES", repr(PROJ_TYPES))
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=120)
    other = torch.load(path)
    here = DattriProjector(random_project)
    for t in PROJ_TYPES:
        mine = here.matrix(
            37, proj_dim=6, proj_seed=5, device="cpu", dtype=torch.float32, proj_type=t
        )
        assert torch.equal(mine, other[t]), t
    assert torch.equal(
        here.mask_indices(1000, proj_dim=17, proj_seed=5, device="cpu"), other["mask"]
    )


@pytest.mark.parametrize("proj_type", PROJ_TYPES)
def test_seed_determinism_across_instances(proj_type):
    kw = dict(proj_dim=8, device="cpu", dtype=torch.float32, proj_type=proj_type)
    first = DattriProjector(random_project).matrix(300, proj_seed=3, **kw)
    second = DattriProjector(random_project).matrix(300, proj_seed=3, **kw)
    other_seed = DattriProjector(random_project).matrix(300, proj_seed=4, **kw)
    assert torch.equal(first, second)
    assert not torch.equal(first, other_seed)


def test_default_projector_resolves_to_a_working_factory():
    factory = DattriProjector().factory
    try:
        import dattri  # noqa: F401
    except ImportError:
        assert factory is random_project
    m1 = DattriProjector().matrix(10, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float32)
    m2 = DattriProjector(None).matrix(
        10, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float32
    )
    assert m1.shape == (10, 3) and torch.equal(m1, m2)


def test_builtin_matrix_is_independent_of_identity_chunking(monkeypatch):
    kw = dict(proj_dim=5, proj_seed=1, device="cpu", dtype=torch.float32, proj_type="grass")
    whole = DattriProjector(random_project).matrix(2500, grass_mask_dim=40, **kw)
    monkeypatch.setattr(proj_mod, "_IDENTITY_CHUNK_ROWS", 333)
    chunked = DattriProjector(random_project).matrix(2500, grass_mask_dim=40, **kw)
    assert torch.equal(whole, chunked)
    assert int((whole.abs().sum(1) > 0).sum()) == 40  # exactly grass_mask_dim rows kept


@pytest.mark.parametrize("proj_type", PROJ_TYPES)
def test_builtin_factory_protocol_matches_matrix(proj_type):
    x = _randn(7, 1500)
    fn = random_project(x, 7, proj_dim=9, proj_seed=2, device="cpu", proj_type=proj_type)
    m = DattriProjector(random_project).matrix(
        1500, proj_dim=9, proj_seed=2, device="cpu", dtype=torch.float32, proj_type=proj_type
    )
    torch.testing.assert_close(fn(x), x @ m, rtol=1e-5, atol=1e-5)
    assert fn(x).shape == (7, 9)


def test_builtin_factory_rejects_bad_arguments():
    x = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="proj_type"):
        random_project(x, 2, proj_dim=3, proj_type="fourier")
    with pytest.raises(ValueError, match="sjlt_c"):
        random_project(x, 2, proj_dim=3, proj_type="sjlt", sjlt_c=4)
    with pytest.raises(ValueError, match="grass_mask_dim"):
        random_project(x, 2, proj_dim=3, proj_type="grass", grass_mask_dim=11)
    with pytest.raises(TypeError, match="feature"):
        random_project({"w": x}, 2, proj_dim=3)
    with pytest.raises(ValueError, match=r"\(n, 10\)"):
        random_project(x, 2, proj_dim=3)(torch.zeros(2, 11))


def test_mask_indices_follow_the_normative_seed_rule():
    d, k, seed = 1000, 17, 5
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + d) * 1_000_003 + k) & (2**63 - 1))
    expected = torch.randperm(d, generator=gen)[:k].sort().values
    got = DattriProjector().mask_indices(d, proj_dim=k, proj_seed=seed, device="cpu")
    assert got.dtype == torch.long and torch.equal(got, expected)
    for bad in (0, d + 1):
        with pytest.raises(ValueError, match="proj_dim"):
            DattriProjector().mask_indices(d, proj_dim=bad, proj_seed=0, device="cpu")


# =========================================================================== JL property


def _jl_error(matrix: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Worst relative error of squared norms and of inner products (scaled by ‖x‖‖y‖)."""
    xp, yp = x @ matrix, y @ matrix
    norm_err = ((xp.square().sum(1) / x.square().sum(1)) - 1).abs().max()
    scale = x.norm(dim=1) * y.norm(dim=1)
    ip_err = (((xp * yp).sum(1) - (x * y).sum(1)).abs() / scale).max()
    return float(max(norm_err, ip_err))


@pytest.mark.parametrize(
    "proj_type,kw",
    [
        ("normal", {}),
        ("rademacher", {}),
        ("sjlt", {}),
        ("sjlt", {"sjlt_c": 4}),
        ("grass", {}),
        ("grass", {"grass_mask_dim": 1024}),
    ],
)
def test_jl_inner_products_and_norms_are_preserved(proj_type, kw):
    d, k, tol = 2000, 512, 0.3
    x = _randn(16, d, seed=3)
    y = x + _randn(16, d, seed=4)  # correlated pairs: <x, y> ≈ ‖x‖²
    m = DattriProjector(random_project).matrix(
        d, proj_dim=k, proj_seed=7, device="cpu", dtype=torch.float32, proj_type=proj_type, **kw
    )
    assert _jl_error(m, x, y) < tol
    # negative controls: the same check fails for broken maps
    assert _jl_error(m * math.sqrt(k), x, y) > tol  # missing 1/√k scaling
    assert _jl_error(torch.eye(d)[:, :k], x, y) > tol  # identity truncation
    assert _jl_error(m * 0.5, x, y) > tol  # wrong scale


# =========================================================================== projector object


def test_projector_caches_and_clears_matrices():
    calls = []

    def counting(feature, rows, *, proj_dim, proj_seed, device, **kw):
        calls.append(rows)
        return random_project(feature, rows, proj_dim=proj_dim, proj_seed=proj_seed, device=device)

    with DattriProjector(counting) as p:
        m = p.matrix(20, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float32)
        assert p.matrix(20, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float32) is m
        assert calls == [20]
        m64 = p.matrix(20, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float64)
        assert m64.dtype == torch.float64 and torch.equal(m64.float(), m) and len(calls) == 2
        p.matrix(20, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float32, extra=[1, 2])
        assert len(calls) == 3 and len(p.cache) == 3
        p.clear()
        assert len(p.cache) == 0
    assert len(p.cache) == 0
    p.matrix(20, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float32)  # still usable
    assert len(calls) == 4


def test_projector_coerce_and_shared_cache():
    cache = TensorCache("memory")
    p = DattriProjector(random_project, cache=cache)
    assert DattriProjector.coerce(p) is p and p.cache is cache and p.factory is random_project
    wrapped = DattriProjector.coerce(random_project)
    assert isinstance(wrapped, DattriProjector) and wrapped.factory is random_project
    with pytest.raises(TypeError, match="factory"):
        DattriProjector("normal")


def test_factory_with_wrong_output_shape_is_rejected():
    def bad(feature, rows, *, proj_dim, proj_seed, device):
        return lambda x: x[:, :2]

    with pytest.raises(ValueError, match="random_project protocol"):
        DattriProjector(bad).matrix(5, proj_dim=3, proj_seed=0, device="cpu", dtype=torch.float32)


def test_apply_bias_row_integer_input_and_projection_matrix():
    p = DattriProjector(random_project)
    x = _randn(2, 3, 6)
    with_bias = p.apply(x, proj_dim=4, proj_seed=1, include_bias=True)
    ones = torch.ones(2, 3, 1)
    torch.testing.assert_close(
        with_bias, p.apply(torch.cat([x, ones], -1), proj_dim=4, proj_seed=1), **TOLS[torch.float32]
    )
    m = p.matrix(6, proj_dim=4, proj_seed=1, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(p.apply(x, proj_dim=4, proj_seed=1), x @ m, rtol=0, atol=0)
    ints = torch.arange(12).reshape(2, 6)
    torch.testing.assert_close(p.apply(ints, proj_dim=4, proj_seed=1), ints.float() @ m)
    resolved = p.resolve(6, proj_dim=4, proj_seed=1, include_bias=True, device="cpu", dtype=x.dtype)
    assert isinstance(resolved, ProjectionMatrix)
    assert (resolved.d_in, resolved.proj_dim, resolved.bias_row.shape) == (6, 4, (4,))
    assert resolved.matches(x) and not resolved.matches(x.double())
    assert not resolved.matches(torch.zeros(2, 7))
    assert torch.equal(resolved(x), with_bias)
    with pytest.raises(ValueError, match="d_in=6"):
        resolved(torch.zeros(2, 7))
    out = apply_projection(random_project, x, proj_dim=4, proj_seed=1, device="cpu")
    assert torch.equal(out, p.apply(x, proj_dim=4, proj_seed=1))


# =========================================================================== logra


def _kronecker_reference(ref, a_shape_k, g_width, layer_type, p, k, seed, dtype):
    """Project reference grads with P_g ⊗ P_a: rows (k_g, k_a) of P_gᵀ·dW·P_a.

    Conv-transpose and embedding layouts are a-side first ``(K_a, D_g)``.
    """
    p_g = p.matrix(g_width, proj_dim=k, proj_seed=seed, device="cpu", dtype=dtype)
    p_a = p.matrix(a_shape_k, proj_dim=k, proj_seed=seed + 1, device="cpu", dtype=dtype)
    batch = ref.shape[0]
    if layer_type.startswith("nn.ConvTranspose") or layer_type == "nn.Embedding":
        dw = ref.reshape(batch, a_shape_k, g_width)
        return torch.einsum("bkd,dp,kq->bpq", dw, p_g, p_a).reshape(batch, -1)
    dw = ref.reshape(batch, g_width, a_shape_k)
    return torch.einsum("bdk,dp,kq->bpq", dw, p_g, p_a).reshape(batch, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", OUTER_LAYERS + ["embedding_padding"])
def test_logra_equals_kronecker_projection_of_reference(name, dtype):
    a, g, layer_type, mk, ref = _case(name, dtype)
    p, k, seed = DattriProjector(random_project), 3, 11
    a_p, g_p = project_factors(a, g, layer_type, p, mk, proj_dim=k, proj_seed=seed)
    assert a_p.shape[-1] == g_p.shape[-1] == k and a_p.dtype == dtype
    got = torch.einsum("bsp,bsq->bpq", g_p.reshape(len(g_p), -1, k), a_p.reshape(len(a_p), -1, k))
    # widths of the preprocessed factors (bias folded) from the reference layout
    if layer_type == "nn.Embedding":
        a_width, g_width = mk["num_embeddings"], g.shape[-1]
    elif layer_type.startswith("nn.ConvTranspose"):
        a_width = a.shape[1] + int(mk["has_bias"])
        g_width = ref.shape[1] // a_width
    else:
        g_width = g.shape[1] if layer_type.startswith("nn.Conv") else g.shape[-1]
        a_width = ref.shape[1] // g_width
    expected = _kronecker_reference(ref, a_width, g_width, layer_type, p, k, seed, dtype)
    torch.testing.assert_close(got.reshape(len(got), -1), expected, **TOLS[dtype])


def test_logra_embedding_activation_is_one_hot_projection():
    a, g, layer_type, mk, _ = _case("embedding_padding")
    p = DattriProjector(random_project)
    a_p, _ = project_factors(a, g, layer_type, p, mk, proj_dim=4, proj_seed=2)
    one_hot = torch.nn.functional.one_hot(a, mk["num_embeddings"]).float()
    torch.testing.assert_close(a_p, p.apply(one_hot, proj_dim=4, proj_seed=3), rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_embeddings"):
        project_factors(a, g, layer_type, p, None, proj_dim=4)
    with pytest.raises(ValueError, match=r"outside \[0, 11\)"):
        project_factors(a + 11, g, layer_type, p, mk, proj_dim=4)


@pytest.mark.parametrize("name", ["linear_bias", "linear_nobias_2d"])
def test_activation_then_gradient_projection_equals_project_factors(name):
    a, g, layer_type, mk, _ = _case(name)
    p = DattriProjector(random_project)
    a_p, g_p = project_factors(a, g, layer_type, p, mk, proj_dim=4, proj_seed=6)
    assert torch.equal(a_p, project_activation(a, layer_type, p, mk, proj_dim=4, proj_seed=6))
    assert torch.equal(g_p, project_gradient(g, layer_type, p, mk, proj_dim=4, proj_seed=6))
    assert a_p.shape == a.shape[:-1] + (4,)
    with pytest.raises(ValueError, match="linear"):
        project_activation(_randn(2, 3, 5), "nn.Conv1d", p, None, proj_dim=2)
    with pytest.raises(ValueError, match="linear"):
        project_gradient(_randn(2, 3, 5), "nn.Embedding", p, None, proj_dim=2)


def test_linear_extra_position_axes_are_folded():
    module = _module(lambda: nn.Linear(4, 3), torch.float32)
    x = _randn(2, 3, 5, 4)
    a, g = capture_factors(module, x)
    mk = extract_module_kwargs(module, "nn.Linear")
    ref = reference_layout(module, reference_grads(module, x))
    p = DattriProjector(random_project)
    a_p, g_p = project_factors(a, g, "nn.Linear", p, mk, proj_dim=2, proj_seed=0)
    assert a_p.shape == (2, 15, 2) and g_p.shape == (2, 15, 2)
    got = torch.einsum("bsp,bsq->bpq", g_p, a_p).reshape(2, -1)
    torch.testing.assert_close(
        got, _kronecker_reference(ref, 5, 3, "nn.Linear", p, 2, 0, torch.float32)
    )


def test_logra_on_norm_layer_raises_naming_the_type():
    a, g, layer_type, mk, _ = _case("layer_norm")
    with pytest.raises(ValueError, match=r"nn\.LayerNorm.*'dense' or 'mask'"):
        project_factors(a, g, layer_type, None, mk, proj_dim=2)
    with pytest.raises(ValueError, match=r"nn\.LayerNorm"):
        project_layer(Factorized(a, g, mk), layer_type, None, style="logra", proj_dim=2)


def test_logra_bf16_is_close_to_fp32():
    a, g, layer_type, mk, _ = _case("linear_bias")
    p = DattriProjector(random_project)
    a32, g32 = project_factors(a, g, layer_type, p, mk, proj_dim=4)
    a16, g16 = project_factors(a.bfloat16(), g.bfloat16(), layer_type, p, mk, proj_dim=4)
    assert a16.dtype == torch.bfloat16
    for lo, hi in ((a16, a32), (g16, g32)):
        assert (lo.float() - hi).norm() / hi.norm() < 2e-2


# =========================================================================== dense


@pytest.mark.parametrize(
    "name", ["linear_bias", "conv_transpose1d", "layer_norm", "embedding_padding"]
)
def test_dense_projection_equals_reference_times_matrix(name):
    a, g, layer_type, mk, ref = _case(name)
    p = DattriProjector(random_project)
    got = project_materialized_factors(a, g, layer_type, p, mk, proj_dim=5, proj_seed=4)
    m = p.matrix(ref.shape[1], proj_dim=5, proj_seed=4, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(got, ref @ m, rtol=1e-5, atol=1e-5)
    f = Factorized(a, g, mk)
    assert torch.equal(project_materialized(f, layer_type, p, proj_dim=5, proj_seed=4), got)
    dense = materialize_factors(a, g, layer_type, mk)
    assert torch.equal(project_materialized(dense, layer_type, p, proj_dim=5, proj_seed=4), got)


# =========================================================================== mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(LAYERS))
def test_mask_entries_equal_reference_entries(name, dtype):
    a, g, layer_type, mk, ref = _case(name, dtype)
    p = DattriProjector()
    k = max(1, ref.shape[1] // 3)
    idx = p.mask_indices(ref.shape[1], proj_dim=k, proj_seed=9, device="cpu")
    got = mask_factors(a, g, layer_type, p, mk, proj_dim=k, proj_seed=9, style="mask")
    assert got.shape == (ref.shape[0], k) and got.dtype == dtype
    torch.testing.assert_close(got, ref[:, idx], **TOLS[dtype])
    full = mask_factors(a, g, layer_type, p, mk, proj_dim=ref.shape[1], proj_seed=9)
    torch.testing.assert_close(full, ref, **TOLS[dtype])  # proj_dim = d keeps every coordinate


def test_mask_linear_without_bias_folding_and_final_factors():
    a, g, layer_type, mk, ref = _case("linear_bias")
    p = DattriProjector()
    nobias = ref.reshape(3, 4, 6)[:, :, :5].reshape(3, -1)
    idx = p.mask_indices(20, proj_dim=7, proj_seed=0, device="cpu")
    got = mask_factors(a, g, layer_type, p, mk, include_bias=False, proj_dim=7)
    torch.testing.assert_close(got, nobias[:, idx], **TOLS[torch.float32])
    assert torch.equal(mask_factors(a, g, layer_type, p, None, proj_dim=7), got)


def test_mask_factorized_sequence_first_and_dense_inputs():
    a, g, layer_type, mk, ref = _case("linear_bias")
    p = DattriProjector()
    expected = mask_factors(a, g, layer_type, p, mk, proj_dim=10, proj_seed=1)
    seq_first = Factorized(a.transpose(0, 1), g.transpose(0, 1), mk, batch_first=False)
    assert torch.equal(
        mask_factorized(seq_first, layer_type, p, proj_dim=10, proj_seed=1), expected
    )
    dense_masked = mask_factorized(ref, layer_type, p, proj_dim=10, proj_seed=1)
    torch.testing.assert_close(dense_masked, expected, **TOLS[torch.float32])
    assert torch.equal(mask_materialized(ref, p, proj_dim=10, proj_seed=1), dense_masked)


def test_mask_bf16_is_close_to_reference():
    a, g, layer_type, mk, ref = _case("conv2d_grouped")
    p = DattriProjector()
    got = mask_factors(a.bfloat16(), g.bfloat16(), layer_type, p, mk, proj_dim=20)
    idx = p.mask_indices(ref.shape[1], proj_dim=20, proj_seed=0, device="cpu")
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref[:, idx]).norm() / ref[:, idx].norm() < 2e-2


def test_mask_rejects_foreign_keys_and_bad_widths():
    a, g, layer_type, mk, _ = _case("linear_bias")
    with pytest.raises(ValueError, match=r"'mask' accepts only.*proj_type"):
        mask_factors(a, g, layer_type, None, mk, proj_dim=3, proj_type="normal")
    with pytest.raises(ValueError, match="proj_max_batch_size"):
        mask_materialized(torch.zeros(2, 5), None, proj_dim=2, proj_max_batch_size=8)
    with pytest.raises(ValueError, match=r"nn\.Linear.*0 < proj_dim <= 24"):
        mask_factors(a, g, layer_type, None, mk, proj_dim=25)
    with pytest.raises(ValueError, match="num_embeddings"):
        mask_factors(_ids(5, 2, 3), _randn(2, 3, 4), "nn.Embedding", None, None, proj_dim=2)
    with pytest.raises(ValueError, match="mask"):
        project_layer(Factorized(a, g, mk), layer_type, None, style="mask", proj_dim=3, sjlt_c=2)


def test_mask_coordinates_from_config():
    p = DattriProjector()
    config = {"lin": {"style": "mask", "proj_dim": 4, "proj_seed": 2}, "__default__": None}
    expected = p.mask_indices(30, proj_dim=4, proj_seed=2, device="cpu")
    assert torch.equal(mask_coordinates(config, "lin", 30, p), expected)
    assert mask_coordinates(None, "lin", 30, p) is None
    assert mask_coordinates({"other": {"style": "mask", "proj_dim": 4}}, "lin", 30, p) is None
    default = {"__default__": {"style": "mask", "proj_dim": 3}}
    assert torch.equal(
        mask_coordinates(default, "any", 30, p),
        p.mask_indices(30, proj_dim=3, proj_seed=0, device="cpu"),
    )
    with pytest.raises(ValueError, match="'lin'.*'logra'"):
        mask_coordinates({"lin": {"style": "logra", "proj_dim": 3}}, "lin", 30, p)


# =========================================================================== project_layer


def test_project_layer_styles_and_capture_styles():
    a, g, layer_type, mk, ref = _case("linear_bias")
    f = Factorized(a, g, mk)
    p = DattriProjector(random_project)
    (a_p, g_p), kept = project_layer(f, layer_type, p, style="logra", proj_dim=4, proj_seed=1)
    assert kept and (a_p.shape, g_p.shape) == ((3, 6, 4), (3, 6, 4))
    expected_a, expected_g = project_factorized(f, layer_type, p, proj_dim=4, proj_seed=1)
    assert torch.equal(a_p, expected_a) and torch.equal(g_p, expected_g)
    dense_logra, kept = project_layer(
        f, layer_type, p, capture_style="materialized", proj_dim=4, proj_seed=1
    )
    assert not kept
    torch.testing.assert_close(
        dense_logra, torch.einsum("bsp,bsq->bpq", g_p, a_p).reshape(3, 16), **TOLS[torch.float32]
    )
    # auto: seq_len 6 >= 4·4/8 → materialized; a 2-D capture (seq_len 1) stays factorized
    assert not project_layer(f, layer_type, p, capture_style="auto", proj_dim=4)[1]
    a2, g2, _, mk2, _ = _case("linear_nobias_2d")
    assert project_layer(Factorized(a2, g2, mk2), layer_type, p, capture_style="auto", proj_dim=4)[
        1
    ]
    dense, kept = project_layer(f, layer_type, p, style="dense", proj_dim=5)
    assert not kept and torch.equal(dense, project_materialized(f, layer_type, p, proj_dim=5))
    masked, kept = project_layer(f, layer_type, p, style="mask", proj_dim=5, device="cpu")
    assert not kept and torch.equal(masked, mask_factorized(f, layer_type, p, proj_dim=5))
    # a dense tensor under "logra" is projected as "dense"
    from_tensor, kept = project_layer(ref, layer_type, p, style="logra", proj_dim=5)
    assert not kept and torch.equal(
        from_tensor, project_materialized(ref, layer_type, p, proj_dim=5)
    )
    with pytest.raises(ValueError, match="unknown projection style"):
        project_layer(f, layer_type, p, style="random", proj_dim=2)
    with pytest.raises(ValueError, match="capture_style"):
        project_layer(f, layer_type, p, capture_style="lazy", proj_dim=2)
    with pytest.raises(ValueError, match="proj_dim"):
        project_layer(f, layer_type, p)


# =========================================================================== CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_projection_matches_cpu():
    p = DattriProjector(random_project)
    kw = dict(proj_dim=6, proj_seed=2, dtype=torch.float32)
    cpu = p.matrix(50, device="cpu", **kw)
    gpu = p.matrix(50, device="cuda", **kw)
    assert gpu.is_cuda
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-6, atol=1e-7)
    x = _randn(3, 50)
    out = p.apply(x, proj_dim=6, proj_seed=2, device="cuda")
    assert out.is_cuda
    torch.testing.assert_close(out.cpu(), x @ cpu, rtol=1e-4, atol=1e-5)
    idx = p.mask_indices(100, proj_dim=7, proj_seed=1, device="cuda")
    assert idx.is_cuda and torch.equal(
        idx.cpu(), p.mask_indices(100, proj_dim=7, proj_seed=1, device="cpu")
    )
    a, g, layer_type, mk, ref = _case("conv2d_grouped")
    got = mask_factors(a, g, layer_type, p, mk, proj_dim=9, device="cuda")
    cpu_idx = p.mask_indices(ref.shape[1], proj_dim=9, proj_seed=0, device="cpu")
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), ref[:, cpu_idx], rtol=1e-4, atol=1e-5)
    a_p, g_p = project_factors(a.cuda(), g.cuda(), layer_type, p, mk, proj_dim=3)
    c_a, c_g = project_factors(a, g, layer_type, p, mk, proj_dim=3)
    torch.testing.assert_close(a_p.cpu(), c_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g_p.cpu(), c_g, rtol=1e-4, atol=1e-5)

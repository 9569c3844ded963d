"""Contract check: public signatures of the gradient model, ``ops``, projection and ``utils``.

Every expected signature below is transcribed by hand from the specification
(``gradient-model.md``, ``ops.md``, ``projection.md``, ``utils.md``), written the
way the spec writes it. The test compiles it into a dummy function and compares
parameter names, order, kinds and defaults with the implementation, so any drift
from the contract fails here. Annotations are not compared (the spec gives
shapes, not type expressions), but their presence is checked separately.

Deliberate, documented extensions of the contract are marked ``# extension``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

GRADIENT = "dattri_llm.gradient.gradient"
TYPES = "dattri_llm.gradient.ops.types"
PREPROCESS = "dattri_llm.gradient.ops.preprocess"
MATERIALIZE = "dattri_llm.gradient.ops.materialize"
DOT = "dattri_llm.gradient.ops.dot"
KRONECKER = "dattri_llm.gradient.ops.kronecker"
OPTIMIZER = "dattri_llm.gradient.ops.optimizer"
DTYPES = "dattri_llm.gradient.ops.dtypes"
PROJECTION = "dattri_llm.gradient.ops.projection"
HASHING = "dattri_llm.utils.hashing"
DISTRIBUTED = "dattri_llm.utils.distributed"
AUTOGRAD = "dattri_llm.utils.autograd"
CACHE = "dattri_llm.utils.cache"
MODULE = "dattri_llm.utils.module"

# (defining module, qualified name, spec parameter list). For methods ``self`` is implied.
SPEC_SIGNATURES: list[tuple[str, str, str]] = [
    # ---------------------------------------------------------------- gradient-model.md
    (GRADIENT, "base_layer_name", "name"),
    (
        GRADIENT,
        "Factorized",
        "activation, pre_activation_grad, module_kwargs=None, batch_first=True",
    ),
    (GRADIENT, "Factorized.to", "device=None, dtype=None, non_blocking=False"),
    (GRADIENT, "Factorized.pin_memory", ""),
    (GRADIENT, "Factorized.as_batch_first", ""),
    (GRADIENT, "Gradient.validate", ""),
    (GRADIENT, "Gradient.map_layers", "fn, *, layers=None, consume=False"),
    (GRADIENT, "Gradient.clone", ""),
    (GRADIENT, "Gradient.to", "device=None, dtype=None, non_blocking=False"),
    (GRADIENT, "Gradient.pin_memory", ""),
    (GRADIENT, "Gradient.materialize", ""),
    (GRADIENT, "Gradient.project", "projector, proj_kwargs, *, capture_style='factorized'"),
    (GRADIENT, "Gradient.select_layers", "layer_names, include_derived=False"),
    (GRADIENT, "Gradient.concatenate", "other, dim='batch'"),
    (GRADIENT, "Gradient.aggregate", "dim='token'"),
    (GRADIENT, "Gradient.slice", "dim, index"),
    (
        GRADIENT,
        "Gradient.similarity",
        "other, metric='dot', reduce='none', mode='auto', eps=1e-8",
    ),
    (GRADIENT, "Gradient.similarity_per_token", "other, reduce='all'"),
    (GRADIENT, "GradientRecord", "step, input_hash, gradient, sample_id_key=None"),
    # ---------------------------------------------------------------- ops.md §1 types
    (TYPES, "is_linear", "layer_type"),
    (TYPES, "is_conv", "layer_type"),
    (TYPES, "is_conv_transpose", "layer_type"),
    (TYPES, "is_norm", "layer_type"),
    (TYPES, "is_embedding", "layer_type"),
    (TYPES, "is_kfac_eligible", "layer_type"),
    (TYPES, "canonical_class_name", "module"),
    # ---------------------------------------------------------------- ops.md §2 preprocess
    (PREPROCESS, "extract_module_kwargs", "module, layer_type"),
    (
        PREPROCESS,
        "preprocess_factors",
        "a, g, layer_type, module_kwargs=None, include_bias=True",
    ),
    (PREPROCESS, "preprocess_factorized", "f, layer_type, include_bias=True"),
    (PREPROCESS, "to_3d", "x"),
    # ---------------------------------------------------------------- ops.md §3 materialize
    (
        MATERIALIZE,
        "materialize_factors",
        "a, g, layer_type, module_kwargs=None, include_bias=True, per_token=False",
    ),
    (MATERIALIZE, "materialize", "f, layer_type, include_bias=True, per_token=False"),
    # ---------------------------------------------------------------- ops.md §4 dot / routing
    (DOT, "maybe_use_materialized_gram", "B1, B2, S, K, D, kappa=1.0"),
    (DOT, "maybe_use_materialized_norm", "S, K, D"),
    (DOT, "effective_dims", "f, layer_type"),
    (DOT, "cross_gram", "a1, g1, a2, g2, layer_type, mode='auto'"),
    (
        DOT,
        "cross_dot_factors",
        "a1, g1, a2, g2, layer_type, module_kwargs1=None, module_kwargs2=None, "
        "include_bias=True, mode='auto'",
    ),
    (
        DOT,
        "pairwise_dot_factors",
        "a, g, layer_type, module_kwargs=None, include_bias=True, mode='auto'",
    ),
    (
        DOT,
        "dot_factors",
        "a1, g1, a2, g2, layer_type, module_kwargs1=None, module_kwargs2=None, include_bias=True",
    ),
    (
        DOT,
        "grad_norm_sq_factors",
        "a, g, layer_type, module_kwargs=None, include_bias=True, mode='auto'",
    ),
    (DOT, "dot", "f1, f2, layer_type, include_bias=True"),
    (DOT, "pairwise_dot", "f, layer_type, include_bias=True, mode='auto'"),
    (DOT, "grad_norm_sq", "f, layer_type, include_bias=True, mode='auto'"),
    (DOT, "cross_dot", "f1, f2, layer_type, include_bias=True, mode='auto'"),
    (DOT, "cross_gram_per_token", "a1, g1, a2, g2, layer_type"),
    (DOT, "cross_gram_per_token_dense", "a1, g1, m2, layer_type"),
    (DOT, "cross_dot_per_token", "f1, f2, layer_type, include_bias=True"),
    (
        DOT,
        "layerwise_cross_dot",
        "train, test, *, layers=None, mode='auto', dense_cache=None, reduce='sum'",
    ),
    (DOT, "layerwise_cross_dot_per_token", "train, test, *, layers=None, reduce='sum'"),
    # ---------------------------------------------------------------- ops.md §5 kronecker
    (KRONECKER, "kfac_factors", "a, g, layer_type, module_kwargs=None, include_bias=True"),
    (KRONECKER, "kfac", "f, layer_type, include_bias=True"),
    (KRONECKER, "fim_factors", "a, g, layer_type, module_kwargs=None, include_bias=True"),
    (KRONECKER, "fim", "f, layer_type, include_bias=True"),
    (KRONECKER, "sym_inverse", "matrix, damping=0.0"),
    (KRONECKER, "dense_inverse", "matrix, damping=0.0"),
    (
        KRONECKER,
        "kfac_cross_factors",
        "a1, g1, a2, g2, layer_type, A_inv, G_inv, module_kwargs1=None, module_kwargs2=None, "
        "include_bias=True",
    ),
    (KRONECKER, "kfac_cross", "f1, f2, layer_type, A_inv, G_inv, include_bias=True"),
    (KRONECKER, "kfac_precondition", "f, layer_type, A_inv, G_inv, include_bias=True"),
    (KRONECKER, "kfac_precondition_materialized", "block, A_inv, G_inv"),
    (KRONECKER, "kfac_eigh", "A, G"),
    (
        KRONECKER,
        "ekfac_materialize_factors",
        "a, g, layer_type, U_A, U_G, module_kwargs=None, include_bias=True",
    ),
    (KRONECKER, "ekfac_materialize", "f, layer_type, U_A, U_G, include_bias=True"),
    (KRONECKER, "ekfac_precondition", "M, U_A, U_G, lam, layer_type"),
    (KRONECKER, "LayerKroneckerAccumulator", ""),
    (OPTIMIZER, "precondition", "g, state, *, optimizer_type, step, **hyperparameters"),
    (OPTIMIZER, "adam_preconditioner", "m_hat, v_hat, *, eps=1e-8"),
    (
        OPTIMIZER,
        "adamw_influence_push",
        "g_z, g_t, d, s, *, lr, step, beta1=0.9, beta2=0.999",
    ),
    (
        OPTIMIZER,
        "adamw_influence_transition",
        "w_theta, w_m, w_v, d, s, *, lr, step, beta1=0.9, beta2=0.999, weight_decay=0.0",
    ),
    (
        OPTIMIZER,
        "adamw_influence_coupling",
        "w_theta, w_m, w_v, g_z, g_t, d, s, *, lr, step, beta1=0.9, beta2=0.999",
    ),
    (
        KRONECKER,
        "LayerKroneckerAccumulator.update",
        "a, g, layer_type, module_kwargs=None, include_bias=True",
    ),
    (KRONECKER, "LayerKroneckerAccumulator.all_reduce", ""),
    (KRONECKER, "LayerKroneckerAccumulator.result", "*, consume=False"),
    (KRONECKER, "LayerKroneckerAccumulator.reset", ""),
    (KRONECKER, "LayerFisherAccumulator", ""),
    (
        KRONECKER,
        "LayerFisherAccumulator.update",
        "a, g, layer_type, module_kwargs=None, include_bias=True",
    ),
    (KRONECKER, "LayerFisherAccumulator.update_from_grad", "grad"),
    (KRONECKER, "LayerFisherAccumulator.all_reduce", ""),
    (KRONECKER, "LayerFisherAccumulator.result", ""),
    (KRONECKER, "LayerFisherAccumulator.reset", ""),
    (KRONECKER, "KroneckerAccumulator", ""),
    (KRONECKER, "KroneckerAccumulator.update", "gradient, layers"),
    (KRONECKER, "KroneckerAccumulator.all_reduce", ""),
    (KRONECKER, "KroneckerAccumulator.result", "*, consume=False"),
    (KRONECKER, "FisherAccumulator", "max_params=None"),
    (KRONECKER, "FisherAccumulator.update", "gradient, layers"),
    (KRONECKER, "FisherAccumulator.all_reduce", ""),
    (KRONECKER, "FisherAccumulator.result", ""),
    # ---------------------------------------------------------------- ops.md §7 dtypes
    (DTYPES, "set_compute_dtype", "policy"),
    (DTYPES, "get_compute_dtype", ""),
    (DTYPES, "compute_dtype", "policy"),
    (DTYPES, "as_float", "*tensors, minimum=None"),
    (DTYPES, "resolve", "*tensors, minimum=None"),
    (DTYPES, "align", "*tensors, minimum=None"),
    # ---------------------------------------------------------------- projection.md
    (PROJECTION, "DattriProjector", "projector=None, *, cache=None"),
    (PROJECTION, "DattriProjector.coerce", "projector"),
    (
        PROJECTION,
        "DattriProjector.matrix",
        "d_in, *, proj_dim, proj_seed, device, dtype, **proj_kwargs",
    ),
    (PROJECTION, "DattriProjector.mask_indices", "d, *, proj_dim, proj_seed, device"),
    (
        PROJECTION,
        "DattriProjector.apply",
        "x, *, proj_dim, proj_seed=0, include_bias=False, **proj_kwargs",
    ),
    (
        PROJECTION,
        "DattriProjector.resolve",
        "d_in, *, proj_dim, proj_seed=0, include_bias=False, device, dtype, **proj_kwargs",
    ),
    (PROJECTION, "DattriProjector.clear", ""),
    (PROJECTION, "DattriProjector.close", ""),
    (PROJECTION, "ProjectionMatrix", "matrix, include_bias, d_in, dtype, device"),
    (PROJECTION, "ProjectionMatrix.matches", "x"),
    (PROJECTION, "ProjectionMatrix.__call__", "x"),
    (
        PROJECTION,
        "apply_projection",
        "projector, x, *, proj_dim, proj_seed=0, include_bias=False, **proj_kwargs",
    ),
    (
        PROJECTION,
        "project_factors",
        "a, g, layer_type, projector, module_kwargs=None, include_bias=True, *, proj_dim, "
        "proj_seed=0, **proj_kwargs",
    ),
    (
        PROJECTION,
        "project_factorized",
        "f, layer_type, projector, *, proj_dim, include_bias=True, proj_seed=0, **proj_kwargs",
    ),
    (
        PROJECTION,
        "project_activation",
        "a, layer_type, projector, module_kwargs, include_bias=True, *, proj_dim, proj_seed=0, "
        "**proj_kwargs",
    ),
    (
        PROJECTION,
        "project_gradient",
        "g, layer_type, projector, module_kwargs, *, proj_dim, proj_seed=0, **proj_kwargs",
    ),
    (
        PROJECTION,
        "project_materialized_factors",
        "a, g, layer_type, projector, module_kwargs=None, include_bias=True, *, proj_dim, "
        "proj_seed=0, **proj_kwargs",
    ),
    (
        PROJECTION,
        "project_materialized",
        "f, layer_type, projector, *, proj_dim, include_bias=True, proj_seed=0, **proj_kwargs",
    ),
    (
        PROJECTION,
        "mask_factors",
        "a, g, layer_type, projector, module_kwargs=None, include_bias=True, *, proj_dim, "
        "proj_seed=0, **proj_kwargs",
    ),
    (
        PROJECTION,
        "mask_factorized",
        "f, layer_type, projector, *, proj_dim, include_bias=True, proj_seed=0, **proj_kwargs",
    ),
    (PROJECTION, "mask_materialized", "x, projector, *, proj_dim, proj_seed=0, **proj_kwargs"),
    (
        PROJECTION,
        "mask_coordinates",
        "projection, layer_name, width, projector, device='cpu'",
    ),
    (
        PROJECTION,
        "project_layer",
        "f, layer_type, projector, *, style='logra', capture_style='factorized', **proj_kwargs",
    ),
    (PROJECTION, "should_materialize", "capture_style, seq_len, k_a, k_g"),
    (PROJECTION, "maybe_materialize_projected", "seq_len, k_a, k_g, kappa=1.0"),
    # ---------------------------------------------------------------- utils.md
    (HASHING, "hash_sample", "inputs"),
    (HASHING, "hash_batch", "inputs, batch_size=None"),
    (DISTRIBUTED, "is_dist_initialized", ""),
    (DISTRIBUTED, "dist_rank", ""),
    (DISTRIBUTED, "dist_world_size", ""),
    (DISTRIBUTED, "all_reduce_sum", "tensor"),
    (AUTOGRAD, "queue_backward_end_callback", "fn"),
    (AUTOGRAD, "queue_after_backward_finalization", "fn"),
    (CACHE, "tensor_nbytes", "value"),
    (CACHE, "available_host_bytes", ""),
    (CACHE, "CacheBudget", "device=None, *, fraction=0.35, limit_bytes=None"),
    (CACHE, "CacheBudget.total", ""),
    (CACHE, "CacheBudget.fits", "nbytes, held=0"),
    (
        CACHE,
        "TensorCache",
        "residency='memory', *, budget=None, spill_dir=None, writer=None, reader=None, "
        "on_spill=None, nbytes_fn=None",
    ),
    (CACHE, "TensorCache.keys", ""),
    (CACHE, "TensorCache.location", "key"),
    (CACHE, "TensorCache.get", "key, default=None"),
    (CACHE, "TensorCache.put", "key, value"),
    (CACHE, "TensorCache.get_or_compute", "key, compute"),
    (CACHE, "TensorCache.discard", "key"),
    (CACHE, "TensorCache.clear", ""),
    (CACHE, "TensorCache.close", ""),
    (MODULE, "linear_module_kwargs", "*, has_bias"),
    (MODULE, "bilinear_module_kwargs", "*, has_bias"),
    (MODULE, "embedding_module_kwargs", "*, num_embeddings, padding_idx"),
    (MODULE, "embedding_bag_module_kwargs", "*, num_embeddings, mode, padding_idx"),
    *[
        # extension: ``groups=1`` (QUALITY.md: grouped convolutions are exact).
        (
            MODULE,
            f"{name}_module_kwargs",
            "*, kernel_size, stride, padding, dilation, has_bias, groups=1",
        )
        for name in (
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
        )
    ],
    (MODULE, "layer_norm_module_kwargs", "*, normalized_shape, eps, has_bias"),
    (MODULE, "rms_norm_module_kwargs", "*, normalized_shape, eps"),
    (MODULE, "group_norm_module_kwargs", "*, num_groups, num_channels, eps, has_bias"),
    *[
        (MODULE, f"instance_norm{rank}d_module_kwargs", "*, num_features, eps, has_bias")
        for rank in (1, 2, 3)
    ],
]

# (defining module, class, property names) — the spec's read-only attributes.
SPEC_PROPERTIES: list[tuple[str, str, tuple[str, ...]]] = [
    (GRADIENT, "Factorized", ("nbytes",)),
    (
        GRADIENT,
        "Gradient",
        (
            "layer_names",
            "batch_size",
            "token_dim",
            "device",
            "dtype",
            "nbytes",
            "materialized_nbytes",
        ),
    ),
    (KRONECKER, "FisherAccumulator", ("skipped",)),
    (PROJECTION, "DattriProjector", ("factory", "cache")),
    (CACHE, "CacheBudget", ("device",)),
    (CACHE, "TensorCache", ("residency", "nbytes", "spill_dir")),
]


def _resolve(module_name: str, qualname: str) -> object:
    """The object ``module.qualname`` (attribute lookup; descriptors resolved)."""
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _expected_parameters(spec: str) -> list[tuple[str, inspect._ParameterKind, object]]:
    """``(name, kind, default)`` of the spec parameter list, via a compiled dummy function."""
    namespace: dict[str, object] = {}
    exec(f"def _spec({spec}): pass", namespace)  # noqa: S102 - hand-written spec strings
    return _describe(inspect.signature(namespace["_spec"]))


def _describe(signature: inspect.Signature) -> list[tuple[str, inspect._ParameterKind, object]]:
    """``(name, kind, (type, value) of default)`` per parameter (the type tells 0 from 0.0)."""
    described = []
    for p in signature.parameters.values():
        default = p.default
        if default is not inspect.Parameter.empty:
            default = (type(default), default)
        described.append((p.name, p.kind, default))
    return described


def _actual_parameters(module_name: str, qualname: str) -> list[tuple]:
    """Parameters of the implementation, without the implicit ``self``."""
    obj = _resolve(module_name, qualname)
    params = _describe(inspect.signature(obj))
    is_method = "." in qualname and not inspect.isclass(obj)
    if is_method and params and params[0][0] == "self":
        params = params[1:]
    return params


@pytest.mark.parametrize(
    ("module_name", "qualname", "spec"),
    SPEC_SIGNATURES,
    ids=[f"{m.rsplit('.', 1)[1]}.{q}" for m, q, _ in SPEC_SIGNATURES],
)
def test_signature_matches_spec(module_name, qualname, spec):
    assert _actual_parameters(module_name, qualname) == _expected_parameters(spec)


@pytest.mark.parametrize(
    ("module_name", "qualname"),
    [(m, q) for m, q, _ in SPEC_SIGNATURES if "." not in q],
)
def test_public_name_is_defined_in_its_spec_module(module_name, qualname):
    obj = _resolve(module_name, qualname)
    assert obj.__module__ == module_name, f"{qualname} is defined in {obj.__module__}"


@pytest.mark.parametrize(("module_name", "qualname"), [(m, q) for m, q, _ in SPEC_SIGNATURES])
def test_public_callable_has_docstring_and_annotations(module_name, qualname):
    obj = _resolve(module_name, qualname)
    assert inspect.getdoc(obj), f"{qualname} has no docstring"
    if inspect.isclass(obj):
        return
    signature = inspect.signature(obj)
    missing = [
        p.name
        for p in signature.parameters.values()
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    assert not missing, f"{qualname}: parameters without type hints {missing}"
    assert signature.return_annotation is not inspect.Signature.empty, qualname


@pytest.mark.parametrize(
    ("module_name", "cls_name", "names"),
    SPEC_PROPERTIES,
    ids=[c for _, c, _ in SPEC_PROPERTIES],
)
def test_spec_properties_are_properties(module_name, cls_name, names):
    cls = _resolve(module_name, cls_name)
    for name in names:
        assert isinstance(inspect.getattr_static(cls, name), property), f"{cls_name}.{name}"


def test_gradient_dataclass_contract():
    from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord

    for cls in (Factorized, Gradient):
        params = cls.__dataclass_params__
        assert params.frozen and not params.eq, cls.__name__
    record_params = GradientRecord.__dataclass_params__
    assert not record_params.frozen
    # Gradient(representation, data, layer_types, indexing={} (factory), validate_on_init=True)
    fields = {f.name: f for f in dataclasses.fields(Gradient)}
    assert list(fields) == ["representation", "data", "layer_types", "indexing"]
    assert fields["indexing"].default_factory is dict
    assert all(
        fields[n].default is dataclasses.MISSING
        and fields[n].default_factory is dataclasses.MISSING
        for n in ("representation", "data", "layer_types")
    )
    init = inspect.signature(Gradient)
    assert list(init.parameters) == [*fields, "validate_on_init"]
    assert init.parameters["validate_on_init"].default is True
    # module_kwargs is excluded from Factorized's repr.
    assert not {f.name: f for f in dataclasses.fields(Factorized)}["module_kwargs"].repr


def test_accumulators_are_dataclasses_constructed_without_arguments():
    from dattri_llm.gradient.ops.kronecker import (
        LayerFisherAccumulator,
        LayerKroneckerAccumulator,
    )

    for cls in (LayerKroneckerAccumulator, LayerFisherAccumulator):
        assert dataclasses.is_dataclass(cls)
        assert not inspect.signature(cls).parameters, cls.__name__


def test_projection_matrix_slots():
    from dattri_llm.gradient.ops.projection import ProjectionMatrix

    assert set(ProjectionMatrix.__slots__) == {
        "matrix",
        "bias_row",
        "d_in",
        "dtype",
        "device",
        "proj_dim",
    }


def test_context_managers_and_container_protocol():
    from dattri_llm.gradient.ops.projection import DattriProjector
    from dattri_llm.utils.cache import TensorCache

    for cls in (DattriProjector, TensorCache):
        assert callable(cls.__enter__) and callable(cls.__exit__), cls.__name__
    for dunder in ("__len__", "__contains__"):
        assert dunder in vars(TensorCache), dunder
    assert isinstance(inspect.getattr_static(DattriProjector, "coerce"), classmethod)


def test_spec_constants():
    from dattri_llm.gradient.ops import projection, types
    from dattri_llm.utils import cache, hashing

    assert types.LINEAR_TYPES == frozenset(
        {
            "nn.Linear",
            "nn.Bilinear",
            "nn.NonDynamicallyQuantizableLinear",
            "transformers.pytorch_utils.Conv1D",
        }
    )
    assert isinstance(types.LINEAR_TYPES, frozenset)
    assert types.CONV_TYPES == {"nn.Conv1d", "nn.Conv2d", "nn.Conv3d"}
    assert types.CONV_TRANSPOSE_TYPES == {
        "nn.ConvTranspose1d",
        "nn.ConvTranspose2d",
        "nn.ConvTranspose3d",
    }
    assert types.NORM_TYPES == {
        "nn.LayerNorm",
        "nn.RMSNorm",
        "nn.GroupNorm",
        "nn.InstanceNorm1d",
        "nn.InstanceNorm2d",
        "nn.InstanceNorm3d",
    }
    assert types.EMBEDDING_TYPES == {"nn.Embedding", "nn.EmbeddingBag"}
    assert isinstance(types.ALL_LAYER_TYPES, frozenset)
    assert types.ALL_LAYER_TYPES == (
        types.LINEAR_TYPES
        | types.CONV_TYPES
        | types.CONV_TRANSPOSE_TYPES
        | types.NORM_TYPES
        | types.EMBEDDING_TYPES
    )
    assert types.PARAM_GRAD_TYPES == "param_grad_layers"
    assert projection.PROJECTION_STYLES == ("logra", "dense", "mask")
    assert projection.CAPTURE_STYLES == ("factorized", "materialized", "auto")
    assert projection.MASK_KEYS == frozenset(
        {"style", "proj_dim", "proj_seed", "include_bias", "device"}
    )
    assert isinstance(projection.MASK_KEYS, frozenset)
    assert cache.CACHE_RESIDENCIES == ("disk", "memory", "tiered")
    assert cache.DEFAULT_CACHE_FRACTION == 0.35
    assert hashing.PAD_MASK_KEY == "attention_mask"


def test_gradient_aliases():
    import typing

    import torch

    from dattri_llm.gradient import gradient

    assert typing.get_args(gradient.GradientRepresentation) == ("materialized", "factorized")
    assert typing.get_args(gradient.Indexing) == ("batch", "batch_token")
    assert gradient.GradientData == torch.Tensor | gradient.Factorized


# ops.md §0, transcribed.
SPEC_OPS_ALL = """
ALL_LAYER_TYPES CAPTURE_STYLES CONV_TRANSPOSE_TYPES CONV_TYPES EMBEDDING_TYPES LINEAR_TYPES
MASK_KEYS NORM_TYPES OPTIMIZER_STATE_KEYS PARAM_GRAD_TYPES PROJECTION_STYLES DattriProjector
FisherAccumulator KroneckerAccumulator LayerFisherAccumulator LayerKroneckerAccumulator
ProjectionMatrix adam_preconditioner adamw_influence_coupling adamw_influence_push
adamw_influence_transition apply_projection as_float canonical_class_name compute_dtype
cross_dot cross_dot_factors cross_dot_per_token cross_gram cross_gram_per_token
cross_gram_per_token_dense dense_inverse dot dot_factors dtypes effective_dims
ekfac_materialize ekfac_materialize_factors ekfac_precondition extract_module_kwargs fim
fim_factors get_compute_dtype grad_norm_sq grad_norm_sq_factors is_conv is_conv_transpose
is_embedding is_kfac_eligible is_linear is_norm kfac kfac_cross kfac_cross_factors kfac_eigh
kfac_factors kfac_precondition kfac_precondition_materialized layerwise_cross_dot
layerwise_cross_dot_per_token mask_coordinates mask_factorized mask_factors mask_materialized
materialize materialize_factors maybe_materialize_projected maybe_use_materialized_gram
maybe_use_materialized_norm pairwise_dot pairwise_dot_factors precondition
preprocess_factorized preprocess_factors project_activation project_factorized project_factors
project_gradient project_layer project_materialized project_materialized_factors
set_compute_dtype should_materialize sym_inverse to_3d
""".split()

SPEC_UTILS_ALL = """
CACHE_RESIDENCIES CacheBudget TensorCache dist_rank dist_world_size hash_batch hash_sample
is_dist_initialized queue_after_backward_finalization queue_backward_end_callback tensor_nbytes
""".split()


def test_ops_and_utils_all_match_spec():
    from dattri_llm import utils
    from dattri_llm.gradient import ops

    assert len(SPEC_OPS_ALL) == 85
    assert sorted(ops.__all__) == sorted(SPEC_OPS_ALL)
    assert sorted(utils.__all__) == sorted(SPEC_UTILS_ALL)
    assert "all_reduce_sum" not in importlib.import_module(DISTRIBUTED).__all__

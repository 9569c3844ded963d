"""Tests of the module_kwargs builders: they must equal ops.extract_module_kwargs of a module."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.utils import module as builders


def _check(built: dict, module: nn.Module, layer_type: str) -> None:
    """Built kwargs equal what extract_module_kwargs reads from a real module."""
    assert built == extract_module_kwargs(module, layer_type)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_and_bilinear(bias):
    _check(builders.linear_module_kwargs(has_bias=bias), nn.Linear(3, 2, bias=bias), "nn.Linear")
    _check(
        builders.bilinear_module_kwargs(has_bias=bias),
        nn.Bilinear(3, 4, 2, bias=bias),
        "nn.Bilinear",
    )


@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding_canonical_padding_idx(padding_idx):
    built = builders.embedding_module_kwargs(num_embeddings=5, padding_idx=padding_idx)
    _check(built, nn.Embedding(5, 3, padding_idx=padding_idx), "nn.Embedding")
    assert built["padding_idx"] in (None, 2, 4)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag(mode):
    built = builders.embedding_bag_module_kwargs(num_embeddings=6, mode=mode, padding_idx=-2)
    _check(built, nn.EmbeddingBag(6, 3, mode=mode, padding_idx=-2), "nn.EmbeddingBag")
    assert built["padding_idx"] == 4


def test_embedding_errors():
    with pytest.raises(ValueError, match="mode 'max'"):
        builders.embedding_bag_module_kwargs(num_embeddings=6, mode="max", padding_idx=None)
    with pytest.raises(ValueError, match="padding_idx 5"):
        builders.embedding_module_kwargs(num_embeddings=5, padding_idx=5)
    with pytest.raises(ValueError, match="padding_idx -6"):
        builders.embedding_module_kwargs(num_embeddings=5, padding_idx=-6)
    with pytest.raises(ValueError, match="num_embeddings"):
        builders.embedding_module_kwargs(num_embeddings=0, padding_idx=None)


CONV_CASES = [
    ("conv1d", nn.Conv1d, "nn.Conv1d", 1, {"kernel_size": 3, "stride": 2, "padding": 1,
                                            "dilation": 1}),
    ("conv2d", nn.Conv2d, "nn.Conv2d", 2, {"kernel_size": (3, 2), "stride": [1, 2],
                                            "padding": 0, "dilation": (2, 1)}),
    ("conv2d", nn.Conv2d, "nn.Conv2d", 2, {"kernel_size": 3, "stride": 1, "padding": "same",
                                            "dilation": 1}),
    ("conv3d", nn.Conv3d, "nn.Conv3d", 3, {"kernel_size": 1, "stride": 1, "padding": "valid",
                                            "dilation": 1}),
    ("conv_transpose1d", nn.ConvTranspose1d, "nn.ConvTranspose1d", 1,
     {"kernel_size": 3, "stride": 2, "padding": 1, "dilation": 1}),
    ("conv_transpose2d", nn.ConvTranspose2d, "nn.ConvTranspose2d", 2,
     {"kernel_size": (2, 3), "stride": 1, "padding": (0, 1), "dilation": 2}),
    ("conv_transpose3d", nn.ConvTranspose3d, "nn.ConvTranspose3d", 3,
     {"kernel_size": 2, "stride": (1, 2, 1), "padding": 0, "dilation": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "cls", "layer_type", "rank", "geometry"), CONV_CASES)
@pytest.mark.parametrize(("bias", "groups"), [(True, 1), (False, 2)])
def test_conv_builders_match_modules(name, cls, layer_type, rank, geometry, bias, groups):
    builder = getattr(builders, f"{name}_module_kwargs")
    built = builder(**geometry, has_bias=bias, groups=groups)
    _check(built, cls(4, 6, **geometry, bias=bias, groups=groups), layer_type)
    for key in ("kernel_size", "stride", "dilation"):
        assert isinstance(built[key], tuple) and len(built[key]) == rank
    assert built["groups"] == groups


def test_conv_groups_defaults_to_one():
    built = builders.conv2d_module_kwargs(
        kernel_size=3, stride=1, padding=1, dilation=1, has_bias=True
    )
    assert built["groups"] == 1


def test_conv_errors():
    geometry = {"kernel_size": 3, "stride": 1, "padding": 0, "dilation": 1, "has_bias": True}
    with pytest.raises(ValueError, match="kernel_size.*2 entries.*3-D"):
        builders.conv3d_module_kwargs(**{**geometry, "kernel_size": (3, 3)})
    with pytest.raises(ValueError, match="stride"):
        builders.conv2d_module_kwargs(**{**geometry, "stride": 0})
    with pytest.raises(ValueError, match="padding 'same'"):
        builders.conv_transpose2d_module_kwargs(**{**geometry, "padding": "same"})
    with pytest.raises(ValueError, match="padding 'full'"):
        builders.conv1d_module_kwargs(**{**geometry, "padding": "full"})
    with pytest.raises(TypeError, match="dilation"):
        builders.conv1d_module_kwargs(**{**geometry, "dilation": 1.5})
    with pytest.raises(ValueError, match="groups"):
        builders.conv1d_module_kwargs(**geometry, groups=0)
    with pytest.raises(TypeError, match="has_bias"):
        builders.conv1d_module_kwargs(**{**geometry, "has_bias": 1})


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_builder_matches_module(bias):
    _check(
        builders.layer_norm_module_kwargs(normalized_shape=4, eps=1e-5, has_bias=bias),
        nn.LayerNorm(4, eps=1e-5, bias=bias),
        "nn.LayerNorm",
    )


def test_group_and_instance_norm_builders_match_modules():
    _check(
        builders.group_norm_module_kwargs(num_groups=2, num_channels=4, eps=1e-3, has_bias=True),
        nn.GroupNorm(2, 4, eps=1e-3, affine=True),
        "nn.GroupNorm",
    )
    for dim in (1, 2, 3):
        builder = getattr(builders, f"instance_norm{dim}d_module_kwargs")
        module = getattr(nn, f"InstanceNorm{dim}d")(3, eps=1e-4, affine=True)
        _check(builder(num_features=3, eps=1e-4, has_bias=True), module, f"nn.InstanceNorm{dim}d")


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_builder(eps):
    built = builders.rms_norm_module_kwargs(normalized_shape=[2, 4], eps=eps)
    _check(built, nn.RMSNorm([2, 4], eps=eps), "nn.RMSNorm")
    assert built == {"has_bias": False, "normalized_shape": (2, 4), "eps": eps}


def test_norm_errors():
    with pytest.raises(ValueError, match="normalized_shape"):
        builders.layer_norm_module_kwargs(normalized_shape=(), eps=1e-5, has_bias=True)
    with pytest.raises(TypeError, match="eps"):
        builders.layer_norm_module_kwargs(normalized_shape=3, eps=None, has_bias=True)
    with pytest.raises(ValueError, match="not divisible"):
        builders.group_norm_module_kwargs(num_groups=3, num_channels=4, eps=1e-5, has_bias=True)
    with pytest.raises(ValueError, match="num_features"):
        builders.instance_norm2d_module_kwargs(num_features=0, eps=1e-5, has_bias=True)


def test_all_builders_keyword_only_with_required_arguments():
    for name in builders.__all__:
        params = inspect.signature(getattr(builders, name)).parameters.values()
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), name
        required = [p.name for p in params if p.default is inspect.Parameter.empty]
        assert set(required) == {p.name for p in params} - {"groups"}, name
    with pytest.raises(TypeError):
        builders.linear_module_kwargs(True)


def test_builders_return_picklable_plain_dicts():
    import pickle

    built = builders.conv2d_module_kwargs(
        kernel_size=3, stride=1, padding=1, dilation=1, has_bias=True, groups=2
    )
    assert pickle.loads(pickle.dumps(built)) == built
    assert all(not isinstance(v, torch.Tensor) for v in built.values())

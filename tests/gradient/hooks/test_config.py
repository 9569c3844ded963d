import pickle
import sys
import warnings

import pytest
import torch
from torch import nn

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.hooks import hooks as hooks_module
from dattri_llm.gradient.hooks.config import (
    REGISTER_ALL,
    HookManagerConfig,
    default_hook_assignment,
    resolve_hook_assignments,
)
from dattri_llm.gradient.hooks.manager import HookManager


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.plain_norm = nn.LayerNorm(5, elementwise_affine=False)
        self.fc2 = nn.Linear(5, 3)
        self.unused = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.fc2(self.plain_norm(self.norm(self.fc1(x)))) * self.scale


def test_register_all_singleton_repr_and_pickle():
    assert repr(REGISTER_ALL) == "REGISTER_ALL"
    assert pickle.loads(pickle.dumps(REGISTER_ALL)) is REGISTER_ALL
    assert type(REGISTER_ALL)() is REGISTER_ALL


def test_config_stores_normalized_fields():
    cfg = HookManagerConfig(linear_io=("fc",), include_frozen=1)
    assert cfg.linear_io == ["fc"] and cfg.include_frozen is True
    assert cfg.hook_types == {} and cfg.layer_types == {} and cfg.module_kwargs == {}
    assert cfg.projection_kwargs is None and not cfg.is_default
    assert HookManagerConfig().is_default


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hook_types": ["fc"]}, TypeError, "hook_types must be a dict"),
        (
            {"hook_types": {"fc": "linear"}},
            ValueError,
            r"'linear'.*must be one of \['linear_io', 'param_grad', 'invasive_linear_io'\]",
        ),
        ({"linear_io": "fc"}, TypeError, "list of regex"),
        ({"param_grad": [1]}, TypeError, "patterns must be strings"),
        ({"linear_io": ["("]}, ValueError, "not a valid regex"),
        ({"layer_types": {"fc": 3}}, TypeError, "layer-type string"),
        ({"layer_types": {"fc": "nn.Linaer"}}, ValueError, r"'nn.Linaer'.*must be one of \["),
        ({"module_kwargs": {"fc": {"bias": True}}}, TypeError, "has_bias"),
        ({"projection_kwargs": [1]}, TypeError, "projection_kwargs"),
        ({"projection_kwargs": {"fc": 1}}, TypeError, "projection settings"),
        (
            {"projection_kwargs": {"fc": {"style": "svd"}}},
            ValueError,
            r"'svd'; it must be one of \['logra', 'dense', 'mask'\]",
        ),
        ({"projection_kwargs": {"fc": {"proj_dim": 2, "seq_len": 3}}}, ValueError, "seq_len"),
        (
            {"projection_kwargs": {"fc": {"style": "mask", "proj_dim": 2, "proj_type": "x"}}},
            ValueError,
            "proj_type",
        ),
        (
            {"capture_style": "dense"},
            ValueError,
            r"capture_style 'dense'.*must be one of \['factorized', 'materialized', 'auto'\]",
        ),
        ({"projector": 3}, TypeError, "projector"),
    ],
)
def test_config_validation_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        HookManagerConfig(**kwargs)


def test_default_resolution():
    net = Net()
    assert resolve_hook_assignments(net, HookManagerConfig()) == {
        "": "param_grad",
        "fc1": "linear_io",
        "norm": "linear_io",
        "fc2": "linear_io",
        "unused": "linear_io",
    }


def test_selectors_and_explicit_types():
    net = Net()
    cfg = HookManagerConfig(
        hook_types={"fc1": "invasive_linear_io", "": "param_grad"}, linear_io=[r"fc2", r"norm"]
    )
    assert resolve_hook_assignments(net, cfg) == {
        "fc1": "invasive_linear_io",
        "": "param_grad",
        "fc2": "linear_io",
        "norm": "linear_io",
    }
    cfg = HookManagerConfig(invasive_linear_io=REGISTER_ALL)
    assert set(resolve_hook_assignments(net, cfg)) == {"fc1", "fc2", "unused"}


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (HookManagerConfig(linear_io=[r"^attn"]), r"'\^attn' matches no linear_io-capable"),
        (HookManagerConfig(hook_types={"fc3": "linear_io"}), "'fc3'.*Did you mean"),
        (HookManagerConfig(hook_types={"": "linear_io"}), "not a linear_io-capable"),
        (HookManagerConfig(hook_types={"plain_norm": "param_grad"}), "no parameter"),
        (HookManagerConfig(hook_types={"norm": "invasive_linear_io"}), "not an nn.Linear"),
        (
            HookManagerConfig(hook_types={"fc1": "param_grad"}, linear_io=["fc"]),
            "'fc1' is assigned two hook families",
        ),
    ],
)
def test_resolution_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        resolve_hook_assignments(Net(), cfg)


def test_declared_layer_type_makes_module_eligible():
    net = Net()
    cfg = HookManagerConfig(hook_types={"": "linear_io"}, layer_types={"": "nn.Linear"})
    assert resolve_hook_assignments(net, cfg) == {"": "linear_io"}


def test_zero_layers_warns_and_manager_raises():
    with pytest.warns(UserWarning, match="registered zero layers"):
        assert resolve_hook_assignments(nn.Sequential(nn.ReLU()), HookManagerConfig()) == {}
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="hooked no layer.*linear_io="):
        HookManager(nn.Sequential(nn.ReLU()))


def test_frozen_layers_skipped_unless_included():
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    net[0].requires_grad_(False)
    assert HookManager(net).layer_names == ["1"]
    with pytest.warns(UserWarning, match="include_frozen=True hooks frozen layers"):
        manager = HookManager(net, HookManagerConfig(include_frozen=True))
    assert manager.layer_names == ["0", "1"]


def test_wrapped_model_is_unwrapped():
    net = Net()
    assert resolve_hook_assignments(nn.DataParallel(net), HookManagerConfig()) == (
        resolve_hook_assignments(net, HookManagerConfig())
    )


def test_default_hook_assignment_keeps_only_fired_layers():
    net = Net()
    with pytest.warns(UserWarning, match=r"never fired.*\['unused'\]"):
        result = default_hook_assignment(net, torch.randn(2, 4))
    assert result == {"": "param_grad", "fc1": "linear_io", "norm": "linear_io", "fc2": "linear_io"}
    assert all(p.grad is None for p in net.parameters())


def test_default_hook_assignment_without_loss_warns():
    net = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = default_hook_assignment(net, torch.randn(2, 4), loss_fn=lambda out: None)
    assert any("could not derive" in str(w.message) for w in caught)
    assert result == {"fc1": "linear_io", "norm": "linear_io", "fc2": "linear_io"}


def test_logra_on_norm_layer_raises_at_register():
    cfg = HookManagerConfig(
        linear_io=["norm"], projection_kwargs={"norm": {"proj_dim": 2, "style": "logra"}}
    )
    with pytest.raises(ValueError, match="'norm' is a normalization layer.*'dense' or 'mask'"):
        HookManager(Net(), cfg)


def test_invasive_refuses_callbacks_needing_param_grads():
    class NeedsGrads(HookManagerCallback):
        needs_param_grads = True

    cfg = HookManagerConfig(invasive_linear_io=["fc1"])
    with pytest.raises(RuntimeError, match="NeedsGrads.*invasive_linear_io"):
        HookManager(Net(), cfg, callbacks=[NeedsGrads()])
    manager = HookManager(Net(), cfg)
    with pytest.raises(RuntimeError, match="need parameter gradients"):
        manager.add_callback(NeedsGrads())


def test_manager_argument_errors():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        HookManager(Net(), optimizer=object())
    with pytest.raises(ValueError, match="exclusive"):
        HookManager(Net(), sample_id_key="idx", sample_hash_fields=["x"])
    with pytest.raises(ValueError, match="empty"):
        HookManager(Net(), sample_hash_fields=[])
    with pytest.raises(TypeError, match="sample_id_key"):
        HookManager(Net(), sample_id_key=1.5)
    manager = HookManager(Net(), sample_hash_fields=0)
    assert manager.sample_hash_fields == (0,)
    with pytest.raises(ValueError, match="optimizer"):
        manager.precondition = True
    assert manager.precondition is False and manager.supports_preconditioning is False


def test_hf_conv1d_resolved_lazily():
    assert hooks_module.HF_Conv1D is getattr(
        sys.modules.get("transformers.pytorch_utils"), "Conv1D", None
    )
    with pytest.raises(AttributeError):
        hooks_module.no_such_name  # noqa: B018


def test_invalid_choices_say_must_be_one_of():
    with pytest.raises(
        ValueError, match=r"capture_style 'dense'.*must be one of \['factorized', 'materialized'"
    ):
        hooks_module.register_linear_io_hooks(Net(), capture_style="dense")
    with pytest.raises(
        ValueError, match=r"unsupported keys \['proj_type'\]; each key must be one of"
    ):
        HookManagerConfig(
            projection_kwargs={"fc": {"style": "mask", "proj_dim": 2, "proj_type": 1}}
        )

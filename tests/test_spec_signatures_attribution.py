"""Exact public signatures of the attribution tier, transcribed by hand from attribution.md §1–9.

Each expected signature is written as the contract spells it (parameter names,
order, kinds and defaults; annotations are not compared). A signature is
rendered without annotations, so ``(self, args, *, task=None)`` reads as in
the contract with ``self`` in front for methods.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from dattri_llm.attribution import utils as attribution_utils
from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
from dattri_llm.attribution.algorithm.kronecker import (
    EKFACAttributor,
    KFACAttributor,
    KroneckerAttributor,
)
from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.algorithm.trajectory import TrajectoryAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import (
    ATTRIBUTION_GRANULARITIES,
    BaseAttributor,
    BaseInnerProductAttributor,
)
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.task import (
    AttributionTask,
    as_task,
    default_checkpoint_load_func,
    default_loss_func,
)


def bare_signature(obj: object) -> str:
    """``inspect.signature(obj)`` without annotations, as a string."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def check(owner: object, expected: dict[str, str]) -> None:
    """Every ``owner.<name>`` has exactly the signature ``expected[name]``."""
    actual = {name: bare_signature(getattr(owner, name)) for name in expected}
    assert actual == expected


def check_properties(cls: type, names: list[str]) -> None:
    """Each name is a ``property`` of ``cls``."""
    kinds = {name: type(inspect.getattr_static(cls, name)).__name__ for name in names}
    assert kinds == dict.fromkeys(names, "property")


# ---------------------------------------------------------------------------- §1 task.py
def test_task_module_functions():
    check(
        AttributionTask,
        {
            "__init__": "(self, loss_func, model, checkpoints=None, target_func=None, "
            "checkpoints_load_func=None)",
            "get_model": "(self)",
            "get_checkpoints": "(self)",
            "num_checkpoints": "(self)",
            "load_checkpoint": "(self, index)",
            "from_dattri": "(task)",
        },
    )
    assert isinstance(inspect.getattr_static(AttributionTask, "from_dattri"), classmethod)
    check_properties(AttributionTask, ["model", "forward_model", "is_wrapped"])
    assert bare_signature(as_task) == "(task)"
    assert bare_signature(default_loss_func) == "(model, batch)"
    assert bare_signature(default_checkpoint_load_func) == "(model, checkpoint)"


def test_task_attributes():
    import torch

    task = AttributionTask(None, torch.nn.Linear(2, 2))
    assert task.loss_func is default_loss_func and task.target_func is default_loss_func
    assert task.checkpoints == [None] and task.current_checkpoint_idx is None


# ---------------------------------------------------------------------------- §2 arguments
ARGUMENT_FIELDS = [
    ("output_dir", dataclasses.MISSING),
    ("per_device_train_batch_size", 8),
    ("per_device_eval_batch_size", 8),
    ("learning_rate", 5e-5),
    ("weight_decay", 0.0),
    ("optim", "adamw_torch"),
    ("adam_beta1", 0.9),
    ("adam_beta2", 0.999),
    ("adam_epsilon", 1e-8),
    ("lr_scheduler_type", "linear"),
    ("warmup_steps", 0),
    ("gradient_accumulation_steps", 1),
    ("max_grad_norm", 1.0),
    ("gradient_checkpointing", False),
    ("gradient_checkpointing_kwargs", None),
    ("use_cpu", False),
    ("bf16", False),
    ("fp16", False),
    ("tf32", None),
    ("seed", 42),
    ("data_seed", None),
    ("full_determinism", False),
    ("dataloader_num_workers", 0),
    ("dataloader_pin_memory", True),
    ("dataloader_persistent_workers", False),
    ("dataloader_prefetch_factor", None),
    ("async_disk_write", False),
    ("recompute_gradients", False),
    ("ddp_find_unused_parameters", None),
    ("fsdp", ""),
    ("fsdp_config", None),
    ("deepspeed", None),
]


def test_arguments_fields_order_defaults_and_help():
    fields = dataclasses.fields(AttributionArguments)
    assert [(f.name, f.default) for f in fields] == ARGUMENT_FIELDS
    assert all(f.default_factory is dataclasses.MISSING for f in fields)
    assert all(isinstance(f.metadata.get("help"), str) and f.metadata["help"] for f in fields)
    params = list(inspect.signature(AttributionArguments).parameters.values())
    assert [p.name for p in params] == [name for name, _ in ARGUMENT_FIELDS]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def test_arguments_properties():
    check_properties(
        AttributionArguments,
        [
            "device",
            "n_gpu",
            "world_size",
            "process_index",
            "local_process_index",
            "train_batch_size",
            "eval_batch_size",
            "should_log",
            "output_path",
        ],
    )


# ---------------------------------------------------------------------------- §3 score
def test_score_fields():
    init = [(f.name, f.default) for f in dataclasses.fields(AttributionScore) if f.init]
    assert init == [
        ("scores", dataclasses.MISSING),
        ("row_train_ids", dataclasses.MISSING),
        ("row_steps", dataclasses.MISSING),
        ("test_ids", dataclasses.MISSING),
        ("algorithm", dataclasses.MISSING),
        ("algorithm_meta", dataclasses.MISSING),
        ("layer_name", dataclasses.MISSING),
        ("row_token_ids", None),
        ("polarity", 1),  # beyond the contract: keyword-only, last
    ]
    derived = [f.name for f in dataclasses.fields(AttributionScore) if not f.init]
    assert derived == ["train_index", "test_index"]


def test_score_methods():
    check(
        AttributionScore,
        {
            "__init__": "(self, scores, row_train_ids, row_steps, test_ids, algorithm, "
            "algorithm_meta, layer_name, row_token_ids=None, *, polarity=1)",
            "agnostic_matrix": "(self)",
            "top_k": "(self, k, *, proponents=True, test_ids=None)",
            "trajectory_aware": "(self, train_hash)",
            "trajectory_agnostic": "(self, train_hash)",
            "token_scores": "(self, train_hash, step=None)",
            "column": "(self, test_hash)",
            "step_matrix": "(self, step)",
            "step_matrices": "(self)",
            "score_at": "(self, train_hash, step, test_hash)",
            "query": "(self, train_hashes=None, test_hashes=None, trajectory='agnostic')",
            "save": "(self, out_dir)",
            "load": "(out_dir)",
        },
    )
    assert isinstance(inspect.getattr_static(AttributionScore, "load"), classmethod)
    check_properties(
        AttributionScore, ["granularity", "train_ids", "num_rows", "num_train", "num_test"]
    )


# ---------------------------------------------------------------------------- §4 base
def test_granularities():
    assert ATTRIBUTION_GRANULARITIES == ("instance", "token")


def test_base_attributor_abstract_methods():
    assert BaseAttributor.__abstractmethods__ == {
        "__init__",
        "cache",
        "attribute",
        "attribute_from_cache",
    }
    check(
        BaseAttributor,
        {
            "__init__": "(self, args, *, task=None, **kwargs)",
            "cache": "(self, train_dataset, test_dataset, *, cache_dir=None, hook_config=None, "
            "**cache_kwargs)",
            "attribute": "(self, train_dataset, test_dataset, *, hook_config=None, verbose=False, "
            "**attribution_kwargs)",
            "attribute_from_cache": "(self, train_source, test_source, *, "
            "selected_training_steps=None, layer_name=None, verbose=False, **attribution_kwargs)",
        },
    )
    assert "algorithm" in BaseAttributor.__annotations__


INNER_PRODUCT_METHODS = {
    "require_task": "(self, method)",
    "num_checkpoints": "(self)",
    "load_checkpoint": "(self, index)",
    "checkpoints": "(self)",
    "train_loss_fn": "(self)",
    "test_loss_fn": "(self)",
    "generate_train_rep": "(self, train_dataset, *, checkpoint_step=0, enable_update=False, "
    "hook_config=None, snapshots=None, forward_model=None)",
    "generate_test_rep": "(self, test_dataset, *, checkpoint_step=0, hook_config=None, "
    "hook_manager=None, forward_model=None, shard=True)",
    "load_train_rep": "(self, train_gradients, *, steps=None, layer_name=None, verbose=False, "
    "desc=None)",
    "load_test_rep": "(self, test_gradients, *, layer_name=None, verbose=False, desc=None)",
    "collect_gradients": "(self, streamer, store, *, offload_interval=1, on_block=None)",
    "cache_representations": "(self, source, store, *, transform=None, sample_id_key=None)",
    "prepare_scoring": "(self, train_source, test_source)",
    "transform_train_rep": "(self, block)",
    "transform_test_rep": "(self, block)",
    "inner_product": "(self, train_rep, test_rep, *, dense_cache=None)",
    "inner_product_per_token": "(self, train_rep, test_rep)",
    "score_sources": "(self, train_source, test_source, *, loop_over_test=False, "
    "transform_test=None, attribution_granularity='instance')",
    "build_score": "(self, scores, row_train_ids, row_steps, test_ids, *, algorithm_meta=None, "
    "layer_name=None, row_token_ids=None)",
    "stores_meta": "(train_store, test_store)",
    "resolve_store": "(source)",
}


@pytest.mark.parametrize(
    "cls",
    [
        BaseInnerProductAttributor,
        TracInAttributor,
        KFACAttributor,
        EKFACAttributor,
        TrajectoryAttributor,
    ],
)
def test_inner_product_extension_hooks(cls):
    """The base's extension hooks keep their contract signatures in every subclass."""
    check(cls, INNER_PRODUCT_METHODS)
    for name in ("stores_meta", "resolve_store"):
        assert isinstance(inspect.getattr_static(cls, name), staticmethod)


def test_inner_product_entry_points():
    check(
        BaseInnerProductAttributor,
        {
            "__init__": "(self, args, *, task=None)",
            "cache": "(self, train_dataset, test_dataset, *, cache_dir=None, hook_config=None, "
            "enable_update=False, on_train_block=None)",
            "attribute": "(self, train_dataset, test_dataset, *, hook_config=None, verbose=False, "
            "loop_over_test=False, enable_update=False, gradient_cache_residency=None, "
            "attribution_granularity='instance', **attribution_kwargs)",
            "attribute_from_cache": "(self, train_source, test_source, *, "
            "selected_training_steps=None, layer_name=None, verbose=False, "
            "loop_over_test=False, algorithm_meta=None, attribution_granularity='instance', "
            "**attribution_kwargs)",
        },
    )


# ---------------------------------------------------------------------------- §5 utils
def test_attribution_utils():
    check(
        attribution_utils,
        {
            "normalize_layer_names": "(x)",
            "collect_gradients": "(streamer, store, *, offload_interval=1, on_block=None, "
            "async_write=None)",
            "finalize_factors": "(rep, *, budget=None, held=0)",
        },
    )
    assert attribution_utils.LR_SCHEDULE_FILE == "lr_schedule.json"


def test_lr_schedule_parameter_names():
    check(
        attribution_utils,
        {"write_lr_schedule": "(dir, lrs)", "read_lr_schedule": "(dir)"},
    )


# ---------------------------------------------------------------------------- §6 TracIn
def test_tracin_signatures():
    assert TracInAttributor.algorithm == "TracIn"
    check(
        TracInAttributor,
        {
            "__init__": "(self, args, *, task=None)",
            "attribute": "(self, train_dataset, test_dataset, *, hook_config=None, verbose=False, "
            "loop_over_test=False, enable_update=False, gradient_cache_residency=None, "
            "attribution_granularity='instance', normalized_grad=False)",
            "attribute_from_cache": "(self, train_source, test_source, *, "
            "selected_training_steps=None, layer_name=None, verbose=False, "
            "loop_over_test=False, algorithm_meta=None, attribution_granularity='instance', "
            "normalized_grad=False)",
        },
    )


# ---------------------------------------------------------------------------- §7 K-FAC family
def test_kronecker_subclass_contract():
    assert KroneckerAttributor.algorithm == "Kronecker"
    check(
        KroneckerAttributor,
        {
            "__init__": "(self, args, *, task=None)",
            "checkpoints": "(self)",
            "fit_factors": "(self, train_source, fisher_acc)",
            "damp": "(self, raw_factors, damping)",
            "precondition_test_layer": "(self, value, layer_type, factors)",
            "fit_raw": "(self, train_source)",
            "damp_fit": "(self, raw_fit, damping)",
            "kfac_layers": "(self, grad)",
            "fisher_layers": "(self, grad)",
            "accumulate_fisher": "(self, fisher_acc, grad)",
            "save_fisher": "(self, covariances, fit_dir=None, *, fisher=None)",
            "load_fisher": "(self, fit_dir)",
        },
    )


KRONECKER_ENTRY_POINTS = {
    # extension: ``kept_gradient_budget=None`` (issue 13: first-pass gradients kept in a budget)
    "attribute": "(self, train_dataset, test_dataset, *, hook_config=None, verbose=False, "
    "loop_over_test=False, gradient_cache_residency=None, attribution_granularity='instance', "
    "damping=0.001, non_kfac_strategy='ignore', direct_fim_max_params=4096, "
    "relative_damping=False, factor_cache_residency=None, covariances_at_capture=True, "
    "fit_dir=None, kept_gradient_budget=None)",
    "attribute_from_cache": "(self, train_source, test_source, *, selected_training_steps=None, "
    "layer_name=None, verbose=False, loop_over_test=False, algorithm_meta=None, "
    "attribution_granularity='instance', damping=0.001, preconditioned_test_dir=None, "
    "preconditioned_test_cache_residency=None, fit_dir=None, non_kfac_strategy='ignore', "
    "direct_fim_max_params=4096, relative_damping=False, factor_cache_residency=None, "
    "covariances_at_capture=True)",
    "fit": "(self, train_source, fit_dir=None, *, selected_training_steps=None, "
    "non_kfac_strategy='ignore', direct_fim_max_params=4096, layer_name=None, verbose=False, "
    "covariances=None, factor_cache_residency=None, covariances_at_capture=True)",
    "cache_preconditioned_test": "(self, train_source, test_source, "
    "preconditioned_test_dir=None, *, damping=0.001, selected_training_steps=None, "
    "non_kfac_strategy='ignore', direct_fim_max_params=4096, layer_name=None, verbose=False, "
    "relative_damping=False, factor_cache_residency=None, covariances_at_capture=True)",
    "cache": "(self, train_dataset, test_dataset, *, covariances_at_capture=None, **kwargs)",
}


def test_kfac_signatures():
    assert KFACAttributor.algorithm == "KFAC"
    check(KFACAttributor, {"__init__": "(self, args, *, task=None)", **KRONECKER_ENTRY_POINTS})


def test_ekfac_signatures():
    assert EKFACAttributor.algorithm == "EKFAC"
    assert EKFACAttributor.EKFAC_MODES == ("exact", "approx")
    check(
        EKFACAttributor,
        {"__init__": "(self, args, *, task=None, mode='exact')", **KRONECKER_ENTRY_POINTS},
    )


# ---------------------------------------------------------------------------- §8 LESS
def test_less_signatures():
    assert LESSAttributor.algorithm == "LESS"
    assert issubclass(LESSAttributor, BaseInnerProductAttributor)
    check(
        LESSAttributor,
        {
            "__init__": "(self, args, *, task=None, optimizers=None, checkpoint_weights=None)",
            "attribute": "(self, train_dataset, test_dataset, *, hook_config=None, verbose=False, "
            "loop_over_test=False, enable_update=False, gradient_cache_residency=None, "
            "attribution_granularity='instance', loss_reduction='mean')",  # + loss_reduction
            "attribute_from_cache": "(self, train_source, test_source, *, "
            "checkpoint_weight=None, learning_rate=None, algorithm_meta=None, **kwargs)",
            "cache": "(self, train_dataset, test_dataset, *, enable_update=False, "
            "loss_reduction='mean', **kwargs)",
            "generate_train_rep": "(self, train_dataset, *, checkpoint_step=0, "
            "enable_update=False, hook_config=None)",
        },
    )


# ---------------------------------------------------------------------------- §9 Trajectory
def test_trajectory_signatures():
    assert TrajectoryAttributor.algorithm == "Trajectory"
    check(
        TrajectoryAttributor,
        {
            "__init__": "(self, args, *, task=None)",
            "checkpoints": "(self)",
            "cache": "(self, train_dataset, test_dataset, *, cache_dir=None, hook_config=None, "
            "offload_interval=1)",
            "collect_trajectory": "(self, train_target, test_store, train_dataset, test_dataset, "
            "*, hook_config=None, offload_interval=1)",
            "trajectory_callbacks": "(self, model, streamer, snapshots)",
            "on_trajectory_block": "(self)",
            "finish_trajectory": "(self, train_target)",
            "open_train_source": "(self, train_source, *, steps=None, layer_name=None, "
            "hook_config=None, verbose=False)",
            "validate_propagation": "(propagation, loop_over_test)",
            "resolve_steps": "(available, selected, final_step)",
        },
    )
    check_properties(TrajectoryAttributor, ["recompute"])
    for name in ("validate_propagation", "resolve_steps"):
        assert isinstance(inspect.getattr_static(TrajectoryAttributor, name), staticmethod)
    for name in (
        "train_dir_of",
        "available_steps",
        "recorded_lr_of",
        "close_source",
        "source_meta",
        "steps_bar",
        "collect_test_matrix",
        "test_column_order",
    ):
        assert callable(getattr(TrajectoryAttributor, name))


# ---------------------------------------------------------------------------- §10 DVEmb
def test_dvemb_signatures():
    assert DVEmbAttributor.algorithm == "DVEmb"
    assert issubclass(DVEmbAttributor, TrajectoryAttributor)
    check(DVEmbAttributor, INNER_PRODUCT_METHODS)
    check(
        DVEmbAttributor,
        {
            "__init__": "(self, args, *, task=None)",
            "attribute": "(self, train_dataset, test_dataset, *, hook_config=None, verbose=False, "
            "loop_over_test=False, gradient_cache_residency='disk', propagation='train', "
            "dvemb_dir=None, hessian_mode='full', selected_training_steps=None, "
            "loss_reduction='mean', learning_rate=1.0)",
            "attribute_from_cache": "(self, train_source, test_source, *, "
            "selected_training_steps=None, layer_name=None, verbose=False, "
            "loop_over_test=False, algorithm_meta=None, propagation='train', dvemb_dir=None, "
            "hessian_mode='full', final_step=None, loss_reduction='mean', learning_rate=1.0, "
            "recorded_lr=None, hook_config=None, block_dtype=torch.float32)",
            "cache_dvemb": "(self, train_source, dvemb_dir=None, *, "
            "selected_training_steps=None, hessian_mode='full', final_step=None, "
            "loss_reduction='mean', verbose=False, layer_name=None, learning_rate=1.0)",
            "embed_trajectory": "(self, train_source, prop_steps, output_steps, *, "
            "learning_rate, loss_reduction='mean', hessian_mode='full', verbose=False)",
        },
    )


# ---------------------------------------------------------------------------- §11 AdamW-influence
def test_adamw_influence_signatures():
    assert AdamWInfluenceAttributor.algorithm == "AdamWInfluence"
    assert issubclass(AdamWInfluenceAttributor, TrajectoryAttributor)
    check(
        AdamWInfluenceAttributor,
        {
            "__init__": "(self, args, *, task=None, projection_kwargs=None)",
            "attribute": "(self, train_dataset, test_dataset, *, hook_config=None, verbose=False, "
            "**kwargs)",
            "attribute_from_cache": "(self, train_source, test_source, *, dynamics=None, "
            "selected_training_steps=None, layer_name=None, verbose=False, "
            "loss_reduction='mean', propagation='train', loop_over_test=False, final_step=None, "
            "hook_config=None, block_dtype=torch.float32, **kwargs)",
            "load_dynamics": "(train, dynamics)",
        },
    )
    assert isinstance(
        inspect.getattr_static(AdamWInfluenceAttributor, "load_dynamics"), staticmethod
    )
    for name in ("sweep", "sweep_queries", "trajectory_callbacks", "on_trajectory_block"):
        assert callable(getattr(AdamWInfluenceAttributor, name))


# ---------------------------------------------------------------------------- one name per concept
SPEC_ALIASES = {
    (KFACAttributor, "attribute"): {"fisher_dir": "fit_dir"},
    (KFACAttributor, "attribute_from_cache"): {"fisher_dir": "fit_dir"},
    (KFACAttributor, "fit"): {"train_gradients_dir": "train_source", "fisher_dir": "fit_dir"},
    (KFACAttributor, "cache_preconditioned_test"): {
        "train_gradients_dir": "train_source",
        "test_gradients_dir": "test_source",
    },
    (KFACAttributor, "save_fisher"): {"fisher_dir": "fit_dir"},
    (KFACAttributor, "load_fisher"): {"fisher_dir": "fit_dir"},
    (LESSAttributor, "attribute_from_cache"): {"learning_rates": "learning_rate"},
    (DVEmbAttributor, "cache_dvemb"): {"train_gradients_dir": "train_source"},
}


@pytest.mark.parametrize("owner, method", sorted(SPEC_ALIASES, key=lambda k: (k[0].__name__, k[1])))
def test_spec_names_stay_accepted_as_aliases(owner, method):
    assert getattr(owner, method).__keyword_aliases__ == SPEC_ALIASES[owner, method]

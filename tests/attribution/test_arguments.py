from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dattri_llm.attribution.arguments import AttributionArguments

EXPECTED_FIELDS = [
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


def test_field_order_defaults_and_help():
    fields = dataclasses.fields(AttributionArguments)
    assert [(f.name, f.default) for f in fields] == EXPECTED_FIELDS
    assert all(f.metadata.get("help") for f in fields)


def test_post_init_normalisation(tmp_path, monkeypatch):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"min_num_params": 10}))
    a = AttributionArguments(
        output_dir="~/scores",
        seed=7,
        fsdp_config=str(cfg),
        gradient_checkpointing_kwargs='{"use_reentrant": false}',
        deepspeed="not-a-file",
        fsdp="full_shard auto_wrap",
    )
    assert not a.output_dir.startswith("~")
    assert a.data_seed == 7
    assert a.fsdp_config == {"min_num_params": 10}
    assert a.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert a.deepspeed == "not-a-file"
    assert a.fsdp == ["full_shard", "auto_wrap"]
    assert a.output_path == a.output_path.__class__(a.output_dir)
    if not torch.cuda.is_available():
        assert a.dataloader_pin_memory is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bf16": True, "fp16": True}, "bf16 and fp16"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"per_device_eval_batch_size": -1}, "per_device_eval_batch_size"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"dataloader_prefetch_factor": 0}, "dataloader_prefetch_factor"),
        ({"fsdp": "full_shard bogus"}, "bogus"),
        ({"fsdp_config": "{not json"}, "fsdp_config"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttributionArguments(output_dir="o", **kwargs)


def test_max_grad_norm_none_allowed():
    assert AttributionArguments(output_dir="o", max_grad_norm=None).max_grad_norm is None


def test_distributed_properties(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    a = AttributionArguments(output_dir="o", use_cpu=True, per_device_train_batch_size=3)
    assert a.device == torch.device("cpu") and a.n_gpu == 0
    assert (a.world_size, a.process_index, a.local_process_index) == (1, 0, 0)
    assert a.should_log and a.train_batch_size == 3 and a.eval_batch_size == 8
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (a.world_size, a.process_index, a.local_process_index) == (4, 2, 1)
    assert not a.should_log
    assert a.device == torch.device("cpu")


def test_tf32_flags_applied():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        AttributionArguments(output_dir="o", tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        AttributionArguments(output_dir="o", tf32=False)
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_hf_argument_parser():
    transformers = pytest.importorskip("transformers")
    parser = transformers.HfArgumentParser(AttributionArguments)
    (a,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            "o",
            "--fsdp",
            "full_shard",
            "offload",
            "--max_grad_norm",
            "2",
            "--bf16",
            "--fsdp_config",
            '{"min_num_params": 3}',
        ]
    )
    assert a.fsdp == ["full_shard", "offload"] and a.max_grad_norm == 2.0 and a.bf16
    assert a.fsdp_config == {"min_num_params": 3}

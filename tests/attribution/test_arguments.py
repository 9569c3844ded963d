from __future__ import annotations

import json

import pytest
import torch

from dattri_llm.attribution.arguments import AttributionArguments

# Field order, defaults and help texts: tests/test_spec_signatures_attribution.py.


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

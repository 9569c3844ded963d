"""``TrainingSettings``: the run settings the gradient sources read, with their checks.

Device, precision, batching, optimizer and schedule, clipping, accumulation,
data loading and DDP / FSDP wrapping, as fields named like the Hugging Face
``TrainingArguments`` subset they mirror (``HfArgumentParser``-compatible),
plus the device and rank properties. `AttributionArguments`
(:mod:`dattri_llm.attribution.arguments`) extends it with the attribution-facing
properties. Dataclass inheritance puts a base's fields first and the contract
fixes their positional order, so the field list is the whole of it, also the
few fields only the attribution tier reads (``output_dir``, the batch sizes,
``async_disk_write``, ``recompute_gradients``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["FSDP_OPTIONS", "TrainingSettings"]

FSDP_OPTIONS = ("full_shard", "shard_grad_op", "offload", "auto_wrap")
_JSON_FIELDS = ("gradient_checkpointing_kwargs", "fsdp_config", "deepspeed")


def _load_json_option(name: str, value: object) -> object:
    """Parse a JSON string (starting with ``{``) or load a JSON file path; else return as is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}: invalid JSON string {value!r}: {err}") from err
    path = Path(value).expanduser()
    if path.is_file():
        with path.open(encoding="utf-8") as handle:
            try:
                return json.load(handle)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name}: file {path} is not valid JSON: {err}") from err
    return value


def _env_int(name: str, default: int) -> int:
    """Integer value of environment variable ``name`` (``default`` when unset)."""
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


@dataclass
class TrainingSettings:
    """Settings of a gradient-streaming run (HfArgumentParser-compatible)."""

    output_dir: str = field(metadata={"help": "Directory where scores and caches are written."})
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Training-side batch size per device."}
    )
    per_device_eval_batch_size: int = field(
        default=8, metadata={"help": "Test (query) side batch size per device."}
    )
    learning_rate: float = field(
        default=5e-5, metadata={"help": "Learning rate of updating (trajectory) passes."}
    )
    weight_decay: float = field(
        default=0.0, metadata={"help": "Weight decay of parameters with ndim >= 2 (not biases)."}
    )
    optim: str = field(
        default="adamw_torch", metadata={"help": "Optimizer of updating passes: adamw_torch | sgd."}
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    lr_scheduler_type: str = field(
        default="linear", metadata={"help": "transformers.get_scheduler name."}
    )
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Batches accumulated per optimizer update."}
    )
    max_grad_norm: float | None = field(
        default=1.0, metadata={"help": "Gradient clipping norm (None disables clipping)."}
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Enable gradient checkpointing on the model."}
    )
    gradient_checkpointing_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Kwargs of gradient_checkpointing_enable (dict, JSON string or path)."},
    )
    use_cpu: bool = field(default=False, metadata={"help": "Run on CPU even if CUDA is present."})
    bf16: bool = field(default=False, metadata={"help": "bfloat16 autocast."})
    fp16: bool = field(default=False, metadata={"help": "float16 autocast (GradScaler on GPU)."})
    tf32: bool | None = field(
        default=None, metadata={"help": "Set the CUDA matmul/cuDNN TF32 flags (None: untouched)."}
    )
    seed: int = field(default=42, metadata={"help": "Random seed set at the start of a pass."})
    data_seed: int | None = field(
        default=None, metadata={"help": "Seed of the data shuffling generator (default: seed)."}
    )
    full_determinism: bool = field(
        default=False, metadata={"help": "Use transformers.enable_full_determinism(seed)."}
    )
    dataloader_num_workers: int = field(
        default=0, metadata={"help": "DataLoader worker processes."}
    )
    dataloader_pin_memory: bool = field(
        default=True, metadata={"help": "Pin DataLoader memory (forced off without CUDA)."}
    )
    dataloader_persistent_workers: bool = field(
        default=False, metadata={"help": "Keep DataLoader workers alive between passes."}
    )
    dataloader_prefetch_factor: int | None = field(
        default=None, metadata={"help": "Batches prefetched per DataLoader worker."}
    )
    async_disk_write: bool = field(
        default=False, metadata={"help": "Write gradient groups from a background thread."}
    )
    recompute_gradients: bool = field(
        default=False,
        metadata={"help": "Trajectory methods store parameter snapshots instead of gradients."},
    )
    ddp_find_unused_parameters: bool | None = field(
        default=None, metadata={"help": "find_unused_parameters of DistributedDataParallel."}
    )
    fsdp: str | list[str] = field(
        default="",
        metadata={"help": "FSDP options: any of full_shard, shard_grad_op, offload, auto_wrap."},
    )
    fsdp_config: dict | str | None = field(
        default=None, metadata={"help": "FSDP config (dict, JSON string or path)."}
    )
    deepspeed: dict | str | None = field(
        default=None, metadata={"help": "DeepSpeed config (dict, JSON string or path)."}
    )

    def __post_init__(self) -> None:
        """Normalise options, apply TF32 flags and validate values."""
        self.output_dir = os.path.expanduser(str(self.output_dir))
        for name in _JSON_FIELDS:
            setattr(self, name, _load_json_option(name, getattr(self, name)))
        if self.data_seed is None:
            self.data_seed = self.seed
        if not torch.cuda.is_available():
            self.dataloader_pin_memory = False
        self.fsdp = self._parse_fsdp(self.fsdp)
        self._validate()
        if self.tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = bool(self.tf32)
            torch.backends.cudnn.allow_tf32 = bool(self.tf32)

    @staticmethod
    def _parse_fsdp(value: str | list[str] | None) -> list[str]:
        """Split the FSDP option string into tokens and check each one."""
        if value is None or value is False:
            return []
        parts = [value] if isinstance(value, str) else [str(part) for part in value]
        tokens = [tok for part in parts for tok in part.split()]
        unknown = [tok for tok in tokens if tok not in FSDP_OPTIONS]
        if unknown:
            raise ValueError(
                f"fsdp: unknown option(s) {unknown}; each must be one of {FSDP_OPTIONS}"
            )
        return tokens

    def _validate(self) -> None:
        """Raise ``ValueError`` for inconsistent settings."""
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 are mutually exclusive; set at most one of them")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}"
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(
                f"max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm}"
            )
        if self.dataloader_prefetch_factor is not None and self.dataloader_prefetch_factor <= 0:
            raise ValueError(
                "dataloader_prefetch_factor must be a positive integer or None, got "
                f"{self.dataloader_prefetch_factor}"
            )
        if self.dataloader_num_workers < 0:
            raise ValueError(
                f"dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}"
            )

    @property
    def device(self) -> torch.device:
        """``cpu`` (``use_cpu`` or no CUDA), else ``cuda:<LOCAL_RANK>`` when set, else ``cuda``."""
        if self.use_cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank not in (None, ""):
            return torch.device(f"cuda:{int(local_rank)}")
        return torch.device("cuda")

    @property
    def n_gpu(self) -> int:
        """GPUs used by this process: 0 on CPU, 1 per distributed rank, else all visible."""
        if self.device.type != "cuda":
            return 0
        if os.environ.get("LOCAL_RANK") not in (None, ""):
            return 1
        return torch.cuda.device_count()

    @property
    def world_size(self) -> int:
        """Number of processes (``WORLD_SIZE``, default 1)."""
        return _env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        """Global rank (``RANK``, default 0)."""
        return _env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        """Rank on this node (``LOCAL_RANK``, default 0)."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def should_log(self) -> bool:
        """Whether this process logs (rank 0)."""
        return self.process_index == 0

"""Model loading and the causal-LM loss the capture streams.

The loss of a batch is the sum over its samples of each sample's mean
next-token loss over its scored tokens (labels other than ``-100``), so every
captured per-sample gradient is the gradient of that sample's own loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from dattri_llm.cli.arguments import ModelArguments
from dattri_llm.cli.data import model_inputs
from dattri_llm.cli.errors import CLIError

__all__ = [
    "causal_lm_loss",
    "disable_dropout",
    "load_config",
    "load_model",
    "load_tokenizer",
    "sample_losses",
]

# The dropout modules of torch.nn (their rate is the attribute ``p``).
_DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def load_tokenizer(args: ModelArguments) -> Any:
    """The tokenizer of ``--tokenizer`` (default ``--model``); ``CLIError`` when it cannot load."""
    name = args.tokenizer or args.model
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise CLIError(f"cannot load tokenizer {name!r}: {_first_line(err)}") from err


def load_config(args: ModelArguments) -> Any:
    """The model's ``PretrainedConfig`` (its ``config.json`` only; no weights)."""
    try:
        return AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise CLIError(
            f"cannot load the config of model {args.model!r}: {_first_line(err)}"
        ) from err


def load_model(args: ModelArguments, *, quiet: bool = False) -> tuple[torch.nn.Module, Any]:
    """``(model in eval mode, tokenizer)`` from a Hub id or a local directory.

    ``quiet`` hides the loading bars of ``transformers`` for the call.
    """
    bars = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            args.tokenizer or args.model, trust_remote_code=args.trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            args.model, trust_remote_code=args.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise CLIError(f"cannot load model {args.model!r}: {_first_line(err)}") from err
    finally:
        if quiet and bars:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tokenizer


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Σ over the batch of each sample's mean next-token loss (labels ``-100`` ignored)."""
    return sample_losses(model, batch).sum()


def sample_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sample's mean next-token loss over its scored tokens, ``(B,)`` float32."""
    logits = model(**model_inputs(batch)).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    token_loss = F.cross_entropy(
        logits.transpose(1, 2).float(), targets, reduction="none", ignore_index=-100
    )
    counted = (targets != -100).sum(1).clamp(min=1)
    return token_loss.sum(1) / counted


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout of ``model`` to 0; return what was nonzero (``"name: p"``).

    Dropout modules (``nn.Dropout`` and its kin) get ``p = 0``; float attributes
    named ``*dropout*`` (the rate an attention module passes to its kernel, as
    Llama's ``attention_dropout``) are set to 0.0. The model then computes the
    same in ``train()`` and ``eval()`` mode.
    """
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, _DROPOUTS) and module.p > 0:
            changed.append(f"{name or 'model'}: {module.p:g}")
            module.p = 0.0
        for attr, value in vars(module).items():
            if "dropout" in attr and isinstance(value, float) and value > 0:
                changed.append(f"{name}.{attr}: {value:g}" if name else f"{attr}: {value:g}")
                setattr(module, attr, 0.0)
    return changed

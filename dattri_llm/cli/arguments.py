"""The command line's own dataclasses, and the command → dataclasses table.

Every option of every command is a field of one of these dataclasses or of
`AttributionArguments`; ``transformers.HfArgumentParser`` turns them into flags
and :mod:`dattri_llm.cli.parsing` merges them with a ``--config`` file.
`CaptureArguments` mirrors the selectors of `HookManagerConfig` (which is not a
dataclass) and converts to one with :meth:`CaptureArguments.hook_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig

__all__ = [
    "COMMANDS",
    "METHODS",
    "CaptureArguments",
    "DataArguments",
    "MethodArguments",
    "ModelArguments",
    "RunArguments",
    "StoreArguments",
    "TopKArguments",
]

METHODS = ("graddot", "tracin", "gradcos", "kfac", "ekfac", "lorif")


@dataclass
class RunArguments:
    """How a command runs (not recorded in the written `config.yaml`)."""

    config: str | None = field(
        default=None,
        metadata={
            "help": "A YAML or JSON file of options (a run's config.yaml replays it); "
            "flags given beside it override its values."
        },
    )
    overwrite: bool = field(
        default=False, metadata={"help": "Replace an existing, finished output directory."}
    )
    quiet: bool = field(default=False, metadata={"help": "No progress bars."})


@dataclass
class ModelArguments:
    """The causal language model whose gradients are captured."""

    model: str = field(
        metadata={"help": "Hugging Face Hub id or local directory (AutoModelForCausalLM)."}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer id or directory (default: --model)."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow the model's own code from the Hub."}
    )


@dataclass
class DataArguments:
    """The training and query sets and how their text becomes token ids."""

    train_data: str = field(
        metadata={
            "help": "Training set: a .jsonl/.json, .txt (one sample a line) or .parquet "
            "file, or a datasets.save_to_disk directory."
        }
    )
    query_data: str = field(metadata={"help": "Query set, in the same forms as --train_data."})
    text_field: str = field(
        default="text", metadata={"help": "Field holding a sample's text (every token counts)."}
    )
    prompt_field: str | None = field(
        default=None,
        metadata={
            "help": "Field holding the prompt; with --completion_field, the prompt's "
            "tokens are masked from the loss (label -100)."
        },
    )
    completion_field: str | None = field(
        default=None, metadata={"help": "Field holding the completion (scored tokens)."}
    )
    max_length: int = field(
        default=512, metadata={"help": "Tokens per sample at most (longer ones are truncated)."}
    )

    def __post_init__(self) -> None:
        """``ValueError`` for half a prompt/completion pair or a bad length."""
        if (self.prompt_field is None) != (self.completion_field is None):
            raise ValueError("--prompt_field and --completion_field go together; give both")
        if self.max_length < 2:
            raise ValueError(f"--max_length must be >= 2, got {self.max_length}")


@dataclass
class CaptureArguments:
    """Which layers are captured, as `HookManagerConfig` selectors (regexes, re.search)."""

    linear_io: list[str] | None = field(
        default=None,
        metadata={
            "help": "Regexes of the layers captured as factorized linear_io (inputs and "
            "output gradients); 'all' for every capable layer. Neither selector given: "
            "the library default (every eligible layer)."
        },
    )
    param_grad: list[str] | None = field(
        default=None,
        metadata={
            "help": "Regexes of the layers captured from their parameter gradients; "
            "'all' for every layer owning trainable parameters."
        },
    )
    capture_style: str = field(
        default="factorized",
        metadata={"help": "factorized | materialized | auto: how linear_io layers are stored."},
    )

    def hook_config(self) -> HookManagerConfig:
        """The equivalent `HookManagerConfig`."""

        def selector(patterns: list[str] | None) -> object:
            if patterns is None:
                return None
            return REGISTER_ALL if list(patterns) == ["all"] else list(patterns)

        return HookManagerConfig(
            linear_io=selector(self.linear_io),
            param_grad=selector(self.param_grad),
            capture_style=self.capture_style,
        )


@dataclass
class StoreArguments:
    """Where the gradient stores are (the output directory of ``capture``)."""

    store: str = field(metadata={"help": "Output directory of a dattri-llm capture run."})


@dataclass
class MethodArguments:
    """The attribution method and its options."""

    method: str = field(default="graddot", metadata={"help": "One of: " + ", ".join(METHODS) + "."})
    damping: float | None = field(
        default=None,
        metadata={
            "help": "kfac / ekfac / lorif damping (default: 1e-3 for kfac and ekfac; "
            "0.1 x each layer's mean eigenvalue for lorif)."
        },
    )
    relative_damping: bool = field(
        default=False,
        metadata={"help": "kfac / ekfac: damping relative to each layer's mean eigenvalue."},
    )
    ekfac_mode: str = field(default="exact", metadata={"help": "ekfac: exact | approx."})
    lorif_rank: int | None = field(
        default=1, metadata={"help": "lorif: rank c of the stored training gradients."}
    )
    lorif_svd_rank: int | None = field(
        default=None, metadata={"help": "lorif: singular directions kept per layer (all)."}
    )

    def __post_init__(self) -> None:
        """``ValueError`` for an unknown method."""
        self.method = self.method.lower().replace("-", "")
        if self.method not in METHODS:
            raise ValueError(f"unknown --method {self.method!r}; choose one of {list(METHODS)}")


@dataclass
class TopKArguments:
    """How many training samples per query, which ones, and how they are printed."""

    k: int = field(default=5, metadata={"help": "Training samples per query."})
    opponents: bool = field(
        default=False, metadata={"help": "The most harmful samples instead of the most helpful."}
    )
    format: str = field(default="text", metadata={"help": "text | json (what is printed)."})

    def __post_init__(self) -> None:
        """``ValueError`` for a bad ``k`` or format."""
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.format not in ("text", "json"):
            raise ValueError(f"--format must be text or json, got {self.format!r}")


COMMANDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "capture": (
        "Capture per-sample gradients of the training and query sets (one pass, no training).",
        (ModelArguments, DataArguments, CaptureArguments, AttributionArguments),
    ),
    "attribute": (
        "Score every training sample against every query from the stores of a capture run.",
        (StoreArguments, MethodArguments, AttributionArguments),
    ),
    "top-k": (
        "Each query's k best training samples from the stores of a capture run.",
        (StoreArguments, MethodArguments, TopKArguments, AttributionArguments),
    ),
}
"""Command → (one-line description, its dataclasses besides `RunArguments`)."""

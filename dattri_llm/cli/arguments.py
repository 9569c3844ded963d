"""The command line's own dataclasses, and the command → dataclasses table.

Every option of every command is a field of one of these dataclasses or of
`AttributionArguments` (``--method`` and the methods' own flags are
`MethodArguments`, in :mod:`dattri_llm.cli.method_arguments`);
``transformers.HfArgumentParser`` turns them into flags and
:mod:`dattri_llm.cli.parsing` merges them with a ``--config`` file.
`CaptureArguments` mirrors the selectors of `HookManagerConfig` (which is not a
dataclass) and converts to one with :meth:`CaptureArguments.hook_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.index import INDEX_KINDS
from dattri_llm.cli.method_arguments import MethodArguments
from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig

__all__ = [
    "COMMANDS",
    "AttributeStoreArguments",
    "CaptureArguments",
    "DataArguments",
    "LiveDataArguments",
    "LiveModelArguments",
    "ModelArguments",
    "PlanArguments",
    "PlanDataArguments",
    "RankSourceArguments",
    "ReportArguments",
    "RunArguments",
    "StoreArguments",
    "TopKArguments",
    "TrainArguments",
    "VALIDATE_METRICS",
    "ValidateArguments",
]

VALIDATE_METRICS = ("lds", "loo", "both")  # what `dattri-llm validate --metric` measures


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
    quiet: bool = field(
        default=False, metadata={"help": "No progress bars, and no run plan printed."}
    )
    force: bool = field(
        default=False,
        metadata={
            "help": "capture / attribute / fit: start even when the run plan says the stores "
            "or the fit do not fit the free disk or memory (or the plan cannot be made)."
        },
    )


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
class LiveModelArguments(ModelArguments):
    """The model of a live ``attribute`` (without ``--store``), as for ``capture``."""

    model: str | None = field(
        default=None,
        metadata={
            "help": "Live attribute (no --store): Hugging Face Hub id or local directory "
            "(AutoModelForCausalLM), with --train_data and --query_data (stride: the only "
            "way it runs)."
        },
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
    messages_field: str | None = field(
        default=None,
        metadata={
            "help": "Field holding a chat, a list of {'role', 'content'} messages rendered "
            "with the tokenizer's chat template; only the tokens the template adds for the "
            "assistant messages are scored (their role header included); the others get "
            "label -100."
        },
    )
    max_length: int = field(
        default=512, metadata={"help": "Tokens per sample at most (longer ones are truncated)."}
    )

    def __post_init__(self) -> None:
        """``ValueError`` for half a prompt/completion pair, two layouts, or a bad length."""
        if (self.prompt_field is None) != (self.completion_field is None):
            raise ValueError("--prompt_field and --completion_field go together; give both")
        if self.messages_field is not None and self.prompt_field is not None:
            raise ValueError(
                "--messages_field and --prompt_field/--completion_field are two layouts of a "
                "sample; give one"
            )
        if self.max_length < 2:
            raise ValueError(f"--max_length must be >= 2, got {self.max_length}")


@dataclass
class PlanDataArguments(DataArguments):
    """The data of a plan: the files of `DataArguments` (both optional here) or bare sizes."""

    train_data: str | None = field(
        default=None,
        metadata={
            "help": "Training set file (as for capture): its samples and token lengths are "
            "counted with the tokenizer. Without it: --num_train."
        },
    )
    query_data: str | None = field(
        default=None, metadata={"help": "Query set file (as for capture). Without it: --num_test."}
    )


@dataclass
class LiveDataArguments(DataArguments):
    """The data of a live ``attribute`` (without ``--store``): the files of `DataArguments`."""

    train_data: str | None = field(
        default=None,
        metadata={"help": "Live attribute (no --store): the training set file, as for capture."},
    )
    query_data: str | None = field(
        default=None,
        metadata={"help": "Live attribute (no --store): the query set file, as for capture."},
    )


@dataclass
class TrainArguments:
    """Whether ``capture`` trains the model over the training set while recording the run."""

    train: bool = field(
        default=False,
        metadata={
            "help": "Train one epoch over the training set (AdamW with the optimizer options: "
            "--learning_rate, --weight_decay, --lr_scheduler_type, --max_grad_norm, batch "
            "and accumulation sizes, --seed) and record the run: every step's per-sample "
            "gradients, learning rates and training dynamics; the queries are captured at "
            "the trained weights. Needed by trajectory_tracin, dvemb and adamw_influence."
        },
    )
    save_model: bool = field(
        default=False,
        metadata={
            "help": "With --train: also save the trained model and tokenizer to "
            "<output_dir>/trained_model (save_pretrained)."
        },
    )

    less: bool = field(
        default=False,
        metadata={
            "help": "With --train (AdamW): record the run for the less method instead: every "
            "step's per-sample gradients preconditioned by Adam's state before the step, "
            "with the learning rates and training dynamics. Such a capture serves less only."
        },
    )

    def __post_init__(self) -> None:
        """``ValueError`` for ``--save_model`` or ``--less`` without ``--train``."""
        if self.save_model and not self.train:
            raise ValueError("--save_model saves the trained weights; it needs --train")
        if self.less and not self.train:
            raise ValueError("--less records a training run for LESS; it needs --train")


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
    proj_dim: int | None = field(
        default=None,
        metadata={
            "help": "Project every linear_io layer's captured gradient to this size "
            "(default: no projection)."
        },
    )
    proj_style: str = field(
        default="logra",
        metadata={"help": "logra | dense | mask: the projection style (with --proj_dim)."},
    )

    def __post_init__(self) -> None:
        """``ValueError`` for a bad projection size."""
        if self.proj_dim is not None and self.proj_dim < 1:
            raise ValueError(f"--proj_dim must be >= 1, got {self.proj_dim}")

    def projection(self) -> dict[str, dict] | None:
        """The ``projection_kwargs`` of the options (``None`` without ``--proj_dim``)."""
        if self.proj_dim is None:
            return None
        return {"__default__": {"proj_dim": self.proj_dim, "style": self.proj_style}}

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
            projection_kwargs=self.projection(),
        )


@dataclass
class StoreArguments:
    """Where the gradient stores are (the output directory of ``capture``)."""

    store: str = field(metadata={"help": "Output directory of a dattri-llm capture run."})


@dataclass
class AttributeStoreArguments(StoreArguments):
    """Where the gradient stores are; without it, ``attribute`` runs live from a model and data."""

    store: str | None = field(
        default=None,
        metadata={
            "help": "Output directory of a dattri-llm capture run. Without it: live attribute "
            "from --model, --train_data and --query_data (graddot, gradcos, kfac, ekfac; no "
            "store written). stride, trak, datainf, influence, trackstar and metagradient read "
            "no store and run live only."
        },
    )


@dataclass
class RankSourceArguments(StoreArguments):
    """What ``top-k`` and ``report`` rank: a capture's stores or an ``attribute`` run's score."""

    store: str | None = field(
        default=None,
        metadata={
            "help": "Output directory of a dattri-llm capture run: its gradient stores are "
            "ranked with --method. Give --store or --scores."
        },
    )
    scores: str | None = field(
        default=None,
        metadata={
            "help": "Output directory of a dattri-llm attribute run (any method, stride "
            "included): its saved score is ranked (AttributionScore.load(dir).top_k(k), its "
            "polarity respected) and the texts come from the run's data and tokenizer. The "
            "run's method scored it: --method and its options, --index and --shade do not "
            "apply (tokens unshaded). Give --store or --scores."
        },
    )


@dataclass
class TopKArguments:
    """How many training samples per query, which ones, and how they are printed."""

    k: int = field(default=5, metadata={"help": "Training samples per query."})
    opponents: bool = field(
        default=False, metadata={"help": "The most harmful samples instead of the most helpful."}
    )
    format: str = field(default="text", metadata={"help": "text | json (what is printed)."})
    index: str | None = field(
        default=None,
        metadata={
            "help": "Search a FAISS index of the training store instead of reading it: flat "
            "(exact), ivf or hnsw (approximate); built beside the store on first use and "
            "reused after (refused as stale when the store changed). Grad-Dot and Grad-Cos "
            "only. Needs the index extra (faiss-cpu)."
        },
    )
    nprobe: int = field(default=8, metadata={"help": "IVF lists searched (--index ivf)."})
    ef_search: int = field(
        default=64, metadata={"help": "HNSW candidate list when searching (--index hnsw)."}
    )

    def __post_init__(self) -> None:
        """``ValueError`` for a bad ``k``, format or index kind."""
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.format not in ("text", "json"):
            raise ValueError(f"--format must be text or json, got {self.format!r}")
        if self.index is not None and self.index not in INDEX_KINDS:
            raise ValueError(f"--index must be one of {list(INDEX_KINDS)}, got {self.index!r}")


@dataclass
class PlanArguments:
    """What the plan reads besides the model and data, and how it is printed."""

    config_only: bool = field(
        default=False,
        metadata={
            "help": "Plan from the model's config.json alone (no weights loaded); also "
            "the case whenever --model holds no weight file."
        },
    )
    num_train: int | None = field(
        default=None, metadata={"help": "Training records, when there is no --train_data."}
    )
    num_test: int | None = field(
        default=None, metadata={"help": "Query records, when there is no --query_data."}
    )
    seq_len: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per record, when neither --train_data nor --query_data is given."
        },
    )
    probe: bool = field(
        default=False,
        metadata={
            "help": "Time a real captured forward+backward of one batch (needs the weights) "
            "so the plan has an estimated time."
        },
    )
    format: str = field(default="text", metadata={"help": "text | json (what is printed)."})

    def __post_init__(self) -> None:
        """``ValueError`` for a bad size, format or ``--probe`` with ``--config_only``."""
        for name in ("num_train", "num_test", "seq_len"):
            value = getattr(self, name)
            low = 0 if name == "num_test" else 1
            if value is not None and value < low:
                raise ValueError(f"--{name} must be >= {low}, got {value}")
        if self.format not in ("text", "json"):
            raise ValueError(f"--format must be text or json, got {self.format!r}")
        if self.probe and self.config_only:
            raise ValueError("--probe runs the model and needs its weights; drop --config_only")


@dataclass
class ReportArguments:
    """How many training samples per query the report shows, and what else it writes."""

    k: int = field(default=5, metadata={"help": "Training samples per query."})
    opponents: bool = field(
        default=False, metadata={"help": "The most harmful samples instead of the most helpful."}
    )
    format: str = field(
        default="html",
        metadata={
            "help": "html | text | json: besides report.html, also write (and print) the "
            "top-k table as top_k.txt or top_k.json."
        },
    )
    shade: bool = field(
        default=True,
        metadata={
            "help": "Shade each token by the method's token-granularity score (factorized "
            "stores only; otherwise the tokens are shown unshaded and the page says so)."
        },
    )

    def __post_init__(self) -> None:
        """``ValueError`` for a bad ``k`` or format."""
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.format not in ("html", "text", "json"):
            raise ValueError(f"--format must be html, text or json, got {self.format!r}")


@dataclass
class ValidateArguments:
    """What ``validate`` scores, against which retraining ground truth (LDS, LOO, recall@k)."""

    scores: list[str] = field(
        metadata={
            "help": "Output directories of dattri-llm attribute runs (any method, stride "
            "included) on this --train_data / --query_data: each saved score is measured, one "
            "table row per directory; rows and queries are matched by sample id."
        }
    )
    metric: str = field(
        default="lds",
        metadata={
            "help": "lds | loo | both: the linear datamodeling score (retrains on random "
            "subsets) and/or the leave-one-out Spearman correlation."
        },
    )
    num_subsets: int = field(
        default=32, metadata={"help": "LDS: random training subsets, one retrain each (>= 2)."}
    )
    alpha: float = field(
        default=0.5, metadata={"help": "LDS: fraction of the training set in each subset."}
    )
    num_removed: int | None = field(
        default=None,
        metadata={
            "help": "LOO: training samples left out, one retrain each plus the full run "
            "(default: all); fewer are drawn at random with --seed."
        },
    )
    planted: str | None = field(
        default=None,
        metadata={
            "help": "JSON file of the training samples planted for each query: a list with "
            "one list per query (query file order), or an object {query id: list}; entries "
            "are training ids or row indices. Adds recall@k."
        },
    )
    k: int = field(default=10, metadata={"help": "With --planted: the k of recall@k."})
    retrain_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where each finished retrain is saved at once (default: <output_dir>"
            ".retrains beside the output directory). It outlives the run: a killed or repeated "
            "validate with the same settings reuses every finished retrain."
        },
    )

    def __post_init__(self) -> None:
        """``ValueError`` for a bad metric, size, fraction or ``k``."""
        self.metric = self.metric.lower()
        if self.metric not in VALIDATE_METRICS:
            raise ValueError(
                f"--metric must be one of {list(VALIDATE_METRICS)}, got {self.metric!r}"
            )
        if self.num_subsets < 2:
            raise ValueError(f"--num_subsets must be >= 2, got {self.num_subsets}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"--alpha must be a fraction in (0, 1), got {self.alpha}")
        if self.num_removed is not None and self.num_removed < 1:
            raise ValueError(f"--num_removed must be >= 1, got {self.num_removed}")
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if not self.scores:
            raise ValueError("--scores needs at least one attribute run's output directory")


COMMANDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "plan": (
        "Predict a run's stores, fit and scoring memory and passes before running it.",
        (
            ModelArguments,
            PlanDataArguments,
            CaptureArguments,
            PlanArguments,
            MethodArguments,
            AttributionArguments,
        ),
    ),
    "capture": (
        "Capture per-sample gradients of the training and query sets (one frozen pass, or "
        "with --train one recorded epoch of training).",
        (ModelArguments, DataArguments, CaptureArguments, TrainArguments, AttributionArguments),
    ),
    "fit": (
        "Fit the curvature of kfac / ekfac / lorif over a capture's training store, for reuse.",
        (StoreArguments, MethodArguments, AttributionArguments),
    ),
    "attribute": (
        "Score every training sample against every query, from the stores of a capture run "
        "or live from a model and data.",
        (
            AttributeStoreArguments,
            LiveModelArguments,
            LiveDataArguments,
            CaptureArguments,
            MethodArguments,
            AttributionArguments,
        ),
    ),
    "top-k": (
        "Each query's k best training samples from the stores of a capture run, or from the "
        "saved score of an attribute run (--scores).",
        (RankSourceArguments, MethodArguments, TopKArguments, AttributionArguments),
    ),
    "report": (
        "The token HTML report: each query's top training samples, tokens shaded by score "
        "(from a capture's stores; an attribute run's saved score (--scores) gives unshaded "
        "tokens).",
        (RankSourceArguments, MethodArguments, ReportArguments, AttributionArguments),
    ),
    "validate": (
        "Measure saved attribution scores against retraining on this data: fine-tune the "
        "model on training subsets (LDS) or without single samples (LOO), resumably.",
        (ModelArguments, DataArguments, ValidateArguments, AttributionArguments),
    ),
}
"""Command → (one-line description, its dataclasses besides `RunArguments`)."""

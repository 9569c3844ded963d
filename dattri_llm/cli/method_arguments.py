"""The attribution methods the command line knows, and their options (`MethodArguments`).

The method tables say which command serves which method: the trajectory
methods score a ``capture --train`` run, LESS a ``capture --train --less``
run, STRIDE and the live-only methods run only as a live ``attribute``.
`MethodArguments` holds ``--method`` and every method's own flags; it is one
of the dataclasses of :data:`dattri_llm.cli.arguments.COMMANDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dattri_llm.attribution.algorithm.stride import StrideConfig
from dattri_llm.attribution.algorithm.trackstar import DEFAULT_MIXING

__all__ = [
    "FIT_METHODS",
    "INFLUENCE_SOLVERS",
    "LESS_METHOD",
    "LIVE_METHODS",
    "LIVE_ONLY_METHODS",
    "METAGRADIENT_METHOD",
    "METHODS",
    "OPTIMIZER_PARAM_ORDERS",
    "STRIDE_METHOD",
    "STRIDE_OPTIONS",
    "TRACKSTAR_METHOD",
    "TRAJECTORY_METHODS",
    "MethodArguments",
]

TRAJECTORY_METHODS = ("trajectory_tracin", "dvemb", "adamw_influence")  # need `capture --train`
LESS_METHOD = "less"  # needs `capture --train --less` (Adam-preconditioned train gradients)
STRIDE_METHOD = "stride"  # no per-sample gradients: live `attribute` only, no store
TRACKSTAR_METHOD = "trackstar"  # needs the trained model's optimizer state (--optimizer_state)
METAGRADIENT_METHOD = "metagradient"  # trains from --model itself, recording the run to replay
# Live `attribute` only, as STRIDE.
LIVE_ONLY_METHODS = ("trak", "datainf", "influence", TRACKSTAR_METHOD, METAGRADIENT_METHOD)
# How --optimizer_state's parameter indices map to the model's parameters (the first: default).
OPTIMIZER_PARAM_ORDERS = ("trainer", "model")
INFLUENCE_SOLVERS = ("cg", "lissa", "direct")  # influence: how (H + damping I)^-1 is applied
METHODS = (
    "graddot", "tracin", "gradcos", "kfac", "ekfac", "lorif", *TRAJECTORY_METHODS, LESS_METHOD,
    STRIDE_METHOD, *LIVE_ONLY_METHODS,
)  # fmt: skip
FIT_METHODS = ("kfac", "ekfac", "lorif")  # the methods whose fit `dattri-llm fit` persists
LIVE_METHODS = ("graddot", "tracin", "gradcos", "kfac", "ekfac", STRIDE_METHOD,
                *LIVE_ONLY_METHODS)  # fmt: skip
# The StrideConfig fields the command line sets, each as the flag --stride_<field>.
STRIDE_OPTIONS = (
    "rank", "num_subsets", "subsets_per_example", "injection", "layer", "steps", "lasso_lambda",
)  # fmt: skip


@dataclass
class MethodArguments:
    """The attribution method and its options."""

    method: str = field(
        default="graddot",
        metadata={
            "help": "One of: "
            + ", ".join(METHODS)
            + ". trajectory_tracin, dvemb and adamw_influence score the run of a "
            "`capture --train` (adamw_influence: a more negative score is more helpful); "
            "less (LESS) the run of a `capture --train --less`. stride (STRIDE) needs no "
            "gradients and runs only as a live attribute (--model, --train_data, --query_data), "
            "as do trak (TRAK), datainf (DataInf), influence (exact-Hessian influence "
            "functions, small nn.Linear layers only), trackstar (TrackStar: needs "
            "--optimizer_state) and metagradient (exact metagradients: trains the model one "
            "epoch with the optimizer options while recording the run, then differentiates the "
            "queries' losses through it; a more negative score is more helpful)."
        },
    )
    damping: float | None = field(
        default=None,
        metadata={
            "help": "kfac / ekfac / lorif / trak / datainf / influence / trackstar damping "
            "(default: 1e-3 for kfac, ekfac and influence; 0.1 x each layer's mean eigenvalue "
            "for lorif, trak, datainf and trackstar)."
        },
    )
    influence_solver: str = field(
        default="cg", metadata={"help": "influence: cg | lissa | direct, how H^-1 is applied."}
    )
    influence_max_params: int = field(
        default=20_000, metadata={"help": "influence: the most hooked parameters accepted."}
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
    fit: str | None = field(
        default=None,
        metadata={
            "help": "kfac / ekfac / lorif: the output directory of `dattri-llm fit` whose fit "
            "is reused (no pass over the training store for the curvature)."
        },
    )
    optimizer_state: str | None = field(
        default=None,
        metadata={
            "help": "trackstar (required): the trained model's saved optimizer state, "
            "torch.save(optimizer.state_dict()) of an Adam, AdamW or Adafactor (e.g. the "
            "optimizer.pt of a Hugging Face Trainer checkpoint); its second moment normalises "
            "the gradients."
        },
    )
    optimizer_param_order: str = field(
        default=OPTIMIZER_PARAM_ORDERS[0],
        metadata={
            "help": "trackstar: how --optimizer_state's parameter indices map to --model's "
            "parameters: trainer (the names saved with the state when it has them, else "
            "Hugging Face Trainer's order: the weight-decayed parameters first, then biases "
            "and norm weights) | model (model.named_parameters() order: an optimizer built "
            "over model.parameters())."
        },
    )
    trackstar_mixing: float | None = field(
        default=None,
        metadata={
            "help": "trackstar: weight in [0, 1] of the training rows' second moment in the "
            "whitening matrix (the rest: the queries'); 1 uses the training rows only "
            f"(default {DEFAULT_MIXING})."
        },
    )
    stride_rank: int | None = field(
        default=None, metadata={"help": "stride: width r of the operators' shared basis (16)."}
    )
    stride_num_subsets: int | None = field(
        default=None,
        metadata={
            "help": "stride: random training subsets K, one operator each (default: from the "
            "training set's size, ceil(2 s ln(N / s)) with s = 10)."
        },
    )
    stride_subsets_per_example: int | None = field(
        default=None, metadata={"help": "stride: subsets d each training sample joins (10)."}
    )
    stride_injection: str | None = field(
        default=None,
        metadata={"help": "stride: logits | residual, where the operators act (logits)."},
    )
    stride_layer: str | None = field(
        default=None,
        metadata={
            "help": "stride: name of the module whose output the operators read (default: "
            "the decoder block at about 0.63 depth)."
        },
    )
    stride_steps: int | None = field(
        default=None, metadata={"help": "stride: optimizer steps of the operators' fit (1000)."}
    )
    stride_lasso_lambda: float | None = field(
        default=None,
        metadata={
            "help": "stride: Lasso penalty relative to each query's largest useful one, in "
            "[0, 1) (0.01); higher gives sparser scores."
        },
    )

    def __post_init__(self) -> None:
        """``ValueError`` for an unknown method, or STRIDE / TrackStar options that are bad or
        misplaced (given with another method)."""
        name = self.method.lower()
        self.method = name.replace("-", "_") if name.replace("-", "_") in METHODS else name
        self.method = self.method.replace("-", "")
        if self.method not in METHODS:
            raise ValueError(f"unknown --method {self.method!r}; choose one of {list(METHODS)}")
        values = self._stride_values()
        given = [f"--stride_{name}" for name, value in values.items() if value is not None]
        if given and self.method != STRIDE_METHOD:
            raise ValueError(
                f"{', '.join(given)} set STRIDE's options; pass --method stride or drop them"
            )
        if self.method == STRIDE_METHOD:
            self.stride_config()
        self._check_trackstar_options()
        if self.influence_solver not in INFLUENCE_SOLVERS:
            raise ValueError(
                f"--influence_solver must be one of {list(INFLUENCE_SOLVERS)}, "
                f"got {self.influence_solver!r}"
            )
        if self.influence_max_params < 1:
            raise ValueError(
                f"--influence_max_params must be >= 1, got {self.influence_max_params}"
            )

    def _check_trackstar_options(self) -> None:
        """``ValueError`` for TrackStar options that are bad, or given to another method."""
        given = [
            f"--{name}"
            for name, unset in (
                ("optimizer_state", None),
                ("optimizer_param_order", OPTIMIZER_PARAM_ORDERS[0]),
                ("trackstar_mixing", None),
            )
            if getattr(self, name) != unset
        ]
        if given and self.method != TRACKSTAR_METHOD:
            raise ValueError(
                f"{', '.join(given)} set TrackStar's options; pass --method trackstar or drop them"
            )
        if self.optimizer_param_order not in OPTIMIZER_PARAM_ORDERS:
            raise ValueError(
                f"--optimizer_param_order must be one of {list(OPTIMIZER_PARAM_ORDERS)}, "
                f"got {self.optimizer_param_order!r}"
            )
        mixing = self.trackstar_mixing
        if mixing is not None and not 0.0 <= mixing <= 1.0:
            raise ValueError(f"--trackstar_mixing must lie in [0, 1], got {mixing}")

    def _stride_values(self) -> dict[str, Any]:
        """``{StrideConfig field: the value of its --stride_ flag}`` (``None``: not given)."""
        return {name: getattr(self, f"stride_{name}") for name in STRIDE_OPTIONS}

    def stride_config(self) -> StrideConfig:
        """The `StrideConfig` of the ``--stride_*`` flags (the library defaults elsewhere).

        Raises:
            ValueError: a value ``StrideConfig`` refuses, naming its flag.
        """
        try:
            return StrideConfig().replace(**self._stride_values())
        except (TypeError, ValueError) as err:
            message = str(err)
            flagged = message.split(" ", 1)[0] in STRIDE_OPTIONS
            raise ValueError(
                f"--stride_{message}" if flagged else f"bad --stride_* option: {message}"
            ) from err

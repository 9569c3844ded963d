"""Method names → attributors and the keywords of their ``*_from_cache`` calls; reused fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from dattri_llm.attribution.algorithm.adamw_influence import (
    ADAMW_DYNAMICS_FILE,
    AdamWInfluenceAttributor,
)
from dattri_llm.attribution.algorithm.datainf import DataInfAttributor
from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
from dattri_llm.attribution.algorithm.influence import InfluenceFunctionAttributor
from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.kronecker.persistence import FISHER_FILE
from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.algorithm.lorif import FIT_FILE, LoRIFAttributor
from dattri_llm.attribution.algorithm.metagradient import MetagradientAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.algorithm.trackstar import TrackStarAttributor
from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor
from dattri_llm.attribution.algorithm.trak import TRAKAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.topk import TopK
from dattri_llm.cli.arguments import CaptureArguments
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.method_arguments import (
    FIT_METHODS,
    LESS_METHOD,
    LIVE_ONLY_METHODS,
    METAGRADIENT_METHOD,
    STRIDE_METHOD,
    TRACKSTAR_METHOD,
    TRAJECTORY_METHODS,
    MethodArguments,
)
from dattri_llm.cli.model import sample_losses
from dattri_llm.cli.output import CONFIG_FILE, STORE_DIRS
from dattri_llm.cli.stores import capture_config
from dattri_llm.task import AttributionTask

__all__ = [
    "TRAJECTORY_KEYWORDS",
    "build_attributor",
    "check_fit_method",
    "check_live_options",
    "check_not_stride",
    "check_store_method",
    "fit_file",
    "live_only_attributor",
    "rank_top_k",
    "reused_fit",
    "score_top_k",
    "trackstar_attributor",
]

# The keywords of a trajectory method's *_from_cache calls on a `capture --train` run: the
# training loss is the sum of the samples' losses (each row is the sample's own gradient),
# DVEmb takes the recorded learning rates (its library default is 1.0), and the queries are
# carried back (propagation="test": memory ∝ queries × coordinates, where the train-side
# summary is coordinates × coordinates; the same scores).
TRAJECTORY_KEYWORDS: dict[str, dict[str, Any]] = {
    "trajectory_tracin": {},
    "dvemb": {"learning_rate": None, "loss_reduction": "sum", "propagation": "test"},
    "adamw_influence": {"loss_reduction": "sum", "propagation": "test"},
}


_STRIDE_LIVE = (
    "run it live: `dattri-llm attribute --method stride --model M --train_data T --query_data Q`"
)
# Why each store-reading command refuses STRIDE, and what to run instead.
_STRIDE_REFUSALS = {
    "attribute": f"stride reads no gradient store; drop --store and {_STRIDE_LIVE}",
    "fit": (
        "stride fits its operators inside `dattri-llm attribute --method stride` (live); "
        f"`dattri-llm fit` persists the fits of {', '.join(FIT_METHODS)} only"
    ),
    "top-k": (
        "top-k --store ranks a capture's gradient stores and stride reads none; score with "
        "`dattri-llm attribute --method stride` (live) and rank its output: "
        "`dattri-llm top-k --scores <its output_dir>`"
    ),
    "report": (
        "report --store ranks a capture's gradient stores and stride reads none; score with "
        "`dattri-llm attribute --method stride` (live) and render its output: "
        "`dattri-llm report --scores <its output_dir>` (stride has no token-level scores: "
        "the tokens stay unshaded)"
    ),
    "plan": (
        "plan predicts gradient stores and their scoring, and stride captures no gradients; "
        f"{_STRIDE_LIVE}"
    ),
}


def check_not_stride(method: str, command: str) -> None:
    """``CLIError`` when ``method`` runs live only and ``command`` would read or plan a store.

    STRIDE keeps no per-sample gradients: only a live ``attribute`` runs it.
    TRAK (its ``1 − p`` weights come from the live training forward), DataInf
    and the exact-Hessian influence functions (several passes, or the model,
    over the training gradients) are served live only too, as are TrackStar
    (a capture's stores hold raw gradients, not its optimizer-normalised ones)
    and the metagradient (it trains the model itself, recording snapshots).
    """
    if method == STRIDE_METHOD:
        raise CLIError(_STRIDE_REFUSALS[command])
    if method in LIVE_ONLY_METHODS:
        needs = " --optimizer_state PATH" if method == TRACKSTAR_METHOD else ""
        raise CLIError(
            f"{method} runs only as a live attribute: `dattri-llm attribute --method {method} "
            f"--model M --train_data T --query_data Q{needs}`"
            + ("" if command == "attribute" else f"; {command} --store does not serve it")
        )


def fit_file(method: str) -> str:
    """The file a method's fit is written to."""
    return FIT_FILE if method == "lorif" else FISHER_FILE


def check_fit_method(method: str, what: str) -> None:
    """``CLIError`` unless ``method`` has a fit (``what``: the flag or command, for the message)."""
    if method not in FIT_METHODS:
        raise CLIError(f"{what} is for {', '.join(FIT_METHODS)}; {method} has no fit")


def reused_fit(method_args: MethodArguments) -> str | None:
    """The fit directory of ``--fit`` after checking it (``None`` without ``--fit``).

    ``CLIError`` unless it is the output of ``dattri-llm fit`` with the same method.
    """
    if method_args.fit is None:
        return None
    check_fit_method(method_args.method, "--fit")
    root = Path(method_args.fit).expanduser()
    config = root / CONFIG_FILE
    recorded = yaml.safe_load(config.read_text(encoding="utf-8")) if config.is_file() else None
    if not isinstance(recorded, dict) or recorded.get("command") != "fit":
        raise CLIError(f"--fit {root} is not the output directory of `dattri-llm fit`")
    if recorded.get("method") != method_args.method:
        raise CLIError(
            f"--fit {root} holds a {recorded.get('method')} fit, not {method_args.method}; "
            f"pass --method {recorded.get('method')} or another fit"
        )
    if not (root / fit_file(method_args.method)).is_file():
        raise CLIError(f"--fit {root}: {fit_file(method_args.method)} is missing")
    return str(root)


def check_store_method(store: str, method: str) -> None:
    """``CLIError`` unless the capture ``store`` can be scored by ``method``.

    The trajectory methods need a trained capture (``capture --train``);
    ``adamw_influence`` one whose run recorded the AdamW moments; ``less`` a
    ``capture --train --less``, which serves no other method.
    """
    config = capture_config(store)
    if method == LESS_METHOD and not config.get("less", False):
        kind = "a trained" if config.get("train", False) else "a frozen"
        raise CLIError(
            f"less scores Adam-preconditioned training gradients and --store {store} is {kind} "
            "capture without them; capture with `dattri-llm capture --train --less`"
        )
    if method != LESS_METHOD and config.get("less", False):
        raise CLIError(
            f"--store {store} holds LESS's preconditioned gradients (capture --train --less) "
            f"and serves only --method less; for {method}, capture without --less"
        )
    if method not in TRAJECTORY_METHODS:
        return
    if not config.get("train", False):
        raise CLIError(
            f"{method} scores a recorded training run and --store {store} is a frozen capture; "
            "capture with `dattri-llm capture --train`"
        )
    moments = Path(store).expanduser() / STORE_DIRS["train"] / ADAMW_DYNAMICS_FILE
    if method == "adamw_influence" and not moments.is_file():
        raise CLIError(
            f"adamw_influence needs an AdamW run and --store {store} trained with --optim "
            f"{config.get('optim')!r}; capture --train with --optim adamw_torch"
        )


def build_attributor(
    args: AttributionArguments,
    method: MethodArguments,
    store: str | None = None,
    task: AttributionTask | None = None,
    train_samples: list[dict[str, torch.Tensor]] | None = None,
) -> tuple[BaseInnerProductAttributor, dict[str, Any]]:
    """``(attributor, keywords of attribute_from_cache / top_k_from_cache)`` of a method.

    With ``--fit`` the keywords include its ``fit_dir`` (checked by :func:`reused_fit`).
    With ``store`` (a capture) the method is checked against it first
    (:func:`check_store_method`). ``task``: the model and loss of a live run;
    ``train_samples``: its training samples (the influence functions' Hessian).
    """
    name = method.method
    if store is not None:
        check_store_method(store, name)
    if name == LESS_METHOD:
        if method.fit is not None:
            check_fit_method(name, "--fit")
        return LESSAttributor(args, task=task), {}
    if name in TRAJECTORY_METHODS:
        if method.fit is not None:
            check_fit_method(name, "--fit")
        cls = {
            "trajectory_tracin": TrajectoryTracInAttributor,
            "dvemb": DVEmbAttributor,
            "adamw_influence": AdamWInfluenceAttributor,
        }[name]
        return cls(args, task=task), dict(TRAJECTORY_KEYWORDS[name])
    if name in LIVE_ONLY_METHODS:
        if method.fit is not None:
            check_fit_method(name, "--fit")
        return live_only_attributor(args, method, task, train_samples)
    fit_dir = reused_fit(method)
    extra = {} if fit_dir is None else {"fit_dir": fit_dir}
    if name in ("graddot", "tracin", "gradcos"):
        return TracInAttributor(args, task=task), {"normalized_grad": name == "gradcos"}
    if name in ("kfac", "ekfac"):
        attributor = (
            KFACAttributor(args, task=task)
            if name == "kfac"
            else EKFACAttributor(args, task=task, mode=method.ekfac_mode)
        )
        damping = 1e-3 if method.damping is None else method.damping
        return attributor, {
            "damping": damping,
            "relative_damping": method.relative_damping,
            **extra,
        }
    attributor = LoRIFAttributor(
        args,
        task=task,
        rank=method.lorif_rank,
        svd_rank=method.lorif_svd_rank,
        damping=method.damping,
    )
    return attributor, extra


def check_live_options(method: MethodArguments, capture_args: CaptureArguments) -> None:
    """``CLIError`` for a live run its method cannot make, before the model is loaded.

    TrackStar needs ``--optimizer_state`` (an existing file) and projects after
    the optimizer normalisation, which the ``dense`` and ``mask`` projections
    allow (``logra`` projects the layer's factors before any normalisation).
    """
    if method.method != TRACKSTAR_METHOD:
        return
    if method.optimizer_state is None:
        raise CLIError(
            "trackstar normalises by the trained model's optimizer state: pass --optimizer_state "
            "PATH (torch.save(optimizer.state_dict()), e.g. a Trainer checkpoint's optimizer.pt)"
        )
    if not Path(method.optimizer_state).expanduser().is_file():
        raise CLIError(f"--optimizer_state {method.optimizer_state}: no such file")
    if capture_args.proj_dim is not None and capture_args.proj_style not in ("dense", "mask"):
        raise CLIError(
            f"trackstar projects the optimizer-normalised gradient, which --proj_style "
            f"{capture_args.proj_style} cannot; pass --proj_style dense or mask"
        )


def live_only_attributor(
    args: AttributionArguments,
    method: MethodArguments,
    task: AttributionTask | None,
    train_samples: list[dict[str, torch.Tensor]] | None = None,
) -> tuple[BaseInnerProductAttributor, dict[str, Any]]:
    """``(attributor, keywords of its live attribute)`` of a live-only method.

    DataInf and the influence functions score from gradients collected in
    memory first (``gradient_cache_residency="memory"``): DataInf passes over
    the training gradients several times, and the influence functions' Hessian
    products run the model free of capture hooks. The influence Hessian is that
    of the mean training loss over ``train_samples`` (one sample per batch).
    The task loss is summed over a batch (:func:`~dattri_llm.cli.model.causal_lm_loss`):
    TrackStar and the metagradient are told so (``loss_reduction="sum"``); the
    metagradient's per-sample losses are :func:`~dattri_llm.cli.model.sample_losses`
    (one forward per batch).
    """
    if method.method == "trak":
        return TRAKAttributor(args, task=task, damping=method.damping), {}
    if method.method == TRACKSTAR_METHOD:
        return trackstar_attributor(args, method, task), {}
    if method.method == METAGRADIENT_METHOD:
        attributor = MetagradientAttributor(
            args, task=task, sample_loss_func=sample_losses, sample_target_func=sample_losses
        )
        return attributor, {"loss_reduction": "sum"}
    memory = {"gradient_cache_residency": "memory"}
    if method.method == "datainf":
        return DataInfAttributor(args, task=task, damping=method.damping), memory
    if task is None or not train_samples:
        raise CLIError("influence runs live only: give --model, --train_data and --query_data")
    device = torch.device(args.device)
    batches = [{k: v.unsqueeze(0).to(device) for k, v in s.items()} for s in train_samples]
    attributor = InfluenceFunctionAttributor(
        args,
        task=task,
        hessian_batches=batches,
        solver=method.influence_solver,
        damping=1e-3 if method.damping is None else method.damping,
        max_params=method.influence_max_params,
    )
    return attributor, memory


def trackstar_attributor(
    args: AttributionArguments, method: MethodArguments, task: AttributionTask | None
) -> TrackStarAttributor:
    """TrackStar over ``task``'s model with the state of ``--optimizer_state``.

    ``--optimizer_param_order model`` names the saved indices by the model's
    ``named_parameters()``; ``trainer`` leaves them to the library (the names
    saved with the state, else Hugging Face ``Trainer``'s order). The state is
    rebuilt over the model here; ``CLIError`` when it does not fit.
    """
    if task is None:
        raise CLIError("trackstar runs live only: give --model, --train_data and --query_data")
    names = None
    if method.optimizer_param_order == "model":
        names = [name for name, _ in task.model.named_parameters()]
    mixing = {} if method.trackstar_mixing is None else {"mixing": method.trackstar_mixing}
    attributor = TrackStarAttributor(
        args,
        task=task,
        optimizer=method.optimizer_state,
        damping=method.damping,
        loss_reduction="sum",
        optimizer_param_names=names,
        **mixing,
    )
    try:  # read the state now: a mismatch is reported before any pass over the data
        attributor.resolved_optimizer()
    except (KeyError, ValueError) as err:
        other = "trainer" if method.optimizer_param_order == "model" else "model"
        raise CLIError(
            f"--optimizer_state {method.optimizer_state} does not fit --model's parameters in "
            f"{method.optimizer_param_order} order ({str(err).strip()}); check that it is the "
            f"state of this model's optimizer, or try --optimizer_param_order {other}"
        ) from err
    return attributor


def rank_top_k(
    attributor: BaseInnerProductAttributor,
    train_dir: str,
    query_dir: str,
    k: int,
    *,
    proponents: bool,
    verbose: bool,
    options: dict[str, Any],
) -> TopK:
    """Each query's ``k`` best rows: ``top_k_from_cache`` (one streamed pass) where the method
    allows it, else ``attribute_from_cache(...).top_k(k)`` (LESS rescales its rows after the
    pass, so it cannot be ranked while streaming)."""
    if getattr(attributor, "streaming_top_k", False):
        return attributor.top_k_from_cache(
            train_dir, query_dir, k, proponents=proponents, verbose=verbose, **options
        )
    score = attributor.attribute_from_cache(train_dir, query_dir, verbose=verbose, **options)
    return score_top_k(score, k, proponents=proponents)


def score_top_k(score: AttributionScore, k: int, *, proponents: bool) -> TopK:
    """``score.top_k(k, proponents=...)`` (its polarity respected) as a :class:`TopK`."""
    ranking = score.top_k(k, proponents=proponents)
    return TopK(
        test_ids=list(ranking),
        train_ids=[[train_id for train_id, _ in ranked] for ranked in ranking.values()],
        scores=torch.tensor(
            [[value for _, value in ranked] for ranked in ranking.values()], dtype=torch.float64
        ),
        polarity=score.polarity,
        proponents=proponents,
        algorithm=score.algorithm,
        algorithm_meta=dict(score.algorithm_meta),
        layer_name=score.layer_name,
    )

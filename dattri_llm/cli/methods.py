"""Method names → attributors and the keywords of their ``*_from_cache`` calls; reused fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.kronecker.persistence import FISHER_FILE
from dattri_llm.attribution.algorithm.lorif import FIT_FILE, LoRIFAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.cli.arguments import FIT_METHODS, MethodArguments
from dattri_llm.cli.errors import CLIError
from dattri_llm.cli.output import CONFIG_FILE

__all__ = ["build_attributor", "check_fit_method", "fit_file", "reused_fit"]


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


def build_attributor(
    args: AttributionArguments, method: MethodArguments
) -> tuple[BaseInnerProductAttributor, dict[str, Any]]:
    """``(attributor, keywords of attribute_from_cache / top_k_from_cache)`` of a method.

    With ``--fit`` the keywords include its ``fit_dir`` (checked by :func:`reused_fit`).
    """
    name = method.method
    fit_dir = reused_fit(method)
    extra = {} if fit_dir is None else {"fit_dir": fit_dir}
    if name in ("graddot", "tracin", "gradcos"):
        return TracInAttributor(args), {"normalized_grad": name == "gradcos"}
    if name in ("kfac", "ekfac"):
        attributor = (
            KFACAttributor(args)
            if name == "kfac"
            else EKFACAttributor(args, mode=method.ekfac_mode)
        )
        damping = 1e-3 if method.damping is None else method.damping
        return attributor, {
            "damping": damping,
            "relative_damping": method.relative_damping,
            **extra,
        }
    attributor = LoRIFAttributor(
        args, rank=method.lorif_rank, svd_rank=method.lorif_svd_rank, damping=method.damping
    )
    return attributor, extra

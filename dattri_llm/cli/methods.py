"""Method names → attributors and the keywords of their ``*_from_cache`` calls."""

from __future__ import annotations

from typing import Any

from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.lorif import LoRIFAttributor
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.cli.arguments import MethodArguments

__all__ = ["build_attributor"]


def build_attributor(
    args: AttributionArguments, method: MethodArguments
) -> tuple[BaseInnerProductAttributor, dict[str, Any]]:
    """``(attributor, keywords of attribute_from_cache / top_k_from_cache)`` of a method."""
    name = method.method
    if name in ("graddot", "tracin", "gradcos"):
        return TracInAttributor(args), {"normalized_grad": name == "gradcos"}
    if name in ("kfac", "ekfac"):
        attributor = (
            KFACAttributor(args)
            if name == "kfac"
            else EKFACAttributor(args, mode=method.ekfac_mode)
        )
        damping = 1e-3 if method.damping is None else method.damping
        return attributor, {"damping": damping, "relative_damping": method.relative_damping}
    attributor = LoRIFAttributor(
        args, rank=method.lorif_rank, svd_rank=method.lorif_svd_rank, damping=method.damping
    )
    return attributor, {}

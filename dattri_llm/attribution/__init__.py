"""The attribution tier: arguments, scores, attributor bases and methods."""

from dattri_llm.attribution.algorithm import (
    AdamWInfluenceAttributor,
    DataInfAttributor,
    DVEmbAttributor,
    EKFACAttributor,
    InfluenceFunctionAttributor,
    KFACAttributor,
    KroneckerAttributor,
    LESSAttributor,
    LoRIFAttributor,
    MetagradientAttributor,
    SourceAttributor,
    StrideAttributor,
    StrideConfig,
    TracInAttributor,
    TrackStarAttributor,
    TrajectoryAttributor,
    TrajectoryTracInAttributor,
    TRAKAttributor,
)
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseAttributor, BaseInnerProductAttributor
from dattri_llm.attribution.score import AttributionScore

__all__ = [
    "AdamWInfluenceAttributor",
    "AttributionArguments",
    "AttributionScore",
    "BaseAttributor",
    "BaseInnerProductAttributor",
    "DVEmbAttributor",
    "DataInfAttributor",
    "EKFACAttributor",
    "InfluenceFunctionAttributor",
    "KFACAttributor",
    "KroneckerAttributor",
    "LESSAttributor",
    "LoRIFAttributor",
    "MetagradientAttributor",
    "SourceAttributor",
    "StrideAttributor",
    "StrideConfig",
    "TRAKAttributor",
    "TracInAttributor",
    "TrackStarAttributor",
    "TrajectoryAttributor",
    "TrajectoryTracInAttributor",
]

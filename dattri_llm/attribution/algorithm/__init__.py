"""One module per attribution method."""

from dattri_llm.attribution.algorithm.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.algorithm.datainf import DataInfAttributor
from dattri_llm.attribution.algorithm.dvemb import DVEmbAttributor
from dattri_llm.attribution.algorithm.influence import InfluenceFunctionAttributor
from dattri_llm.attribution.algorithm.kronecker import (
    EKFACAttributor,
    KFACAttributor,
    KroneckerAttributor,
)
from dattri_llm.attribution.algorithm.less import LESSAttributor
from dattri_llm.attribution.algorithm.lorif import LoRIFAttributor
from dattri_llm.attribution.algorithm.metagradient import MetagradientAttributor
from dattri_llm.attribution.algorithm.source import SourceAttributor
from dattri_llm.attribution.algorithm.stride import StrideAttributor, StrideConfig
from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.algorithm.trackstar import TrackStarAttributor
from dattri_llm.attribution.algorithm.trajectory import TrajectoryAttributor
from dattri_llm.attribution.algorithm.trajectory_tracin import TrajectoryTracInAttributor
from dattri_llm.attribution.algorithm.trak import TRAKAttributor

__all__ = [
    "AdamWInfluenceAttributor",
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

"""Literal option aliases used in public signatures (no side effects).

Runtime validation happens where each option is consumed.
"""

from __future__ import annotations

from typing import Literal

AttributionGranularity = Literal["instance", "token"]
LossReduction = Literal["mean", "sum"]
Propagation = Literal["train", "test"]
HessianMode = Literal["full", "diagonal"]
CaptureStyle = Literal["factorized", "materialized", "auto"]
RoutingMode = Literal["factorized", "materialized", "auto"]
DotReduce = Literal["sum", "none"]
CacheResidency = Literal["disk", "memory", "tiered"]
DiskFormat = Literal["pickle", "memmap"]
RecordingType = Literal["per_sample", "per_batch"]
ProjectionStyle = Literal["logra", "dense", "mask"]
ScoreTrajectory = Literal["aware", "agnostic"]
EKFACMode = Literal["exact", "approx"]

"""Gradient sources: the one contract attributors read per-step gradient blocks through.

A source yields `StreamBatch` es ``(step, block, identifiers)``. Attributors
branch only on `GradientSource.reusable`. This module is the public path of
the sources, which live in :mod:`dattri_llm.gradient.stream`: the protocol
(`stream.source`), the live `GradientStreamer` (`stream.streamer`), the
snapshot-backed `ReplayGradientSource` (`stream.replay`), the store-backed
`DiskGradientSource` (`stream.readers`), `rebatch_blocks` (`stream.rebatch`)
and the helpers `autocast_for`, `move_batch` (`stream.training`).
"""

from dattri_llm.gradient.stream.readers import DiskGradientSource
from dattri_llm.gradient.stream.rebatch import rebatch_blocks
from dattri_llm.gradient.stream.replay import ReplayGradientSource
from dattri_llm.gradient.stream.source import GradientSource, LossFn, StreamBatch
from dattri_llm.gradient.stream.streamer import GradientStreamer
from dattri_llm.gradient.stream.training import autocast_for, move_batch
from dattri_llm.gradient.stream.wrapping import (
    _build_auto_wrap_policy as _build_auto_wrap_policy,  # public at this path
)

__all__ = [
    "DiskGradientSource",
    "GradientSource",
    "GradientStreamer",
    "LossFn",
    "ReplayGradientSource",
    "StreamBatch",
    "autocast_for",
    "move_batch",
    "rebatch_blocks",
]

"""Gradient sources: where per-step gradient blocks come from, and how they are produced.

`source` holds the contract (`GradientSource`, `StreamBatch`, `LossFn`);
`streamer` the live `GradientStreamer`, with its input batching in `inputs`,
its training step in `training` and its DDP / FSDP placement in `wrapping`;
`replay` the snapshot-backed `ReplayGradientSource`; `readers` the
store-backed `DiskGradientSource` and the store reading helpers; `rebatch`
`rebatch_blocks`; `settings` the `TrainingSettings` they all read. The public
names are imported from :mod:`dattri_llm.gradient.streaming` and
:mod:`dattri_llm.gradient.datasets`; this package imports none of its modules,
so that reading one (e.g. `wrapping` from a callback) loads only what it needs.
"""

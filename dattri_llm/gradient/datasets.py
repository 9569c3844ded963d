"""Datasets on both sides of capture: the inputs streamed, and the gradient stores read back.

This module is the public path of the dataset helpers, which live in
:mod:`dattri_llm.gradient.stream`: `check_dataset` / `ACCEPTED_DATASETS`
(what a live source accepts, `stream.inputs`); the store readers
`resolve_steps`, `iter_gradient_blocks`, `DiskGradientSource`, the file-level
`GradientFileMultiStepDataset` / `make_gradient_multistep_dataloader` and the
block helpers (`stream.readers`); `rebatch_blocks` (`stream.rebatch`).
"""

from dattri_llm.gradient.stream.inputs import ACCEPTED_DATASETS, check_dataset
from dattri_llm.gradient.stream.readers import (
    DiskGradientSource,
    GradientFileMultiStepDataset,
    GroupBlockDataset,
    concatenate_gradients,
    group_blocks,
    iter_gradient_blocks,
    make_gradient_multistep_dataloader,
    resolve_layer_filter,
    resolve_steps,
    select_block_layers,
)
from dattri_llm.gradient.stream.rebatch import rebatch_blocks

__all__ = [
    "ACCEPTED_DATASETS",
    "DiskGradientSource",
    "GradientFileMultiStepDataset",
    "GroupBlockDataset",
    "check_dataset",
    "concatenate_gradients",
    "group_blocks",
    "iter_gradient_blocks",
    "make_gradient_multistep_dataloader",
    "rebatch_blocks",
    "resolve_layer_filter",
    "resolve_steps",
    "select_block_layers",
]

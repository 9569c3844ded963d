"""FSDP (``FullyShardedDataParallel``, auto-wrapped per block): capture, then score on rank 0.

Run:  torchrun --nproc_per_node 2 examples/distributed/fsdp1.py [store_dir]

Build the ``HookManager`` on the plain model *before* wrapping it: FSDP1 then
flattens the parameters (the default ``use_orig_params=False``) and renames the
modules (``..._fsdp_wrapped_module...``); hooks registered first keep the plain
layer names and keep firing on the same modules inside the wrapper.
"""

from __future__ import annotations

import torch
from common import (
    CAPTURE,
    EPOCHS,
    build_model,
    capture_store,
    loss_fn,
    my_batches,
    score_on_rank_0,
    start,
)
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from dattri_llm import HookManager

rank, device = start()
net = build_model().to(device)
store, callbacks = capture_store(rank)
manager = HookManager(net, CAPTURE, callbacks=callbacks)  # before wrapping
model = FullyShardedDataParallel(
    net, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), device_id=device
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

with manager.collect(deregister_on_exit=True):  # the user's loop, unchanged
    for epoch in range(EPOCHS):
        for ids in my_batches(rank, epoch):
            optimizer.zero_grad()
            loss_fn(model, ids.to(device)).backward()
            optimizer.step()

score_on_rank_0(rank, device)

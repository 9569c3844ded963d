"""DDP: capture every rank's per-sample gradients into one store, then score on rank 0.

Run:  torchrun --nproc_per_node 2 examples/distributed/ddp.py [store_dir]

The training loop is the user's own; ``HookManager`` hooks the module inside the
``DistributedDataParallel`` wrapper and each rank writes its own batches'
gradients (taken before the all-reduce) into ``store_dir/train/rank_<r>/``.
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
from torch.nn.parallel import DistributedDataParallel

from dattri_llm import HookManager

rank, device = start()
model = DistributedDataParallel(
    build_model().to(device), device_ids=[device.index] if device.type == "cuda" else None
)
store, callbacks = capture_store(rank)
manager = HookManager(model, CAPTURE, callbacks=callbacks)  # hooks go on model.module
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

with manager.collect(deregister_on_exit=True):  # the user's loop, unchanged
    for epoch in range(EPOCHS):
        for ids in my_batches(rank, epoch):
            optimizer.zero_grad()
            loss_fn(model, ids.to(device)).backward()
            optimizer.step()

score_on_rank_0(rank, device)

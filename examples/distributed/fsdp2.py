"""FSDP2 (``torch.distributed.fsdp.fully_shard`` per block and root): capture, score on rank 0.

Run:  torchrun --nproc_per_node 2 examples/distributed/fsdp2.py [store_dir]

``fully_shard`` keeps the module tree and its names, so the ``HookManager`` can
be built before or after sharding; the hooked layers run unsharded inside each
block's forward and backward, and every rank writes its own batches' gradients.
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
from torch.distributed.fsdp import fully_shard

from dattri_llm import HookManager

rank, device = start()
model = build_model().to(device)
for block in model.transformer.h:
    fully_shard(block)
fully_shard(model)
store, callbacks = capture_store(rank)
manager = HookManager(model, CAPTURE, callbacks=callbacks)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

with manager.collect(deregister_on_exit=True):  # the user's loop, unchanged
    for epoch in range(EPOCHS):
        for ids in my_batches(rank, epoch):
            optimizer.zero_grad()
            loss_fn(model, ids.to(device)).backward()
            optimizer.step()

score_on_rank_0(rank, device)

"""Batch-level ``param_grad`` records are snapshots, not views of ``param.grad``."""

import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.w


def test_param_grad_record_survives_in_place_grad_updates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Scale())
    records = []

    class Keep(CaptureCallback):
        def on_step_end(self, record):
            records.append(record)

    config = HookManagerConfig(hook_types={"0": "linear_io", "1": "param_grad"})
    hm = HookManager(model, config=config, callbacks=[Keep()])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 3)
    expected = []
    with hm.collect():
        for _ in range(2):
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).sum().backward()
            expected.append(model[1].w.grad.clone())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # rewrites .grad in place
            opt.step()
    for record, grad in zip(records, expected):
        torch.testing.assert_close(record.gradient.data["1.w"], grad)

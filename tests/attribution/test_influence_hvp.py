"""The influence HVP (VJPs of a retained gradient graph) against per-row ``torch.func`` jvps."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, mlp_data, mlp_loss
from torch import nn

from dattri_llm.attribution.algorithm.influence import InfluenceFunctionAttributor, RowProducts
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.task import AttributionTask


def _attributor(tmp_path, model, samples, **kwargs) -> InfluenceFunctionAttributor:
    args = AttributionArguments(output_dir=str(tmp_path), use_cpu=True)
    task = AttributionTask(mlp_loss, model)
    return InfluenceFunctionAttributor(args, task=task, hessian_batches=samples, **kwargs)


def _jvp_reference(model, samples, rows: torch.Tensor) -> torch.Tensor:
    """``H v`` per row by forward-over-reverse ``torch.func.jvp(grad(mean loss))``, one row at a
    time, over the ``[W | b]`` rows of both layers."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def mean_loss(p):
        call = lambda *a: torch.func.functional_call(model, p, a)  # noqa: E731
        return sum(mlp_loss(call, s) for s in samples) / len(samples)

    def split(row):
        out, offset = {}, 0
        for name in MLP_LAYERS:
            w = params[f"{name}.weight"]
            size = w.shape[0] * (w.shape[1] + 1)
            block = row[offset : offset + size].reshape(w.shape[0], w.shape[1] + 1)
            out[f"{name}.weight"], out[f"{name}.bias"] = block[:, :-1], block[:, -1]
            offset += size
        return out

    products = []
    for row in rows:
        _, hv = torch.func.jvp(torch.func.grad(mean_loss), (params,), (split(row),))
        products.append(
            torch.cat(
                [
                    torch.cat([hv[f"{n}.weight"], hv[f"{n}.bias"][:, None]], 1).reshape(-1)
                    for n in MLP_LAYERS
                ]
            )
        )
    return torch.stack(products)


def _setup():
    torch.manual_seed(0)
    model = MLP().double()
    train = mlp_data(4, 1, torch.float64)
    samples = [tuple(t[i : i + 1] for t in train) for i in range(4)]
    rows = torch.randn(3, 5 * 5 + 3 * 6, dtype=torch.float64)  # K = 3, D = 43
    return model, samples, rows


@pytest.mark.parametrize("batched", [True, False, None])
@pytest.mark.parametrize("retain", [True, False])
def test_hvp_equals_per_row_jvp(tmp_path, batched, retain):
    model, samples, rows = _setup()
    attributor = _attributor(
        tmp_path, model, samples, retain_hessian_graph=retain, batch_hvp_rows=batched
    )
    hvp, size = attributor.hvp_function(list(MLP_LAYERS))
    assert size == rows.shape[1]
    expected = _jvp_reference(model, samples, rows)
    for _ in range(2):  # the retained graph serves every call
        got = hvp(rows)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hvp(rows[:1]), expected[:1], rtol=1e-10, atol=1e-10)


class _Tanh(torch.autograd.Function):
    """tanh whose derivative is :class:`_TanhGrad` (old-style: no vmap support)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _TanhGrad.apply(x, grad)


class _TanhGrad(torch.autograd.Function):
    """``g · (1 − tanh² x)``; its backward (the HVP's) cannot run under vmap."""

    @staticmethod
    def forward(ctx, x, grad):
        ctx.save_for_backward(x, grad)
        return grad * (1 - x.tanh() ** 2)

    @staticmethod
    def backward(ctx, gg):
        x, grad = ctx.saved_tensors
        if not torch.isfinite(gg).all().item():  # data-dependent: no batching rule
            raise ValueError("non-finite cotangent")
        t = x.tanh()
        return gg * grad * (-2 * t * (1 - t * t)), gg * (1 - t * t)


class _CustomTanh(nn.Module):
    def forward(self, x):
        return _Tanh.apply(x)


def test_unbatchable_graph_falls_back_to_one_backward_per_row(tmp_path):
    model, samples, rows = _setup()
    expected = _jvp_reference(model, samples, rows)  # nn.Tanh: same Hessian
    model.act = _CustomTanh()
    attributor = _attributor(tmp_path, model, samples, batch_hvp_rows=True)
    hvp, _ = attributor.hvp_function(list(MLP_LAYERS))
    torch.testing.assert_close(hvp(rows), expected, rtol=1e-10, atol=1e-10)
    # the fallback is taken: a batched backward through _TanhGrad raises
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 4, dtype=torch.float64)
    (g,) = torch.autograd.grad(_Tanh.apply(x @ w.T).sum(), [w], create_graph=True)
    products = RowProducts(True)
    got = products([g], [w], [rows[:, :20].reshape(3, 5, 4)])
    assert products.batched is False
    for k in range(3):
        (single,) = torch.autograd.grad([g], [w], [rows[k, :20].reshape(5, 4)], retain_graph=True)
        torch.testing.assert_close(got[0][k], single, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batched", [True, None])
def test_row_blocks_equal_one_backward_per_row(batched):
    torch.manual_seed(0)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 4, dtype=torch.float64)
    (g,) = torch.autograd.grad((x @ w.T).tanh().pow(2).sum(), [w], create_graph=True)
    rows = torch.randn(5, 5, 4, dtype=torch.float64)
    products = RowProducts(batched, row_block=2)  # blocks of 2, 2, 1 rows
    got = products([g], [w], [rows])[0]
    assert got.shape == rows.shape
    for k in range(5):
        (single,) = torch.autograd.grad([g], [w], [rows[k]], retain_graph=True)
        torch.testing.assert_close(got[k], single, rtol=1e-12, atol=1e-12)
    assert products.batched is not None

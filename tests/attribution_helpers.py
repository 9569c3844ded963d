"""Test helpers for the attribution tier: tiny models, hand-captured factors, dense references.

Factors are captured here with plain forward / full-backward hooks (no
HookManager), so the attributor tests depend only on the Gradient data model
and the store. Dense per-sample ground truth comes from ``tests/reference.py``.
"""

from __future__ import annotations

import warnings

import torch
from reference import per_sample_loop_grads
from torch import nn

from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.ops.preprocess import extract_module_kwargs
from dattri_llm.gradient.ops.types import canonical_class_name
from dattri_llm.gradient.storage_manager import GradientStorageManager
from dattri_llm.utils.hashing import hash_batch


class MLP(nn.Module):
    """Two linear layers on 3-D inputs ``(B, T, 4) -> (B, T, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


MLP_LAYERS = ("fc1", "fc2")


def mlp_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Sum-reduced loss: per-sample gradient = ∇ℓ_i."""
    x, y = batch
    return ((model(x) - y) ** 2).sum()


def mlp_data(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 4, generator=gen, dtype=dtype)
    y = torch.randn(n, 3, 3, generator=gen, dtype=dtype)
    return x, y


def capture_factors(model: nn.Module, layers: tuple[str, ...], loss_fn, batch: tuple) -> Gradient:
    """Factorized per-sample gradient of ``loss_fn(model, batch)`` for the named modules."""
    modules = dict(model.named_modules())
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    handles = []
    for name in layers:
        module = modules[name]
        handles.append(
            module.register_forward_hook(lambda m, i, o, n=name: acts.__setitem__(n, i[0].detach()))
        )
        handles.append(
            module.register_full_backward_hook(
                lambda m, gi, go, n=name: grads.__setitem__(n, go[0].detach())
            )
        )
    try:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss_fn(model, batch).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    data, types, indexing = {}, {}, {}
    for name in layers:
        layer_type = canonical_class_name(modules[name])
        kwargs = extract_module_kwargs(modules[name], layer_type)
        data[name] = Factorized(acts[name], grads[name], module_kwargs=kwargs)
        types[name] = layer_type
        indexing[name] = "batch_token" if acts[name].dim() >= 3 else "batch"
    return Gradient(
        representation={n: "factorized" for n in layers},
        data=data,
        layer_types=types,
        indexing=indexing,
    )


def dense_reference(
    model: nn.Module, layers: tuple[str, ...], loss_fn, batch: tuple, transpose: tuple = ()
) -> dict[str, torch.Tensor]:
    """Per-layer per-sample gradients ``{layer: (B, d)}`` in materialize layout (loop reference).

    Linear-family layers are ``[W | b]`` row-major ``(out, in+1)``; layers named
    in ``transpose`` store ``W`` as ``(in, out)`` (HF Conv1D). Norm layers are
    ``[dγ, dβ]``.
    """
    grads = per_sample_loop_grads(model, loss_fn, batch)
    modules = dict(model.named_modules())
    out = {}
    for name in layers:
        w = grads[f"{name}.weight"]
        b = grads.get(f"{name}.bias")
        if w.dim() == 2:  # LayerNorm weight (B, d)
            out[name] = torch.cat([w, b], dim=1) if b is not None else w
            continue
        if name in transpose:
            w = w.transpose(1, 2)
        if b is not None:
            w = torch.cat([w, b.unsqueeze(-1)], dim=2)
        out[name] = w.reshape(w.shape[0], -1)
        assert modules[name] is not None
    return out


def dense_gram(train: dict, test: dict, layers=None) -> torch.Tensor:
    names = layers or list(train)
    return sum(train[n] @ test[n].T for n in names)


def sample_ids(x: torch.Tensor) -> list[str]:
    return hash_batch({"x": x}, x.shape[0])


def write_store(
    path,
    model: nn.Module,
    layers: tuple[str, ...],
    loss_fn,
    data: tuple,
    *,
    batch_sizes: list[int],
    step: int = 0,
    order: torch.Tensor | None = None,
    materialize: bool = False,
    residency: str = "disk",
) -> GradientStorageManager:
    """Capture ``data`` in batches of ``batch_sizes`` and save one group per two batches."""
    store = GradientStorageManager(str(path), residency=residency)
    append_store(
        store,
        model,
        layers,
        loss_fn,
        data,
        batch_sizes=batch_sizes,
        step=step,
        order=order,
        materialize=materialize,
    )
    return store


def append_store(
    store: GradientStorageManager,
    model: nn.Module,
    layers: tuple[str, ...],
    loss_fn,
    data: tuple,
    *,
    batch_sizes: list[int],
    step: int = 0,
    order: torch.Tensor | None = None,
    materialize: bool = False,
) -> None:
    x = data[0]
    order = torch.arange(x.shape[0]) if order is None else order
    assert sum(batch_sizes) == x.shape[0]
    ids = sample_ids(x)
    records, start = [], 0
    for size in batch_sizes:
        rows = order[start : start + size]
        start += size
        batch = tuple(t[rows] for t in data)
        grad = capture_factors(model, layers, loss_fn, batch)
        if materialize:
            grad = grad.materialize()
        records.append(GradientRecord(step, [ids[i] for i in rows.tolist()], grad))
        if len(records) == 2:
            store.save_bulk(records)
            records = []
    if records:
        store.save_bulk(records)


def per_sample_rows(model, loss_fn, batches, layers, transpose=()) -> dict[str, torch.Tensor]:
    """``{layer: (N, D)}`` per-sample ``[W | b]`` rows (``(out, in+1)``) via ``torch.func.grad``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(p, sample):
        return loss_fn(lambda *a, **kw: torch.func.functional_call(model, p, a, kw), sample)

    grads = [torch.func.grad(loss_of)(params, sample) for sample in batches]
    rows = {}
    for name in layers:
        w = torch.stack([g[f"{name}.weight"] for g in grads])
        if name in transpose:
            w = w.transpose(1, 2)
        b = torch.stack([g[f"{name}.bias"] for g in grads]).unsqueeze(-1)
        rows[name] = torch.cat([w, b], dim=2).reshape(len(grads), -1)
    return rows


def dense_inverse_scores(train: dict, test: dict, damping=None) -> torch.Tensor:
    """``Σ_ℓ G (GᵀG/N + λI)⁻¹ Qᵀ`` with an explicit dense inverse (float64)."""
    total = 0
    for name, g in train.items():
        g, q = g.double(), test[name].double()
        n, d = g.shape
        lam = damping if damping is not None else 0.1 * g.square().sum() / (n * d)
        h = g.T @ g / n + lam * torch.eye(d, dtype=g.dtype)
        total = total + g @ torch.linalg.inv(h) @ q.T
    return total

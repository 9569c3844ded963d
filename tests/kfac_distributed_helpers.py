"""Fork workers and independent references for the distributed K-FAC / EK-FAC fit tests.

`SkipNet` runs its ``side`` branch (``Linear`` + ``LayerNorm``) only for batches
flagged ``use_side``: control flow that makes a rank skip a layer in some
batches or entirely. Flags are constant within every batch a rank (or the
single-process reference, whose dataset is the ranks' shards one after the
other) runs, so each sample's gradient is that of its own flag.

Two scenarios, both with 2 gloo ranks (``init_process_group`` with a short
timeout, so a rank left waiting fails instead of hanging):

* ``live``: ``WORLD_SIZE=2`` / ``RANK=r``; the attributor's own live path
  (``attribute(train, test)``) shards the train set without padding
  (``shuffle=False``: rank ``r`` gets rows ``r, r+2, ...``)
  and wraps the model in DDP (``find_unused_parameters``). Rank 1 never runs
  ``side``, rank 0 runs it in 2 of its 3 batches. Covariances come from the
  capture callback; a small ``kept_gradient_budget`` keeps a different number
  of first-pass blocks on each rank (rank 0's blocks are larger).
* ``per_rank``: uneven shards with uneven batch counts (the live path runs the
  same number of batches on every rank): no ``WORLD_SIZE``, each rank calls
  ``attribute`` on its own shard under the process group (rank 0: 3 batches,
  rank 1: 1 batch that skips ``side``), ``covariances_at_capture=False`` (the
  covariances come from the blocks' factors) and ``non_kfac_strategy="direct"``
  (the dense Fisher of ``side_ln``, seen on rank 0 only).

Each rank saves ``{method: {"raw_fit", "scores", "row_ids", "test_ids", "plan"}}``
to ``<out_dir>/<scenario>_rank<r>.pt``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from kfac_helpers import covariances, damped_inverse, linear_rows
from torch import nn

WORLD = 2
BATCH = 2
DAMPING = 0.05
KFAC_LAYERS = ("inp", "side", "head")
FISHER_LAYER = "side_ln"
LIVE_FLAGS = [True, False, True, False, False, False, False, False, True, False, True, False]
PER_RANK_FLAGS = ([True, True, False, False, True, True], [False, False])
KEPT_BUDGET = 900  # bytes: rank 1 keeps 2 of its 408-byte blocks, rank 0 (888, 408, 888) 1
METHODS = ("kfac", "ekfac")


class SkipNet(nn.Module):
    """``(B, T, 4) -> (B, T, 3)``; the ``side`` branch runs only with ``use_side``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.side = nn.Linear(5, 5)
        self.side_ln = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_side:
            h = h + self.side_ln(torch.tanh(self.side(h)))
        return self.head(h)


def build_model() -> SkipNet:
    torch.manual_seed(0)
    return SkipNet()


def skip_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum squared error; ``side`` runs when the batch is flagged (flags are per batch)."""
    use_side = bool(batch["use_side"].any())
    return ((model(batch["x"], use_side=use_side) - batch["y"]) ** 2).sum()


def samples(flags: list[bool], seed: int) -> list[dict]:
    """``{"x": (3, 4), "y": (3, 3), "use_side": ()}`` samples with the given flags."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "x": torch.randn(3, 4, generator=gen),
            "y": torch.randn(3, 3, generator=gen),
            "use_side": torch.tensor(flag),
        }
        for flag in flags
    ]


def live_train() -> list[dict]:
    return samples(LIVE_FLAGS, 1)


def per_rank_train() -> list[list[dict]]:
    return [samples(flags, 10 + rank) for rank, flags in enumerate(PER_RANK_FLAGS)]


def queries() -> list[dict]:
    return samples([True, True, True], 2)


def union_of_live_shards() -> list[dict]:
    """The live train set as the ranks' shards one after the other (rank 0's rows first)."""
    data = live_train()
    return [row for rank in range(WORLD) for row in data[rank::WORLD]]


def arguments(out_dir: str, **extra):
    from dattri_llm.attribution.arguments import AttributionArguments

    return AttributionArguments(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=2,
        **extra,
    )


def attributor_class(method: str):
    from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor

    return KFACAttributor if method == "kfac" else EKFACAttributor


def run_attribute(method: str, args, train: list[dict], **options) -> dict:
    """One ``attribute`` call on a fresh ``SkipNet``: fit, scores, ids and pass plan."""
    import warnings

    from dattri_llm.task import AttributionTask

    attributor = attributor_class(method)(args, task=AttributionTask(skip_loss, build_model()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers captured on one side only (rank 1's side)
        score = attributor.attribute(train, queries(), damping=DAMPING, **options)
    return {
        "raw_fit": attributor.raw_fit,
        "scores": score.scores,
        "row_ids": list(score.row_train_ids),
        "test_ids": list(score.test_ids),
        "plan": score.algorithm_meta.get("pass_plan"),
    }


SCENARIO_OPTIONS = {
    "live": {"kept_gradient_budget": KEPT_BUDGET},
    "per_rank": {"covariances_at_capture": False, "non_kfac_strategy": "direct"},
}


def worker(rank: int, scenario: str, init_method: str, out_dir: str) -> None:
    """One rank of ``scenario``: K-FAC then EK-FAC ``attribute`` under a gloo group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if scenario == "live":
        os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank))
        train = live_train()
        extra = {"ddp_find_unused_parameters": True}
    else:
        train = per_rank_train()[rank]
        extra = {}
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20)
    )
    try:
        results = {
            method: run_attribute(
                method,
                arguments(f"{out_dir}/{scenario}_{method}_{rank}", **extra),
                train,
                **SCENARIO_OPTIONS[scenario],
            )
            for method in METHODS
        }
        torch.save(results, f"{out_dir}/{scenario}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- references


def _per_sample(model: SkipNet, sample: dict) -> tuple[dict, dict]:
    """One sample's ``({layer: (input, output grad)}, {param: grad})`` (float64, own flag)."""
    modules = dict(model.named_modules())
    io: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str):
        def forward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0].detach().clone()
            output.register_hook(lambda g: io.__setitem__(name, (x[0], g.detach()[0].clone())))

        return forward

    handles = [modules[name].register_forward_hook(hook(name)) for name in KFAC_LAYERS]
    batch = {k: v.unsqueeze(0).double() if v.is_floating_point() else v.unsqueeze(0)
             for k, v in sample.items()}  # fmt: skip
    try:
        model.zero_grad(set_to_none=True)
        skip_loss(model, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
    grads = {
        name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for name, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return io, grads


def _dense_rows(grads: dict, layer: str) -> torch.Tensor:
    """A layer's gradient in the materialize layout: ``[W | b]`` ``(out·(in+1))``, ``[γ, β]``."""
    w, b = grads[f"{layer}.weight"], grads[f"{layer}.bias"]
    if w.dim() == 1:
        return torch.cat([w, b])
    return torch.cat([w, b[:, None]], dim=1).reshape(-1)


def reference(train: list[dict], direct: bool) -> dict:
    """Independent fit and scores on ``train`` (float64; flags decide who holds ``side``).

    Returns ``{"A", "G", "lam", "fisher", "scores": {method: (n_train, n_test)}}``;
    ``lam`` is the EK-FAC ``Λ = mean_i (U_Gᵀ dW_i U_A)²`` over the samples whose
    batch ran the layer; ``fisher`` (``direct``) the dense Fisher of ``side_ln``
    over those samples.
    """
    model = build_model().double()
    per_train = [_per_sample(model, s) for s in train]
    per_test = [_per_sample(model, s) for s in queries()]
    layers = KFAC_LAYERS + ((FISHER_LAYER,) if direct else ())
    g_tr = {name: torch.stack([_dense_rows(g, name) for _, g in per_train]) for name in layers}
    g_te = {name: torch.stack([_dense_rows(g, name) for _, g in per_test]) for name in layers}
    users = {name: [i for i, (io, _) in enumerate(per_train) if name in io] for name in KFAC_LAYERS}
    users[FISHER_LAYER] = users["side"]
    out = {"A": {}, "G": {}, "lam": {}, "fisher": {}}
    scores = {method: 0 for method in METHODS}
    for name in KFAC_LAYERS:
        xs = torch.cat([per_train[i][0][name][0] for i in users[name]])
        gs = torch.cat([per_train[i][0][name][1] for i in users[name]])
        a_cov, g_cov = covariances(*linear_rows(xs, gs))
        out["A"][name], out["G"][name] = a_cov, g_cov
        _, u_a = torch.linalg.eigh(a_cov)
        _, u_g = torch.linalg.eigh(g_cov)
        rot = torch.kron(u_g, u_a)
        lam = ((g_tr[name][users[name]] @ rot) ** 2).mean(dim=0)
        out["lam"][name] = lam
        kfac_op = torch.kron(damped_inverse(g_cov, DAMPING), damped_inverse(a_cov, DAMPING))
        ekfac_op = rot @ torch.diag(1.0 / (lam + DAMPING)) @ rot.T
        scores["kfac"] = scores["kfac"] + g_tr[name] @ kfac_op @ g_te[name].T
        scores["ekfac"] = scores["ekfac"] + g_tr[name] @ ekfac_op @ g_te[name].T
    if direct:
        held = g_tr[FISHER_LAYER][users[FISHER_LAYER]]
        fisher = held.T @ held / held.shape[0]
        out["fisher"][FISHER_LAYER] = fisher
        part = g_tr[FISHER_LAYER] @ damped_inverse(fisher, DAMPING) @ g_te[FISHER_LAYER].T
        scores = {method: s + part for method, s in scores.items()}
    out["scores"] = scores
    return out


# --------------------------------------------------------------------------- accumulators


def _rows(rank: int, n: int, width: int) -> torch.Tensor:
    """Rank ``rank``'s ``(1, n, width)`` factor rows (fixed seed per rank and width)."""
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(100 * rank + width))


def accumulator_worker(rank: int, init_method: str) -> None:
    """Accumulators on ranks holding different layers, row counts or nothing (asserts inside).

    Rank 0 holds layer ``a`` (3 rows), rank 1 layer ``b`` (2 rows) and a
    ``LayerKroneckerAccumulator`` rank 0 leaves empty; expected sums are built
    from both ranks' rows here.
    """
    import pytest
    import torch.distributed as dist

    from dattri_llm.gradient.ops.kronecker import (
        FisherAccumulator,
        LayerFisherAccumulator,
        LayerKroneckerAccumulator,
    )
    from dattri_llm.utils.distributed import all_reduce_named_sums

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20)
    )
    try:
        # one layer, accumulated on rank 1 only: rank 0 receives rank 1's sums
        single = LayerKroneckerAccumulator()
        a1, g1 = _rows(1, 2, 4), _rows(1, 2, 3)
        if rank == 1:
            single.update(a1, g1, "linear", include_bias=False)
        single.all_reduce()
        a_cov, g_cov = single.result()
        assert single.rows == 2
        torch.testing.assert_close(a_cov, a1[0].T @ a1[0] / 2)
        torch.testing.assert_close(g_cov, g1[0].T @ g1[0] / 2)
        # nothing on any rank: RuntimeError on every rank (no rank left waiting)
        with pytest.raises(RuntimeError, match="nothing accumulated"):
            LayerFisherAccumulator().all_reduce()
        # different layers per rank: the union, global counts
        fisher = FisherAccumulator()
        width = {"a": 3, "b": 2}
        mine = "a" if rank == 0 else "b"
        fisher.layers[mine] = LayerFisherAccumulator()
        fisher.layers[mine].update_from_grad(_rows(rank, 3 - rank, width[mine])[0])
        fisher.all_reduce()
        result = fisher.result()
        assert sorted(result) == ["a", "b"]
        for holder, name in enumerate(("a", "b")):
            grads = _rows(holder, 3 - holder, width[name])[0]
            torch.testing.assert_close(result[name], grads.T @ grads / (3 - holder))
        # one layer with different shapes on the two ranks: ValueError naming it, everywhere
        with pytest.raises(ValueError, match=r"'w'.*different shapes"):
            all_reduce_named_sums({"w": ([torch.zeros(2 + rank)], 1)})
    finally:
        dist.destroy_process_group()

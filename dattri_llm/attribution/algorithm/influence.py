"""Exact-Hessian influence functions for small models (CG, LiSSA or a direct solve).

A training row ``i`` scores against query ``j``

    ``g_iᵀ (H + λI)⁻¹ q_j``

with ``g_i``, ``q_j`` the stored per-sample gradients of the hooked linear
layers (weight and bias, unprojected) and ``H`` the exact Hessian, over those
layers' parameters, of the mean of the task's ``loss_func`` over
``hessian_batches`` (one sample per batch: the mean training loss). ``H`` is
never formed for ``"cg"`` / ``"lissa"``: Hessian-vector products are
reverse-over-reverse (a batched backward through the retained graph of the
gradient, see :meth:`InfluenceFunctionAttributor.hvp_function`) on the task
model, every other parameter held fixed. Sign: positive = helpful, as Grad-Dot
(``polarity = +1``; Koh & Liang 2017's influence on the test loss is the
negative of this score).

The queries are solved once (``n_test`` solves, each a few dozen HVPs, every
HVP a backward through the gradient's graph over ``hessian_batches``);
training rows are read as stored.
Meant for small models: more than ``max_params`` hooked parameters is refused.
For the HVPs ``loss_func(model, batch)`` receives a callable standing in for
the model (the model run with substituted parameters): it may call its model
argument but not read attributes of it. ``attribute`` collects both sides
into stores first (``gradient_cache_residency``, ``"memory"`` by default) so
the HVPs run on a model free of capture hooks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from dattri_llm.attribution.algorithm.ihvp import conjugate_gradient, direct_solve, lissa
from dattri_llm.attribution.algorithm.vjp import batched_vjp, looped_vjp, math_attention
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.blocks import layer_rows, per_sample_layers
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.model.container import Gradient

__all__ = ["SOLVERS", "InfluenceFunctionAttributor"]

SOLVERS = ("cg", "lissa", "direct")
DEFAULT_MAX_PARAMS = 20_000
ROW_BLOCK = 64  # rows per batched HVP backward: bounds its (rows, *activation) temporaries


class RowProducts:
    """VJPs of a retained graph for ``K`` cotangent rows, batched or one row at a time.

    ``batched``: ``True`` batched backwards (``is_grads_batched``) of at most
    ``row_block`` rows each, ``False`` one backward per row, ``None`` (auto)
    both timed on the first block of more than one row and the faster kept.
    Batched wins when per-call overhead dominates (tiny graphs), looping when
    the activations are large (the batched backward's ``(K, tokens, vocab)``
    temporaries are memory-bound on CPU); ``row_block`` bounds the batched
    temporaries (the direct solve passes all ``D`` unit vectors in one call).
    An operation without a batching rule switches to looping for good.
    """

    def __init__(self, batched: bool | None, row_block: int = ROW_BLOCK) -> None:
        self.batched = batched
        self.row_block = row_block

    def __call__(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], rows: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``(K, *input.shape)`` per input: each row of ``rows`` times the outputs' Jacobian."""
        count = rows[0].shape[0]
        parts = []
        for start in range(0, count, self.row_block):
            if self.batched is False:  # the rest one row at a time
                parts.append(
                    looped_vjp(outputs, inputs, [r[start:] for r in rows], retain_graph=True)
                )
                break
            parts.append(
                self._block(outputs, inputs, [r[start : start + self.row_block] for r in rows])
            )
        return [torch.cat(pieces) for pieces in zip(*parts)]

    def _block(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], rows: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        count = rows[0].shape[0]
        if count == 1:
            return looped_vjp(outputs, inputs, rows, retain_graph=True)
        start = _clock(rows[0])
        got = batched_vjp(outputs, inputs, rows, retain_graph=True)
        if got is None:
            self.batched = False
            return looped_vjp(outputs, inputs, rows, retain_graph=True)
        if self.batched is None:
            batched_seconds = _clock(rows[0]) - start
            start = _clock(rows[0])
            looped_vjp(outputs, inputs, rows, retain_graph=True)
            self.batched = batched_seconds <= _clock(rows[0]) - start
        return [
            torch.zeros(count, *x.shape, device=x.device, dtype=x.dtype) if g is None else g
            for g, x in zip(got, inputs)
        ]


def _clock(reference: torch.Tensor) -> float:
    """``time.perf_counter()`` once the device of ``reference`` is idle."""
    if reference.is_cuda:
        torch.cuda.synchronize(reference.device)
    return time.perf_counter()


class InfluenceFunctionAttributor(BaseInnerProductAttributor):
    """Influence functions with the exact Hessian (``algorithm="InfluenceFunction"``).

    Args:
        args: the run settings.
        task: the :class:`AttributionTask` whose model and ``loss_func`` give ``H``
            (required: the Hessian needs the model even when scoring from stores).
        hessian_batches: batches ``loss_func(model, batch)`` accepts; ``H`` is
            the Hessian of their mean loss (one training sample per batch for
            the mean training loss).
        solver: ``"cg"`` (conjugate gradients), ``"lissa"`` or ``"direct"``
            (dense solve of ``H`` built from ``D`` HVPs).
        damping: ``λ >= 0`` (``H + λI`` must be positive definite for CG and
            the direct solve; the Hessian of a non-convex loss may need ``λ``
            above ``-λ_min(H)``).
        max_params: the most hooked parameters ``D`` accepted.
        solver_options: passed to the solver (``max_iter``/``tol`` for CG,
            ``scale``/``depth``/``repeat`` for LiSSA).
        retain_hessian_graph: ``True`` (default): the gradient's graph over all
            ``hessian_batches`` is built once per solve and kept, each HVP one
            backward through it (fast; memory: the activations of every
            Hessian batch). ``False``: every HVP rebuilds one batch's graph at a
            time (a forward and backward per batch per HVP; memory: one batch).
        batch_hvp_rows: the ``K`` rows of an HVP call in one batched backward
            (``True``), one backward each (``False``), or ``None`` (default):
            both timed on the first call, the faster kept (:class:`RowProducts`).

    Raises:
        ValueError: no task; an unknown solver; negative damping; no batches.
    """

    algorithm: ClassVar[str] = "InfluenceFunction"

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        hessian_batches: Sequence[object] = (),
        solver: str = "cg",
        damping: float = 1e-3,
        max_params: int = DEFAULT_MAX_PARAMS,
        solver_options: dict[str, Any] | None = None,
        retain_hessian_graph: bool = True,
        batch_hvp_rows: bool | None = None,
    ) -> None:
        super().__init__(args, task=task)
        self.require_task("__init__")
        if solver not in SOLVERS:
            raise ValueError(
                f"InfluenceFunctionAttributor: solver must be one of {SOLVERS}, got {solver!r}."
            )
        if isinstance(damping, bool) or not math.isfinite(float(damping)) or damping < 0:
            raise ValueError(
                f"InfluenceFunctionAttributor: damping must be finite and >= 0, got {damping!r}."
            )
        self.hessian_batches = list(hessian_batches)
        if not self.hessian_batches:
            raise ValueError(
                "InfluenceFunctionAttributor: hessian_batches is empty; pass the training "
                "batches (one sample each for the mean training loss) the Hessian is taken over."
            )
        self.solver = solver
        self.damping = float(damping)
        self.max_params = int(max_params)
        self.solver_options = dict(solver_options or {})
        self.retain_hessian_graph = bool(retain_hessian_graph)
        self.batch_hvp_rows = batch_hvp_rows

    def checkpoints(self) -> list[int]:
        """``[0]``: the Hessian is taken at one checkpoint (``UserWarning`` if more)."""
        return self._first_checkpoint_only()

    # ------------------------------------------------------------------ parameters
    def _linear_layers(self, model: nn.Module, names: list[str]) -> dict[str, nn.Linear]:
        """The hooked modules, each an ``nn.Linear`` (``ValueError`` otherwise)."""
        modules = dict(model.named_modules())
        layers = {}
        for name in names:
            module = modules.get(name)
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"InfluenceFunctionAttributor: layer {name!r} is "
                    f"{type(module).__name__}, not nn.Linear; the exact Hessian maps stored rows "
                    "to linear weights and biases only. Hook only nn.Linear layers (layer_name= or "
                    "the hook config; --linear_io on the command line)."
                )
            layers[name] = module
        return layers

    def _split(self, layers: dict[str, nn.Linear], rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``(K, D)`` rows → ``{param name: (K, *param shape)}`` (``[W | b]`` per layer)."""
        out, offset = {}, 0
        for name, module in layers.items():
            width = module.in_features + (module.bias is not None)
            size = module.out_features * width
            block = rows[:, offset : offset + size].reshape(-1, module.out_features, width)
            out[f"{name}.weight"] = block[..., : module.in_features]
            if module.bias is not None:
                out[f"{name}.bias"] = block[..., module.in_features]
            offset += size
        return out

    def _join(self, layers: dict[str, nn.Linear], params: dict[str, torch.Tensor]) -> torch.Tensor:
        """``{param name: (K, *shape)}`` → ``(K, D)`` rows (inverse of :meth:`_split`)."""
        parts = []
        for name, module in layers.items():
            weight = params[f"{name}.weight"]
            if module.bias is not None:
                weight = torch.cat([weight, params[f"{name}.bias"].unsqueeze(-1)], dim=-1)
            parts.append(weight.reshape(weight.shape[0], -1))
        return torch.cat(parts, dim=1)

    def hvp_function(self, names: list[str]) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
        """``(hvp, D)``: ``hvp((K, D)) -> (K, D)``, ``H`` over layers ``names``' parameters.

        ``H v`` is a vector-Jacobian product of the gradient ``g = ∇ L`` (``H``
        is symmetric): ``g`` is computed once with its graph
        (``create_graph=True``, every parameter but the hooked ones detached),
        then each call takes backwards through it for the ``K`` rows, batched
        or one per row (``batch_hvp_rows``; :class:`RowProducts`).
        Scaled-dot-product attention runs on its math kernel (the fused
        kernels have no double backward).

        Raises:
            ValueError: a non-linear layer; ``D > max_params``.
        """
        model = self.load_checkpoint(0)
        layers = self._linear_layers(model, names)
        params = {
            f"{name}.{kind}": getattr(module, kind).detach()
            for name, module in layers.items()
            for kind in ("weight", "bias")
            if getattr(module, kind) is not None
        }
        size = sum(p.numel() for p in params.values())
        if size > self.max_params:
            raise ValueError(
                f"InfluenceFunctionAttributor: the hooked layers hold {size} parameters, above "
                f"max_params={self.max_params}; the exact Hessian is for small models. Use "
                "DataInfAttributor, LoRIFAttributor or KFACAttributor, hook fewer layers, or "
                "raise max_params."
            )
        loss_func = self.train_loss_fn()
        # every other parameter enters detached: the graph covers the hooked layers only
        leaf_ids = {
            id(getattr(module, kind))
            for module in layers.values()
            for kind in ("weight", "bias")
            if getattr(module, kind) is not None
        }
        frozen = {n: p.detach() for n, p in model.named_parameters() if id(p) not in leaf_ids}
        scale = 1.0 / len(self.hessian_batches)

        def gradient_graph(batches: Sequence[object]) -> tuple[list[torch.Tensor], list]:
            """``(leaves, g)``: fresh leaves, ``g = ∂(scale · Σ loss)/∂leaves`` with its graph."""
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}

            def call(*a: Any, **kw: Any) -> Any:
                tensors = {**frozen, **leaves}
                return torch.func.functional_call(model, tensors, a, kw, strict=False)

            with torch.enable_grad(), math_attention():
                total = sum(loss_func(call, batch) for batch in batches) * scale
                grads = torch.autograd.grad(
                    total, list(leaves.values()), create_graph=True, allow_unused=True
                )
            return list(leaves.values()), list(grads)

        rows_vjp = RowProducts(self.batch_hvp_rows)

        def products(graph: tuple[list, list], tangents: list[torch.Tensor]) -> list:
            """``H_b v`` for every row ``v`` of ``tangents``: a VJP of the gradient graph."""
            leaves, grads = graph
            live = [(g, t) for g, t in zip(grads, tangents) if g is not None and g.requires_grad]
            if not live:  # the gradient is constant in the parameters: H = 0
                return [torch.zeros_like(t) for t in tangents]
            return rows_vjp([g for g, _ in live], leaves, [t for _, t in live])

        graphs = [gradient_graph(self.hessian_batches)] if self.retain_hessian_graph else None

        def hvp(rows: torch.Tensor) -> torch.Tensor:
            split = self._split(layers, rows.to(next(iter(params.values()))))
            tangents = [split[key] for key in params]
            if graphs is not None:
                total = products(graphs[0], tangents)
            else:  # one batch's graph at a time, freed after its products
                total = [torch.zeros_like(t) for t in tangents]
                for batch in self.hessian_batches:
                    part = products(gradient_graph([batch]), tangents)
                    total = [a + b for a, b in zip(total, part)]
            joined = {key: value.detach() for key, value in zip(params, total)}
            return self._join(layers, joined).to(rows)

        return hvp, size

    # ------------------------------------------------------------------ scoring
    def solve(
        self, hvp: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor
    ) -> torch.Tensor:
        """``(H + λI)⁻¹`` applied to ``(K, D)`` query rows with the configured solver."""
        if self.solver == "cg":
            return conjugate_gradient(hvp, rows, damping=self.damping, **self.solver_options)
        if self.solver == "lissa":
            return lissa(hvp, rows, damping=self.damping, **self.solver_options)
        return direct_solve(hvp, rows, damping=self.damping)

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """Queries solved against ``H + λI`` over all hooked layers jointly (dense ``(B, D_l)``)."""
        names = per_sample_layers(block)
        hvp, size = self.hvp_function(names)
        rows = [layer_rows(block, name) for name in names]
        joined = torch.cat(rows, dim=1)
        if joined.shape[1] != size:
            raise ValueError(
                f"InfluenceFunctionAttributor: the query gradients have {joined.shape[1]} entries "
                f"but layers {names} hold {size} parameters; projected stores cannot be scored "
                "with the exact Hessian. Capture without projection."
            )
        solved = self.solve(hvp, joined.to(torch.float64)).to(joined.dtype)
        pieces = dict(zip(names, torch.split(solved, [r.shape[1] for r in rows], dim=1)))
        return block.select_layers(names).map_layers(lambda name, _v, _t: pieces[name])

    @keywords()
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: Any = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        gradient_cache_residency: str | None = "memory",
        attribution_granularity: str = "instance",
    ) -> AttributionScore:
        """Collect both sides into stores of ``gradient_cache_residency``, then score them.

        The HVPs run the model, which must be free of capture hooks then: the
        live path (``gradient_cache_residency=None``) is refused.
        """
        if gradient_cache_residency is None:
            raise ValueError(
                "InfluenceFunctionAttributor runs Hessian-vector products on the model, which "
                "the live path keeps hooked for capture; pass gradient_cache_residency="
                "'memory' (the default), 'tiered' or 'disk'."
            )
        return super().attribute(
            train_dataset,
            test_dataset,
            hook_config=hook_config,
            verbose=verbose,
            loop_over_test=loop_over_test,
            gradient_cache_residency=gradient_cache_residency,
            attribution_granularity=attribution_granularity,
        )

"""Online data selection between ``backward()`` and ``optimizer.step()``.

Each capture step, :class:`DataSelectionCallback` scores every sample of the
batch against a target gradient (Grad-Dot on the captured factors), chooses the
samples to drop, and subtracts their exact contribution from ``param.grad`` of
every factorized layer, so the optimizer sees the gradient of the kept samples.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dattri_llm.gradient.callbacks import _lookahead as lookahead
from dattri_llm.gradient.callbacks import _selection as sel
from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.model.container import Gradient, GradientRecord
from dattri_llm.utils.autograd import queue_after_backward_finalization
from dattri_llm.utils.distributed import all_reduce_sum, dist_world_size
from dattri_llm.utils.wrappers import is_fsdp, unwrap_model

if TYPE_CHECKING:
    from dattri_llm.gradient.hooks.manager import HookManager

__all__ = ["DataSelectionCallback"]


_COLLECTIVE_LOOKAHEAD = (
    "DataSelectionCallback: score='lookahead' is not implemented under DDP (world > 1) or FSDP "
    "(per-rank batches against the averaged step); use score='grad_dot' there."
)


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


class DataSelectionCallback(HookManagerCallback):
    """Drop the samples that hurt a target from each step's parameter gradients.

    Args:
        model: the trained model (the DDP / FSDP wrapper when wrapped); layers are
            resolved on its unwrapped module.
        target: ``"batch"`` (score against the batch's own summed gradient),
            ``"fixed"`` (against ``target_gradient``) or ``"val_loader"`` (against
            the gradient of ``val_loss_fn`` on batches drawn from ``val_loader``).
        target_gradient: the fixed target (rows summed); needed by ``"fixed"``.
        val_loader: iterable of validation batches, re-iterated when exhausted.
        val_loss_fn: ``val_loss_fn(model, batch) -> scalar loss``.
        renormalize: weight the kept samples so that the result equals the
            *mean*-loss gradient over them (use with mean-reduced losses); without
            it the dropped contributions are just subtracted (sum-reduced losses).
        val_targets_per_pass: validation batches per pass; the pass's rows are
            split into that many targets consumed over the next steps.
        scoring_kwargs: ``{"score_mode": "ghost" | "materialized"}`` (Grad-Dot only).
        selection_kwargs: ``{"threshold": float, "threshold_mode": "hard" |
            "bottom_fraction" | "negative_bottom_fraction", "layer_wise": bool}``.
        score: ``"grad_dot"`` (default): ``score_i = <t_i, q>`` with ``t_i`` sample
            ``i``'s captured gradient and ``q`` the target's summed rows.
            ``"lookahead"``: minus the first-order change of the target loss
            ``K = horizon`` updates later when ``t_i`` is up-weighted in this step's
            gradient, with frozen dynamics: ``score_i = −[q, 0, 0]·J^{K−1}·
            (∂s'/∂g)·C'·t_i``, where ``s' = (θ', m', v')`` is the coming Adam/AdamW
            update of the captured parameters (read from ``optimizer``: moments,
            step + 1, each group's lr, betas, eps, weight decay: decoupled for
            AdamW, coupled L2 for Adam), ``J`` its Jacobian in ``(θ, m, v)`` at the
            current state (held fixed over the horizon, as is ``q``), ``g`` the
            applied gradient (``param.grad`` times the clip coefficient) and ``C'``
            the clip's Jacobian. With ``lookahead_curvature`` the gradient in ``J``
            responds to ``θ`` like the batch's empirical Fisher of a *mean* loss,
            ``∂g/∂θ ≈ C'·B·Σ_b t_b t_bᵀ``; without it ``J`` carries momentum, second
            moment and weight decay only. ``K = 1`` is the Adam-preconditioned
            alignment ``−q·(∂θ'/∂g)·C'·t_i``. Positive = helpful for both scores.
            Only the captured per-sample layers enter; the per-sample gradients are
            materialized once per step (``B`` × captured parameters, float32).
        horizon: ``K ≥ 1``, the updates looked ahead (``"lookahead"`` only).
        optimizer: the ``torch.optim.Adam`` / ``AdamW`` that steps the model
            (``"lookahead"`` only; ``amsgrad`` / ``maximize`` refused).
        max_grad_norm: the norm the training loop clips every parameter's gradient
            to before ``optimizer.step()`` (``"lookahead"`` only), or ``None``.
        lookahead_curvature: include the Gauss–Newton coupling in ``J``.

    Attributes:
        last_scores: layer-summed scores ``(B,)`` of the last step (CPU; the
            look-ahead scores with ``score="lookahead"``), or ``None``.
        last_dropped: sorted indices dropped at the last step (union over layers).
    """

    needs_param_grads = True

    def __init__(
        self,
        model: nn.Module,
        target: str = "batch",
        target_gradient: Gradient | None = None,
        val_loader: Iterable[object] | None = None,
        val_loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        renormalize: bool = False,
        val_targets_per_pass: int = 1,
        *,
        scoring_kwargs: dict[str, Any] | None = None,
        selection_kwargs: dict[str, Any] | None = None,
        score: str = "grad_dot",
        horizon: int = 1,
        optimizer: torch.optim.Optimizer | None = None,
        max_grad_norm: float | None = None,
        lookahead_curvature: bool = True,
    ) -> None:
        """Validate the options (``ValueError`` / ``TypeError`` naming the bad one)."""
        _check_target(target, target_gradient, val_loader, val_loss_fn)
        lookahead.check_options(score, horizon, optimizer, max_grad_norm, lookahead_curvature)
        if isinstance(val_targets_per_pass, bool) or not isinstance(val_targets_per_pass, int):
            raise ValueError(
                f"DataSelectionCallback: val_targets_per_pass must be an int >= 1, got "
                f"{val_targets_per_pass!r}."
            )
        if val_targets_per_pass < 1:
            raise ValueError(
                f"DataSelectionCallback: val_targets_per_pass must be >= 1, got "
                f"{val_targets_per_pass}."
            )
        self.model = model
        self.target = target
        self.target_gradient = target_gradient
        self.val_loader = val_loader
        self.val_loss_fn = val_loss_fn
        self.renormalize = bool(renormalize)
        self.val_targets_per_pass = val_targets_per_pass
        self.scoring_kwargs = sel.scoring_options(scoring_kwargs)
        self.selection_kwargs = sel.selection_options(selection_kwargs)
        self.score = score
        self.horizon = horizon
        self.optimizer = optimizer
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.lookahead_curvature = lookahead_curvature
        if self.selection_kwargs["threshold_mode"] == "hard" and val_targets_per_pass > 1:
            warnings.warn(
                "DataSelectionCallback: threshold_mode 'hard' with val_targets_per_pass > 1 "
                "compares scores against different single-row targets to one fixed threshold; "
                "consider a fraction mode.",
                UserWarning,
                stacklevel=2,
            )
        self.last_scores: torch.Tensor | None = None
        self.last_dropped: list[int] = []
        self._manager: HookManager | None = None
        self._val_iter: Iterator[object] | None = None
        self._queued_targets: list[Gradient] = []
        self._capturing_target = False
        self._captured: list[GradientRecord] = []
        self._warned: set[frozenset[str]] = set()

    # ------------------------------------------------------------------ registration

    def on_register(self, hook_manager: HookManager) -> None:
        """Attach the manager; refuse captures from which contributions cannot be removed.

        Raises:
            ValueError: the manager projects or materializes captures, or
                preconditions them with an optimizer (removal needs raw factors).
            NotImplementedError: ``model`` is FSDP2-wrapped, or FSDP1-wrapped without
                ``use_orig_params=True``, with ``target="val_loader"`` or with
                ``score="lookahead"``.
        """
        config = hook_manager.config
        if config.projection_kwargs or config.capture_style != "factorized":
            raise ValueError(
                "DataSelectionCallback removes contributions from the raw captured factors: "
                "build its HookManager without projection_kwargs and with "
                f"capture_style='factorized' (got projection_kwargs={config.projection_kwargs!r}, "
                f"capture_style={config.capture_style!r})."
            )
        if hook_manager.supports_preconditioning:
            raise ValueError(
                "DataSelectionCallback needs raw captures: build its HookManager without "
                "optimizer= (preconditioned capture)."
            )
        if type(self.model).__name__.startswith("FSDP"):
            raise NotImplementedError(
                "DataSelectionCallback under FSDP2 (fully_shard) is not implemented; use "
                "FullyShardedDataParallel(..., use_orig_params=True), DDP or a single process."
            )
        if is_fsdp(self.model):
            sel.fsdp_shard_slices(self.model)  # NotImplementedError without use_orig_params
            if self.score == "lookahead":
                raise NotImplementedError(_COLLECTIVE_LOOKAHEAD)
            if self.target == "val_loader":
                raise NotImplementedError(
                    "DataSelectionCallback: target='val_loader' is not supported under FSDP (a "
                    "second backward inside the training step); use target='batch' or 'fixed'."
                )
        self._manager = hook_manager

    # ------------------------------------------------------------------ the step

    def on_step_end(self, record: GradientRecord) -> None:
        """Score the batch, choose the dropped samples and remove their contributions.

        Under DDP (synchronizing step) and FSDP the work runs after the averaged
        gradients are written (FSDP: reduce-scattered into each rank's shard), and
        every rank takes part in the collective removal.
        """
        if self._capturing_target:
            self._captured.append(record)
            return
        if self._is_collective():
            if self.score == "lookahead":
                raise NotImplementedError(_COLLECTIVE_LOOKAHEAD)
            if self.selection_kwargs["layer_wise"]:
                raise NotImplementedError(
                    "DataSelectionCallback: selection_kwargs['layer_wise'] is not implemented "
                    "under DDP or FSDP; use global selection."
                )
            if not queue_after_backward_finalization(lambda: self._run(record, collective=True)):
                self._run(record, collective=True)
            return
        self._run(record, collective=False)

    def _is_collective(self) -> bool:
        """Whether this step's removal is collective: a synchronizing DDP step (world > 1)
        or any FSDP step (``NotImplementedError`` inside FSDP's ``no_sync()``)."""
        if is_fsdp(self.model):
            if not self.model._sync_gradients:
                raise NotImplementedError(
                    "DataSelectionCallback under FSDP inside no_sync() (unsharded accumulated "
                    "gradients) is not implemented; accumulate without no_sync()."
                )
            return True
        return (
            _is_ddp(self.model) and dist_world_size() > 1 and self.model.require_backward_grad_sync
        )

    def _run(self, record: GradientRecord, *, collective: bool) -> None:
        with torch.no_grad():
            target = self._current_target()
            root = unwrap_model(self.model)
            if self.score == "lookahead":
                scores = lookahead.lookahead_scores(
                    record,
                    root,
                    target,
                    self.optimizer,
                    horizon=self.horizon,
                    max_grad_norm=self.max_grad_norm,
                    curvature=self.lookahead_curvature,
                )
            else:
                scores = self.compute_scores(
                    record.gradient, target, scoring_kwargs=self.scoring_kwargs
                )
            if not scores:
                raise ValueError(
                    f"DataSelectionCallback: the target shares no per-sample layer with the "
                    f"captured record (record layers {sorted(record.gradient.data)})."
                )
            dropped = self._choose(scores, sel.sample_layers(record.gradient))
            self.last_scores = sum(scores.values()).detach().cpu()
            self.last_dropped = sorted(set().union(*dropped.values()))
            if self.last_dropped:
                self._warn_batch_level(record.gradient)
            if collective:
                self._remove_collectively(record, self.last_dropped, root)
            elif self.last_dropped:
                self.remove_contributions(record, dropped, root, renormalize=self.renormalize)

    def _warn_batch_level(self, gradient: Gradient) -> None:
        """Warn once per layer set about ``param_grad`` layers, which keep every sample."""
        batch_level = sorted(set(gradient.data) - set(sel.sample_layers(gradient)))
        if batch_level and frozenset(batch_level) not in self._warned:
            self._warned.add(frozenset(batch_level))
            warnings.warn(
                f"DataSelectionCallback: {batch_level} are captured as batch-level param_grad "
                "gradients without a sample axis; the dropped samples' contributions stay in "
                "them. Hook those layers with linear_io for exact removal.",
                UserWarning,
                stacklevel=2,
            )

    def _choose(self, scores: dict[str, torch.Tensor], layers: list[str]) -> dict[str, list[int]]:
        """``{layer: dropped indices}``: per scored layer when ``layer_wise``, else one
        choice on the layer-summed score applied to every per-sample layer in ``layers``."""
        options = self.selection_kwargs
        if options["layer_wise"]:
            return {n: self.select_samples(s, selection_kwargs=options) for n, s in scores.items()}
        chosen = self.select_samples(sum(scores.values()), selection_kwargs=options)
        return {name: chosen for name in layers}

    def _remove_collectively(
        self, record: GradientRecord, dropped: list[int], root: nn.Module
    ) -> None:
        """Every rank subtracts ``all_reduce(Σ_i w_i dW_i) / world`` (one flat collective).

        DDP: from the whole ``param.grad``. FSDP: the deltas are formed at full
        parameter shape on every rank and each rank subtracts the slice of its shard.
        """
        batch = record.gradient.batch_size
        counts = all_reduce_sum(torch.tensor([float(len(dropped)), float(batch)]))
        weights = sel.removal_weights(
            batch,
            dropped,
            self.renormalize,
            n_dropped=int(counts[0]),
            n_total=int(counts[1]),
        )
        shards = sel.fsdp_shard_slices(self.model) if is_fsdp(self.model) else None
        deltas = [
            pair
            for name, module in sel.removable_layers(record, root).items()
            for pair in sel.layer_deltas(
                record.gradient.data[name],
                record.gradient.layer_types[name],
                module,
                weights,
                shards,
            )
        ]
        if not deltas:
            return
        flat = torch.cat([d.reshape(-1).float() for _, d in deltas])
        flat = all_reduce_sum(flat) / dist_world_size()
        pieces = flat.split([d.numel() for _, d in deltas])
        averaged = [(p, piece.reshape(d.shape)) for (p, d), piece in zip(deltas, pieces)]
        if shards is None:
            sel.subtract(averaged)
        else:
            sel.subtract_shards(averaged, shards)

    # ------------------------------------------------------------------ targets

    def _current_target(self) -> Gradient | None:
        if self.target == "batch":
            return None
        if self.target == "fixed":
            return self.target_gradient
        if not self._queued_targets:
            self._queued_targets = self._validation_targets()
        return self._queued_targets.pop(0)

    def _next_val_batch(self) -> object:
        """The next validation batch, re-iterating ``val_loader`` when it is exhausted."""
        if self._val_iter is not None:
            with contextlib.suppress(StopIteration):
                return next(self._val_iter)
        self._val_iter = iter(self.val_loader)
        try:
            return next(self._val_iter)
        except StopIteration:
            raise ValueError("DataSelectionCallback: val_loader yielded no batch.") from None

    def _validation_targets(self) -> list[Gradient]:
        """One validation pass; its rows split into ``val_targets_per_pass`` targets."""
        k = self.val_targets_per_pass
        batch = sel.concatenate_batches([self._next_val_batch() for _ in range(k)])
        gradient = self._capture_validation(batch).gradient
        gradient = gradient.select_layers(sel.sample_layers(gradient))
        rows = gradient.batch_size
        if k == 1:
            return [gradient]
        if rows % k:
            raise ValueError(
                f"DataSelectionCallback: the validation pass captured {rows} rows, not a "
                f"multiple of val_targets_per_pass={k}; use validation batches of equal size."
            )
        per = rows // k
        return [gradient.slice("batch", list(range(i * per, (i + 1) * per))) for i in range(k)]

    def _capture_validation(self, batch: object) -> GradientRecord:
        """Backward ``val_loss_fn(model, batch)`` in an isolated capture step; return its record.

        ``param.grad`` and the manager's step state are saved before and restored
        after; the manager dispatches this step to this callback only, so other
        callbacks (offload, covariances) see exactly the training steps.
        """
        manager = self._manager
        if manager is None:
            raise RuntimeError(
                "DataSelectionCallback(target='val_loader') is not attached to a HookManager: "
                "pass it in HookManager(callbacks=[...]) or via add_callback()."
            )
        params = list(self.model.parameters())
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        state = manager.save_state()
        manager.clear_state()
        others, manager.callbacks = manager.callbacks, [self]
        self._captured, self._capturing_target = [], True
        no_sync = self.model.no_sync() if _is_ddp(self.model) else contextlib.nullcontext()
        try:
            with torch.enable_grad(), no_sync:
                self.val_loss_fn(self.model, batch).backward()
        finally:
            self._capturing_target = False
            manager.callbacks = others
            manager.load_state(state)
            for p, g in zip(params, grads):
                p.grad = g
        if not self._captured:
            raise RuntimeError(
                "DataSelectionCallback: the validation backward captured no record; val_loss_fn "
                "must run the model (inside collect()) and return a loss that depends on the "
                "hooked layers."
            )
        return self._captured[-1]

    # ------------------------------------------------------------------ stages

    @staticmethod
    def compute_scores(
        gradient: Gradient,
        target: Gradient | None = None,
        *,
        scoring_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``{layer: (B,)}`` Grad-Dot scores ``<dW_i, Σ_j dW_target_j>`` per layer.

        ``target=None`` scores against the batch itself. ``"ghost"`` routes each
        layer's inner products by the cost model (factorized when cheaper),
        ``"materialized"`` forms the per-sample gradients. ``param_grad`` layers
        are excluded; the target is moved to the gradient's device; broadcast
        layers are expanded to ``B``.
        """
        options = sel.scoring_options(scoring_kwargs)
        return sel.layer_scores(gradient, target, options["score_mode"])

    @staticmethod
    def select_samples(
        scores: torch.Tensor, *, selection_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Sorted indices to drop from ``scores : (B,)``.

        ``"hard"``: every ``score < threshold``; fraction modes take the
        ``round(B·threshold)`` lowest scores, of which ``"negative_bottom_fraction"``
        keeps only the negative ones.
        """
        options = sel.selection_options(selection_kwargs)
        return sel.choose_samples(scores, options["threshold"], options["threshold_mode"])

    @staticmethod
    def remove_contributions(
        record: GradientRecord,
        dropped: dict[str, list[int]],
        root: nn.Module,
        *,
        renormalize: bool = False,
    ) -> None:
        """Subtract the dropped samples' gradient from ``param.grad`` of each factorized layer.

        ``weight.grad -= Σ_{i∈drop} dW_i`` and ``bias.grad -= Σ g`` over the
        dropped rows (broadcast layers and names not under ``root`` skipped).
        With ``renormalize`` and ``0 < k < B`` the kept samples are weighted
        ``-k/(B-k)`` in the same pass, giving the mean-loss gradient over them.
        """
        batch = record.gradient.batch_size
        for name, module in sel.removable_layers(record, root).items():
            drop = dropped.get(name) or []
            if not drop:
                continue
            weights = sel.removal_weights(batch, drop, renormalize)
            sel.subtract(
                sel.layer_deltas(
                    record.gradient.data[name], record.gradient.layer_types[name], module, weights
                )
            )


def _check_target(
    target: str,
    target_gradient: Gradient | None,
    val_loader: Iterable[object] | None,
    val_loss_fn: Callable | None,
) -> None:
    """``ValueError`` for an unknown target or one missing what it needs."""
    if target not in sel.TARGETS:
        raise ValueError(
            f"DataSelectionCallback: target must be one of {sel.TARGETS}, got {target!r}."
        )
    if target == "fixed" and target_gradient is None:
        raise ValueError("DataSelectionCallback: target='fixed' needs target_gradient=Gradient.")
    if target_gradient is not None and not isinstance(target_gradient, Gradient):
        raise TypeError(
            f"DataSelectionCallback: target_gradient must be a Gradient, got "
            f"{type(target_gradient).__name__}."
        )
    if target == "val_loader" and (val_loader is None or val_loss_fn is None):
        raise ValueError(
            "DataSelectionCallback: target='val_loader' needs both val_loader and "
            "val_loss_fn(model, batch) -> loss."
        )

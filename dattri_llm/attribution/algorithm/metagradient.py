"""The exact metagradient of a recorded run (MAGIC-style data attribution).

For each training sample ``z_b`` of a recorded Adam / AdamW run and each query
``j``, the score is the exact derivative of the query's loss at the final
parameters in the sample's weight in the training loss, through the whole run
and the optimizer: ``score[b, j] = d L_j(θ_T(w)) / d w_b`` at ``w = 1``
(Ilyas & Engstrom, 2025, "MAGIC: Near-Optimal Data Attribution for Deep
Learning"). One row per occurrence of a sample in the run, labelled with its
step; a sample's total effect is the sum of its rows. Like AdamW-influence the
scores are ``dL/dw``: **a helpful sample scores negative** (``polarity = -1``).

Unlike AdamW-influence, which linearises every update around the recorded
run (the batch gradient's dependence on the parameters by its Gauss–Newton
part, the clip by its Jacobian), nothing is approximated: the run is replayed
as a differentiable function of ``w`` (:mod:`.trajectory.unroll`) and
differentiated in reverse mode with checkpointing (:mod:`.trajectory.reverse`):
a forward replay from the snapshots saving each update's Adam moments, then a
reverse sweep rebuilding each update's graph (forward, gradient with its graph)
and taking one vector-Jacobian product per query. Cost: about two to three
replays of the run; memory: one update's double-backward graph, the moments of
every update on disk, and ``(n_test, 3p)`` adjoints.

The queries are **data**: MAGIC differentiates the task's target function on
each query sample at ``θ_T`` with respect to every trained parameter (not
only hooked layers), so :meth:`MetagradientAttributor.attribute_from_cache`
takes the test dataset, not a gradient store. See ``docs/metagradient.md``.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from dattri_llm.attribution.algorithm.trajectory.base import TrajectoryAttributor
from dattri_llm.attribution.algorithm.trajectory.first_update import first_update_meta
from dattri_llm.attribution.algorithm.trajectory.reverse import MetagradientSweep, UnrollSetup
from dattri_llm.attribution.algorithm.trajectory.run import RunDynamics, Window
from dattri_llm.attribution.algorithm.trajectory.sweep import LOSS_REDUCTIONS, check_choice
from dattri_llm.attribution.algorithm.trajectory.unroll import (
    ADAM_TYPES,
    GroupValues,
    SampleLossFn,
    bound_parameters,
    cast_batch,
    per_sample_losses,
)
from dattri_llm.attribution.algorithm.vjp import math_attention
from dattri_llm.attribution.sources import _check_dataset
from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback
from dattri_llm.gradient.hooks.identity import SampleIdentity
from dattri_llm.gradient.state.dynamics import load_training_dynamics
from dattri_llm.gradient.state.snapshots import TrajectorySnapshots
from dattri_llm.gradient.stream.inputs import make_loader
from dattri_llm.gradient.stream.training import move_batch
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.hooks.config import HookManagerConfig

__all__ = ["MetagradientAttributor"]

# ``args.optim`` values whose optimizer the replay models.
_FROM_ARGS = object()  # max_grad_norm default: args.max_grad_norm
# Keywords of ``attribute_from_cache`` that ``attribute`` passes on.
_FROM_CACHE = (
    "dynamics", "selected_training_steps", "final_step", "loss_reduction", "max_grad_norm",
    "block_dtype", "replay_rtol", "sample_id_key", "scratch_dir", "query_block",
)  # fmt: skip


class MetagradientAttributor(TrajectoryAttributor):
    """Exact metagradients of a recorded Adam / AdamW run (``algorithm="Metagradient"``).

    Args:
        args: the run settings (``args.optim`` must name AdamW to record a run;
            ``args.max_grad_norm`` is the loop's clip threshold).
        task: the :class:`AttributionTask` (its model, ``loss_func`` for the
            training samples and ``target_func`` for the queries, both summed
            over a batch by the library's convention).
        sample_loss_func: optional ``(model, batch) -> (B,)`` per-sample training
            losses in one forward; by default ``loss_func`` runs on each
            one-sample slice of a batch.
        sample_target_func: the same for the queries' ``target_func``.
    """

    algorithm: ClassVar[str] = "Metagradient"
    # Rows are d(query loss)/d(sample weight): a helpful sample scores NEGATIVE.
    polarity: ClassVar[int] = -1
    streaming_top_k: ClassVar[bool] = False

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        sample_loss_func: SampleLossFn | None = None,
        sample_target_func: SampleLossFn | None = None,
    ) -> None:
        super().__init__(args, task=task)
        self.sample_loss_func = sample_loss_func
        self.sample_target_func = sample_target_func
        self.last_sweep: MetagradientSweep | None = None

    @property
    def recompute(self) -> bool:
        """Always ``True``: the run is replayed, so its snapshots are recorded."""
        return True

    # ------------------------------------------------------------------ collection
    @keywords()
    def cache(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        cache_dir: str | None = None,
        hook_config: HookManagerConfig | None = None,
        offload_interval: int = 1,
    ) -> list[tuple[str, str]]:
        """Record the run as snapshots (``<cache_dir>/train_snapshots``) with its dynamics.

        The queries' gradients also go to ``test_grads`` (the shared recording),
        though the metagradient reads the queries as data.

        Raises:
            ValueError: ``args.optim`` is not AdamW (checked before training).
        """
        _check_single_process(self.args.world_size, "args.world_size")
        self.require_adamw_training("the exact metagradient replays")
        return super().cache(
            train_dataset,
            test_dataset,
            cache_dir=cache_dir,
            hook_config=hook_config,
            offload_interval=offload_interval,
        )

    # ------------------------------------------------------------------ entry points
    @keywords(extra=("cache_dir", *_FROM_CACHE))
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> AttributionScore:
        """Record the run (:meth:`cache`), then score it against ``test_dataset``.

        ``kwargs``: ``cache_dir`` (default ``args.output_dir``) goes to
        :meth:`cache`, the others to :meth:`attribute_from_cache`.
        """
        check_choice("loss_reduction", kwargs.get("loss_reduction", "mean"), LOSS_REDUCTIONS)
        cache_dir = kwargs.pop("cache_dir", None)
        ((train_dir, _test_dir),) = self.cache(
            train_dataset, test_dataset, cache_dir=cache_dir, hook_config=hook_config
        )
        return self.attribute_from_cache(train_dir, test_dataset, verbose=verbose, **kwargs)

    @keywords()
    def attribute_from_cache(
        self,
        train_source: object,
        test_dataset: object,
        *,
        dynamics: object = None,
        selected_training_steps: Iterable[int] | None = None,
        final_step: int | None = None,
        loss_reduction: str = "mean",
        max_grad_norm: object = _FROM_ARGS,
        block_dtype: torch.dtype = torch.float32,
        replay_rtol: float | None = None,
        sample_id_key: str | int | None = None,
        scratch_dir: str | Path | None = None,
        query_block: int | None = None,
        verbose: bool = False,
    ) -> AttributionScore:
        """Exact metagradients of a recorded run against the queries of ``test_dataset``.

        The queries are data: each query's loss is the task's ``target_func`` on
        its own sample at ``θ_T`` (batches of ``per_device_eval_batch_size``
        in dataset order, the model in ``eval()`` mode, as the other
        attributors' query probe), differentiated in every trained parameter.

        Args:
            train_source: the run's ``TrajectorySnapshots`` (or its directory):
                parameters at every window start and every micro-batch.
            test_dataset: the queries (a dataset of the task's batch format).
            dynamics: the run's records: ``None`` reads
                ``training_dynamics.json`` beside the snapshots; a directory
                holding one; a ``TrainingDynamicsCallback``; or its
                ``records()`` / ``load_training_dynamics`` mapping.
            selected_training_steps: steps whose rows are emitted (default all);
                the reverse sweep stops at the earliest one.
            final_step: the queries are taken after the updates before this
                step (default: the whole run).
            loss_reduction: the loop's micro-batch reduction, ``"mean"`` or ``"sum"``.
            max_grad_norm: the loop's clip threshold (default ``args.max_grad_norm``;
                ``None`` for no clip).
            block_dtype: the dtype of the passes, which run on the device of the
                task model's parameters (the model is copied and cast
                when it differs from the model's; floating batch tensors too).
            replay_rtol: relative tolerance of the replay checks (a
                ``UserWarning`` when the replayed parameters leave the snapshots);
                ``None``: 1e-6 for a run recorded in float64, else 1e-3 (a
                float32 run replayed with other kernels, e.g. attention's math
                kernel, drifts by up to ~1e-4: Adam amplifies rounding where a
                coordinate's gradients are tiny).
            sample_id_key: the id field the recording ``HookManager`` used
                (``None``: content hashes, the attributors' default).
            scratch_dir: where the per-update moments are kept during the call
                (a temporary directory, deleted after; default the system's).
            query_block: queries per batched vector-Jacobian product of the
                reverse sweep (``None``: all at once; 1: one backward per query,
                the least memory: a batched product holds that many copies of
                the update's backward intermediates).
            verbose: progress bars over the replay and reverse loops.

        Returns:
            rows ``(sample, step)`` latest step first, columns the queries;
            ``algorithm_meta`` holds the replay errors, clip coefficients,
            the passes' wall times and, when the optimizer's first update is
            scored, ``first_update`` (a ``UserWarning`` when its rows stand out;
            :mod:`.trajectory.first_update`).

        Raises:
            ValueError: a train source that is not a snapshot store; a run
                without recorded dynamics; an optimizer other than Adam /
                AdamW, ``amsgrad`` or ``maximize``; a multi-group run recorded
                without ``parameter_groups``; a run not starting from a fresh
                optimizer; an empty test set; a bad ``loss_reduction``; a
                data-parallel run (``args.world_size`` or the recorded one > 1).
        """
        check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        if query_block is not None and (
            isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 1
        ):
            raise ValueError(f"query_block must be None or an int >= 1, got {query_block!r}")
        clip = self.args.max_grad_norm if max_grad_norm is _FROM_ARGS else max_grad_norm
        snapshots = self.snapshots_of(train_source)
        if snapshots is None:
            raise ValueError(
                f"{type(self).__name__} replays the run from its snapshots; {train_source!r} is "
                "not a TrajectorySnapshots store. Record the run with args.recompute_gradients="
                "True (cache does), or TrajectorySnapshots.save_parameters/save_batch per step"
            )
        _check_dataset(test_dataset, "test")
        recorded = _load_records(snapshots, dynamics)
        prop, output, final = self.resolve_steps(
            snapshots.steps(), selected_training_steps, final_step
        )
        run = RunDynamics.from_records(recorded)
        _check_single_process(self.args.world_size, "args.world_size")
        _check_single_process(
            max((int(u.get("world_size", 1)) for u in run.updates.values()), default=1),
            "the recorded run's world_size",
        )
        windows = _check_windows(run, prop, output)
        task = self.require_task("attribute_from_cache")
        groups = _parameter_groups(recorded, task.model, windows)
        device = _device_of(task.model)
        model, cast_inputs = _compute_model(task.model, block_dtype, device)
        names = [n for n, p in model.named_parameters() if n in groups]
        setup = UnrollSetup(
            model=model,
            names=names,
            groups={name: groups[name] for name in names},
            loss_fn=self.train_loss_fn(),
            sample_loss_fn=self.sample_loss_func,
            reduction=loss_reduction,
            max_grad_norm=clip,
            device=device,
            dtype=block_dtype,
            cast_inputs=cast_inputs,
            replay_rtol=_replay_rtol(replay_rtol, snapshots, windows[0]),
            query_block=query_block,
        )
        self._verbose = verbose
        try:
            with tempfile.TemporaryDirectory(prefix="metagradient-", dir=scratch_dir) as scratch:
                sweep = MetagradientSweep(setup, snapshots, windows, Path(scratch), self._loops)
                self.last_sweep = sweep
                test_ids, rows, seconds = self._passes(
                    sweep, test_dataset, set(output), sample_id_key
                )
        finally:
            self._verbose = False
        scores, row_ids, row_steps = self._rows(snapshots, rows, sample_id_key)
        meta = {
            "final_step": final,
            "selected_training_steps": (
                None if selected_training_steps is None else sorted(output)
            ),
            "propagated_steps": sorted((s for w in windows for s in w.steps), reverse=True),
            "loss_reduction": loss_reduction,
            "max_grad_norm": clip,
            "block_dtype": str(block_dtype),
            "train_source": "snapshots",
            "queries": "data",
            "replay_errors": dict(sweep.replay_errors),
            "clip_coefficients": dict(sweep.clip_coefficients),
            "seconds": seconds,
        }
        meta.update(first_update_meta(scores, row_steps, run, windows, method=self.algorithm))
        self.scored_layers = []
        return self.build_score(scores, row_ids, row_steps, test_ids, algorithm_meta=meta)

    def _passes(
        self,
        sweep: MetagradientSweep,
        test_dataset: object,
        emitted: set[int],
        sample_id_key: str | int | None,
    ) -> tuple[list[str], dict[int, torch.Tensor], dict[str, float]]:
        """The replay (``train()`` mode), the query adjoints (``eval()``), the reverse sweep
        from the last update to the first holding an ``emitted`` step; the model's modes
        are restored. Returns ``(test_ids, {step: (B, n_test)}, {pass: seconds})``."""
        model = sweep.setup.model
        modes = {m: m.training for m in model.modules()}
        first = min(i for i, w in enumerate(sweep.windows) if emitted & set(w.steps))
        try:
            start = time.perf_counter()
            model.train()
            theta_final = sweep.replay()
            replayed = time.perf_counter()
            model.eval()
            test_ids, adjoint = self._query_adjoints(
                sweep.setup, theta_final, test_dataset, sample_id_key
            )
            queried = time.perf_counter()
            model.train()
            rows = sweep.reverse(adjoint, first, emitted)
            done = time.perf_counter()
        finally:
            for module, training in modes.items():
                module.train(training)
        seconds = {
            "replay": replayed - start,
            "queries": queried - replayed,
            "reverse": done - queried,
        }
        return test_ids, rows, seconds

    # ------------------------------------------------------------------ pieces
    def _loops(self, windows: Iterable[Window], desc: str) -> Iterable[Window]:
        windows = list(windows)
        return self._bar(windows, desc=f"{self.algorithm} {desc}", unit="update")

    def _query_adjoints(
        self,
        setup: UnrollSetup,
        theta: Mapping[str, torch.Tensor],
        test_dataset: object,
        sample_id_key: str | int | None,
    ) -> tuple[list[str], list[torch.Tensor]]:
        """``(test_ids, θ̄)``: each query's loss gradient at ``θ_T``, ``(n_test, *shape)`` per
        trained parameter; a query id repeated keeps its last row."""
        task = self.require_task("attribute_from_cache")
        target = self.test_loss_fn()
        identity = SampleIdentity(sample_id_key, None)
        loader = make_loader(
            test_dataset,
            self.args.per_device_eval_batch_size,
            self.args,
            collate_fn=None,
            shuffle=False,
            shard=False,
        )
        dtype = setup.dtype if setup.cast_inputs else None
        rows: dict[str, list[torch.Tensor]] = {}
        for batch in loader:
            batch = move_batch(batch, setup.device)
            with torch.no_grad():
                inputs, keyed = identity.forward_inputs(
                    task.model, lambda b=batch: target(task.model, b)
                )
            ids = identity.identifiers(None, inputs, keyed, task.model)
            leaves = {n: theta[n].detach().clone().requires_grad_(True) for n in setup.names}
            with bound_parameters(setup.model, {**theta, **leaves}), math_attention():
                losses = per_sample_losses(
                    setup.model, cast_batch(batch, setup.device, dtype), target,
                    self.sample_target_func,
                )  # fmt: skip
            params = [leaves[n] for n in setup.names]
            for b, sample in enumerate(ids):
                grads = torch.autograd.grad(
                    losses[b], params, retain_graph=b < len(ids) - 1, allow_unused=True
                )
                rows[sample] = [
                    torch.zeros_like(p) if g is None else g.detach()
                    for p, g in zip(params, grads, strict=True)
                ]
        if not rows:
            raise ValueError("the test set is empty: no query to differentiate")
        test_ids = list(rows)
        adjoint = [torch.stack([rows[s][k] for s in test_ids]) for k in range(len(setup.names))]
        return test_ids, adjoint

    def _rows(
        self,
        snapshots: TrajectorySnapshots,
        rows: Mapping[int, torch.Tensor],
        sample_id_key: str | int | None,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """``(scores, row_ids, row_steps)``, latest step first; ids as a capture names them."""
        task = self.require_task("attribute_from_cache")
        loss_fn = self.train_loss_fn()
        identity = SampleIdentity(sample_id_key, None)
        device = _device_of(task.model)
        blocks, row_ids, row_steps = [], [], []
        for step in sorted(rows, reverse=True):
            batch = move_batch(snapshots.load_batch(step), device)
            with torch.no_grad():
                inputs, keyed = identity.forward_inputs(
                    task.model, lambda b=batch: loss_fn(task.model, b)
                )
            ids = identity.identifiers(None, inputs, keyed, task.model)
            if len(ids) != rows[step].shape[0]:
                raise ValueError(
                    f"step {step}: the batch names {len(ids)} samples but holds "
                    f"{rows[step].shape[0]}; pass the sample_id_key the recording used"
                )
            blocks.append(rows[step])
            row_ids.extend(ids)
            row_steps.extend([step] * len(ids))
        return torch.cat(blocks), row_ids, row_steps


# ---------------------------------------------------------------------------- run records
def _load_records(snapshots: TrajectorySnapshots, dynamics: object) -> dict[str, Any]:
    """The run's records as :func:`load_training_dynamics` returns them.

    Raises:
        ValueError: nothing recorded.
    """
    if isinstance(dynamics, TrainingDynamicsCallback):
        recorded: Mapping[str, Any] | None = dynamics.records()
    elif isinstance(dynamics, (str, Path)):
        recorded = load_training_dynamics(Path(dynamics).expanduser())
    elif isinstance(dynamics, Mapping):
        recorded = dynamics if "updates" in dynamics else {"updates": dict(dynamics)}
    elif dynamics is None:
        recorded = load_training_dynamics(snapshots.root)
    else:
        raise TypeError(
            "dynamics must be None, a directory, a TrainingDynamicsCallback or its records(), "
            f"got {type(dynamics).__name__}"
        )
    if not recorded or not recorded.get("updates"):
        raise ValueError(
            f"no recorded updates for the run in {snapshots.root}: the exact metagradient needs "
            "what every update applied (training_dynamics.json written by a "
            "TrainingDynamicsCallback on the run's HookManager, or dynamics=callback)"
        )
    return {"layers": {}, "skipped_steps": [], **recorded}


def _check_single_process(world_size: int, what: str) -> None:
    """``ValueError`` for a data-parallel run: the replay recomputes each update from one
    process's batch, while a data-parallel update averaged every rank's gradients."""
    if world_size > 1:
        raise ValueError(
            f"the exact metagradient replays single-process runs; {what} is {world_size}. A "
            "data-parallel update averages the ranks' gradients, which the replay (one "
            "process's batches) does not reproduce. Record and score the run in one process."
        )


def _check_windows(run: RunDynamics, steps: list[int], output: list[int]) -> list[Window]:
    """The updates over ``steps`` if the replay can model them, else ``ValueError`` naming
    what is refused (or that no update holds an ``output`` step)."""
    windows = run.windows(steps)
    other = sorted(run.optimizers() - set(ADAM_TYPES))
    if other:
        raise ValueError(
            f"the exact metagradient replays torch.optim.Adam and AdamW; the recorded run used "
            f"{other}"
        )
    if not any(set(output) & set(w.steps) for w in windows):
        raise ValueError(
            f"none of the output steps {sorted(output)} belongs to a recorded optimizer "
            "update; nothing to score"
        )
    for window in windows:
        steps = [int(s) for s in window.update.get("steps", window.steps)]
        if list(window.steps) != steps:
            missing = sorted(set(steps) - set(window.steps))
            raise ValueError(
                f"the update ending at step {window.key} consumed steps {steps} but the "
                f"snapshots lack {missing}; record every micro-batch"
            )
        for group in window.update["groups"]:
            GroupValues.from_record(group)  # amsgrad / maximize refused here
    counts = {int(g["step"]) for g in windows[0].update["groups"]}
    if counts != {1}:
        raise ValueError(
            f"the first replayed update (ending at step {windows[0].key}) is the optimizer's "
            f"update {sorted(counts)}, not its first: the replay starts from m = v = 0, so "
            "the snapshots must start where the optimizer was created"
        )
    return windows


def _parameter_groups(
    recorded: Mapping[str, Any], model: nn.Module, windows: list[Window]
) -> dict[str, int]:
    """``{name: group}`` of the parameters the optimizer held.

    Raises:
        ValueError: a multi-group run recorded without ``parameter_groups``; a
            recorded name the model lacks.
    """
    groups = recorded.get("parameter_groups")
    named = dict(model.named_parameters())
    if groups:
        unknown = sorted(set(groups) - set(named))
        if unknown:
            raise ValueError(
                f"the recorded parameter groups name {unknown}, which "
                f"{type(model).__name__} does not have; score with the model that was trained"
            )
        return {str(name): int(group) for name, group in groups.items()}
    counts = {len(w.update["groups"]) for w in windows}
    if counts != {1}:
        raise ValueError(
            f"the recorded run has {max(counts)} parameter groups but no record of which "
            "parameter is in which (parameter_groups, written by TrainingDynamicsCallback since "
            "this version); record the run again, or train with a single parameter group"
        )
    return {name: 0 for name, p in named.items() if p.requires_grad}


def _replay_rtol(
    replay_rtol: float | None, snapshots: TrajectorySnapshots, window: Window
) -> float:
    """``replay_rtol``, or the default for the precision the run was recorded in."""
    if replay_rtol is not None:
        return float(replay_rtol)
    stored = snapshots.parameter_dict(window.steps[0]).values()
    recorded64 = all(t.dtype == torch.float64 for t in stored if t.is_floating_point())
    return 1e-6 if recorded64 else 1e-3


def _device_of(model: nn.Module) -> torch.device:
    """Where the passes run: the device of the model's first parameter (as a replay of its
    snapshots does), the CPU for a model without parameters."""
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def _compute_model(
    model: nn.Module, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, bool]:
    """``(model to replay on, whether batches are cast)``: the model itself when its floating
    parameters already have ``dtype``, else a copy cast to it."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes <= {dtype}:
        return model, False
    return copy.deepcopy(model).to(device=device, dtype=dtype), True

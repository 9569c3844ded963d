"""Attributor interface and the inner-product attributor base.

An inner-product attributor scores training sample ``i`` against test sample
``j`` as ``Σ_shared layers <T_train(g_i), T_test(g_j)>``; subclasses change the
transforms (``transform_train_rep`` / ``transform_test_rep``) or the inner
product. Gradients come from a :class:`~dattri_llm.gradient.streaming.GradientSource`:
live (``GradientStreamer``, :meth:`BaseInnerProductAttributor.attribute`) or a
gradient store (:meth:`BaseInnerProductAttributor.attribute_from_cache`).

This module holds the public entry points and the extension hooks a subclass
fills in; the work they delegate lives beside it: the sides' sources
(:mod:`.sources`), collection into stores (:mod:`.collection`), the scoring
engine and one scoring pass (:mod:`.scoring`, with the checks of
:mod:`.checks`), and the runs over the checkpoints (:mod:`.ensemble`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from tqdm.auto import tqdm

import dattri_llm.attribution.collection as collection
import dattri_llm.attribution.gather as gather
import dattri_llm.attribution.runs as runs
import dattri_llm.attribution.scoring as scoring
import dattri_llm.attribution.sources as sources
import dattri_llm.attribution.topk as topk
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.scoring import ATTRIBUTION_GRANULARITIES as ATTRIBUTION_GRANULARITIES
from dattri_llm.attribution.scoring import ScoreResult, check_granularity
from dattri_llm.attribution.sources import _check_dataset
from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback
from dattri_llm.gradient.ops.dot import layerwise_cross_dot, layerwise_cross_dot_per_token
from dattri_llm.task import AttributionTask, as_task
from dattri_llm.utils.distributed import NamedSums, all_reduce_named_sums, dist_world_size

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.gradient.stream.readers import DiskGradientSource
    from dattri_llm.gradient.stream.source import GradientSource
    from dattri_llm.gradient.stream.streamer import GradientStreamer
    from dattri_llm.utils.cache import TensorCache


class BaseAttributor(ABC):
    """Interface of every attributor (live ``attribute`` and ``attribute_from_cache``).

    ``polarity`` is the sign its scores call helpful, recorded on every
    :class:`AttributionScore` it builds: ``+1`` when a larger score means a
    more helpful training sample, ``-1`` when a more negative score does.
    """

    algorithm: ClassVar[str] = "Base"
    polarity: ClassVar[int] = 1

    @abstractmethod
    def __init__(
        self, args: AttributionArguments, *, task: AttributionTask | None = None, **kwargs: Any
    ) -> None:
        """Store the run settings and the (optional) task."""

    @abstractmethod
    def cache(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        cache_dir: str | None = None,
        hook_config: HookManagerConfig | None = None,
        **cache_kwargs: Any,
    ) -> list[tuple[str, str]]:
        """Collect gradients into stores; return ``[(train_dir, test_dir), ...]``."""

    @abstractmethod
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        **attribution_kwargs: Any,
    ) -> AttributionScore:
        """Score training samples against test samples by running the model."""

    @abstractmethod
    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        **attribution_kwargs: Any,
    ) -> AttributionScore:
        """Score from gradient stores (no model needed)."""


class BaseInnerProductAttributor(topk.TopKCalls, BaseAttributor):
    """Scores ``Σ_shared layers <T_train(g_i), T_test(g_j)>`` over gradient sources.

    Tied weights (e.g. a shared embedding and output head) are scored per use
    site: each hooked module contributes its own term and cross-site terms are
    dropped. ``top_k`` / ``top_k_from_cache`` (:class:`~.topk.TopKCalls`) rank
    each query's best training samples without the full matrix.

    Attributes:
        args: the run settings.
        task: the :class:`AttributionTask` (``None`` for cache-only use).
        scored_layers: layers that contributed to the last scoring pass.
    """

    algorithm: ClassVar[str] = "InnerProduct"

    def __init__(self, args: AttributionArguments, *, task: object | None = None) -> None:
        self.args = args
        self.task: AttributionTask | None = as_task(task) if task is not None else None
        self.scored_layers: list[str] = []
        self._hooked_layers: list[str] = []
        self._verbose = False
        self._score_sink: scoring.ScoreSink | None = None  # set by top_k for one call
        self._rows_sharded = False  # this attribute() call streams this rank's shard

    # ------------------------------------------------------------------ task delegation
    def require_task(self, method: str) -> AttributionTask:
        """Return the task, or raise ``ValueError`` naming ``method`` when there is none."""
        if self.task is None:
            raise ValueError(
                f"{type(self).__name__}.{method} runs the model and needs a task; construct "
                "the attributor with task=AttributionTask(loss_func, model)"
            )
        return self.task

    def num_checkpoints(self) -> int:
        """Number of task checkpoints."""
        return self.require_task("num_checkpoints").num_checkpoints()

    def load_checkpoint(self, index: int) -> nn.Module:
        """Load task checkpoint ``index`` and return the model."""
        return self.require_task("load_checkpoint").load_checkpoint(index)

    def checkpoints(self) -> list[int]:
        """Checkpoint indices ensembled by :meth:`attribute` (all)."""
        return list(range(self.num_checkpoints()))

    def _first_checkpoint_only(self) -> list[int]:
        """``[0]`` for single-checkpoint methods (``UserWarning`` if the task has more)."""
        if self.num_checkpoints() > 1:
            warnings.warn(
                f"{type(self).__name__} uses the first checkpoint only; the task has "
                f"{self.num_checkpoints()} and the others are ignored.",
                UserWarning,
                stacklevel=3,
            )
        return [0]

    def train_loss_fn(self) -> Callable[[nn.Module, object], torch.Tensor]:
        """Train-side objective (the task's ``loss_func``)."""
        return self.require_task("train_loss_fn").loss_func

    def test_loss_fn(self) -> Callable[[nn.Module, object], torch.Tensor]:
        """Test-side objective (the task's ``target_func``)."""
        return self.require_task("test_loss_fn").target_func

    # ------------------------------------------------------------------ sources
    def generate_train_rep(
        self,
        train_dataset: object,
        *,
        checkpoint_step: int = 0,
        enable_update: bool = False,
        hook_config: HookManagerConfig | None = None,
        snapshots: object | None = None,
        forward_model: nn.Module | None = None,
    ) -> GradientStreamer:
        """Live train-side source (batch ``per_device_train_batch_size``, train loss)."""
        return self._train_streamer(
            train_dataset,
            "generate_train_rep",
            checkpoint_step=checkpoint_step,
            enable_update=enable_update,
            config=hook_config,
            snapshots=snapshots,
            forward_model=forward_model,
        )

    def _train_streamer(
        self,
        train_dataset: object,
        method: str,
        *,
        forward_model: nn.Module | None = None,
        **streamer_options: Any,
    ) -> GradientStreamer:
        """A train-side ``GradientStreamer`` over the task model (``sources.train_streamer``)."""
        return sources.train_streamer(
            self, train_dataset, method, forward_model=forward_model, **streamer_options
        )

    def generate_test_rep(
        self,
        test_dataset: object,
        *,
        checkpoint_step: int = 0,
        hook_config: HookManagerConfig | None = None,
        hook_manager: HookManager | None = None,
        forward_model: nn.Module | None = None,
        shard: bool = True,
    ) -> GradientStreamer:
        """Live frozen test probe (batch ``per_device_eval_batch_size``, target function).

        Its ``role`` is ``"query"``: loss errors name the failing query batch.
        """
        return sources.query_streamer(
            self,
            test_dataset,
            checkpoint_step=checkpoint_step,
            hook_config=hook_config,
            hook_manager=hook_manager,
            forward_model=forward_model,
            shard=shard,
        )

    def load_train_rep(
        self,
        train_gradients: object,
        *,
        steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        desc: str | None = None,
    ) -> DiskGradientSource:
        """Train-side source over a store (directory, open store or ``DiskGradientSource``)."""
        return sources.disk_source(
            train_gradients,
            self.args,
            steps=steps,
            layer_name=layer_name,
            verbose=verbose,
            desc=desc,
        )

    def load_test_rep(
        self,
        test_gradients: object,
        *,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        desc: str | None = None,
    ) -> DiskGradientSource:
        """Test-side source over a store (directory, open store or ``DiskGradientSource``)."""
        return sources.disk_source(
            test_gradients, self.args, steps=None, layer_name=layer_name, verbose=verbose, desc=desc
        )

    # static: a directory, store or DiskGradientSource -> its store; two stores' identity keys
    resolve_store = staticmethod(sources.resolve_store)
    stores_meta = staticmethod(sources.stores_meta)

    # ------------------------------------------------------------------ collection
    def collect_gradients(
        self,
        streamer: GradientStreamer,
        store: GradientStorageManager,
        *,
        offload_interval: int = 1,
        on_block: Callable[[int, Gradient, list[str]], None] | None = None,
    ) -> GradientStorageManager:
        """Save every block of ``streamer`` into ``store`` (``attribution.utils``).

        The streamer's capture projection is declared to ``store`` first (a
        store declaring another projection raises ``ValueError``).
        """
        config = streamer.hook_manager.config
        store.declare_projection(config.projection_kwargs, config.projector)
        return collection.collect_gradients(
            streamer, store, offload_interval=offload_interval, on_block=on_block
        )

    def cache_representations(
        self,
        source: GradientSource,
        store: GradientStorageManager,
        *,
        transform: Callable[[Gradient], Gradient] | None = None,
        sample_id_key: str | int | None = None,
    ) -> GradientStorageManager:
        """Save ``transform(block).materialize()`` (CPU) of each block as one per-batch record.

        ``transform`` defaults to :meth:`transform_test_rep`; records keep the
        block's step and identifiers. A known projection of ``source`` is
        declared to ``store`` (the representations live in the same basis).
        """
        return collection.cache_representations(
            source, store, transform or self.transform_test_rep, sample_id_key
        )

    def dynamics_recorder(
        self, streamer: GradientStreamer, snapshots: object | None = None
    ) -> TrainingDynamicsCallback:
        """The callback recording what each update of a trajectory applied.

        A ``TrainingDynamicsCallback`` over the streamer's model and optimizer
        (windows, clip coefficients, loss scales, every parameter group's
        values), saved as ``training_dynamics.json`` beside the run.
        Subclasses may return a subclass of it (AdamW-influence records the
        moments too); ``snapshots`` is the run's snapshot store, if any.
        """
        return TrainingDynamicsCallback(
            streamer.model,
            lambda: streamer.optimizer,
            projection_kwargs=streamer.hook_manager.config.projection_kwargs,
            grad_scaler=lambda: streamer.grad_scaler,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
        )

    def attach_dynamics_recorder(
        self, streamer: GradientStreamer, snapshots: object | None = None
    ) -> TrainingDynamicsCallback:
        """The streamer manager's ``TrainingDynamicsCallback`` (one attached if it has none).

        The streamer yields rows divided by its loss scale, so the recorder
        notes that the rows carry none.
        """
        return collection.attach_dynamics_recorder(self, streamer, snapshots)

    def _forget_loaded_checkpoint(self, enable_update: bool) -> None:
        """After an updating pass the weights left the checkpoint: force the next load."""
        if enable_update and self.task is not None:
            self.task.current_checkpoint_idx = None

    # ------------------------------------------------------------------ extension hooks
    def prepare_scoring(self, train_source: GradientSource, test_source: GradientSource) -> None:
        """Called once per scoring pass before any transform (no-op)."""

    def transform_train_rep(self, block: Gradient) -> Gradient:
        """Train-side transform ``T_train`` (identity)."""
        return block

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """Test-side transform ``T_test`` (identity)."""
        return block

    def transform_train_step(self, step: int, block: Gradient) -> Gradient:
        """Per-step train-side transform (identity).

        Applied to each block of the train source, which holds one step, before
        re-batching and :meth:`transform_train_rep`; for transforms that depend
        on the step (e.g. LESS's learning-rate weights).
        """
        return block

    def inner_product(
        self, train_rep: Gradient, test_rep: Gradient, *, dense_cache: TensorCache | None = None
    ) -> torch.Tensor:
        """``(B_tr, B_te)`` layer-summed inner products (zeros when no layer is shared)."""
        if not set(train_rep.layer_names) & set(test_rep.layer_names):
            return torch.zeros(train_rep.batch_size, test_rep.batch_size)
        return layerwise_cross_dot(train_rep, test_rep, dense_cache=dense_cache)

    def inner_product_per_token(self, train_rep: Gradient, test_rep: Gradient) -> torch.Tensor:
        """``(B_tr, T, B_te)`` per-token-position contributions of the train side."""
        if not set(train_rep.layer_names) & set(test_rep.layer_names):
            tokens = max((t for t in train_rep.token_dim.values() if t is not None), default=1)
            return torch.zeros(train_rep.batch_size, tokens, test_rep.batch_size)
        return layerwise_cross_dot_per_token(train_rep, test_rep)

    def sum_over_shards(
        self, local: NamedSums, what: str, *, sharded_source: bool = True
    ) -> dict[str, tuple[list[torch.Tensor], int]]:
        """A fit's per-layer partial sums over the training rows, summed over the ranks' shards.

        ``local`` maps a layer to ``(tensors, rows)`` summed over the rows this
        process's training source yielded. Inside :meth:`attribute` under a
        process group that shards the training set (``WORLD_SIZE`` = the
        group's size > 1) each rank's source holds its own shard (live, or a
        ``"memory"`` / ``"tiered"`` store per rank), so the sums are
        all-reduced on the union of the ranks' layers (every rank takes part:
        ``utils.distributed.all_reduce_named_sums``; ``what`` names the sums in
        its errors). Otherwise (one process; a ``"disk"`` store every rank
        reads whole; :meth:`attribute_from_cache` and ``fit`` calls, which
        fit exactly the store they are given; ``sharded_source=False``: sums
        over a source every rank streams whole, e.g. the queries) ``local``
        comes back as it is, sorted by layer, with no collective, so one rank
        may call it alone.
        """
        if not (self._rows_sharded and sharded_source):
            return {name: (list(local[name][0]), int(local[name][1])) for name in sorted(local)}
        return all_reduce_named_sums(local, what)

    # ------------------------------------------------------------------ scoring
    def progress(self, iterable: Iterable[Any], *, total: int | None = None) -> Iterable[Any]:
        """Wrap ``iterable`` in a tqdm bar when the current call is verbose on rank 0."""
        return self._bar(iterable, total=total, desc=f"{self.algorithm} scoring", unit="block")

    def _bar(
        self, iterable: Iterable[Any], *, desc: str, unit: str, total: int | None = None
    ) -> Iterable[Any]:
        """``iterable`` in a tqdm bar when the current call is verbose on rank 0."""
        if not (self._verbose and self.args.should_log):
            return iterable
        return tqdm(iterable, total=total, desc=desc, unit=unit)

    def score_sources(
        self,
        train_source: GradientSource,
        test_source: GradientSource,
        *,
        loop_over_test: bool = False,
        transform_test: Callable[[Gradient], Gradient] | None = None,
        attribution_granularity: str = "instance",
    ) -> ScoreResult:
        """:meth:`prepare_scoring`, then ``attribution.utils.score_sources`` with this attributor.

        Scores on ``args.device`` with the attributor's transforms
        (``transform_test`` defaults to :meth:`transform_test_rep`), inner
        products and progress bar; train batches of
        ``args.per_device_train_batch_size`` rows. Around it, the attributor
        drops ``param_grad`` layers, checks layer compatibility, prepares the
        held test side and records :attr:`scored_layers`. Returns
        ``(scores, row_train_ids, row_steps, test_ids, row_token_ids)``.

        Raises:
            ValueError: unknown granularity; ``loop_over_test`` with a test
                source that is not reusable; an empty training or test set;
                incompatible or disjoint layers.
        """
        return scoring.score_pass(
            self,
            train_source,
            test_source,
            loop_over_test=loop_over_test,
            transform_test=transform_test,
            attribution_granularity=attribution_granularity,
            sink=getattr(self, "_score_sink", None),
        )

    def build_score(
        self,
        scores: torch.Tensor,
        row_train_ids: list[str],
        row_steps: list[int],
        test_ids: list[str],
        *,
        algorithm_meta: dict[str, Any] | None = None,
        layer_name: list[str] | None = None,
        row_token_ids: list[int] | None = None,
    ) -> AttributionScore:
        """Build the :class:`AttributionScore` and save it to ``args.output_dir`` (rank 0)."""
        score = AttributionScore(
            scores=scores,
            row_train_ids=row_train_ids,
            row_steps=row_steps,
            test_ids=test_ids,
            algorithm=self.algorithm,
            algorithm_meta=dict(algorithm_meta or {}),
            layer_name=layer_name,
            row_token_ids=row_token_ids,
            polarity=self.polarity,
        )
        if self.args.should_log and getattr(self, "_score_sink", None) is None:
            score.save(self.args.output_dir)
        return score

    # ------------------------------------------------------------------ entry points
    def cache(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        cache_dir: str | None = None,
        hook_config: HookManagerConfig | None = None,
        enable_update: bool = False,
        on_train_block: Callable[[int, Gradient, list[str]], None] | None = None,
    ) -> list[tuple[str, str]]:
        """Collect gradients per checkpoint into ``<cache_dir>/ckpt_<k>/{test,train}_grads``.

        Test gradients (every rank streams all queries) are collected before
        the train gradients. ``enable_update=True`` uses the first checkpoint
        only and records the train side as a trajectory, with the learning
        rate of each step written beside it (``lr_schedule.json``). A store
        directory that already holds records raises ``ValueError``.
        """
        _check_dataset(train_dataset, "training")
        _check_dataset(test_dataset, "test")
        root = Path(cache_dir if cache_dir is not None else self.args.output_dir).expanduser()
        indices = runs.ensemble_indices(self, enable_update)
        runs.check_single_fsdp_wrap(self, len(indices), collected=True)
        return collection.cache_checkpoints(
            self,
            indices,
            root,
            train_dataset,
            test_dataset,
            hook_config=hook_config,
            enable_update=enable_update,
            on_train_block=on_train_block,
        )

    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        enable_update: bool = False,
        gradient_cache_residency: str | None = None,
        attribution_granularity: str = "instance",
        **attribution_kwargs: Any,
    ) -> AttributionScore:
        """Run the model and score every training row against every test sample.

        ``gradient_cache_residency=None`` scores live per checkpoint (a train
        streamer and a test probe sharing its hooks); ``"memory"``,
        ``"tiered"`` or ``"disk"`` collect each side once into a store of that
        residency (``"disk"`` via :meth:`cache`) and score it with
        :meth:`attribute_from_cache`. Rows are stamped with the checkpoint
        index, or the optimizer step with ``enable_update=True``; checkpoint
        rows are concatenated (``agnostic_matrix()`` sums them).

        Under a process group with the training set sharded over the ranks
        (``WORLD_SIZE > 1``), every rank's rows are gathered in training-set
        order (:func:`~dattri_llm.attribution.gather.gather_results`): every
        rank returns the complete score, equal to the single-process one, and
        rank 0 saves it.
        """
        check_granularity(attribution_granularity)
        runs.check_residency(gradient_cache_residency, enable_update, loop_over_test)
        self.require_task("attribute")
        _check_dataset(train_dataset, "training")
        _check_dataset(test_dataset, "test")
        options = {
            "hook_config": hook_config,
            "verbose": verbose,
            "loop_over_test": loop_over_test,
            "enable_update": enable_update,
            "attribution_granularity": attribution_granularity,
        }
        # a "disk" store is read whole by every rank; live and per-rank stores hold a shard
        self._rows_sharded = (
            gradient_cache_residency != "disk"
            and self.args.world_size > 1
            and dist_world_size() == self.args.world_size
        )
        try:
            if gradient_cache_residency is None:
                results, layers = runs.score_live(self, train_dataset, test_dataset, **options)
            else:
                results, layers = runs.score_collected(
                    self,
                    train_dataset,
                    test_dataset,
                    gradient_cache_residency,
                    attribution_kwargs,
                    **options,
                )
        finally:
            self._rows_sharded = False
        results = gather.gather_results(
            results,
            num_samples=len(train_dataset),
            world_size=self.args.world_size,
            rank=self.args.process_index,
            unique=gradient_cache_residency is not None,
        )
        scores, row_ids, row_steps, test_ids, row_tokens = runs.concat_results(results)
        meta = {
            "n_checkpoints": len(results),
            "enable_update": enable_update,
            "query_at": runs.query_at(enable_update, loop_over_test),
            "attribution_granularity": attribution_granularity,
            **attribution_kwargs,
        }
        return self.build_score(
            scores,
            row_ids,
            row_steps,
            test_ids,
            algorithm_meta=meta,
            layer_name=layers,
            row_token_ids=row_tokens,
        )

    def attribute_from_cache(
        self,
        train_source: object,
        test_source: object,
        *,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        algorithm_meta: dict[str, Any] | None = None,
        attribution_granularity: str = "instance",
        **attribution_kwargs: Any,
    ) -> AttributionScore:
        """Score every train record against every test record of two stores (no model).

        Sources are directories, open stores (any residency) or
        ``DiskGradientSource`` objects. Rows follow store order and carry the
        stored step; ``selected_training_steps`` keeps only those steps;
        ``layer_name`` restricts the stored layers.
        """
        check_granularity(attribution_granularity)
        return runs.score_stores(
            self,
            train_source,
            test_source,
            selected_training_steps=selected_training_steps,
            layer_name=layer_name,
            verbose=verbose,
            loop_over_test=loop_over_test,
            algorithm_meta=algorithm_meta,
            attribution_granularity=attribution_granularity,
            attribution_kwargs=attribution_kwargs,
        )

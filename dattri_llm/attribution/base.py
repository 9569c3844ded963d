"""Attributor interface and the inner-product attributor base.

An inner-product attributor scores training sample ``i`` against test sample
``j`` as ``Σ_shared layers <T_train(g_i), T_test(g_j)>``; subclasses change the
transforms (``transform_train_rep`` / ``transform_test_rep``) or the inner
product. Gradients come from a :class:`~dattri_llm.gradient.streaming.GradientSource`:
live (``GradientStreamer``, :meth:`BaseInnerProductAttributor.attribute`) or a
gradient store (:meth:`BaseInnerProductAttributor.attribute_from_cache`).
"""

from __future__ import annotations

import tempfile
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution import utils as attribution_utils
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.gradient.callbacks.training_dynamics_callback import TrainingDynamicsCallback
from dattri_llm.gradient.datasets import check_dataset
from dattri_llm.gradient.streaming import GradientStreamer
from dattri_llm.task import AttributionTask, as_task

if TYPE_CHECKING:
    from torch import nn

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.gradient import Gradient
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.gradient.streaming import DiskGradientSource, GradientSource
    from dattri_llm.utils.cache import TensorCache

ATTRIBUTION_GRANULARITIES = attribution_utils.ATTRIBUTION_GRANULARITIES
check_granularity = attribution_utils.check_granularity

ScoreResult = attribution_utils.ScoreResult


def _check_dataset(dataset: object, side: str) -> None:
    """Check a ``train_dataset`` / ``test_dataset`` argument before any work starts.

    ``TypeError`` unless it is a kind `check_dataset` accepts (the streamer
    checks the same); ``ValueError`` for a dataset of length 0.
    """
    check_dataset(dataset, f"the {side} dataset")
    if len(dataset) == 0:
        raise ValueError(f"the {side} dataset is empty; pass at least one {side} sample")


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


class BaseInnerProductAttributor(BaseAttributor):
    """Scores ``Σ_shared layers <T_train(g_i), T_test(g_j)>`` over gradient sources.

    Tied weights (e.g. a shared embedding and output head) are scored per use
    site: each hooked module contributes its own term and cross-site terms are
    dropped.

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
        """A train-side ``GradientStreamer`` over the task model with the train loss.

        ``streamer_options`` go to the streamer (``enable_update``, ``config``,
        ``optimizer``, ``precondition``, ...); the forward model defaults to the
        task's wrapper and the batch size is ``per_device_train_batch_size``.
        """
        task = self.require_task(method)
        return GradientStreamer(
            task.model,
            train_dataset,
            self.args,
            batch_size=self.args.per_device_train_batch_size,
            loss_fn=self.train_loss_fn(),
            forward_model=forward_model if forward_model is not None else task.forward_model,
            **streamer_options,
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
        task = self.require_task("generate_test_rep")
        streamer = GradientStreamer(
            task.model,
            test_dataset,
            self.args,
            batch_size=self.args.per_device_eval_batch_size,
            loss_fn=self.test_loss_fn(),
            config=hook_config,
            checkpoint_step=checkpoint_step,
            hook_manager=hook_manager,
            forward_model=forward_model if forward_model is not None else task.forward_model,
            shard=shard,
        )
        streamer.role = "query"
        return streamer

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
        return self._disk_source(train_gradients, steps, layer_name, verbose, desc)

    def load_test_rep(
        self,
        test_gradients: object,
        *,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
        desc: str | None = None,
    ) -> DiskGradientSource:
        """Test-side source over a store (directory, open store or ``DiskGradientSource``)."""
        return self._disk_source(test_gradients, None, layer_name, verbose, desc)

    def _disk_source(
        self,
        source: object,
        steps: Iterable[int] | None,
        layer_name: str | list[str] | None,
        verbose: bool,
        desc: str | None,
    ) -> DiskGradientSource:
        from dattri_llm.gradient.streaming import DiskGradientSource

        if isinstance(source, DiskGradientSource):
            steps = source.steps if steps is None else steps
            layer_name = source.layer_name if layer_name is None else layer_name
        return DiskGradientSource(
            self.resolve_store(source),
            self.args,
            steps=steps,
            layer_name=layer_name,
            desc=desc,
            verbose=verbose,
        )

    @staticmethod
    def resolve_store(source: object) -> GradientStorageManager:
        """A directory → a new store on it; a store → itself; a ``DiskGradientSource`` → its store.

        A missing directory raises ``FileNotFoundError``; other types ``TypeError``.
        """
        from dattri_llm.gradient.storage_manager import GradientStorageManager
        from dattri_llm.gradient.streaming import DiskGradientSource

        if isinstance(source, GradientStorageManager):
            return source
        if isinstance(source, DiskGradientSource):
            return source.file_manager
        if isinstance(source, (str, Path)):
            path = Path(source).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(
                    f"gradient cache directory {str(path)!r} does not exist; write it with "
                    "OffloadCallback or attributor.cache(...) first"
                )
            return GradientStorageManager(str(path))
        raise TypeError(
            "expected a gradient store directory, a GradientStorageManager or a "
            f"DiskGradientSource, got {type(source).__name__}"
        )

    @staticmethod
    def stores_meta(
        train_store: GradientStorageManager, test_store: GradientStorageManager
    ) -> dict[str, dict[str, object]]:
        """``{"sample_id_key": {"train": k1, "test": k2}}`` of two stores."""
        return {
            "sample_id_key": {"train": train_store.sample_id_key, "test": test_store.sample_id_key}
        }

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
        return attribution_utils.collect_gradients(
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
        from dattri_llm.gradient.gradient import GradientRecord

        projection = attribution_utils.source_projection(source)
        if projection is not None:
            store.declare_projection(projection)
        transform = transform or self.transform_test_rep
        for step, block, ids in source:
            rep = transform(block).materialize().to(device="cpu")
            store.save_bulk([GradientRecord(step, list(ids), rep, sample_id_key)])
        return store

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

    def _train_steps_transformed(
        self, source: Iterable[tuple[int, Gradient, list[str]]]
    ) -> Iterator[tuple[int, Gradient, list[str]]]:
        """``source`` with :meth:`transform_train_step` applied to each block."""
        for step, block, ids in source:
            item = (step, self.transform_train_step(step, block), ids)
            del block
            yield item
            del item

    def inner_product(
        self, train_rep: Gradient, test_rep: Gradient, *, dense_cache: TensorCache | None = None
    ) -> torch.Tensor:
        """``(B_tr, B_te)`` layer-summed inner products (zeros when no layer is shared)."""
        from dattri_llm.gradient.ops.dot import layerwise_cross_dot

        if not set(train_rep.layer_names) & set(test_rep.layer_names):
            return torch.zeros(train_rep.batch_size, test_rep.batch_size)
        return layerwise_cross_dot(train_rep, test_rep, dense_cache=dense_cache)

    def inner_product_per_token(self, train_rep: Gradient, test_rep: Gradient) -> torch.Tensor:
        """``(B_tr, T, B_te)`` per-token-position contributions of the train side."""
        from dattri_llm.gradient.ops.dot import layerwise_cross_dot_per_token

        if not set(train_rep.layer_names) & set(test_rep.layer_names):
            tokens = max((t for t in train_rep.token_dim.values() if t is not None), default=1)
            return torch.zeros(train_rep.batch_size, tokens, test_rep.batch_size)
        return layerwise_cross_dot_per_token(train_rep, test_rep)

    # ------------------------------------------------------------------ scoring
    def progress(self, iterable: Iterable[Any], *, total: int | None = None) -> Iterable[Any]:
        """Wrap ``iterable`` in a tqdm bar when the current call is verbose on rank 0."""
        if not (self._verbose and self.args.should_log):
            return iterable
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=f"{self.algorithm} scoring", unit="block")

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
        check_granularity(attribution_granularity)
        if loop_over_test:
            attribution_utils._require_reusable(test_source)
        self.prepare_scoring(train_source, test_source)
        device = torch.device(self.args.device)
        checks = attribution_utils._ScoringChecks(
            train_source, test_source, device, hold_test=not loop_over_test
        )
        total = len(train_source) if hasattr(train_source, "__len__") else None
        result = attribution_utils.score_sources(
            self.progress(
                self._train_steps_transformed(checks.train_source(train_source)), total=total
            ),
            checks.test_source(test_source),
            device,
            inner_product=self.inner_product,
            transform_train=checks.transform_train(self.transform_train_rep),
            transform_test=checks.transform_test(transform_test or self.transform_test_rep),
            batch_size=self.args.per_device_train_batch_size,
            loop_over_test=loop_over_test,
            granularity=attribution_granularity,
            inner_product_per_token=self.inner_product_per_token,
        )
        self.scored_layers = checks.finish()
        return result

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
        if self.args.should_log:
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
        pairs = []
        for k in self._ensemble(enable_update):
            train_dir = root / f"ckpt_{k}" / "train_grads"
            test_dir = root / f"ckpt_{k}" / "test_grads"
            stores = [fresh_store(d) for d in (train_dir, test_dir)]
            self.load_checkpoint(k)
            self._collect_checkpoint(
                k,
                train_dataset,
                test_dataset,
                *stores,
                hook_config=hook_config,
                enable_update=enable_update,
                on_train_block=on_train_block,
            )
            pairs.append((str(train_dir), str(test_dir)))
        return pairs

    def _ensemble(self, enable_update: bool) -> list[int]:
        """Checkpoint indices to run; a trajectory uses the first one only (``UserWarning``)."""
        indices = self.checkpoints()
        if enable_update and len(indices) > 1:
            warnings.warn(
                f"enable_update=True trains from the first checkpoint only; checkpoints "
                f"{indices[1:]} are ignored",
                UserWarning,
                stacklevel=3,
            )
            return indices[:1]
        return indices

    def _collect_checkpoint(
        self,
        k: int,
        train_dataset: object,
        test_dataset: object,
        train_store: GradientStorageManager,
        test_store: GradientStorageManager,
        *,
        hook_config: HookManagerConfig | None,
        enable_update: bool,
        on_train_block: Callable[[int, Gradient, list[str]], None] | None = None,
    ) -> list[str]:
        """Collect test then train gradients at checkpoint ``k``; return the hooked layers."""
        test = self.generate_test_rep(
            test_dataset, checkpoint_step=k, hook_config=hook_config, shard=False
        )
        self.collect_gradients(test, test_store)
        train = self.generate_train_rep(
            train_dataset, checkpoint_step=k, enable_update=enable_update, hook_config=hook_config
        )
        layers = list(train.hook_manager.layer_names)
        self._hooked_layers = layers
        recorder = self.attach_dynamics_recorder(train) if enable_update else None
        try:
            self.collect_gradients(train, train_store, on_block=on_train_block)
        finally:
            self._forget_loaded_checkpoint(enable_update)
        if recorder is not None and self.args.should_log:
            attribution_utils.write_lr_schedule(train_store.save_dir, train.learning_rates)
            recorder.save(train_store.save_dir)
        return layers

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
        for callback in streamer.hook_manager.callbacks:
            if isinstance(callback, TrainingDynamicsCallback):
                return callback
        recorder = self.dynamics_recorder(streamer, snapshots)
        recorder.rows_unscaled = True
        streamer.hook_manager.add_callback(recorder)
        return recorder

    def _forget_loaded_checkpoint(self, enable_update: bool) -> None:
        """After an updating pass the weights left the checkpoint: force the next load."""
        if enable_update and self.task is not None:
            self.task.current_checkpoint_idx = None

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
        """
        from dattri_llm.utils.cache import CACHE_RESIDENCIES

        check_granularity(attribution_granularity)
        if gradient_cache_residency is not None and gradient_cache_residency not in (
            CACHE_RESIDENCIES
        ):
            raise ValueError(
                f"gradient_cache_residency must be one of {[None, *CACHE_RESIDENCIES]}, got "
                f"{gradient_cache_residency!r}"
            )
        if gradient_cache_residency is not None and enable_update and loop_over_test:
            raise ValueError(
                "enable_update with loop_over_test re-takes the queries at every θ_t, which needs "
                "live scoring; use gradient_cache_residency=None"
            )
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
        if gradient_cache_residency is None:
            results, layers = self._attribute_live(train_dataset, test_dataset, **options)
        else:
            results, layers = self._attribute_collected(
                train_dataset, test_dataset, gradient_cache_residency, attribution_kwargs, **options
            )
        scores, row_ids, row_steps, test_ids, row_tokens = _concat_results(results)
        meta = {
            "n_checkpoints": len(results),
            "enable_update": enable_update,
            "query_at": _query_at(enable_update, loop_over_test),
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

    def _attribute_live(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None,
        verbose: bool,
        loop_over_test: bool,
        enable_update: bool,
        attribution_granularity: str,
    ) -> tuple[list[ScoreResult], list[str]]:
        """Score each checkpoint live; return the per-checkpoint results and hooked layers."""
        results, layers = [], []
        self._verbose = verbose
        try:
            for k in self._ensemble(enable_update):
                self.load_checkpoint(k)
                train = self.generate_train_rep(
                    train_dataset,
                    checkpoint_step=k,
                    enable_update=enable_update,
                    hook_config=hook_config,
                )
                test = self.generate_test_rep(
                    test_dataset,
                    checkpoint_step=k,
                    hook_config=hook_config,
                    hook_manager=train.hook_manager,
                    forward_model=train.forward_model,
                    shard=False,
                )
                train.defer_update = enable_update and loop_over_test
                with train, test:
                    layers = list(train.hook_manager.layer_names)
                    results.append(
                        self.score_sources(
                            train,
                            test,
                            loop_over_test=loop_over_test,
                            attribution_granularity=attribution_granularity,
                        )
                    )
        finally:
            self._verbose = False
            self._forget_loaded_checkpoint(enable_update)
        return results, layers

    def _attribute_collected(
        self,
        train_dataset: object,
        test_dataset: object,
        residency: str,
        attribution_kwargs: dict[str, Any],
        *,
        hook_config: HookManagerConfig | None,
        verbose: bool,
        loop_over_test: bool,
        enable_update: bool,
        attribution_granularity: str,
    ) -> tuple[list[ScoreResult], list[str]]:
        """Collect each side into stores of ``residency``, then score them from the cache."""
        score_kwargs = {
            "verbose": verbose,
            "loop_over_test": loop_over_test,
            "attribution_granularity": attribution_granularity,
            **attribution_kwargs,
        }
        results: list[ScoreResult] = []
        layers: list[str] = []
        if residency == "disk":
            for train_dir, test_dir in self.cache(
                train_dataset, test_dataset, hook_config=hook_config, enable_update=enable_update
            ):
                score = self.attribute_from_cache(train_dir, test_dir, **score_kwargs)
                results.append(_score_result(score))
            return results, list(self._hooked_layers)
        from dattri_llm.gradient.storage_manager import GradientStorageManager

        for k in self._ensemble(enable_update):
            self.load_checkpoint(k)
            with tempfile.TemporaryDirectory(prefix="dattri_llm_cache_") as tmp:
                train_store = GradientStorageManager(f"{tmp}/train", residency=residency)
                test_store = GradientStorageManager(f"{tmp}/test", residency=residency)
                with train_store, test_store:
                    layers = self._collect_checkpoint(
                        k,
                        train_dataset,
                        test_dataset,
                        train_store,
                        test_store,
                        hook_config=hook_config,
                        enable_update=enable_update,
                    )
                    score = self.attribute_from_cache(train_store, test_store, **score_kwargs)
                    results.append(_score_result(score))
        return results, layers

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
        layers = attribution_utils.normalize_layer_names(layer_name)
        steps = None if selected_training_steps is None else sorted(set(selected_training_steps))
        train_store = self.resolve_store(train_source)
        test_store = self.resolve_store(test_source)
        _require_records(train_store, "training")
        _require_records(test_store, "test")
        self._verbose = verbose
        try:
            train = self.load_train_rep(train_source, steps=steps, layer_name=layers)
            test = self.load_test_rep(test_source, layer_name=layers)
            scores, row_ids, row_steps, test_ids, row_tokens = self.score_sources(
                train,
                test,
                loop_over_test=loop_over_test,
                attribution_granularity=attribution_granularity,
            )
        finally:
            self._verbose = False
        meta = {
            "selected_training_steps": steps,
            **self.stores_meta(train_store, test_store),
            "attribution_granularity": attribution_granularity,
            **(algorithm_meta or {}),
            **attribution_kwargs,
        }
        return self.build_score(
            scores,
            row_ids,
            row_steps,
            test_ids,
            algorithm_meta=meta,
            layer_name=layers if layers is not None else list(self.scored_layers),
            row_token_ids=row_tokens,
        )


def fresh_store(path: str | Path) -> GradientStorageManager:
    """A disk store on ``path`` for a new collection; ``ValueError`` if it already holds records."""
    from dattri_llm.gradient.storage_manager import GradientStorageManager

    store = GradientStorageManager(str(path))
    if store.index:
        raise ValueError(
            f"gradient cache {store.save_dir} already holds records; remove it or choose "
            "another cache_dir"
        )
    return store


def _require_records(store: GradientStorageManager, side: str) -> None:
    """Raise ``ValueError`` when ``store`` holds no record."""
    if not store.index:
        raise ValueError(
            f"the {side} gradient store {str(store.save_dir)!r} holds no records; capture "
            f"{side} gradients into it first"
        )


def _query_at(enable_update: bool, loop_over_test: bool) -> str:
    """Parameters the queries are taken at: ``checkpoint``, ``theta_0`` or ``theta_t``."""
    if not enable_update:
        return "checkpoint"
    return "theta_t" if loop_over_test else "theta_0"


def _score_result(score: AttributionScore) -> ScoreResult:
    """The raw tuple of a built score."""
    return (
        score.scores,
        score.row_train_ids,
        score.row_steps,
        score.test_ids,
        score.row_token_ids,
    )


def _concat_results(results: list[ScoreResult]) -> ScoreResult:
    """Concatenate per-checkpoint rows, aligning test columns to the first result's order."""
    first_ids = results[0][3]
    matrices, row_ids, row_steps = [], [], []
    row_tokens: list[int] | None = [] if results[0][4] is not None else None
    for scores, ids, steps, test_ids, tokens in results:
        if set(test_ids) != set(first_ids):
            raise ValueError("checkpoints produced different test samples; cannot ensemble them")
        position = {h: i for i, h in enumerate(test_ids)}
        matrices.append(scores[:, [position[h] for h in first_ids]])
        row_ids.extend(ids)
        row_steps.extend(steps)
        if row_tokens is not None:
            row_tokens.extend(tokens or [])
    return torch.cat(matrices, dim=0), row_ids, row_steps, list(first_ids), row_tokens

"""SOURCE: attribution by approximate unrolling (Bae, Lin, Lorraine, Grosse 2024).

The paper: "Training Data Attribution via Approximate Unrolled Differentiation".

The training run is cut into ``L`` segments, one per task checkpoint. Within
segment ``ℓ`` the curvature ``H_ℓ`` (K-FAC or EK-FAC, damped, fitted at the
segment's checkpoint ``θ_ℓ``) and each sample's gradient ``g_ℓ(z) = ∇L(z, θ_ℓ)``
are held fixed and the segment's steps sum to the learning rate
``η̄_ℓ``. Unrolling gradient descent in closed form gives, per segment,

* ``S_ℓ = exp(−η̄_ℓ H_ℓ)``: how the segment carries an earlier perturbation on;
* ``r_ℓ = (I − exp(−η̄_ℓ H_ℓ)) H_ℓ⁻¹``: its accumulated response to a constant
  gradient (``η̄_ℓ I`` as ``H → 0``, ``H_ℓ⁻¹`` as ``η̄_ℓ → ∞``);

and the score of training sample ``z`` on query ``q`` (gradient ``∇f_q(θ_T)``
at the last checkpoint)::

    score(z, q) = (1/N) Σ_ℓ ∇f_q(θ_T)ᵀ (S_L ⋯ S_{ℓ+1}) r_ℓ g_ℓ(z)

with one row per (sample, segment); the rows of a sample sum to its score.
``N`` is ``num_train`` (``None``: no division, the scale of the library's
K-FAC/EK-FAC influence). Polarity ``+1``: the score estimates how much the
query's loss would rise if ``z`` were left out, so larger means more helpful
(the paper's upweighting derivative, negated).

All operators are diagonal in the Kronecker eigenbasis of their segment and
block-diagonal over the hooked layers; they are applied to the query side,
latest segment first: ``v = q``; for ``ℓ = L..1``: rows ``vᵀ r_ℓ g_ℓ(z)``,
then ``v ← S_ℓ v`` (``docs/source.md``).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import dattri_llm.attribution.gather as gather
from dattri_llm.attribution.algorithm.kronecker import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.algorithm.kronecker.curvature import layer_error, token_summed_rows
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.runs import concat_results
from dattri_llm.attribution.sources import (
    _check_dataset,
    _require_records,
    normalize_layer_names,
    open_store_directory,
)
from dattri_llm.gradient.model.container import Gradient
from dattri_llm.gradient.ops.kronecker import (
    damping_for,
    eigenbasis_apply,
    kfac_eigenvalues,
    kfac_eigh,
    unrolled_propagator,
    unrolled_response,
)
from dattri_llm.gradient.ops.materialize import materialize
from dattri_llm.gradient.ops.types import is_kfac_eligible
from dattri_llm.utils.distributed import dist_world_size
from dattri_llm.utils.wrappers import is_fsdp

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.attribution.scoring import ScoreResult
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.stream.source import GradientSource, StreamBatch

SOURCE_CURVATURES = ("kfac", "ekfac")


@dataclass(frozen=True)
class SegmentCurvature:
    """One layer's damped curvature ``H = (U_G ⊗ U_A) diag(λ) (U_G ⊗ U_A)ᵀ`` of one segment.

    Attributes:
        u_a: ``(K, K)`` eigenvectors of the activation covariance ``A``.
        u_g: ``(D, D)`` eigenvectors of the output-gradient covariance ``G``.
        eigenvalues: ``(D·K,)`` damped eigenvalues in the eigen-coordinate layout
            (``ops.kronecker.ekfac_materialize``).
        layer_type: the layer's canonical type.
    """

    u_a: torch.Tensor
    u_g: torch.Tensor
    eigenvalues: torch.Tensor
    layer_type: str

    def apply(self, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``f(H)·rows`` for ``values = f(eigenvalues)``; rows ``(B, d)`` → ``(B, d)``."""
        device = rows.device
        return eigenbasis_apply(
            rows, self.u_a.to(device), self.u_g.to(device), values.to(device), self.layer_type
        )


def segment_rates(rates: object, num_segments: int | None = None) -> list[float]:
    """``segment_learning_rates`` as a list ``[η̄_0, …, η̄_{L−1}]`` (``ValueError`` if invalid).

    A sequence of floats, or a ``{checkpoint index: float}`` mapping covering
    ``0..L−1`` exactly; every rate finite and ``>= 0``; ``num_segments``
    (the task's checkpoints) must match when given.
    """
    if isinstance(rates, Mapping):
        keys = sorted(rates)
        if keys != list(range(len(keys))):
            raise ValueError(
                "segment_learning_rates as a mapping must have the checkpoint indices "
                f"0..L-1 as keys, got {keys}."
            )
        values = [rates[k] for k in keys]
    elif isinstance(rates, Sequence) and not isinstance(rates, (str, bytes)):
        values = list(rates)
    else:
        raise ValueError(
            "segment_learning_rates must be a sequence of floats (one per checkpoint) or a "
            f"{{checkpoint index: float}} mapping, got {type(rates).__name__}."
        )
    if not values:
        raise ValueError("segment_learning_rates is empty; give one rate per checkpoint.")
    out = []
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(
                f"segment_learning_rates[{index}] must be a float, got {type(value).__name__}."
            )
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"segment_learning_rates[{index}] = {value}: rates must be finite and >= 0 "
                "(the sum of the learning rates of the segment's optimizer steps)."
            )
        out.append(float(value))
    if not any(out):
        raise ValueError(
            "segment_learning_rates are all 0: no segment moves the parameters, so every score "
            "is 0; give each segment the sum of its steps' learning rates."
        )
    if num_segments is not None and len(out) != num_segments:
        raise ValueError(
            f"segment_learning_rates has {len(out)} rate(s) but there are {num_segments} "
            "segment(s) (one per task checkpoint / training store); give one η̄ per segment."
        )
    return out


class _HeldQueries:
    """The query blocks at ``θ_T``, held in memory as dense rows; re-iterable (a source)."""

    def __init__(self, blocks: list[StreamBatch]) -> None:
        self.blocks = blocks

    def __iter__(self) -> Iterator[StreamBatch]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def reusable(self) -> bool:
        """Always: the blocks are held."""
        return True

    def map(self, fn: Callable[[str, torch.Tensor, str], torch.Tensor | None]) -> None:
        """Replace every block by ``block.map_layers(fn)``."""
        self.blocks = [(step, block.map_layers(fn), ids) for step, block, ids in self.blocks]


class _CurvatureLayers:
    """A training source restricted to the layers with a curvature (other attributes forwarded).

    Layers SOURCE cannot score (norms, embeddings) are dropped before the
    scoring pass sees them, as they are on the query side.
    """

    def __init__(self, source: GradientSource, names: set[str]) -> None:
        self.source = source
        self.names = names

    def __iter__(self) -> Iterator[StreamBatch]:
        for step, block, ids in self.source:
            yield step, block.map_layers(lambda n, v, _t: v if n in self.names else None), ids

    def __len__(self) -> int:
        return len(self.source)

    def __getattr__(self, name: str) -> Any:  # reusable, hook_manager, file_manager, ...
        return getattr(self.source, name)


def _dense_rows(name: str, value: Any, layer_type: str) -> torch.Tensor | None:
    """A K-FAC-eligible query layer as dense ``(B, d)`` rows; other layers dropped.

    Factorized layers are materialized, dense ``(B, T, d)`` ones summed over
    tokens. Only linear/conv/conv-transpose layers can have a Kronecker
    curvature, so the others (norms, embeddings, ``param_grad``) are never
    materialized.
    """
    if not is_kfac_eligible(layer_type):
        return None
    if isinstance(value, torch.Tensor):  # a copy: the held rows outlive the capture
        return (
            token_summed_rows(value) if value.dim() == 3 else value.reshape(len(value), -1).clone()
        )
    try:
        return materialize(value, layer_type)
    except ValueError as error:
        raise layer_error(name, error) from None


class SourceAttributor(BaseInnerProductAttributor):
    """SOURCE (approximate unrolling) over the task's checkpoints, one segment each.

    Args:
        args: run settings (device, batch sizes, output directory).
        task: the model, its loss/target functions and the checkpoints
            ``θ_0 … θ_{L−1}``, one per segment (``None`` for from-cache use).
            Queries are taken at the last checkpoint, ``θ_T``.
        segment_learning_rates: ``η̄_ℓ`` per checkpoint, the sum of the learning
            rates of the optimizer steps of segment ``ℓ``: a sequence of ``L``
            floats or a ``{checkpoint index: float}`` mapping; finite, ``>= 0``.
        curvature: ``"ekfac"`` (the paper's choice) or ``"kfac"``.
        damping: ``δ`` added to the curvature (``None`` = 0: ``r_ℓ`` stays
            bounded by ``η̄_ℓ`` without damping). K-FAC damps each factor,
            ``H = (A + δ_A I) ⊗ (G + δ_G I)``; EK-FAC its corrected eigenvalues,
            ``Λ + δ`` — the damped curvatures of ``KFACAttributor`` /
            ``EKFACAttributor``.
        relative_damping: ``δ_X = damping · mean eigenvalue of X`` (EK-FAC:
            ``damping · mean(Λ)``), as the Kronecker attributors.
        num_train: ``N`` of the ``1/N`` factor (``None``: no division).
        keep_fits: keep every segment's fit in :attr:`raw_fits` and
            :attr:`segment_curvatures` after the call (``False``: only the
            segment being scored is held, one K-FAC fit of memory).

    Raises:
        ValueError: rates invalid or not one per task checkpoint; an unknown
            ``curvature``; a negative or non-finite ``damping``; ``num_train`` < 1.
    """

    algorithm: ClassVar[str] = "SOURCE"
    polarity: ClassVar[int] = 1
    streaming_top_k: ClassVar[bool] = False  # rows come from L passes; rank the built score

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        segment_learning_rates: Sequence[float] | Mapping[int, float],
        curvature: str = "ekfac",
        damping: float | None = None,
        relative_damping: bool = False,
        num_train: int | None = None,
        keep_fits: bool = False,
    ) -> None:
        super().__init__(args, task=task)
        if curvature not in SOURCE_CURVATURES:
            raise ValueError(
                f"SourceAttributor curvature must be one of {SOURCE_CURVATURES}, got {curvature!r}."
            )
        damping = 0.0 if damping is None else damping
        if isinstance(damping, bool) or not math.isfinite(damping) or damping < 0:
            raise ValueError(f"damping must be None or a finite float >= 0, got {damping}.")
        if num_train is not None and (isinstance(num_train, bool) or int(num_train) < 1):
            raise ValueError(f"num_train must be None or an integer >= 1, got {num_train}.")
        count = self.task.num_checkpoints() if self.task is not None else None
        self.segment_learning_rates = segment_rates(segment_learning_rates, count)
        self.curvature = curvature
        self.damping = float(damping)
        self.relative_damping = bool(relative_damping)
        self.num_train = None if num_train is None else int(num_train)
        self.keep_fits = bool(keep_fits)
        fitter_cls = EKFACAttributor if curvature == "ekfac" else KFACAttributor
        self._fitter = fitter_cls(args)
        self._fitter.configure(damping=self.damping, relative_damping=self.relative_damping)
        self.raw_fits: list[dict[str, Any] | None] = []
        """Damping-free fits per segment (K-FAC ``(A, G)``, EK-FAC ``{U_A, U_G, lam}``);
        ``None`` for a segment with ``η̄ = 0`` or, without ``keep_fits``, once scored."""
        self.segment_curvatures: list[dict[str, SegmentCurvature] | None] = []
        """Damped curvature per segment and layer (:class:`SegmentCurvature`), as ``raw_fits``."""
        self._response: dict[str, tuple[SegmentCurvature, torch.Tensor]] = {}

    # ------------------------------------------------------------------ entry points
    def attribute(  # type: ignore[override]
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: HookManagerConfig | None = None,
        verbose: bool = False,
    ) -> AttributionScore:
        """Run the model at every checkpoint and score each training sample per segment.

        The queries are taken once at the last checkpoint and held (dense rows
        per K-FAC layer); then, latest checkpoint first, each checkpoint's
        training gradients are streamed for the curvature fit (one pass K-FAC,
        two EK-FAC) and the scoring pass. Rows carry the checkpoint index.

        Under a process group (``WORLD_SIZE`` = the group's size > 1, the model
        wrapped in DDP) each rank streams its unpadded shard of the training
        set and every query; each segment's fit sums its statistics over the
        ranks (the Kronecker accumulators' all-reduce), so every rank holds
        the same curvatures and propagated queries, and the rows of every
        segment are gathered in training-set order: every rank returns the
        single-process score and rank 0 saves it.

        Raises:
            ValueError: no task; empty datasets; ``WORLD_SIZE > 1`` without a
                process group of that size; ``args.fsdp`` or an FSDP-wrapped
                task under a process group (see :meth:`_check_distributed`).
        """
        task = self.require_task("attribute")
        _check_dataset(train_dataset, "training")
        _check_dataset(test_dataset, "test")
        self._check_distributed(task)
        last = task.num_checkpoints() - 1
        self.load_checkpoint(last)
        probe = self.generate_test_rep(
            test_dataset, checkpoint_step=last, hook_config=hook_config, shard=False
        )
        with probe:
            queries = [(s, b.map_layers(_dense_rows), ids) for s, b, ids in probe]
            self._hooked_layers = list(probe.hook_manager.layer_names)

        def segment(k: int) -> Any:
            self.load_checkpoint(k)
            return self.generate_train_rep(
                train_dataset, checkpoint_step=k, hook_config=hook_config
            )

        return self._run(
            segment, queries, task.num_checkpoints(), verbose, None, len(train_dataset)
        )

    def attribute_from_cache(  # type: ignore[override]
        self,
        train_source: Sequence[object],
        test_source: object,
        *,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
    ) -> AttributionScore:
        """Score from stores: one training store per checkpoint, the queries' store at ``θ_T``.

        ``train_source[ℓ]`` holds the training gradients at checkpoint ``ℓ``
        (directory, open store or ``DiskGradientSource``), ``test_source`` the
        query gradients at the last checkpoint. With ``pairs =
        attributor.cache(train, test)``: ``[t for t, _ in pairs]`` and
        ``pairs[-1][1]``. Rows carry the store's index ``ℓ``.

        Under a process group every rank must call it (each segment's fit
        all-reduces its sums and counts) and scores exactly the stores it is
        given, with nothing gathered: given the same whole stores, every rank's
        sums and counts both grow ``W``-fold, so the fits and the score equal
        the single-process ones.

        Raises:
            ValueError: ``train_source`` is not a sequence with one store per
                segment rate; a store without records.
        """
        if isinstance(train_source, (str, bytes)) or not isinstance(train_source, Sequence):
            raise ValueError(
                "SourceAttributor.attribute_from_cache needs a list of training stores, one per "
                f"checkpoint (segment), got {type(train_source).__name__}."
            )
        segment_rates(self.segment_learning_rates, len(train_source))
        layers = normalize_layer_names(layer_name)
        stores = [open_store_directory(s) for s in train_source]
        for store in stores:
            _require_records(self.resolve_store(store), "training")
        test_source = open_store_directory(test_source)
        _require_records(self.resolve_store(test_source), "test")
        test = self.load_test_rep(test_source, layer_name=layers)
        queries = [(s, b.map_layers(_dense_rows), ids) for s, b, ids in test]

        def segment(k: int) -> Any:
            return self.load_train_rep(stores[k], layer_name=layers)

        return self._run(segment, queries, len(stores), verbose, layers)

    # ------------------------------------------------------------------ the segments
    def _check_distributed(self, task: Any) -> None:
        """Refuse the live settings whose scores could not equal the single-process ones.

        Raised before any collective, on every rank alike: ``WORLD_SIZE > 1``
        without a process group of that size (the sampler would shard the
        training set but the fits could not be summed over the ranks, so each
        rank would fit its own shard); FSDP (``args.fsdp``, or a task given an
        FSDP wrapper) under a process group: the query probe and every
        checkpoint's training pass run through their own streamers, and FSDP
        shards a model in place once.
        """
        world = self.args.world_size
        if world <= 1:
            return
        if dist_world_size() != world:
            raise ValueError(
                f"SourceAttributor: WORLD_SIZE={world} shards the training set, but this process "
                f"is in a process group of {dist_world_size()}; each segment's K-FAC fit must "
                "sum over every rank's rows. Call torch.distributed.init_process_group on every "
                "rank before attribute(), or unset WORLD_SIZE to score in one process."
            )
        wrapper = task.forward_model
        if self.args.fsdp or (wrapper is not None and is_fsdp(wrapper)):
            what = f"args.fsdp={self.args.fsdp!r}" if self.args.fsdp else "an FSDP-wrapped task"
            raise ValueError(
                f"SourceAttributor does not support FSDP ({what}): it runs the queries and "
                "every checkpoint's training pass through separate streamers, and FSDP shards "
                "the model's parameters in place once. Use DDP (unset args.fsdp and give the "
                "task the plain model), or score stores with attribute_from_cache."
            )

    def _run(
        self,
        segment_source: Callable[[int], Any],
        queries: list[StreamBatch],
        num_segments: int,
        verbose: bool,
        layers: list[str] | None,
        num_samples: int | None = None,
    ) -> AttributionScore:
        """Fit and score every segment, latest first, propagating the queries; build the score.

        ``num_samples`` (live): the training set's size; each segment's rows
        are gathered over the ranks' shards in training-set order
        (:func:`~dattri_llm.attribution.gather.gather_results`, a no-op in one
        process).
        """
        if not queries:
            raise ValueError("SourceAttributor: the test set gave no query gradients.")
        rates = segment_rates(self.segment_learning_rates, num_segments)
        held = _HeldQueries(queries)
        self.raw_fits = [None] * num_segments
        self.segment_curvatures = [None] * num_segments
        results: list[ScoreResult] = []
        fitted = [k for k in range(num_segments) if rates[k] > 0]  # η̄ = 0: r = 0, S = I
        self._verbose = verbose
        try:
            for k in self._bar(fitted[::-1], desc="SOURCE segments", unit="segment"):
                source = segment_source(k)
                ends = {"latest": k == fitted[-1], "earliest": k == fitted[0]}
                results.append(self._segment(k, source, held, rates[k], **ends))
        finally:
            self._verbose = False
            self._response = {}
        results = results[::-1]  # checkpoint order
        if num_samples is not None:
            results = gather.gather_results(
                results,
                num_samples=num_samples,
                world_size=self.args.world_size,
                rank=self.args.process_index,
            )
        scores, row_ids, row_steps, test_ids, _ = concat_results(results)
        meta = {
            "n_checkpoints": num_segments,
            "segment_learning_rates": rates,
            "curvature": self.curvature,
            "damping": self.damping,
            "relative_damping": self.relative_damping,
            "num_train": self.num_train,
            "query_at": "last_checkpoint",
            "attribution_granularity": "instance",
        }
        return self.build_score(
            scores,
            row_ids,
            row_steps,
            test_ids,
            algorithm_meta=meta,
            layer_name=layers if layers is not None else list(self.scored_layers),
        )

    def _segment(
        self,
        k: int,
        source: GradientSource,
        held: _HeldQueries,
        rate: float,
        *,
        latest: bool,
        earliest: bool,
    ) -> ScoreResult:
        """Segment ``k``: fit ``H_k``, rows ``(r_k v)·g_k(z)`` (``/N``), then ``v ← S_k v``.

        ``latest``: the first segment scored, whose fit decides the query layers
        kept; ``earliest``: the last one, after which ``v`` is not propagated.
        """
        context = source if hasattr(source, "__enter__") else contextlib.nullcontext()
        with context:
            curv = self._fit_segment(k, source)
            if latest:
                held.map(lambda n, v, _t: v if n in curv else None)
            self._check_layers(k, curv, held)
            self._response = {
                n: (c, unrolled_response(c.eigenvalues, rate)) for n, c in curv.items()
            }
            selected = _CurvatureLayers(source, set(curv))
            scores, ids, _steps, test_ids, _tokens = self.score_sources(selected, held)
        self._response = {}
        if not earliest:
            propagators = {n: unrolled_propagator(c.eigenvalues, rate) for n, c in curv.items()}
            held.map(lambda n, v, _t: curv[n].apply(v, propagators[n]))
        if not self.keep_fits:
            self.raw_fits[k] = self.segment_curvatures[k] = None
        scaled = scores if self.num_train is None else scores / self.num_train
        return scaled, ids, [k] * len(ids), test_ids, None

    def _check_layers(
        self, k: int, curv: Mapping[str, SegmentCurvature], held: _HeldQueries
    ) -> None:
        """Every held query layer must have a curvature at segment ``k`` (``ValueError``)."""
        names = set().union(*(block.layer_names for _s, block, _i in held))
        missing = sorted(names - set(curv))
        if missing:
            raise ValueError(
                f"SourceAttributor: layers {missing} have a K-FAC curvature at the latest "
                f"segment but none at checkpoint {k}; capture the same layers at every "
                "checkpoint."
            )
        if not names:
            raise ValueError(
                "SourceAttributor: no query layer has a K-FAC curvature (K-FAC needs "
                "linear/conv layers captured factorized or with covariances)."
            )

    def _fit_segment(self, k: int, source: GradientSource) -> dict[str, SegmentCurvature]:
        """Fit the segment's curvature (damping-free, kept in ``raw_fits``) and damp it."""
        fitter = self._fitter
        fitter._fitted_layer_types = {}
        raw, fisher = fitter.fit_raw(source)
        if fisher:
            raise ValueError(
                f"SourceAttributor: layers {sorted(fisher)} have no Kronecker factors (stored "
                "dense without covariances); SOURCE needs K-FAC factors for every scored layer: "
                "capture them factorized or select the K-FAC layers (layer_name)."
            )
        types = dict(fitter._fitted_layer_types)
        self.raw_fits[k] = raw
        curv = {name: self._damped(name, value, types[name]) for name, value in raw.items()}
        self.segment_curvatures[k] = curv
        return curv

    def _damped(self, name: str, raw: Any, layer_type: str) -> SegmentCurvature:
        """The damped curvature of one layer in its eigenbasis."""
        if self.curvature == "ekfac":
            lam = raw["lam"]
            shift = self.damping * float(lam.mean()) if self.relative_damping else self.damping
            return SegmentCurvature(raw["U_A"], raw["U_G"], lam + shift, layer_type)
        a_cov, g_cov = raw
        s_a, u_a, s_g, u_g = kfac_eigh(a_cov, g_cov)
        d_a = damping_for(a_cov, self.damping, self.relative_damping)
        d_g = damping_for(g_cov, self.damping, self.relative_damping)
        return SegmentCurvature(
            u_a, u_g, kfac_eigenvalues(s_a + d_a, s_g + d_g, layer_type), layer_type
        )

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """``r_ℓ v`` of every held query layer for the segment being scored."""

        def respond(name: str, value: Any, _layer_type: str) -> torch.Tensor | None:
            entry = self._response.get(name)
            if entry is None:
                return None
            curvature, values = entry
            try:
                return curvature.apply(value, values)
            except ValueError as error:
                raise layer_error(name, error) from None

        return block.map_layers(respond)

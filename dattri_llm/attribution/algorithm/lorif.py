"""LoRIF: low-rank influence functions (rank-``c`` gradient records, truncated-SVD curvature).

Per layer ``ℓ``, with ``G`` the ``N × D`` matrix of the training rows (each
sample's per-sample gradient of the layer, projected as captured and stored at
rank ``c``), a training row ``i`` scores against query ``j``

    ``g_iᵀ (GᵀG/N + λI)⁻¹ q_j``,

the inverse approximated from the top ``r`` right singular vectors ``V_r`` and
values ``σ`` of ``G`` by the Woodbury form
``V_r diag(1/(σ²/N + λ)) V_rᵀ + (I − V_r V_rᵀ)/λ`` (exact for ``r = D``). Scores
sum over layers. The query side is preconditioned once (dense ``(B, D)`` rows);
training rows are read as stored (low-rank records are materialized per batch).

The SVD is computed streaming from the training source, never holding ``G``:
accumulating ``GᵀG`` (one pass, ``D²`` memory) when that is cheaper than
randomized range finding (``2 + POWER_ITERATIONS`` passes, ``D·(r + OVERSAMPLE)``
memory), i.e. when ``D <= 2·(2 + POWER_ITERATIONS)·(r + OVERSAMPLE)``, and
always for ``svd_rank=None`` (full rank). When ``attribute`` shards the
training set over ranks, the sums (rows, ``‖G‖²``, ``GᵀG``, each pass's
``GᵀG·Q``) are summed over the ranks before they are used (``sum_over_shards``;
``Ω`` is seeded by ``args.seed``, the same on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dattri_llm.attribution.algorithm.kronecker.persistence import (
    fit_path,
    fit_settings,
    read_fit,
    write_fit,
)
from dattri_llm.attribution.base import BaseInnerProductAttributor
from dattri_llm.attribution.blocks import layer_rows, per_sample_layers
from dattri_llm.gradient.model.lowrank import check_low_rank, is_low_rank, low_rank_gradient
from dattri_llm.utils.keywords import keywords

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.gradient.model.container import Gradient
    from dattri_llm.gradient.storage_manager import GradientStorageManager
    from dattri_llm.gradient.stream.source import GradientSource
    from dattri_llm.gradient.stream.streamer import GradientStreamer

__all__ = ["FIT_FILE", "LoRIFAttributor", "LoRIFLayerFit"]

FIT_FILE = "lorif_fit.pt"
DEFAULT_RELATIVE_DAMPING = 0.1
OVERSAMPLE = 10
POWER_ITERATIONS = 2


@dataclass(frozen=True)
class LoRIFLayerFit:
    """Damping-free truncated SVD of one layer's ``N × D`` training matrix ``G``.

    Attributes:
        basis: ``V_r`` ``(D, r)``, orthonormal columns (top right singular vectors).
        eigenvalues: ``σ²/N`` ``(r,)``, descending.
        mean_eigenvalue: ``‖G‖_F² / (N·D)``, the mean of ``σ²/N`` over all ``D``
            values (zeros included): the default damping is 0.1 × this.
        rows: ``N``.
    """

    basis: torch.Tensor
    eigenvalues: torch.Tensor
    mean_eigenvalue: float
    rows: int

    @property
    def width(self) -> int:
        """``D``: the layer's (projected) per-sample gradient size."""
        return self.basis.shape[0]

    def truncated(self, rank: int) -> LoRIFLayerFit:
        """The top ``rank`` components (``rank`` at most the fitted ``r``)."""
        return LoRIFLayerFit(
            self.basis[:, :rank], self.eigenvalues[:rank], self.mean_eigenvalue, self.rows
        )

    def as_dict(self) -> dict[str, Any]:
        """Tensors and plain numbers (loadable with ``weights_only=True``)."""
        return {
            "basis": self.basis.cpu(),
            "eigenvalues": self.eigenvalues.cpu(),
            "mean_eigenvalue": float(self.mean_eigenvalue),
            "rows": int(self.rows),
        }


def _check_svd_rank(svd_rank: object) -> int | None:
    """``None`` or an ``int >= 0`` (``svd_rank=0`` drops the curvature: scores are ``<g, q>/λ``)."""
    if svd_rank is None:
        return None
    if isinstance(svd_rank, bool) or not isinstance(svd_rank, int) or svd_rank < 0:
        raise ValueError(
            f"LoRIFAttributor: svd_rank must be an int >= 0 or None (full rank), got {svd_rank!r}."
        )
    return svd_rank


def _check_damping(damping: object) -> float | None:
    """``None`` (relative default) or a finite float ``> 0``."""
    if damping is None:
        return None
    if isinstance(damping, bool) or not isinstance(damping, (int, float)):
        raise TypeError(f"LoRIFAttributor: damping must be a float > 0 or None, got {damping!r}.")
    if not math.isfinite(damping) or damping <= 0:
        raise ValueError(
            f"LoRIFAttributor: damping must be finite and > 0 (the complement of the kept "
            f"subspace is scaled by 1/λ), got {damping!r}; None uses 0.1 × mean(σ²/N)."
        )
    return float(damping)


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis ``(D, l)`` of the column span of ``matrix``."""
    return torch.linalg.qr(matrix, mode="reduced").Q


class _LayerSweep:
    """Streaming accumulators of one layer: rows, ``‖G‖_F²`` per column, and ``GᵀG`` or ``GᵀG·Q``.

    ``GᵀG`` is accumulated (in the first pass) only for a layer fitted from
    it (``use_gram``); a randomized layer accumulates ``GᵀG·Q`` in the later
    passes, for the ``probe`` ``Q`` of the pass.
    """

    def __init__(
        self, width: int, dtype: torch.dtype, device: torch.device, *, use_gram: bool
    ) -> None:
        self.width = width
        self.dtype = dtype  # dtype of the stored fit (the gradients')
        self.device = device
        self.rows = 0
        self.column_sq = torch.zeros(width, dtype=torch.float64, device=device)  # Σ_i g_i²
        self.gram = (
            torch.zeros(width, width, dtype=torch.float64, device=device) if use_gram else None
        )
        self.probe: torch.Tensor | None = None  # Q (D, l) of the current randomized pass
        self.product: torch.Tensor | None = None  # Σ Mᵀ(M Q) (D, l)

    @property
    def sum_sq(self) -> float:
        """``‖G‖_F²``."""
        return float(self.column_sq.sum())

    def set_probe(self, probe: torch.Tensor) -> None:
        """Start a randomized pass with ``probe`` ``Q`` ``(D, l)`` (``product`` reset to 0)."""
        self.probe = probe
        self.product = torch.zeros_like(probe)

    def add(self, rows: torch.Tensor, first_pass: bool) -> None:
        """Accumulate one block's ``(B, D)`` rows (in float64)."""
        m = rows.to(torch.float64)
        if first_pass:
            self.rows += m.shape[0]
            self.column_sq += m.square().sum(0)
            if self.gram is not None:
                self.gram += m.T @ m
            return
        self.product += m.T @ (m @ self.probe)

    def first_pass_sums(self) -> tuple[list[torch.Tensor], int]:
        """``([Σ g², GᵀG (gram layers only), dtype marker], rows)``, for the sum over ranks.

        The marker is a zero of the fit's dtype: the ranks' sums promote it, so a
        rank that never saw the layer learns the dtype the others store.
        """
        marker = torch.zeros(1, dtype=self.dtype, device=self.device)
        grams = [] if self.gram is None else [self.gram]
        return [self.column_sq, *grams, marker], self.rows

    @classmethod
    def from_sums(cls, sums: list[torch.Tensor], rows: int) -> _LayerSweep:
        """A sweep holding first-pass sums (the layout of :meth:`first_pass_sums`)."""
        column_sq, *grams, marker = sums
        sweep = cls(column_sq.shape[0], marker.dtype, column_sq.device, use_gram=False)
        sweep.column_sq, sweep.gram, sweep.rows = column_sq, (grams or [None])[0], rows
        return sweep


def _check_rank_fits(name: str, svd_rank: int | None, width: int) -> int:
    """The kept rank ``r`` for a layer of width ``D`` (``ValueError`` when ``svd_rank > D``)."""
    if svd_rank is None:
        return width
    if svd_rank > width:
        raise ValueError(
            f"LoRIFAttributor: svd_rank={svd_rank} exceeds layer {name!r}'s projected gradient "
            f"size D={width}; pass svd_rank <= {width} (or None for full rank)."
        )
    return svd_rank


def _uses_gram(width: int, rank: int, full: bool) -> bool:
    """Whether ``GᵀG`` accumulation is cheaper than randomized range finding for ``D``, ``r``."""
    sketch = rank + OVERSAMPLE
    return full or sketch >= width or width <= 2 * (2 + POWER_ITERATIONS) * sketch


def _top_eigen(symmetric: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``rank`` eigenpairs ``(values (r,), vectors (n, r))``, descending, values ≥ 0."""
    values, vectors = torch.linalg.eigh(symmetric)
    order = torch.argsort(values, descending=True)[:rank]
    return values[order].clamp_min(0), vectors[:, order]


class LoRIFAttributor(BaseInnerProductAttributor):
    """LoRIF (``algorithm="LoRIF"``): rank-``c`` training records, rank-``r`` SVD curvature.

    Args:
        args: the run settings.
        task: the :class:`AttributionTask` (``None`` for cache-only use).
        rank: ``c``, singular triplets kept per training sample and layer
            (``None``: full rank, i.e. LoGRA-style projected influence). Training
            gradients are compressed to ``c`` as they are read (or stored at ``c``
            by :meth:`cache`); a store recorded at another ``c`` → ``ValueError``.
        svd_rank: ``r``, singular directions of ``G`` kept per layer (``None``:
            all ``D``; ``0``: no curvature, ``<g, q>/λ``).
        damping: ``λ``; ``None`` = 0.1 × the layer's mean ``σ²/N`` over all ``D``
            singular values (``‖G‖_F²/(N·D)``).

    Raises:
        ValueError: ``rank < 1``; ``svd_rank < 0``; ``damping <= 0``.
    """

    algorithm: ClassVar[str] = "LoRIF"

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object | None = None,
        rank: int | None = 1,
        svd_rank: int | None = None,
        damping: float | None = None,
    ) -> None:
        super().__init__(args, task=task)
        self.rank = check_low_rank(rank, "LoRIFAttributor: rank")
        self.svd_rank = _check_svd_rank(svd_rank)
        self.damping = _check_damping(damping)
        self.layer_fits: dict[str, LoRIFLayerFit] | None = None
        self._loaded_fits: dict[str, LoRIFLayerFit] | None = None
        self._fit_settings: dict[str, Any] = {}

    # ------------------------------------------------------------------ fit
    def fit_meta(self) -> dict[str, Any]:
        """Settings a persisted fit must match (damping is applied at scoring)."""
        return {"rank": self.rank, **self._fit_settings}

    def fit_source(
        self, train_source: GradientSource, *, sharded_source: bool = True
    ) -> dict[str, LoRIFLayerFit]:
        """Streaming truncated SVD ``{layer: LoRIFLayerFit}`` of a train source's rows.

        Rows are the train blocks after :meth:`transform_train_rep` (rank ``c``).
        One pass for ``GᵀG`` layers; randomized layers need a reusable source.
        Inside a sharded :meth:`attribute` every rank must call it: the sums
        are summed over the ranks (:meth:`sum_over_shards`), so each rank fits
        every rank's rows; otherwise, or with ``sharded_source=False`` (a
        source every rank streams whole, such as the queries), it issues no
        collective.
        """
        sweeps: dict[str, _LayerSweep] = {}
        self._sweep(train_source, sweeps, first_pass=True)
        sweeps = {
            name: _LayerSweep.from_sums(sums, rows)
            for name, (sums, rows) in self.sum_over_shards(
                {name: sweep.first_pass_sums() for name, sweep in sweeps.items()},
                "LoRIF fit sums",
                sharded_source=sharded_source,
            ).items()
        }
        if not sweeps:
            raise ValueError("LoRIFAttributor: the training source yielded no per-sample layer.")
        ranks = {name: _check_rank_fits(name, self.svd_rank, s.width) for name, s in sweeps.items()}
        randomized = {name: sweep for name, sweep in sweeps.items() if sweep.gram is None}
        if randomized:
            self._range_find(train_source, randomized, ranks, sharded_source)
        return {name: self._finish(name, sweep, ranks[name]) for name, sweep in sweeps.items()}

    def _sweep(
        self, train_source: GradientSource, sweeps: dict[str, _LayerSweep], *, first_pass: bool
    ) -> None:
        """One pass over ``train_source`` feeding every layer's accumulator."""
        for _step, block, _ids in train_source:
            layers = per_sample_layers(block)
            if not layers:
                continue
            block = self.fit_rows(block.select_layers(layers))
            for name in layers:
                rows = layer_rows(block, name)
                sweep = sweeps.get(name)
                if sweep is None:
                    if not first_pass:
                        continue
                    sweep = sweeps[name] = self._new_sweep(name, rows)
                if rows.shape[1] != sweep.width:
                    raise ValueError(
                        f"LoRIFAttributor: layer {name!r} has {rows.shape[1]} gradient entries "
                        f"per sample in one block and {sweep.width} in another; score one "
                        "projection per store."
                    )
                sweep.add(rows, first_pass)
            del block

    def _new_sweep(self, name: str, rows: torch.Tensor) -> _LayerSweep:
        """The accumulators of a layer first seen with ``(B, D)`` ``rows``."""
        width = rows.shape[1]
        rank = _check_rank_fits(name, self.svd_rank, width)
        dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
        use_gram = _uses_gram(width, rank, self.svd_rank is None)
        return _LayerSweep(width, dtype, rows.device, use_gram=use_gram)

    def _range_find(
        self,
        train_source: GradientSource,
        sweeps: dict[str, _LayerSweep],
        ranks: Mapping[str, int],
        sharded_source: bool,
    ) -> None:
        """Randomized range finding for ``sweeps`` (``2 + POWER_ITERATIONS`` passes).

        Leaves ``probe`` = an orthonormal basis ``Q`` of the approximate top
        subspace and ``product`` = ``GᵀG·Q`` (for the Rayleigh–Ritz step).
        """
        if not getattr(train_source, "reusable", False):
            raise ValueError(
                f"LoRIFAttributor: layers {sorted(sweeps)} need randomized range finding "
                "(several passes over the training gradients), but the train source "
                f"{type(train_source).__name__} is not reusable; use a store or a frozen probe, "
                "or svd_rank=None."
            )
        generator = torch.Generator().manual_seed(int(getattr(self.args, "seed", 0)))
        for name in sorted(sweeps):
            sweep = sweeps[name]
            sketch = min(sweep.width, ranks[name] + OVERSAMPLE)
            omega = torch.randn(sweep.width, sketch, generator=generator, dtype=torch.float64)
            sweep.set_probe(omega.to(sweep.device))  # the same Ω on every rank (seeded)
        for _ in range(POWER_ITERATIONS + 1):
            self._product_pass(train_source, sweeps, sharded_source)
            for sweep in sweeps.values():
                sweep.set_probe(_orthonormal(sweep.product))
        self._product_pass(train_source, sweeps, sharded_source)

    def _product_pass(
        self, train_source: GradientSource, sweeps: dict[str, _LayerSweep], sharded_source: bool
    ) -> None:
        """One pass accumulating ``GᵀG·Q`` per layer, summed over the ranks' shards."""
        self._sweep(train_source, sweeps, first_pass=False)
        local = {name: ([sweep.product], 0) for name, sweep in sweeps.items()}
        for name, ([product], _) in self.sum_over_shards(
            local, "LoRIF range-finder products", sharded_source=sharded_source
        ).items():
            sweeps[name].product = product

    @staticmethod
    def _finish(name: str, sweep: _LayerSweep, rank: int) -> LoRIFLayerFit:
        """The layer's fit from its accumulators (eigenpairs of ``GᵀG``, or Rayleigh–Ritz)."""
        if sweep.probe is None:
            values, basis = _top_eigen(sweep.gram, rank)
        else:
            ritz = sweep.probe.T @ sweep.product
            values, vectors = _top_eigen((ritz + ritz.T) / 2, rank)
            basis = sweep.probe @ vectors
        mean = sweep.sum_sq / (sweep.rows * sweep.width)
        if not mean > 0:
            raise ValueError(
                f"LoRIFAttributor: layer {name!r} has all-zero training gradients "
                f"({sweep.rows} rows); its curvature is undefined. Exclude it with layer_name."
            )
        return LoRIFLayerFit(
            basis.to(sweep.dtype), (values / sweep.rows).to(sweep.dtype), mean, sweep.rows
        )

    def _resolved_svd_rank(self, name: str, fit: LoRIFLayerFit) -> LoRIFLayerFit:
        """``fit`` truncated to this attributor's ``svd_rank`` (a smaller stored fit → error)."""
        wanted = _check_rank_fits(name, self.svd_rank, fit.width)
        if wanted > fit.basis.shape[1]:
            raise ValueError(
                f"LoRIFAttributor: the loaded fit of layer {name!r} keeps {fit.basis.shape[1]} "
                f"singular directions, fewer than svd_rank={self.svd_rank}; refit with fit(...)."
            )
        return fit.truncated(wanted)

    def default_fit_dir(self) -> Path:
        """``<output_dir>/lorif_fit``."""
        return Path(self.args.output_dir).expanduser() / "lorif_fit"

    def save_fit(self, fits: Mapping[str, LoRIFLayerFit], fit_dir: str | Path | None) -> Path:
        """Write a damping-free fit to ``<fit_dir>/lorif_fit.pt`` atomically; return the dir."""
        return write_fit(
            Path(fit_dir or self.default_fit_dir()).expanduser(),
            FIT_FILE,
            self.algorithm,
            self.fit_meta(),
            lambda: {
                "svd_rank": self.svd_rank,
                "layers": {name: fit.as_dict() for name, fit in fits.items()},
            },
            should_log=self.args.should_log,
        )

    def load_fit(self, fit_dir: str | Path) -> dict[str, LoRIFLayerFit]:
        """Load a fit written by :meth:`save_fit` (``weights_only=True``; settings must match).

        A fit with more singular directions than ``svd_rank`` is truncated; damping may differ.
        """
        path = fit_path(fit_dir, FIT_FILE)
        payload = read_fit(
            path,
            self.algorithm,
            self.fit_meta(),
            missing=f"no LoRIF fit at {str(path)!r}; run LoRIFAttributor.fit(...) first.",
            other="not a LoRIF fit; use another fit_dir",
            may_differ="svd_rank may be smaller, damping may differ",
        )
        fits = {name: LoRIFLayerFit(**entry) for name, entry in payload["layers"].items()}
        return {name: self._resolved_svd_rank(name, fit) for name, fit in fits.items()}

    def _start_call(self, layer_name: Any, steps: Iterable[int] | None) -> None:
        """Reset per-call state: the fit belongs to one call's selection."""
        self._fit_settings = fit_settings(layer_name, steps)
        self.layer_fits = None
        self._loaded_fits = None

    @keywords(aliases={"train_gradients_dir": "train_source"})
    def fit(
        self,
        train_source: object,
        fit_dir: str | None = None,
        *,
        selected_training_steps: Iterable[int] | None = None,
        layer_name: str | list[str] | None = None,
        verbose: bool = False,
    ) -> Path:
        """Fit the truncated SVD over a train store and persist it; return the directory.

        Default directory ``<output_dir>/lorif_fit``; the file is written
        atomically and re-read by ``attribute_from_cache(..., fit_dir=...)``.
        """
        self._start_call(layer_name, selected_training_steps)
        source = self.load_train_rep(
            train_source,
            steps=self._fit_settings["selected_training_steps"],
            layer_name=self._fit_settings["layer_name"],
            verbose=verbose,
        )
        self._check_store_rank(source)
        self.layer_fits = self.fit_source(source)
        return self.save_fit(self.layer_fits, fit_dir)

    # ------------------------------------------------------------------ transforms
    def _check_store_rank(self, source: object) -> None:
        """``ValueError`` when a train store records another ``c`` than ``rank``."""
        store = getattr(source, "file_manager", None)
        stored = getattr(store, "low_rank", None)
        if stored is not None and self.rank is not None and stored != self.rank:
            raise ValueError(
                f"the train store {store.save_dir} holds low-rank records of rank c={stored}, but "
                f"LoRIFAttributor(rank={self.rank}) was asked for; stores of different c cannot "
                f"be mixed. Use rank={stored} (or None to use the records as stored), or "
                "re-capture."
            )

    def prepare_scoring(self, train_source: GradientSource, test_source: GradientSource) -> None:
        """Fit the curvature over the train source (unless a fit was loaded for this call)."""
        self._check_store_rank(train_source)
        if self._loaded_fits is not None:
            self.layer_fits = self._loaded_fits
        else:
            self.layer_fits = self.fit_source(train_source)

    def fit_rows(self, block: Gradient) -> Gradient:
        """The rows the fit sweeps: :meth:`transform_train_rep` (a subclass may differ)."""
        return self.transform_train_rep(block)

    def transform_train_rep(self, block: Gradient) -> Gradient:
        """Matrix-form layers at rank ``c`` (identity for ``rank=None``)."""
        return block if self.rank is None else low_rank_gradient(block, self.rank)

    def layer_damping(self, fit: LoRIFLayerFit) -> float:
        """``λ`` of a layer: ``damping``, or 0.1 × its mean ``σ²/N``."""
        if self.damping is not None:
            return self.damping
        return DEFAULT_RELATIVE_DAMPING * fit.mean_eigenvalue

    def precondition(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """``(GᵀG/N + λI)⁻¹ q`` of ``(B, D)`` query rows, by the truncated Woodbury form."""
        fit = self.layer_fits[name]
        if rows.shape[1] != fit.width:
            raise ValueError(
                f"LoRIFAttributor: query layer {name!r} has {rows.shape[1]} entries per sample "
                f"but the fit has D={fit.width}; the fit belongs to another projection — refit."
            )
        damping = self.layer_damping(fit)
        basis = fit.basis.to(device=rows.device)
        q = rows.to(basis.dtype)
        weights = 1.0 / (fit.eigenvalues.to(basis) + damping) - 1.0 / damping
        return q / damping + ((q @ basis) * weights) @ basis.T

    def transform_test_rep(self, block: Gradient) -> Gradient:
        """Query rows preconditioned per fitted layer (dense ``(B, D)``); other layers dropped."""
        fitted = [name for name in per_sample_layers(block) if name in self.layer_fits]
        if not fitted:
            return block
        return block.select_layers(fitted).map_layers(
            lambda name, _value, _type: self.precondition(name, layer_rows(block, name))
        )

    def inner_product_per_token(self, train_rep: Gradient, test_rep: Gradient) -> torch.Tensor:
        """Per-token scores; ``ValueError`` when the train side holds low-rank records."""
        low = sorted(
            name
            for name in train_rep.layer_names & test_rep.layer_names
            if is_low_rank(train_rep.data[name])
        )
        if low:
            raise ValueError(
                f"token-level LoRIF scores need the training gradients' token factors, but "
                f"layers {low} are rank-{self.rank} records (one matrix per sample, no token "
                "axis); use rank=None for attribution_granularity='token'."
            )
        return super().inner_product_per_token(train_rep, test_rep)

    # ------------------------------------------------------------------ collection
    def collect_gradients(
        self,
        streamer: GradientStreamer,
        store: GradientStorageManager,
        *,
        offload_interval: int = 1,
        on_block: Callable[[int, Gradient, list[str]], None] | None = None,
    ) -> GradientStorageManager:
        """As the base, storing the training side at rank ``c`` (``store.declare_low_rank``)."""
        if self.rank is not None and getattr(streamer, "role", "training") != "query":
            store.declare_low_rank(self.rank)
        return super().collect_gradients(
            streamer, store, offload_interval=offload_interval, on_block=on_block
        )

    # ------------------------------------------------------------------ entry points
    @keywords()
    def attribute(
        self,
        train_dataset: object,
        test_dataset: object,
        *,
        hook_config: Any = None,
        verbose: bool = False,
        loop_over_test: bool = False,
        gradient_cache_residency: str | None = None,
        attribution_granularity: str = "instance",
    ) -> AttributionScore:
        """Run the model (frozen probes): fit over the training set, then score.

        With ``gradient_cache_residency`` the training side is stored at rank ``c``.
        """
        self._start_call(None, None)
        return super().attribute(
            train_dataset,
            test_dataset,
            hook_config=hook_config,
            verbose=verbose,
            loop_over_test=loop_over_test,
            gradient_cache_residency=gradient_cache_residency,
            attribution_granularity=attribution_granularity,
        )

    @keywords()
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
        fit_dir: str | None = None,
    ) -> AttributionScore:
        """LoRIF scores from gradient stores (no model needed).

        A fit in ``fit_dir`` is loaded (no pass over the training store for the
        curvature); otherwise this call's fit is written there when given.
        """
        self._start_call(layer_name, selected_training_steps)
        write_to = None
        if fit_dir is not None and fit_path(fit_dir, FIT_FILE).is_file():
            self._loaded_fits = self.load_fit(fit_dir)
        else:
            write_to = fit_dir
        score = super().attribute_from_cache(
            train_source,
            test_source,
            selected_training_steps=selected_training_steps,
            layer_name=layer_name,
            verbose=verbose,
            loop_over_test=loop_over_test,
            algorithm_meta={**(algorithm_meta or {}), **self._meta()},
            attribution_granularity=attribution_granularity,
        )
        if write_to is not None:
            self.save_fit(self.layer_fits, write_to)
        return score

    def _meta(self) -> dict[str, Any]:
        """``algorithm_meta`` entries of a call: ``rank``, ``svd_rank``, ``damping``."""
        return {"rank": self.rank, "svd_rank": self.svd_rank, "damping": self.damping}

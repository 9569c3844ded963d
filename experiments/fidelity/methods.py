"""The attribution methods, as a registry: name → function of the captured stores.

Every entry returns a ``(num_train, num_query)`` float64 matrix, rows in
fine-tuning order (``captured.train_ids``), columns in query order, with ONE
sign convention: a positive score means the sample HELPS the query — training
on it lowers the query loss, so removing it raises the loss. That is the sign
of the TSLOO ground truth ``L_j(θ_T without i) − L_j(θ_T)``: every score is
multiplied by its ``polarity`` (``-1`` for AdamW-influence, whose rows are the
first-order change of the query loss when the sample is up-weighted).

``Method.charged`` names the captures in ``Captured.seconds`` that a method
needs beyond the training run itself and is charged for (the frozen pass at
``θ_T``, the query passes at every checkpoint); the trajectory captures made
during training are not charged, as in the paper (B.2).

Adding a method is ONE entry of ``METHODS``::

    "Name": Method(score_fn, charged=(), note="...", needs=("MyAttributor",)),

``score_fn(captured) -> (num_train, num_query)`` in the "helps" sign (use
:func:`aligned` on an ``AttributionScore``: it applies the polarity); ``needs``
names the attributor classes the entry uses, as ``dattri_llm`` exports them or as
``"module.path:ClassName"`` before they are exported; :func:`attributor_class`
resolves them, and an entry whose class does not import is reported by
``unavailable()`` with the import error instead of failing the run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from capture import Captured
from method_base import (
    PROJECTION_K,
    Method,
    aligned,
    arguments,
    attributor_class,
    final_model,
    projected_hooks,
)
from replay_methods import MAGIC, SOURCE, TRACKSTAR, metagradient, source, trackstar
from setting import collate, sequence_losses

from dattri_llm import (
    AttributionTask,
    EKFACAttributor,
    GradientRecord,
    GradientStorageManager,
    KFACAttributor,
    LESSAttributor,
    LoRIFAttributor,
    StrideAttributor,
    StrideConfig,
    TracInAttributor,
    TrajectoryTracInAttributor,
)
from dattri_llm.task import margin_and_weights


# ---------------------------------------------------------------------------- single checkpoint
def grad_dot(captured: Captured) -> torch.Tensor:
    """``<g_i(θ_T), q_j(θ_T)>``."""
    attributor = TracInAttributor(arguments(captured))
    return aligned(
        attributor.attribute_from_cache(captured.final_train, captured.queries_final), captured
    )


def grad_cos(captured: Captured) -> torch.Tensor:
    """Cosine of ``g_i(θ_T)`` and ``q_j(θ_T)``."""
    attributor = TracInAttributor(arguments(captured))
    score = attributor.attribute_from_cache(
        captured.final_train, captured.queries_final, normalized_grad=True
    )
    return aligned(score, captured)


def kronecker(cls: type) -> Callable[[Captured], torch.Tensor]:
    """K-FAC / EK-FAC influence ``g_iᵀ F⁻¹ q_j`` at ``θ_T``; damping 0.1 × mean eigenvalue (B.2)."""

    def score(captured: Captured) -> torch.Tensor:
        attributor = cls(arguments(captured))
        result = attributor.attribute_from_cache(
            captured.final_train, captured.queries_final, damping=0.1, relative_damping=True
        )
        return aligned(result, captured)

    return score


# ---------------------------------------------------------------------------- LoRIF
def logra_kwargs(k: int, layer_types: dict[str, str] | None = None) -> dict[str, dict]:
    """LoGRA factor projection of every layer to ``k × k`` (``d_out' = d_in' = k``).

    With ``layer_types``, one entry per layer, normalization layers (no factor
    projection exists for them) left unprojected.
    """
    config = {"style": "logra", "proj_dim": k}
    if layer_types is None:
        return {"__default__": config}
    from dattri_llm.gradient.ops.types import is_norm

    return {name: config for name, kind in layer_types.items() if not is_norm(kind)}


def projected_copy(source: Path, target: Path, k: int, *, low_rank: int | None, dense: bool):
    """``source`` projected post hoc to ``k × k`` per layer, written to ``target`` (cached).

    ``dense`` stores the projected gradient materialized (LoGRA's ``(k²,)`` rows);
    otherwise final factors, at rank ``low_rank`` when given (LoRIF's ``c·2k``).
    """
    if target.is_dir():
        return target
    src = GradientStorageManager(source)
    first = src.load_records(src.locations()[0])[0].gradient
    kwargs = logra_kwargs(k, dict(first.layer_types))
    dst = GradientStorageManager(target, low_rank=low_rank)
    dst.declare_projection(kwargs)
    for location in src.locations():
        records = []
        for r in src.load_records(location):
            grad = r.gradient.project(None, kwargs)
            records.append(
                GradientRecord(
                    r.step, r.input_hash, grad.materialize() if dense else grad, r.sample_id_key
                )
            )
        dst.save_bulk(records)
    return target


def projected_stores(captured: Captured, k: int, c: int | None) -> tuple[Path, Path]:
    """``(train, queries)`` stores at ``θ_T`` projected to ``k``; train at rank ``c`` (or dense)."""
    root = captured.root / "projected"
    train = projected_copy(
        captured.final_train, root / f"train_k{k}_c{c}", k, low_rank=c, dense=c is None
    )
    queries = projected_copy(
        captured.queries_final, root / f"queries_k{k}", k, low_rank=None, dense=False
    )
    return train, queries


def lorif(k: int, c: int | None, r: int | None) -> Callable[[Captured], torch.Tensor]:
    """LoRIF ``g_iᵀ(GᵀG/N + λI)⁻¹q_j`` at ``θ_T``, projection ``k``, rank ``c``, SVD rank ``r``.

    ``c = None`` is LoGRA-style projected influence (dense store); with ``r >= N`` (64 training
    rows here) the inverse is exact, since ``G`` has rank at most ``N``.
    """

    def score(captured: Captured) -> torch.Tensor:
        train, queries = projected_stores(captured, k, c)
        attributor = LoRIFAttributor(arguments(captured), rank=c, svd_rank=r)
        return aligned(attributor.attribute_from_cache(train, queries), captured)

    return score


# ---------------------------------------------------------------------------- along the trajectory
def tracin(captured: Captured) -> torch.Tensor:
    """``Σ_t η_t c_t <g_i(θ_t), q_j(θ_t)>``: each step's samples against the queries at ``θ_t``
    (``c_t`` the clip coefficient the update applied)."""
    total = torch.zeros(len(captured.train_ids), len(captured.query_ids), dtype=torch.float64)
    for step, lr in captured.lrs.items():
        score = TracInAttributor(arguments(captured)).attribute_from_cache(
            captured.trajectory, captured.queries_at(step), selected_training_steps=[step]
        )
        total += lr * captured.clip(step) * aligned(score, captured)
    return total


def tracin_final_queries(captured: Captured) -> torch.Tensor:
    """``Σ_t η_t c_t <g_i(θ_t), q_j(θ_T)>`` (DVEmb with ``H = 0``), trajectory TracIn."""
    score = TrajectoryTracInAttributor(arguments(captured)).attribute_from_cache(
        captured.trajectory, captured.queries_final
    )
    return aligned(score, captured)


def less(captured: Captured) -> torch.Tensor:
    """``Σ_t η_t c_t cos(Γ(z_i; θ_t), q_j(θ_t))`` (LESS with the Adam update direction ``Γ`` of
    each sample's own gradient; ``η_t c_t`` from the run's recorded dynamics)."""
    total = torch.zeros(len(captured.train_ids), len(captured.query_ids), dtype=torch.float64)
    for step in captured.lrs:
        score = LESSAttributor(arguments(captured)).attribute_from_cache(
            captured.trajectory_preconditioned,
            captured.queries_at(step),
            selected_training_steps=[step],
        )
        total += aligned(score, captured)
    return total


def random_baseline(captured: Captured) -> torch.Tensor:
    """Standard normal scores (seeded): the chance level, about 0."""
    gen = torch.Generator().manual_seed(captured.setting.seed + 7)
    shape = (len(captured.train_ids), len(captured.query_ids))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------- trajectory methods
def adamw_influence(num_masks: int) -> Callable[[Captured], torch.Tensor]:
    """AdamW-influence (query-side sweep); ``num_masks > 1`` averages disjoint coordinate groups.

    Its rows are the first-order change of the query loss when the sample is
    up-weighted (polarity ``-1``); :func:`aligned` turns them to "helps".
    """

    def score(captured: Captured) -> torch.Tensor:
        attributor = attributor_class(ADAMW)(arguments(captured))
        result = attributor.attribute_from_cache(
            captured.trajectory,
            captured.queries_final,
            dynamics=captured.dynamics,
            loss_reduction=captured.setting.loss_reduction,
            propagation="test",
            num_masks=num_masks,
        )
        return aligned(result, captured)

    return score


def dvemb(mode: str) -> Callable[[Captured], torch.Tensor]:
    """DVEmb ``qᵀ Π(I − η_k c_k H_k) η_s c_s g`` with ``hessian_mode=mode`` (query-side sweep),
    the rates and clip coefficients the run recorded."""

    def score(captured: Captured) -> torch.Tensor:
        result = attributor_class(DVEMB)(arguments(captured)).attribute_from_cache(
            captured.trajectory,
            captured.queries_final,
            propagation="test",
            hessian_mode=mode,
            loss_reduction=captured.setting.loss_reduction,
            learning_rate=None,
        )
        return aligned(result, captured)

    return score


# ---------------------------------------------------------------------------- STRIDE
# N = 64 here, so the design is kept compressive (K < N) with the per-example subset count
# d = 6: each of K = 48 subsets holds N·d/K = 8 samples (1/8 of the set), every sample is
# measured 6 times, and C(48, 6) ≫ N distinct columns exist. The sparsity rule's default
# (s = 10) would give K = ceil(2·10·ln 6.4) = 38; K = 48 leaves a little room.
# 300 Adam steps at the library's lr 1e-3 (its default of 1000 steps took 3.7x longer and
# ranked no better here; stride_sweep.py varies the steps and the rest).
STRIDE_CONFIG = StrideConfig(
    num_subsets=48,
    subsets_per_example=6,
    rank=16,
    injection="logits",
    steps=300,
    learning_rate=1e-3,
    lasso_lambda=0.01,
)


def stride_attributor(
    captured: Captured, model: torch.nn.Module, config: StrideConfig
) -> StrideAttributor:
    """A ``StrideAttributor`` on ``model`` (the default causal-LM logits: ``input_ids`` shifted,
    padding masked, as the setting's loss)."""
    return StrideAttributor(arguments(captured), task=AttributionTask(None, model), config=config)


def stride_config_for(config: StrideConfig, num_examples: int) -> StrideConfig:
    """``config`` for a training set of ``num_examples``: unchanged from 64 examples on; below
    (the smoke settings) ``K = max(4, 3N/4)``, ``d ≤ K/2`` and at most 30 steps."""
    if num_examples >= 64:
        return config
    k = max(4, 3 * num_examples // 4)
    return config.replace(
        num_subsets=k,
        subsets_per_example=min(config.subsets_per_example, k // 2),
        steps=min(config.steps, 30),
    )


def stride(config: StrideConfig = STRIDE_CONFIG) -> Callable[[Captured], torch.Tensor]:
    """STRIDE at ``θ_T``: fit the operators on the fine-tuning samples, measure the queries,
    Lasso. Positive = the sample's subsets lower the query loss (helps), polarity ``+1``."""

    def score(captured: Captured) -> torch.Tensor:
        model, data = final_model(captured)
        scaled = stride_config_for(config, len(data.finetune))
        attributor = stride_attributor(captured, model, scaled)
        return aligned(attributor.attribute(data.finetune, data.queries), captured)

    return score


# ---------------------------------------------------------------------------- TRAK, DataInf, IF
# TRAK's random projection P of the margin gradients: each layer's input and output sides
# projected to k = 32 (k² = 1024 numbers per layer, as the LoGRA-style row).
TRAK_PROJECTION = PROJECTION_K


def lm_margins(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRAK's output function on the setting's batches: ``margin_and_weights`` with the
    next-token ``labels`` (the input ids, padding ``-100``) the batches do not carry."""
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return margin_and_weights(model, {**batch, "labels": labels})


def trak(captured: Captured) -> torch.Tensor:
    """TRAK at ``θ_T`` (one checkpoint): margin gradients of the hooked layers projected to
    ``k = TRAK_PROJECTION`` per side (``k²`` per layer), ``(1 − p_i) φ_iᵀ(ΦᵀΦ + λI)⁻¹φ_j``
    (default ``λ``).

    TRAK scores live only (its ``1 − p`` weights come from the training forward): it
    captures its own gradients, so its whole run is charged.
    """
    model, data = final_model(captured)
    hooks = projected_hooks(model, captured.setting, {"proj_dim": TRAK_PROJECTION})
    attributor = attributor_class(TRAK)(
        arguments(captured), task=AttributionTask(None, model), output_func=lm_margins
    )
    return aligned(attributor.attribute(data.finetune, data.queries, hook_config=hooks), captured)


def datainf(captured: Captured) -> torch.Tensor:
    """DataInf at ``θ_T``: per-layer Sherman–Morrison inverse of the training rows' second
    moment, default damping (0.1 × the mean eigenvalue), unprojected stores."""
    attributor = attributor_class(DATAINF)(arguments(captured))
    return aligned(
        attributor.attribute_from_cache(captured.final_train, captured.queries_final), captured
    )


IF_LAYER = "lm_head"  # the one nn.Linear of GPT-2 (its blocks use Conv1D)
IF_DAMPING = 1e-3
IF_CG_ITERATIONS = 50


def mean_sequence_loss(model, batch: dict) -> torch.Tensor:
    """Mean over the batch of the per-sentence mean token losses (the Hessian's objective)."""
    return sequence_losses(model, batch).mean()


def influence_lm_head(captured: Captured) -> torch.Tensor:
    """Exact-Hessian influence ``g_iᵀ(H + λI)⁻¹q_j`` restricted to ``lm_head`` at ``θ_T``.

    ``InfluenceFunctionAttributor`` maps stored rows to ``nn.Linear`` parameters only, and
    every block layer of GPT-2 is a ``Conv1D``: the LM head (``n_embd × vocab`` weights, no
    bias) is the one layer it can take. ``H`` is the Hessian over the LM head of the mean
    training loss at ``θ_T`` (4 batches of 16 sentences, mean loss each), solved by CG
    (``IF_CG_ITERATIONS`` iterations at most), ``λ = IF_DAMPING``.
    """
    model, data = final_model(captured)
    head = model.get_submodule(IF_LAYER)
    batches = [collate(data.finetune[s : s + 16]) for s in range(0, len(data.finetune), 16)]
    attributor = attributor_class(INFLUENCE)(
        arguments(captured),
        task=AttributionTask(mean_sequence_loss, model),
        hessian_batches=batches,
        solver="cg",
        damping=IF_DAMPING,
        max_params=head.weight.numel() + (0 if head.bias is None else head.bias.numel()),
        solver_options={"max_iter": IF_CG_ITERATIONS},
    )
    result = attributor.attribute_from_cache(
        captured.final_train, captured.queries_final, layer_name=IF_LAYER
    )
    return aligned(result, captured)


ADAMW = "AdamWInfluenceAttributor"
DVEMB = "DVEmbAttributor"
TRAK = "TRAKAttributor"
DATAINF = "DataInfAttributor"
INFLUENCE = "InfluenceFunctionAttributor"
SOURCE_SEGMENTS = 4


FROZEN = ("frozen",)
PER_STEP = ("per_step_queries",)
METHODS: dict[str, Method] = {
    "Random": Method(random_baseline),
    "Grad-Dot": Method(grad_dot, FROZEN, "θ_T"),
    "Grad-Cos": Method(grad_cos, FROZEN, "θ_T"),
    "K-FAC": Method(kronecker(KFACAttributor), FROZEN, "θ_T"),
    "EK-FAC": Method(kronecker(EKFACAttributor), FROZEN, "θ_T"),
    "TracIn": Method(tracin, PER_STEP, "η_t-weighted, queries at each θ_t"),
    "TracIn (θ_T queries)": Method(
        tracin_final_queries, (), "TrajectoryTracInAttributor: η_t c_t-weighted = DVEmb with H=0"
    ),
    "LESS": Method(less, PER_STEP, "η_t-weighted cosine, queries at each θ_t"),
    "AdamW-influence (full)": Method(adamw_influence(1), needs=(ADAMW,)),
    "AdamW-influence (8 masks)": Method(
        adamw_influence(8), (), "8 disjoint per-layer coordinate groups, averaged", (ADAMW,)
    ),
    "DVEmb (full H)": Method(dvemb("full"), needs=(DVEMB,)),
    "DVEmb (diagonal H)": Method(dvemb("diagonal"), needs=(DVEMB,)),
    "LoGRA-style (k=32)": Method(lorif(32, None, 64), FROZEN, "θ_T, dense k² store, exact inverse"),
    "LoRIF (k=32, c=1, r=64)": Method(lorif(32, 1, 64), FROZEN, "θ_T, 9.6× less store"),
    "STRIDE": Method(
        stride(),
        (),
        "θ_T, no gradients: K=48, d=6, r=16, logits, 300 steps, λ=0.01·λ_max (fit included)",
    ),
    "STRIDE (residual)": Method(
        stride(STRIDE_CONFIG.replace(injection="residual")),
        (),
        "the same with the residual injection (stride_sweep.py's best variation)",
    ),
    "TRAK (k=32)": Method(
        trak,
        (),
        f"θ_T, live: margin gradients projected to k={TRAK_PROJECTION} per side (k² per layer), "
        "default λ, "
        "1 − p weights (its own gradient pass included)",
        (TRAK,),
    ),
    "DataInf": Method(
        datainf, FROZEN, "θ_T, per-layer rank-one inverses, λ = 0.1 × mean eigenvalue", (DATAINF,)
    ),
    "Influence function (lm_head only)": Method(
        influence_lm_head,
        FROZEN,
        f"θ_T, exact Hessian of the mean training loss over lm_head only (GPT-2's blocks are "
        f"Conv1D, which the attributor refuses), CG ≤ {IF_CG_ITERATIONS} iterations, "
        f"λ = {IF_DAMPING:g}",
        (INFLUENCE,),
    ),
    "Metagradient (exact ∂L/∂w, MAGIC)": Method(
        metagradient,
        (),
        "exact derivative in the sample's loss weight through the recorded run (every update, "
        "full Hessian, clip, Adam moments), replayed in float64 with a float64 loss from the "
        "snapshots recorded during training; the first-order limit",
        (MAGIC,),
    ),
    "TrackStar (k²=1024 mask)": Method(
        trackstar,
        (),
        "θ_T, live: gradients ⊘ (√v + eps) of the trained AdamW, random mask of 1024 "
        "coordinates per layer (LoGRA's factor projection cannot follow the division), "
        "R = 0.9 R_train + 0.1 R_query, unit rows (its own gradient passes included)",
        (TRACKSTAR,),
    ),
    f"SOURCE (L={SOURCE_SEGMENTS})": Method(
        source(SOURCE_SEGMENTS),
        FROZEN,
        f"EK-FAC at the ends of {SOURCE_SEGMENTS} equal segments, η̄ = summed AdamW rates used "
        "as SGD step sizes, λ = 0.1 × mean eigenvalue (the earlier segments' passes included)",
        (SOURCE,),
    ),
    "SOURCE (L=1)": Method(
        source(1),
        FROZEN,
        "one segment: EK-FAC at θ_T with η̄ = the summed rates (finite-horizon EK-FAC)",
        (SOURCE,),
    ),
}


def needed_classes() -> set[str]:
    """Class names every registry entry needs (``"module:Name"`` as ``Name``)."""
    return {spec.rsplit(":", 1)[-1] for m in METHODS.values() for spec in m.needs}


def unavailable() -> dict[str, str]:
    """``{method: reason}`` for registry entries whose attributor does not import."""
    reasons = {}
    for method, entry in METHODS.items():
        for spec in entry.needs:
            try:
                attributor_class(spec)
            except (AttributeError, ImportError) as error:
                reasons[method] = f"{spec} does not import ({type(error).__name__}: {error})"
                break
    return reasons


def exported(name: str) -> bool:
    """Whether ``from dattri_llm import <name>`` works (the public API)."""
    import dattri_llm

    return hasattr(dattri_llm, name)

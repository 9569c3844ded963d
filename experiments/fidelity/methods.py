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

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from capture import FINAL_MODEL, Captured
from setting import collate, sequence_losses

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    EKFACAttributor,
    GradientRecord,
    GradientStorageManager,
    HookManagerConfig,
    KFACAttributor,
    LESSAttributor,
    LoRIFAttributor,
    StrideAttributor,
    StrideConfig,
    TracInAttributor,
    TrajectoryTracInAttributor,
)
from dattri_llm.task import margin_and_weights


@dataclass(frozen=True)
class Method:
    """One registry entry.

    Attributes:
        score: ``score(captured) -> (num_train, num_query)`` float64, "helps" sign.
        charged: keys of ``Captured.seconds`` added to the method's attribution seconds.
        note: the table's note.
        needs: attributor classes the entry uses (``"Name"`` exported by ``dattri_llm`` or
            ``"module.path:Name"``); if one does not import the row reads "not run".
    """

    score: Callable[[Captured], torch.Tensor]
    charged: tuple[str, ...] = ()
    note: str = ""
    needs: tuple[str, ...] = ()


def aligned(score, captured: Captured) -> torch.Tensor:
    """An ``AttributionScore`` as ``(num_train, num_query)`` in the "helps" sign, rows summed
    over steps.

    Training samples the score has no row for (not in the scored steps) get 0.
    """
    ids, matrix = score.agnostic_matrix()
    matrix = matrix * score.polarity
    row_of = {sample: row for row, sample in enumerate(captured.train_ids)}
    columns = [score.test_index[q] for q in captured.query_ids]
    result = torch.zeros(len(captured.train_ids), len(captured.query_ids), dtype=torch.float64)
    result[[row_of[i] for i in ids]] = matrix[:, columns].double()
    return result


def arguments(captured: Captured) -> AttributionArguments:
    """Scoring arguments: CPU, a throwaway output directory."""
    return AttributionArguments(
        output_dir=tempfile.mkdtemp(prefix="tsloo_"),
        use_cpu=True,
        seed=captured.setting.seed,
        per_device_train_batch_size=16,
    )


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


def final_model(captured: Captured) -> tuple[torch.nn.Module, object]:
    """``(model at θ_T, data)`` rebuilt from the setting and the captured final weights."""
    from setting import make_data, make_model

    data = make_data(captured.setting)
    model = make_model(captured.setting, data.vocab_size)
    model.load_state_dict(torch.load(captured.root / FINAL_MODEL, weights_only=True))
    model.eval()
    return model, data


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
TRAK_PROJECTION = 32


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
    patterns = captured.setting.hooked_layers
    projected = {  # LayerNorms (trainer setting) have no factor projection: left unprojected
        name: {"proj_dim": TRAK_PROJECTION}
        for name, module in model.named_modules()
        if any(re.search(p, name) for p in patterns) and not isinstance(module, torch.nn.LayerNorm)
    }
    hooks = HookManagerConfig(linear_io=patterns, projection_kwargs=projected)
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
}


def attributor_class(spec: str) -> type:
    """The class ``spec`` names: ``"Name"`` from ``dattri_llm``, or ``"module.path:Name"``."""
    import importlib

    import dattri_llm

    if ":" in spec:
        module, name = spec.split(":", 1)
        return getattr(importlib.import_module(module), name)
    return getattr(dattri_llm, spec)


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

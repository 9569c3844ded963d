"""The second-order error proxy of AdamW-influence: a forward sweep of first and second tangents.

AdamW-influence scores a training sample by ``a'(0)``, the derivative of the
query loss ``a(ε) = L_q(θ_T(ε))`` in the sample's loss weight ``1 + ε``.
Removing the sample is ``ε = −1``: ``a(−1) − a(0) = −a'(0) + ½a''(0) − …``,
so ``E = ½a''(0)`` is the first term the linear estimate leaves out.

Along the recorded trajectory, a direction ``w`` over the training samples
(one-hot rows, or Rademacher probes) perturbs the state ``s = (θ, m, v)``.
With ``δs`` and ``δ²s`` the first and second derivatives of the state in
``ε``, both zero before the first swept update, one update ``t`` gives

* the gradient it applied: ``δg = C'(H δθ + Σ_b w_b t_b) + l2·δθ`` and
  ``δ²g = C'(H δ²θ + 2 Σ_b w_b c_b t_b (t_b·δθ)) + l2·δ²θ``, with
  ``H = Σ_b c_b t_b t_bᵀ`` (the Gauss–Newton coupling of AdamW-influence),
  ``C'`` the clip's Jacobian and ``l2`` Adam's coupled decay;
* the moments: ``δm' = β1 δm + (1−β1) δg``, ``δv' = β2 δv + 2(1−β2) g δg``;
  ``δ²m' = β1 δ²m + (1−β1) δ²g``,
  ``δ²v' = β2 δ²v + 2(1−β2)(g δ²g + δg²)``;
* the parameters, ``θ' = decay·θ − (η/bc1) m' D(v')``:
  ``δθ' = decay·δθ + ∂θ'/∂m'·δm' + ∂θ'/∂v'·δv'`` and
  ``δ²θ' = decay·δ²θ + ∂θ'/∂m'·δ²m' + ∂θ'/∂v'·δ²v'
  + 2 ∂²θ'/∂m'∂v'·δm'δv' + ∂²θ'/∂v'²·δv'²``.

The Jacobian pieces come from :func:`~.folds.adam_coefficients`, the same
function the backward AdamW-influence sweep uses, so ``q·δθ_T`` of a one-hot
direction is exactly the sum of the sample's AdamW-influence rows. At the end
``a'' = q·δ²θ_T + δθ_Tᵀ H_q δθ_T``.

Left out: third derivatives of the training loss (zero for a locally
quadratic loss; stored gradients do not hold them), the clip's own curvature
(the second derivative of ``G·M/‖G‖``), and ``amsgrad`` (refused).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.attribution.algorithm.trajectory.folds import AdamCoefficients, adam_coefficients
from dattri_llm.attribution.algorithm.trajectory.run import Window
from dattri_llm.attribution.algorithm.trajectory.sweep import TrajectorySweep, WindowRows

if TYPE_CHECKING:
    from dattri_llm.gradient.stream.source import GradientSource

# Median relative error above which the linear (first-order) scores are flagged unreliable.
RELIABILITY_THRESHOLD = 0.3


@dataclass
class ErrorProxy:
    """The second-order term of removing each training sample, against the linear estimate.

    Attributes:
        train_ids: the perturbed samples, in order of first appearance in the
            run (``per_sample`` mode; ``None`` with probes).
        test_ids: the queries.
        linear: ``(N, n_test)`` ``Δ_linear = −a'(0)``, the linear estimate of
            removing each sample (``per_sample`` mode, else ``None``).
        second_order: ``(N, n_test)`` ``E = ½a''(0)`` (``per_sample`` mode).
        mean_second_order: ``(n_test,)`` the mean of ``E`` over the samples
            (exact, or the probes' unbiased estimate).
        rms_linear: ``(n_test,)`` the root mean square of ``Δ_linear`` over the samples.
        relative_error: ``(n_test,)`` ``|mean_second_order| / rms_linear``.
        num_samples: ``N``, the distinct perturbed samples.
        mode: ``"per_sample"`` or ``"probes"``.
        threshold: the reliability threshold on the median relative error.
        reliable: whether the median relative error is at most ``threshold``.
    """

    train_ids: list[str] | None
    test_ids: list[str]
    linear: torch.Tensor | None
    second_order: torch.Tensor | None
    mean_second_order: torch.Tensor
    rms_linear: torch.Tensor
    relative_error: torch.Tensor
    num_samples: int
    mode: str
    threshold: float
    reliable: bool

    @property
    def median_relative_error(self) -> float:
        """The median over the queries of :attr:`relative_error` (the middle two's mean)."""
        return float(torch.quantile(self.relative_error.double(), 0.5))

    def to_meta(self) -> dict[str, Any]:
        """A JSON-safe summary: per-query statistics as lists of floats (non-finite → ``None``)."""
        return {
            "mode": self.mode,
            "num_samples": self.num_samples,
            "threshold": self.threshold,
            "reliable": self.reliable,
            "median_relative_error": _finite(self.median_relative_error),
            "test_ids": list(self.test_ids),
            "mean_second_order": [_finite(x) for x in self.mean_second_order.tolist()],
            "rms_linear": [_finite(x) for x in self.rms_linear.tolist()],
            "relative_error": [_finite(x) for x in self.relative_error.tolist()],
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _summarise(
    mean_second_order: torch.Tensor,
    rms_linear: torch.Tensor,
    *,
    test_ids: list[str],
    num_samples: int,
    mode: str,
    train_ids: list[str] | None = None,
    linear: torch.Tensor | None = None,
    second_order: torch.Tensor | None = None,
) -> ErrorProxy:
    """The :class:`ErrorProxy` of per-query statistics (``(n_test,)`` each).

    ``relative_error`` is ``|mean_second_order| / rms_linear`` (``inf`` where
    only the linear term vanishes, ``0`` where both do).
    """
    size = mean_second_order.abs()
    tiny = torch.finfo(rms_linear.dtype).tiny
    relative = torch.where(rms_linear > 0, size / rms_linear.clamp_min(tiny), size * math.inf)
    relative = torch.nan_to_num(relative, nan=0.0, posinf=math.inf)
    median = float(torch.quantile(relative.double(), 0.5))
    return ErrorProxy(
        train_ids=train_ids,
        test_ids=test_ids,
        linear=linear,
        second_order=second_order,
        mean_second_order=mean_second_order,
        rms_linear=rms_linear,
        relative_error=relative,
        num_samples=num_samples,
        mode=mode,
        threshold=RELIABILITY_THRESHOLD,
        reliable=median <= RELIABILITY_THRESHOLD,
    )


# ---------------------------------------------------------------------------- directions
class _Directions:
    """The weight of each row of an update in each swept direction.

    Samples get indices in order of first appearance (``index``, shared by the
    blocks of one call). ``per_sample``: direction ``r`` is the one-hot of
    sample ``start + r``; rows exist only for block samples already seen, so
    the tangents grow as they appear. Probes: ``num`` Rademacher directions,
    each sample's signs drawn (seeded) when it first appears.
    """

    def __init__(
        self,
        index: dict[str, int],
        first_window: list[int],
        *,
        start: int = 0,
        count: int = 0,
        probes: int = 0,
        seed: int = 0,
    ) -> None:
        self.index, self.first_window = index, first_window
        self.start, self.count, self.probes = start, count, probes
        self.generator = torch.Generator().manual_seed(seed) if probes else None
        self.signs: list[torch.Tensor] = []

    def active(self) -> int:
        """Directions the tangents hold now."""
        if self.probes:
            return self.probes
        return max(0, min(len(self.index) - self.start, self.count))

    def weights(
        self, rows: WindowRows, perturbed: set[int], position: int, like: torch.Tensor
    ) -> torch.Tensor | None:
        """``(active, B)`` weights of the update's rows (``None`` when none is perturbed)."""
        pairs = enumerate(zip(rows.ids, rows.steps, strict=True))
        picked = [(b, sample) for b, (sample, step) in pairs if step in perturbed]
        for _b, sample in picked:
            if sample not in self.index:
                self.index[sample] = len(self.index)
                self.first_window.append(position)
                if self.generator is not None:
                    draw = torch.randint(0, 2, (self.probes,), generator=self.generator)
                    self.signs.append(draw.to(like) * 2.0 - 1.0)
        active = self.active()
        if not picked or active == 0:
            return None
        weights = torch.zeros(active, len(rows.ids), dtype=like.dtype, device=like.device)
        for b, sample in picked:
            i = self.index[sample]
            if self.generator is not None:
                weights[:, b] = self.signs[i]
            elif self.start <= i < self.start + active:
                weights[i - self.start, b] = 1.0
        return weights


# ---------------------------------------------------------------------------- the sweep
@dataclass
class _Tangents:
    """``δθ, δm, δv`` and ``δ²θ, δ²m, δ²v``, ``(R, p)`` each (one row per direction)."""

    theta: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    theta2: torch.Tensor
    m2: torch.Tensor
    v2: torch.Tensor

    @classmethod
    def zeros(cls, rows: int, width: int, like: torch.Tensor) -> _Tangents:
        return cls(*(like.new_zeros(rows, width) for _ in range(6)))

    def grow(self, rows: int) -> None:
        """Append zero rows up to ``rows`` directions (samples not yet perturbed)."""
        extra = rows - self.theta.shape[0]
        if extra > 0:
            for name in ("theta", "m", "v", "theta2", "m2", "v2"):
                value = getattr(self, name)
                setattr(self, name, torch.cat([value, value.new_zeros(extra, value.shape[1])]))


def _applied(a: torch.Tensor, rows: WindowRows) -> torch.Tensor:
    """``C'·Σ_b a_b t_b`` for coefficients ``a`` ``(R, B)`` (``C'`` the clip's Jacobian)."""
    out = a @ rows.z
    if rows.hat is not None:  # c(I − ĝĝᵀ)
        out.sub_(torch.outer(a @ rows.hat_rows, rows.hat))
    return out.mul_(rows.scale)


def _advance(
    tan: _Tangents, rows: WindowRows, w: torch.Tensor | None, co: AdamCoefficients
) -> None:
    """Carry the tangents through one update (see the module docstring), in place.

    ``w``: ``(R, B)`` the directions' weights of the update's rows (``None``: none).
    """
    shares = rows.curvature / rows.rho  # c_b/ρ: t_b·x = z_b·x/ρ
    proj = tan.theta @ rows.z.T  # (R, B) z_b·δθ
    a1 = proj * shares
    a2 = (tan.theta2 @ rows.z.T) * shares
    if w is not None:
        a1 = a1 + w
        a2 = a2 + 2.0 * w * proj * shares
    dg, d2g = _applied(a1, rows), _applied(a2, rows)
    if co.l2 is not None:
        dg.addcmul_(tan.theta, co.l2)
        d2g.addcmul_(tan.theta2, co.l2)
    tan.m.mul_(co.beta1).addcmul_(dg, co.a_m)
    tan.v.mul_(co.beta2).addcmul_(dg, co.a_v)
    tan.m2.mul_(co.beta1).addcmul_(d2g, co.a_m)
    tan.v2.mul_(co.beta2).addcmul_(d2g, co.a_v).addcmul_(dg.square_(), 2.0 * (1.0 - co.beta2))
    quadratic = (2.0 * co.theta_mv) * tan.m * tan.v + co.theta_vv * tan.v.square()
    tan.theta2.mul_(co.decay).addcmul_(tan.m2, co.theta_mp).addcmul_(tan.v2, co.theta_v)
    tan.theta2.add_(quadratic)
    tan.theta.mul_(co.decay).addcmul_(tan.m, co.theta_mp).addcmul_(tan.v, co.theta_v)


def check_query_hessian(query_hessian: torch.Tensor | None) -> None:
    """``ValueError`` unless ``query_hessian`` is ``None`` or a square 2-D tensor."""
    if query_hessian is None:
        return
    if (
        not isinstance(query_hessian, torch.Tensor)
        or query_hessian.ndim != 2
        or (query_hessian.shape[0] != query_hessian.shape[1])
    ):
        shape = tuple(query_hessian.shape) if isinstance(query_hessian, torch.Tensor) else None
        raise ValueError(
            f"query_hessian must be a square (p, p) tensor over the captured coordinates, got "
            f"{type(query_hessian).__name__} of shape {shape}; pass None for the Gauss–Newton "
            "stand-in of the last update"
        )


def check_counts(**counts: object) -> None:
    """``ValueError`` naming any of ``counts`` that is not an int ``>= 1``."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def error_proxy(
    sweep: TrajectorySweep,
    source: GradientSource,
    windows: list[Window],
    perturbed: set[int],
    queries: Mapping[str, torch.Tensor],
    test_ids: list[str],
    *,
    per_sample: bool = True,
    sample_block: int = 256,
    num_probes: int = 16,
    seed: int = 0,
    query_hessian: torch.Tensor | None = None,
    layers: list[str] | None = None,
    entries: Mapping[int, Mapping[str, Any]] | None = None,
) -> ErrorProxy:
    """The :class:`ErrorProxy` of a recorded AdamW run (see the module docstring).

    Args:
        sweep: reads each update's rows (its ``dtype`` / ``device`` are the
            computation's); its fold's run must not use ``amsgrad``.
        source: the run's per-step gradients.
        windows: the updates to sweep, ascending (from the earliest one holding
            a perturbed step to the last before the queries).
        perturbed: store steps whose rows are perturbed (a sample's occurrences
            at other steps keep their weight).
        queries: ``{layer: (n_test, d)}`` query gradients at ``θ_T``.
        test_ids: the queries' ids.
        per_sample: one-hot directions in blocks of ``sample_block`` samples
            (``ceil(N/sample_block)`` sweeps); else ``num_probes`` Rademacher
            directions in one sweep (``seed``).
        query_hessian: ``(p, p)`` ``H_q`` over the concatenated captured
            coordinates in the sweep's layout order; ``None``: the mean per-sample
            Gauss–Newton ``(1/B) Σ_b c_b² t_b t_bᵀ`` of the last swept update.
        layers: restrict the rows to these layers.
        entries: the AdamW dynamics ``{step: entry}``.

    Warns:
        UserWarning: the clip was active at a swept update (its curvature is left out).

    Raises:
        ValueError: a bad ``query_hessian`` shape; see :class:`TrajectorySweep`.
    """
    check_counts(sample_block=sample_block, num_probes=num_probes)
    check_query_hessian(query_hessian)
    clipped = [window.key for window in windows if window.clipped]
    if clipped:
        warnings.warn(
            f"the gradient clip was active at {len(clipped)} of the {len(windows)} swept updates: "
            "the error proxy carries the clip's Jacobian but leaves out its curvature (the "
            "second derivative of G·M/‖G‖), so E misses that part of the second-order term",
            UserWarning,
            stacklevel=3,
        )
    index: dict[str, int] = {}
    first_window: list[int] = []
    if not per_sample:
        directions = _Directions(index, first_window, probes=num_probes, seed=seed)
        linear, second = _one_sweep(
            sweep, source, windows, perturbed, queries, directions, query_hessian, layers, entries
        )
        n = len(index)
        return _summarise(
            second.mean(0) / n,
            (linear.square().mean(0) / n).sqrt(),
            test_ids=test_ids,
            num_samples=n,
            mode="probes",
        )
    blocks_linear, blocks_second = [], []
    start = 0
    while start == 0 or start < len(index):
        directions = _Directions(index, first_window, start=start, count=sample_block)
        begin = first_window[start] if start else 0
        linear, second = _one_sweep(
            sweep, source, windows[begin:], perturbed, queries, directions, query_hessian,
            layers, entries, position=begin,
        )  # fmt: skip
        blocks_linear.append(linear)
        blocks_second.append(second)
        start += sample_block
    linear, second = torch.cat(blocks_linear), torch.cat(blocks_second)
    return _summarise(
        second.mean(0),
        linear.square().mean(0).sqrt(),
        test_ids=test_ids,
        num_samples=len(index),
        mode="per_sample",
        train_ids=sorted(index, key=index.__getitem__),
        linear=linear,
        second_order=second,
    )


def _one_sweep(
    sweep: TrajectorySweep,
    source: GradientSource,
    windows: list[Window],
    perturbed: set[int],
    queries: Mapping[str, torch.Tensor],
    directions: _Directions,
    query_hessian: torch.Tensor | None,
    layers: list[str] | None,
    entries: Mapping[int, Mapping[str, Any]] | None,
    *,
    position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward sweep: ``(Δ_linear, E)``, ``(R, n_test)`` each on the CPU."""
    tan: _Tangents | None = None
    last: WindowRows | None = None
    for offset, rows in enumerate(
        sweep.forward_rows(source, windows, layers=layers, entries=entries)
    ):
        if tan is None:
            tan = _Tangents.zeros(0, rows.z.shape[1], rows.z)
        w = directions.weights(rows, perturbed, position + offset, rows.z)
        tan.grow(directions.active())
        if tan.theta.shape[0]:
            _advance(tan, rows, w, adam_coefficients(rows, None, second_order=True))
        last = rows
    if tan is None or last is None:
        raise ValueError("the train source yielded no update to sweep")
    q, _shared = sweep.query_matrix(last.layout, queries)
    curvature = _query_curvature(tan.theta, last, query_hessian)
    linear = -(tan.theta @ q.T)
    second = 0.5 * (tan.theta2 @ q.T + curvature[:, None])
    return linear.cpu(), second.cpu()


def _query_curvature(
    theta: torch.Tensor, last: WindowRows, query_hessian: torch.Tensor | None
) -> torch.Tensor:
    """``(R,)`` ``δθ_Tᵀ H_q δθ_T``."""
    if query_hessian is None:  # (1/B) Σ_b (c_b t_b·δθ)²: c_b t_b is the sample's own gradient
        own = (theta @ last.z.T) * (last.curvature / last.rho)
        return own.square().mean(1)
    width = theta.shape[1]
    if tuple(query_hessian.shape) != (width, width):
        raise ValueError(
            f"query_hessian has shape {tuple(query_hessian.shape)} but the captured coordinates "
            f"number {width} (layers {dict(last.layout)}, concatenated in that order); pass a "
            f"({width}, {width}) tensor"
        )
    hessian = query_hessian.to(theta)
    return ((theta @ hessian) * theta).sum(1)


__all__ = [
    "RELIABILITY_THRESHOLD",
    "ErrorProxy",
    "check_counts",
    "check_query_hessian",
    "error_proxy",
]

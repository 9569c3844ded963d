"""Sparse recovery: a batched FISTA Lasso of many queries against one sparse design.

For every query ``q`` (a column of ``U`` ``(K, Q)``) it solves

    ŵ_q = argmin_w ½ ‖P (u_q − M w)‖² + λ_q ‖w‖₁,

``M`` ``(K, N)`` the design, ``P = I − 11ᵀ/K`` with ``fit_intercept`` (the
intercept ``b_q = mean(u_q − M ŵ_q)`` is then free and unpenalised) and
``P = I`` without. ``λ_q = lasso_lambda · λ_max,q`` with ``λ_max,q =
‖Mᵀ P u_q‖_∞``, the smallest ``λ`` whose solution is all zero, so one relative
setting fits queries of any loss scale. FISTA's step is ``1 / L`` with ``L =
d · max_k |A_k| ≥ ‖M‖₂²``; the momentum restarts per query when it points
uphill (gradient restart). A query has converged when an iteration moves no
weight by more than ``tol · max|ŵ_q|``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from dattri_llm.attribution.algorithm.stride.design import SubsetDesign

__all__ = ["LassoResult", "lasso_fista"]


@dataclass
class LassoResult:
    """Solutions of a batch of Lasso problems.

    Attributes:
        weights: ``(Q, N)`` float32, ``ŵ`` per query.
        intercept: ``(Q,)`` the fitted intercepts (zeros without ``fit_intercept``).
        lambdas: ``(Q,)`` the absolute ``λ`` used.
        iterations: FISTA iterations run.
        converged: ``(Q,)`` bool, which queries met the tolerance.
    """

    weights: torch.Tensor
    intercept: torch.Tensor
    lambdas: torch.Tensor
    iterations: int
    converged: torch.Tensor


class _CenteredDesign:
    """``A = P M`` and ``Aᵀ`` on a device, ``P`` the centring projector (or the identity)."""

    def __init__(self, design: SubsetDesign, device: torch.device, center: bool) -> None:
        matrix = design.matrix().to(device)
        self.matrix = matrix
        self.transpose = matrix.t().coalesce()
        self.center = center

    def project(self, values: torch.Tensor) -> torch.Tensor:
        """``P values`` for ``(K, Q)`` values."""
        return values - values.mean(dim=0, keepdim=True) if self.center else values

    def apply(self, weights: torch.Tensor) -> torch.Tensor:
        """``A w``: ``(N, Q)`` → ``(K, Q)``."""
        return self.project(torch.sparse.mm(self.matrix, weights))

    def apply_transpose(self, residual: torch.Tensor) -> torch.Tensor:
        """``Aᵀ r``: ``(K, Q)`` → ``(N, Q)``."""
        return torch.sparse.mm(self.transpose, self.project(residual))


def _soft_threshold(values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``sign(v) · max(|v| − t, 0)`` elementwise; ``threshold`` ``(Q,)`` per column."""
    return values.sign() * (values.abs() - threshold).clamp(min=0)


def lasso_fista(
    design: SubsetDesign,
    measurements: torch.Tensor,
    *,
    lasso_lambda: float,
    max_iter: int,
    tol: float,
    fit_intercept: bool = True,
    device: torch.device | str | None = None,
    verbose: bool = False,
) -> LassoResult:
    """Recover ``ŵ`` ``(Q, N)`` from measurements ``u`` ``(Q, K)`` for every query at once.

    Args:
        design: the subset design ``M`` ``(K, N)``.
        measurements: ``(Q, K)``, row ``q`` the query's subset responses.
        lasso_lambda: ``λ / λ_max`` per query, in ``[0, 1)``.
        max_iter: FISTA iteration cap.
        tol: relative convergence tolerance.
        fit_intercept: centre ``u`` and ``M`` (a free intercept per query).
        device: where to solve (default: the measurements' device).
        verbose: show a progress bar over the iterations.

    Returns:
        the :class:`LassoResult`.

    Raises:
        ValueError: ``measurements`` is not ``(Q, K)`` with the design's ``K``.

    Warns:
        UserWarning: some queries did not converge within ``max_iter``.
    """
    if measurements.dim() != 2 or measurements.shape[1] != design.num_subsets:
        raise ValueError(
            f"measurements must be (Q, K={design.num_subsets}), got {tuple(measurements.shape)}"
        )
    device = torch.device(device) if device is not None else measurements.device
    operator = _CenteredDesign(design, device, fit_intercept)
    target = operator.project(measurements.to(device=device, dtype=torch.float32).T)
    num_queries = target.shape[1]
    step = 1.0 / design.lipschitz_bound()
    lambdas = lasso_lambda * operator.apply_transpose(target).abs().amax(dim=0)
    weights = torch.zeros(design.num_examples, num_queries, device=device)
    momentum_point = weights.clone()
    t = torch.ones(num_queries, device=device)
    converged = torch.zeros(num_queries, dtype=torch.bool, device=device)
    iterations = 0
    for _ in tqdm(range(max_iter), desc="STRIDE Lasso", unit="it", disable=not verbose):
        iterations += 1
        gradient = operator.apply_transpose(operator.apply(momentum_point) - target)
        updated = _soft_threshold(momentum_point - step * gradient, step * lambdas)
        change = updated - weights
        scale = updated.abs().amax(dim=0)
        converged = change.abs().amax(dim=0) <= tol * scale
        uphill = ((momentum_point - updated) * change).sum(dim=0) > 0
        t = torch.where(uphill, torch.ones_like(t), t)
        t_next = (1 + torch.sqrt(1 + 4 * t * t)) / 2
        momentum_point = updated + ((t - 1) / t_next) * change
        weights, t = updated, t_next
        if bool(converged.all()):
            break
    missing = int((~converged).sum())
    if missing:
        warnings.warn(
            f"the STRIDE Lasso did not converge for {missing} of {num_queries} queries in "
            f"{max_iter} iterations (tolerance {tol}); raise lasso_max_iter or lasso_tol",
            UserWarning,
            stacklevel=2,
        )
    residual = measurements.to(device=device, dtype=torch.float32).T - torch.sparse.mm(
        operator.matrix, weights
    )
    intercept = residual.mean(dim=0) if fit_intercept else torch.zeros(num_queries, device=device)
    return LassoResult(
        weights=weights.T.contiguous().cpu(),
        intercept=intercept.cpu(),
        lambdas=lambdas.cpu(),
        iterations=iterations,
        converged=converged.cpu(),
    )

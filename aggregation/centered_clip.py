"""CenteredClip (Karimireddy et al.), the reducer of BTARD, and the clip coefficients its verification reuses.

The fixed point v* solves Σ_i w_i (x_i − v*)·min(1, τ/‖x_i − v*‖) = 0 (FP); it is the minimizer
of the convex Huber loss Σ_i w_i ρ_τ(‖x_i − v‖), so the start v₀ (coordinate-wise median, or a
given one such as the previous aggregate) only changes the iteration count. The paper's step
v ← v + Σ_i ω_i (x_i − v) with ω_i = w_i·min(1, τ/‖x_i − v‖) / Σ_j w_j moves by about τ per step
once every row is clipped, so with τ = 1 and rows thousands apart 500 steps stop far from v*
(and the projection check, which assumes v*, would convict an honest reducer). We take the same
step divided by Σ_i ω_i ≤ 1, i.e. v ← Σ_i ω_i x_i / Σ_i ω_i: iteratively reweighted least
squares for that Huber loss, a majorize-minimize step (the loss only decreases) with the same
fixed point, identical to the paper's step while no row is clipped. It converges in tens of
steps where the paper's needs thousands; we stop once ‖v_{l+1} − v_l‖ ≤ ε or after max_iter.

Every iterate lies in v₀ + span{x_i − v₀}, so we run the iteration on span coordinates in
float64 with the centered Gram matrix (span.py): reads of x are the validity check, the
median start (a few), one Gram pass and one pass forming v, whatever the iteration count.
Weights must not be self-reported by untrusted peers: clip or fix them before calling.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from phalanx.aggregation.base import (
    AggregateResult,
    check_int,
    check_matrix,
    check_nonnegative,
    check_positive,
    check_vector,
    check_weights,
    prepare,
)
from phalanx.aggregation.coordinatewise import mean, median_of_rows
from phalanx.aggregation.span import centered_gram, combine, distances_to_point, row_sq_dists, span_norm, weighted_row_sum

TAU_HINT = "inf gives the mean"


def clip_coefficients(x: Tensor, v: Tensor, tau: float) -> Tensor:
    """min(1, τ/‖x_i − v‖) for every row: (n,) in x's dtype and device.

    Distances are computed directly with float64 sums (no cancellation), so peers checking
    a published aggregate v (random-projection verification) agree to rounding. A row at
    distance 0 gets coefficient 1.
    """
    tau = check_positive("tau", tau, allow_inf=True, hint=TAU_HINT)
    x = check_matrix(x)
    v = check_vector(v, x, "v")
    dist = row_sq_dists(x, v).sqrt_()
    coef = torch.where(dist > 0, (tau / dist).clamp_(max=1.0), torch.ones_like(dist))
    return coef.to(x.dtype)


def fixed_point_residual(x: Tensor, v: Tensor, tau: float, weights: Tensor | None = None) -> float:
    """‖Σ_i w_i (x_i − v)·min(1, τ/‖x_i − v‖)‖ / Σ_i w_i, evaluated directly at v (float64 sums).

    Independent of how v was found: what a verifier computes for the published aggregate.
    """
    x = check_matrix(x)
    v = check_vector(v, x, "v")
    checked = check_weights(weights, x.shape[0], x)
    w = torch.ones(x.shape[0], dtype=torch.float64, device=x.device) if checked is None else checked.double()
    coef = w * clip_coefficients(x, v, tau).to(torch.float64)
    return float(torch.linalg.vector_norm(weighted_row_sum(x, v, coef)) / w.sum())


def centered_clip(
    x: Tensor,
    weights: Tensor | None = None,
    *,
    tau: float,
    eps: float = 1e-6,
    max_iter: int = 500,
    start: Tensor | None = None,
) -> AggregateResult:
    """CenteredClip aggregate of the finite rows of x: (d,), plus iterations and FP residual.

    tau: clipping radius in the units of x (BTARD used 1 and 10); inf gives the weighted mean.
    eps: stop once a step moves v by at most eps (L2). max_iter: hard cap on iterations.
    start: v₀; default the (unweighted) coordinate-wise median of the rows with positive weight.
    residual: ‖Σ_i w_i (x_i − v)·min(1, τ/‖x_i − v‖)‖ / Σ_i w_i at the returned v, at most
    the length of the step the iteration would take next (exact arithmetic on the float64
    iterate; the final rounding of v to x's dtype adds at most about eps_dtype·‖v‖).
    """
    tau = check_positive("tau", tau, allow_inf=True, hint=TAU_HINT)
    eps = check_nonnegative("eps", eps)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    rows = prepare(x, weights)
    if start is not None:
        start = check_vector(start, rows.x, "start")
    if math.isinf(tau):
        return AggregateResult(mean(rows.x, rows.weights).value, excluded=rows.excluded)
    if start is None:  # unweighted median of the rows that count: fast, and robust enough to start from
        start = median_of_rows(rows.x if rows.weights is None else rows.x[rows.weights > 0])
    gram = centered_gram(rows.x, start)  # (n, n) float64, centered at v₀
    w = np.ones(rows.n) if rows.weights is None else rows.weights.double().cpu().numpy()
    beta, iterations, residual = _iterate(gram, w / w.sum(), tau, eps, max_iter)
    return AggregateResult(combine(rows.x, start, beta), iterations, residual, rows.excluded)


def _residual(gram: np.ndarray, w: np.ndarray, beta: np.ndarray, tau: float) -> tuple[np.ndarray, float]:
    """Span coordinates of the FP residual Σ_i ω_i (x_i − v) at v = v₀ + Σ_j β_j (x_j − v₀), and Σ_i ω_i.

    ω_i = w_i·min(1, τ/‖x_i − v‖), with w summing to 1.
    """
    dist = distances_to_point(gram, beta)
    omega = w * np.minimum(1.0, tau / np.maximum(dist, np.finfo(np.float64).tiny))
    return omega - omega.sum() * beta, float(omega.sum())  # Σ ω_i (x_i − v₀) − (Σ ω_i)(v − v₀)


def _iterate(gram: np.ndarray, w: np.ndarray, tau: float, eps: float, max_iter: int) -> tuple[np.ndarray, int, float]:
    """Run the reweighted iteration in span coordinates. Returns (β, iterations, FP residual at β)."""
    beta = np.zeros(len(w))
    residual, total = _residual(gram, w, beta, tau)
    iterations = 0
    while True:
        step = residual / total  # to Σ ω_i x_i / Σ ω_i; total > 0 as every ω_i > 0
        beta = beta + step
        iterations += 1
        moved = span_norm(gram, step)  # ‖v_{l+1} − v_l‖
        residual, total = _residual(gram, w, beta, tau)
        if moved <= eps or iterations >= max_iter:
            return beta, iterations, span_norm(gram, residual)

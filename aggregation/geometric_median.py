"""Geometric median by smoothed Weiszfeld (RFA, Pillutla et al.).

Iteration: β_i = w_i / max(ν, ‖x_i − v‖), v ← Σ β_i x_i / Σ β_i, for ``iters`` steps or
until a step moves v by at most ε. The smoothing ν keeps a point sitting on a row from
dividing by zero. Iterates are affine combinations of the rows, so like CenteredClip we
iterate in span coordinates (span.py): one Gram pass and one pass forming v.

Start: the weighted mean of the ⌈n/2⌉ most central rows (least weighted distance to the
others), found free from the Gram matrix. RFA starts from the mean, which a few far-away
Byzantine rows (×1000) drag so far that a few iterations do not bring it back; starting on
a single row (the medoid) instead would stall Weiszfeld there when ν is small.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from aggregation.base import AggregateResult, check_int, check_nonnegative, check_positive, prepare
from aggregation.span import centered_gram, combine, distances_to_point, median_norm_row, pairwise_sq_dists, span_norm


def geometric_median(
    x: Tensor,
    weights: Tensor | None = None,
    *,
    nu: float = 0.1,
    iters: int = 8,
    eps: float = 1e-6,
) -> AggregateResult:
    """Smoothed-Weiszfeld geometric median of the finite rows: (d,).

    nu: smoothing distance in the units of x. iters: at most this many Weiszfeld steps.
    eps: stop early once a step moves v by at most eps.
    residual: the length of the next Weiszfeld step from the returned v (0 at the fixed point).
    """
    nu = check_positive("nu", nu)
    iters = check_int("iters", iters, minimum=1)
    eps = check_nonnegative("eps", eps)
    rows = prepare(x, weights)
    n = rows.n
    anchor = rows.x[median_norm_row(rows.norms)]
    gram = centered_gram(rows.x, anchor)  # (n, n) float64
    w = np.ones(n) if rows.weights is None else rows.weights.double().cpu().numpy()
    central = np.argsort(np.sqrt(pairwise_sq_dists(gram)) @ w, kind="stable")[: (n + 1) // 2]
    alpha = np.zeros(n)
    alpha[central] = w[central] / w[central].sum()  # v = a + Σ α_j (x_j − a), Σ α = 1
    nxt = _weiszfeld(gram, w, alpha, nu)
    iterations = 0
    while True:
        step = nxt - alpha
        alpha = nxt
        iterations += 1
        nxt = _weiszfeld(gram, w, alpha, nu)
        if span_norm(gram, step) <= eps or iterations >= iters:
            break
    return AggregateResult(combine(rows.x, anchor, alpha), iterations, span_norm(gram, nxt - alpha), rows.excluded)


def _weiszfeld(gram: np.ndarray, w: np.ndarray, alpha: np.ndarray, nu: float) -> np.ndarray:
    """One smoothed Weiszfeld step in span coordinates: the new α (sums to 1)."""
    beta = w / np.maximum(distances_to_point(gram, alpha), nu)
    return beta / beta.sum()

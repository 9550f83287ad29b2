"""Krum and Multi-Krum (Blanchard et al.): pick the rows closest to their n − b − 2 nearest neighbours.

score(i) = Σ of the n − b − 2 smallest ‖x_i − x_j‖², j ≠ i. Krum returns the row with the
lowest score; Multi-Krum averages the m lowest. Needs n > 2b + 2. Pairwise distances come
from one centered Gram pass (span.py), so the cost is n²·d flops and one read of x.
Ties in score go to the lower row index.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from phalanx.aggregation.base import AggregateResult, Rows, check_int, effective_b, excluded_note, prepare
from phalanx.aggregation.span import centered_gram, combine, median_norm_row, pairwise_sq_dists
from phalanx.errors import AggregationInputError


def _scores(sq: np.ndarray, k: int) -> np.ndarray:
    """Sum of the k smallest off-diagonal entries of each row of the (n, n) squared distances."""
    off = sq + np.diag(np.full(sq.shape[0], np.inf))  # a row is not its own neighbour
    return np.sort(off, axis=1)[:, :k].sum(axis=1)


def krum(x: Tensor, b: int, weights: Tensor | None = None) -> AggregateResult:
    """The row with the lowest Krum score (a copy). Weights only drop zero-weight rows."""
    return multi_krum(x, b, 1, weights)


def multi_krum(x: Tensor, b: int, m: int, weights: Tensor | None = None) -> AggregateResult:
    """Weighted average of the m rows with the lowest Krum scores (m = 1 is Krum).

    Selection ignores weights (a weight cannot make a far row near); they weight the
    average and drop zero-weight rows. Each non-finite row excluded lowers b by one; m is
    capped at the n − b rows that can be honest.
    """
    b = check_int("b", b, minimum=0)
    m = check_int("m", m, minimum=1)
    rows = prepare(x, weights, drop_zero_weight=True)
    n, b_eff = rows.n, effective_b(b, rows.excluded)
    _require_rows("multi_krum" if m > 1 else "krum", rows, b, b_eff)
    anchor = rows.x[median_norm_row(rows.norms)]
    scores = _scores(pairwise_sq_dists(centered_gram(rows.x, anchor)), n - b_eff - 2)
    chosen = np.argsort(scores, kind="stable")[: min(m, n - b_eff)]
    if len(chosen) == 1:
        return AggregateResult(rows.x[int(chosen[0])].clone(), excluded=rows.excluded)
    w = np.ones(n) if rows.weights is None else rows.weights.double().cpu().numpy()
    coef = np.zeros(n)
    coef[chosen] = w[chosen] / w[chosen].sum()  # sums to 1, so combine returns the exact average
    return AggregateResult(combine(rows.x, anchor, coef), excluded=rows.excluded)


def _require_rows(name: str, rows: Rows, b: int, b_eff: int) -> None:
    n = rows.n
    if not n > 2 * b_eff + 2:
        raise AggregationInputError(
            f"{name} needs n > 2*b + 2 rows, got n={n} and b={b_eff}"
            f"{excluded_note(rows.excluded, b)}; lower b or add rows"
        )

"""Coordinate-wise rules: weighted mean (no robustness), median and trimmed mean.

Median semantics: for an even number of rows, the average of the two middle values (as
numpy.median), not torch.median's lower one; it is symmetric under negation.
Unweighted (or uniformly weighted) inputs on CPU take the comparator-network fast path
(sortnet.py, a few reads of x); weighted inputs and CUDA sort along dim 0 in column chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from phalanx.aggregation.base import AggregateResult, Rows, check_int, effective_b, excluded_note, prepare
from phalanx.aggregation.sortnet import median_program, middle_program, run_program
from phalanx.errors import AggregationInputError

_SORT_CHUNK_ELEMS = 1 << 24  # (n, chunk) values + int64 indices per sorted chunk: ~200 MB in float32


def mean(x: Tensor, weights: Tensor | None = None) -> AggregateResult:
    """Weighted average of the finite rows: the baseline, with zero robustness."""
    rows = prepare(x, weights)
    return AggregateResult(_mean_rows(rows), excluded=rows.excluded)


def _mean_rows(rows: Rows) -> Tensor:
    if rows.weights is None:
        return rows.x.mean(dim=0)
    return (rows.weights @ rows.x) / rows.weights.sum()


def coordinate_median(x: Tensor, weights: Tensor | None = None) -> AggregateResult:
    """Per-coordinate median; the average of the two middle values when their count is even.

    Weights give the weighted median: the value where the cumulative weight crosses half
    the total, averaged with the next value when it lands exactly on half. Zero-weight rows
    are ignored.
    """
    rows = prepare(x, weights, drop_zero_weight=True)
    if rows.weights is None:
        value = median_of_rows(rows.x)
    else:
        value = _sorted_reduce(rows.x, rows.weights, _weighted_median_sorted)
    return AggregateResult(value, excluded=rows.excluded)


def median_of_rows(x: Tensor) -> Tensor:
    """Unweighted coordinate-wise median of already validated finite rows: (d,)."""
    n = x.shape[0]
    if x.is_cuda:
        return _sorted_reduce(x, None, _weighted_median_sorted)
    return run_program(x, median_program(n), chunk=_network_chunk(n))


def trimmed_mean(x: Tensor, b: int, weights: Tensor | None = None) -> AggregateResult:
    """Per coordinate, drop the b largest and b smallest values and average the rest.

    Needs n > 2b. Non-finite rows are Byzantine rows already found, so each one excluded
    lowers b by one. With weights, the kept values are averaged with their rows' weights.
    """
    b = check_int("b", b, minimum=0)
    rows = prepare(x, weights, drop_zero_weight=True)
    n, b_eff = rows.n, effective_b(b, rows.excluded)
    if not n > 2 * b_eff:
        raise AggregationInputError(
            f"trimmed_mean needs n > 2*b rows, got n={n} and b={b_eff}"
            f"{excluded_note(rows.excluded, b)}; lower b or add rows"
        )
    if b_eff == 0:
        value = _mean_rows(rows)
    elif rows.weights is None and not rows.x.is_cuda:
        value = run_program(rows.x, middle_program(n, b_eff), chunk=_network_chunk(n))
    else:
        value = _sorted_reduce(rows.x, rows.weights, lambda v, w: _weighted_middle_mean(v, w, b_eff))
    return AggregateResult(value, excluded=rows.excluded)


def _network_chunk(n: int) -> int:
    """Columns per network chunk, measured on CPU: 131072 up to n = 32, ~16 MB of live rows beyond.

    Larger chunks amortize the Python and threading overhead of each op; smaller ones stay in cache.
    """
    return max(32768, min(131072, (1 << 22) // n))


def _sorted_reduce(x: Tensor, weights: Tensor | None, reduce: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Sort each column chunk along dim 0 and reduce (values, weights), both (n, c): (d,).

    The path for weights and for CUDA (whose sort handles small dims well; untimed here).
    """
    n, d = x.shape
    w = weights if weights is not None else torch.ones(n, dtype=x.dtype, device=x.device)
    chunk = max(1, _SORT_CHUNK_ELEMS // n)
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    for start in range(0, d, chunk):
        values, idx = torch.sort(x[:, start : start + chunk], dim=0)  # (n, chunk) each
        out[start : start + chunk] = reduce(values, w[idx])
    return out


def _weighted_median_sorted(values: Tensor, w: Tensor) -> Tensor:
    """Weighted median of sorted columns ``values`` with matching weights ``w``, both (n, c)."""
    n = values.shape[0]
    cum = w.cumsum(dim=0)  # (n, c)
    half = cum[-1] / 2
    lo = (cum < half).sum(dim=0).clamp_(max=n - 1)  # first index where cum >= half
    hi = (cum <= half).sum(dim=0).clamp_(max=n - 1)  # first index where cum > half
    return (values.gather(0, lo[None]) + values.gather(0, hi[None]))[0] / 2


def _weighted_middle_mean(values: Tensor, w: Tensor, b: int) -> Tensor:
    """Weighted mean of sorted rows b..n−b−1 of ``values`` (n, c); all weights there are > 0."""
    n = values.shape[0]
    v, ww = values[b : n - b], w[b : n - b]
    return (v * ww).sum(dim=0) / ww.sum(dim=0)

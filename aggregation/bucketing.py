"""Bucketing (Karimireddy, He & Jaggi): average random buckets of s rows, then aggregate the bucket means.

Averaging first shrinks the spread between honest inputs (non-IID data) by about √s, so
a robust rule on the bucket means loses less to honest heterogeneity. The price: a bucket
with a Byzantine row is Byzantine, so b Byzantine rows spoil up to b of ⌈n/s⌉ buckets and
the inner rule needs b < ⌈n/s⌉/2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from phalanx.aggregation.base import AggregateResult, check_int, prepare

Aggregator = Callable[[Tensor, "Tensor | None"], AggregateResult]


def bucket_means(x: Tensor, weights: Tensor | None, s: int, perm: Tensor) -> tuple[Tensor, Tensor | None]:
    """Weighted means of buckets perm[0:s], perm[s:2s], … (the last may be smaller) and their weights.

    One (k, n) @ (n, d) product: x is read once and never copied. Returns ((k, d), (k,) or
    None when every bucket weighs the same).
    """
    n = x.shape[0]
    k = -(-n // s)  # ceil
    w = torch.ones(n, dtype=x.dtype, device=x.device) if weights is None else weights
    bucket_of = torch.empty(n, dtype=torch.long, device=x.device)
    bucket_of[perm.to(x.device)] = torch.arange(n, device=x.device) // s
    mix = torch.zeros(k, n, dtype=x.dtype, device=x.device)
    mix[bucket_of, torch.arange(n, device=x.device)] = w  # (k, n): row j holds bucket j's weights
    totals = mix.sum(dim=1)  # (k,)
    means = (mix / totals.clamp_min(torch.finfo(x.dtype).tiny)[:, None]) @ x  # (k, d)
    keep = totals > 0  # a bucket of zero-weight rows carries nothing
    if not bool(keep.all()):
        means, totals = means[keep], totals[keep]
    return means, None if bool(totals.min() == totals.max()) else totals


def bucketing(
    x: Tensor,
    s: int,
    inner: Aggregator,
    weights: Tensor | None = None,
    *,
    generator: torch.Generator,
) -> AggregateResult:
    """Randomly permute the finite rows (seeded ``generator``), average buckets of s, apply ``inner``.

    inner: any aggregator ``(x, weights) -> AggregateResult``, called on the bucket means
    with the bucket weights (sum of the row weights). The result carries inner's value,
    iterations and residual, and the rows this call excluded.
    """
    s = check_int("s", s, minimum=1)
    rows = prepare(x, weights)
    perm = torch.randperm(rows.n, generator=generator, device=generator.device)
    means, bucket_weights = bucket_means(rows.x, rows.weights, s, perm)
    result = inner(means, bucket_weights)
    return AggregateResult(result.value, result.iterations, result.residual, rows.excluded)

"""Krum and Multi-Krum (aggregation/krum.py) against a loop implementation."""

from __future__ import annotations

import pytest
import torch

from phalanx.aggregation.krum import krum, multi_krum
from phalanx.errors import AggregationInputError


def loop_scores(x, b):
    n = x.shape[0]
    scores = []
    for i in range(n):
        d = sorted(float(((x[i] - x[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(d[: n - b - 2]))
    return scores


@pytest.mark.parametrize(("n", "b"), [(5, 0), (7, 2), (12, 3), (15, 6)])
def test_krum_picks_the_loop_argmin(n, b, device, make_honest):
    x = make_honest(n, 50, seed=n, offset=30.0)
    x[:b] += torch.randn(b, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    scores = loop_scores(x, b)
    result = krum(x.to(device), b=b)
    assert torch.equal(result.value.cpu(), x[scores.index(min(scores))])


@pytest.mark.parametrize("m", [1, 3, 6])
def test_multi_krum_averages_the_m_best(m, device, make_honest):
    x = make_honest(10, 40, seed=2)
    w = torch.linspace(1.0, 2.0, 10, dtype=torch.float64)
    scores = loop_scores(x, 2)
    best = sorted(range(10), key=lambda i: scores[i])[:m]
    result = multi_krum(x.to(device), 2, m, w.to(device))
    expected = (w[best] @ x[best]) / w[best].sum()
    torch.testing.assert_close(result.value.cpu(), expected)


def test_multi_krum_caps_m_at_rows_that_can_be_honest(make_honest):
    x = make_honest(8, 20, seed=3)
    torch.testing.assert_close(multi_krum(x, b=2, m=100).value, multi_krum(x, b=2, m=6).value)


def test_permutation_invariance(device, make_honest):
    x = make_honest(11, 30, seed=4).to(device)
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(0)).to(device)
    for fn in (lambda x: krum(x, b=3), lambda x: multi_krum(x, b=3, m=4)):
        torch.testing.assert_close(fn(x[perm]).value, fn(x).value)


def test_krum_needs_more_than_2b_plus_2_rows():
    with pytest.raises(AggregationInputError) as e:
        krum(torch.zeros(6, 3), b=2)
    assert str(e.value) == "krum needs n > 2*b + 2 rows, got n=6 and b=2; lower b or add rows"
    with pytest.raises(AggregationInputError) as e:
        multi_krum(torch.zeros(4, 3), b=1, m=2)
    assert str(e.value) == "multi_krum needs n > 2*b + 2 rows, got n=4 and b=1; lower b or add rows"


def test_krum_counts_excluded_rows_against_b():
    x = torch.randn(8, 3)
    x[[0, 1]] = float("nan")
    with pytest.raises(AggregationInputError) as e:
        krum(x, b=4)
    assert str(e.value) == (
        "krum needs n > 2*b + 2 rows, got n=6 and b=2 (after excluding 2 non-finite rows, "
        "which count against b=4); lower b or add rows"
    )
    assert krum(x, b=3).excluded == (0, 1)  # n=6 > 2*1 + 2

"""Comparator networks (aggregation/sortnet.py) against numpy order statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx.aggregation.sortnet import batcher_pairs, median_program, middle_program, run_program


@pytest.mark.parametrize("n", range(1, 41))
def test_batcher_network_sorts(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        v = list(rng.integers(0, 5, n))  # many ties
        for lo, hi in batcher_pairs(n):
            if v[lo] > v[hi]:
                v[lo], v[hi] = v[hi], v[lo]
        assert v == sorted(v)


@pytest.mark.parametrize("n", range(1, 36))
def test_median_and_every_trim_match_numpy(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 301, generator=g, dtype=torch.float64)
    x[:, :50] = torch.randint(0, 3, (n, 50), generator=g).double()  # ties
    xs = np.sort(x.numpy(), axis=0)
    # chunk=64 exercises the chunk loop and a short last chunk
    np.testing.assert_allclose(run_program(x, median_program(n), chunk=64).numpy(), np.median(x.numpy(), axis=0))
    for b in range((n + 1) // 2):
        if 2 * b < n:
            got = run_program(x, middle_program(n, b), chunk=64).numpy()
            np.testing.assert_allclose(got, xs[b : n - b].mean(axis=0), rtol=1e-12, atol=1e-14)


def test_run_program_never_writes_its_input():
    x = torch.randn(9, 100)
    before = x.clone()
    run_program(x, middle_program(9, 2), chunk=32)
    run_program(x, median_program(9), chunk=32)
    assert torch.equal(x, before)


def test_cheapest_plan_is_picked():
    # peeling the min and max once is far cheaper than a pruned full sort
    assert middle_program(32, 1).cost < median_program(32).cost < 2 * len(batcher_pairs(32))


def test_middle_program_rejects_too_large_b():
    with pytest.raises(ValueError, match=r"need 0 <= 2\*b < n, got n=4, b=2"):
        middle_program(4, 2)

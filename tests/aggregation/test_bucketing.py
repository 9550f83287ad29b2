"""Bucketing (aggregation/bucketing.py): bucket means by hand, seeding, ragged buckets."""

from __future__ import annotations

import torch

from phalanx.aggregation.bucketing import bucketing
from phalanx.aggregation.coordinatewise import coordinate_median, mean


def test_inner_sees_the_bucket_means(device):
    x = torch.arange(30.0, dtype=torch.float64).view(6, 5).to(device)
    seen = {}

    def inner(means, weights):
        seen["means"], seen["weights"] = means, weights
        return mean(means, weights)

    result = bucketing(x, s=2, inner=inner, generator=torch.Generator().manual_seed(4))
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(4)).to(device)
    expected = x[perm].view(3, 2, 5).mean(dim=1)
    torch.testing.assert_close(seen["means"], expected)
    assert seen["weights"] is None
    torch.testing.assert_close(result.value, x.mean(dim=0))


def test_ragged_last_bucket_and_weights_are_carried():
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    seen = {}

    def inner(means, weights):
        seen["weights"] = weights
        return mean(means, weights)

    result = bucketing(x, 2, inner, w, generator=torch.Generator().manual_seed(1))
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(1))
    assert seen["weights"].tolist() == [float(w[perm[0:2]].sum()), float(w[perm[2:4]].sum()), float(w[perm[4]])]
    torch.testing.assert_close(result.value, (w @ x) / w.sum())  # weighted mean of weighted means


def test_same_seed_same_result_and_generator_advances():
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(2))
    a = bucketing(x, s=3, inner=coordinate_median, generator=torch.Generator().manual_seed(7))
    b = bucketing(x, s=3, inner=coordinate_median, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.value, b.value)
    g = torch.Generator().manual_seed(7)
    first = bucketing(x, s=3, inner=coordinate_median, generator=g).value
    later = [bucketing(x, s=3, inner=coordinate_median, generator=g).value for _ in range(5)]
    assert any(not torch.equal(first, v) for v in later)


def test_s_one_is_the_inner_rule():
    x = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    result = bucketing(x, s=1, inner=coordinate_median, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(result.value, coordinate_median(x).value)


def test_permutation_invariance_in_distribution_is_exact_for_the_mean():
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(6))
    a = bucketing(x, s=2, inner=mean, generator=torch.Generator().manual_seed(0)).value
    b = bucketing(x[perm], s=2, inner=mean, generator=torch.Generator().manual_seed(0)).value
    torch.testing.assert_close(a, b)

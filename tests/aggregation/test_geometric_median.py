"""Smoothed Weiszfeld (aggregation/geometric_median.py) against a loop implementation."""

from __future__ import annotations

import pytest
import torch

from aggregation.errors import AggregationInputError
from aggregation.geometric_median import geometric_median


def naive_weiszfeld(x, w, nu, iters, eps):
    n = x.shape[0]
    central = torch.argsort(torch.cdist(x, x) @ w, stable=True)[: (n + 1) // 2]
    v = (w[central] @ x[central]) / w[central].sum()  # start: weighted mean of the central half
    it = 0
    while it < iters:
        it += 1
        beta = w / torch.clamp((x - v).norm(dim=1), min=nu)
        new = (beta @ x) / beta.sum()
        moved, v = (new - v).norm(), new
        if moved <= eps:
            break
    return v, it


@pytest.mark.parametrize(("nu", "iters"), [(0.1, 8), (1.0, 3), (1e-3, 50)])
def test_matches_naive_weiszfeld(nu, iters, device, make_honest):
    x = make_honest(9, 60, seed=1, offset=5.0)
    x[:3] *= -20
    w = torch.linspace(0.5, 1.5, 9, dtype=torch.float64)
    result = geometric_median(x.to(device), w.to(device), nu=nu, iters=iters)
    ref, it = naive_weiszfeld(x, w, nu, iters, 1e-6)
    assert result.iterations == it
    torch.testing.assert_close(result.value.cpu(), ref, rtol=0, atol=1e-9)


def test_converged_geometric_median_has_zero_gradient(make_honest):
    x = make_honest(7, 30, seed=2)
    result = geometric_median(x, nu=1e-9, iters=500, eps=1e-12)
    diff = x - result.value
    grad = (diff / diff.norm(dim=1, keepdim=True)).sum(dim=0)  # subgradient of Σ‖x_i − v‖
    assert grad.norm() < 1e-6 and result.residual < 1e-10


def test_permutation_invariance(device, make_honest):
    x = make_honest(10, 40, seed=3).to(device)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0)).to(device)
    torch.testing.assert_close(geometric_median(x[perm]).value, geometric_median(x).value, rtol=0, atol=1e-10)


def test_bad_parameters():
    with pytest.raises(AggregationInputError) as e:
        geometric_median(torch.zeros(2, 2), nu=0.0)
    assert str(e.value) == "nu must be a positive finite number, got 0.0"

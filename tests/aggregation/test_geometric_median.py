"""Smoothed Weiszfeld (aggregation/geometric_median.py) against a loop implementation."""

from __future__ import annotations

import pytest
import torch

from phalanx.aggregation.attacks import apply_attack
from phalanx.aggregation.coordinatewise import coordinate_median, mean
from phalanx.aggregation.geometric_median import MAX_ITERS, geometric_median
from phalanx.aggregation.registry import make_aggregator
from phalanx.errors import AggregationInputError


def naive_weiszfeld(x, w, nu, iters, eps):
    v = coordinate_median(x, w).value  # start: the (weighted) coordinate median
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


def test_default_converges_under_sign_flip_where_eight_steps_lose_to_the_mean(make_honest):
    """7 of 16 rows send the flipped honest mean (‖noise‖ = 0.5, ‖μ‖ = 1): eight Weiszfeld steps from
    the central half's mean stopped at 1.16 from the honest mean, behind the mean's 0.89; converged: 0.58."""
    honest = make_honest(9, 10_000, seed=0, spread=0.5, offset=2.0)
    x = apply_attack("sign_flip", honest, 7, generator=torch.Generator().manual_seed(0))
    target = honest.mean(dim=0)
    mean_error = float((mean(x).value - target).norm())
    converged = geometric_median(x, iters=100_000, eps=1e-12)
    result = make_aggregator("geometric_median")(x)  # the default, as --aggregator geometric_median runs it
    error = float((result.value - target).norm())
    assert error < 0.7 * mean_error, (error, mean_error)
    assert abs(error - float((converged.value - target).norm())) < 1e-4
    assert result.residual <= 1e-6 and 8 < result.iterations < MAX_ITERS


def test_cap_reports_the_residual_left(make_honest):
    x = make_honest(9, 200, seed=4)
    x[:4] *= -3
    capped = geometric_median(x, iters=2, eps=0.0)
    assert capped.iterations == 2 and capped.residual > 1e-6
    done = geometric_median(x, eps=1e-9)
    assert 2 < done.iterations < MAX_ITERS and done.residual <= 1e-9

"""CenteredClip (aggregation/centered_clip.py): naive reference, fixed point, τ = ∞, precision."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.aggregation.centered_clip import centered_clip, clip_coefficients, fixed_point_residual
from phalanx.aggregation.coordinatewise import coordinate_median
from phalanx.errors import AggregationInputError


def naive_centered_clip(x, w, tau, eps, max_iter, v, reweighted=True):
    """On materialized differences (float64): the reweighted step v ← Σ ω_i x_i / Σ ω_i centered_clip
    takes, or (reweighted=False) the paper's step v ← v + Σ ω_i (x_i − v) as written in docs/algorithms.md."""
    w = w / w.sum()
    it = 0
    while it < max_iter:
        it += 1
        diff = x - v
        omega = w * torch.clamp(tau / diff.norm(dim=1), max=1.0)
        new = v + omega @ diff / (omega.sum() if reweighted else 1.0)
        moved, v = (new - v).norm(), new
        if moved <= eps:
            break
    return v, it


def _data(seed, n=12, d=300, byz=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) + 2.0
    x[:byz] *= -50.0  # far-away rows that get clipped
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.2
    return x, w


@pytest.mark.parametrize("tau", [0.5, 3.0, 30.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_naive_iteration(tau, weighted, device):
    x, w = _data(1)
    weights = w if weighted else None
    result = centered_clip(x.to(device), None if weights is None else weights.to(device), tau=tau)
    start = coordinate_median(x).value
    ref, iters = naive_centered_clip(x, w if weighted else torch.ones(12, dtype=torch.float64), tau, 1e-6, 500, start)
    assert result.iterations == iters
    torch.testing.assert_close(result.value.cpu(), ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("tau", [0.5, 3.0, 30.0])
def test_same_fixed_point_as_the_papers_step(tau):
    x, w = _data(9)
    start = coordinate_median(x).value
    papers, iters = naive_centered_clip(x, w, tau, 1e-12, 200_000, start, reweighted=False)
    assert iters < 200_000  # it did converge, slowly
    result = centered_clip(x, w, tau=tau, eps=1e-12, max_iter=10_000)
    assert result.iterations <= iters
    torch.testing.assert_close(result.value, papers, rtol=0, atol=1e-8)


@pytest.mark.parametrize("n", [4, 16])
def test_converges_when_rows_are_far_apart_in_units_of_tau(n):
    # BTARD's tau = 1 against gradient parts thousands of units apart: the paper's step moves v by
    # about tau per step, and 500 steps stop far from the fixed point the projection check assumes.
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 100_000, generator=g) * 10.0
    x[0] *= 50.0
    result = centered_clip(x, tau=1.0)
    assert result.iterations <= 100
    assert fixed_point_residual(x, result.value, 1.0) <= 1e-6 + 4 * 2**-24 * float(result.value.norm())


def test_given_start_is_used():
    x, w = _data(2)
    start = torch.full((300,), 5.0, dtype=torch.float64)
    result = centered_clip(x, w, tau=3.0, start=start, max_iter=2)
    ref, _ = naive_centered_clip(x, w, 3.0, 0.0, 2, start)
    torch.testing.assert_close(result.value, ref, rtol=0, atol=1e-10)
    assert result.iterations == 2


@pytest.mark.parametrize("weighted", [False, True])
def test_tau_inf_is_the_weighted_mean(weighted, device):
    x, w = _data(3)
    x, w = x.to(device), w.to(device)
    result = centered_clip(x, w if weighted else None, tau=math.inf)
    expected = (w @ x) / w.sum() if weighted else x.mean(dim=0)
    torch.testing.assert_close(result.value, expected)
    assert (result.iterations, result.residual) == (1, 0.0)


@pytest.mark.parametrize("eps", [1e-3, 1e-6, 1e-9])
def test_returned_point_satisfies_the_fixed_point_equation(eps, device):
    x, w = _data(4)
    result = centered_clip(x.to(device), w.to(device), tau=2.0, eps=eps)
    direct = fixed_point_residual(x.to(device), result.value, 2.0, w.to(device))
    # the residual at v_L is the next step, shorter than the last one (<= eps) for a contraction
    assert direct <= eps
    assert direct == pytest.approx(result.residual, rel=1e-6, abs=1e-12)


def test_float32_with_a_large_common_mean_stays_accurate(make_honest):
    # ‖μ‖ is 1000× the spread: the uncentered ‖x‖² − 2⟨x, v⟩ + ‖v‖² would lose every digit in float32
    x64 = make_honest(16, 20000, seed=5, spread=1.0, offset=1000.0)
    x64[:4] = -x64[:4]
    exact = centered_clip(x64, tau=0.5).value
    got = centered_clip(x64.float(), tau=0.5)
    assert (got.value.double() - exact).norm() <= 1e-3  # spread is 1; float32 rounding of v is ~1e-4
    assert fixed_point_residual(x64.float(), got.value, 0.5) <= 1e-6 + 4 * 2**-24 * float(exact.norm())


def test_max_iter_caps_iterations():
    x, w = _data(6)
    result = centered_clip(x, w, tau=0.1, eps=0.0, max_iter=7)
    assert result.iterations == 7 and result.residual > 0


def test_permutation_invariance(device):
    x, w = _data(7)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    a = centered_clip(x.to(device), w.to(device), tau=1.0)
    b = centered_clip(x[perm].to(device), w[perm].to(device), tau=1.0)
    torch.testing.assert_close(a.value, b.value, rtol=0, atol=1e-10)
    assert a.iterations == b.iterations


def test_clip_coefficients_match_naive(device):
    x, _ = _data(8)
    v = torch.randn(300, dtype=torch.float64)
    got = clip_coefficients(x.to(device), v.to(device), 4.0)
    torch.testing.assert_close(got.cpu(), torch.clamp(4.0 / (x - v).norm(dim=1), max=1.0))
    assert clip_coefficients(x[:1], x[0], 1.0).item() == 1.0  # distance 0
    assert torch.equal(clip_coefficients(x, v, math.inf), torch.ones(12, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tau": 0.0}, "tau must be a positive number (inf gives the mean), got 0.0"),
        ({"tau": 1.0, "eps": -1.0}, "eps must be a finite number >= 0, got -1.0"),
        ({"tau": 1.0, "max_iter": 0}, "max_iter must be an integer >= 1, got 0"),
        ({"tau": 1.0, "start": torch.zeros(4)}, "start must have shape (d,) = (3,), got (4,)"),
        ({"tau": 1.0, "start": torch.tensor([0.0, math.nan, 0.0])}, "start must be finite, got NaN or Inf"),
    ],
)
def test_bad_parameters(kwargs, message):
    with pytest.raises(AggregationInputError) as e:
        centered_clip(torch.zeros(2, 3), **kwargs)
    assert str(e.value) == message

"""SA, Gap-Aware and DC-ASGD (aggregation/staleness.py)."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.aggregation.staleness import GapAware, dc_asgd, staleness_aware
from phalanx.errors import AggregationInputError


def test_staleness_aware():
    g = torch.ones(3)
    assert staleness_aware(g, 0).tolist() == [1.0] * 3
    assert staleness_aware(g, 1).tolist() == [1.0] * 3
    assert staleness_aware(g, 4).tolist() == [0.25] * 3


def test_dc_asgd():
    g, delta = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0])
    assert dc_asgd(g, delta).tolist() == pytest.approx([1.0 + 0.04 * 0.5, -2.0 + 0.04 * 4.0])
    assert dc_asgd(g, delta, lam=0.0).tolist() == g.tolist()


def _history(seed: int, steps: int = 200, d: int = 64) -> tuple[GapAware, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ga = GapAware(lr_max=0.1)
    seen = []
    for _ in range(steps):
        step = torch.randn(d, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, d, dtype=torch.float64)
        ga.observe(step)
        seen.append(step)
    return ga, seen


def test_bias_corrected_statistic_and_threshold():
    ga = GapAware(lr_max=0.5)
    ga.observe(torch.tensor([2.0, -4.0], dtype=torch.float64))
    # after one step v̂ = step² exactly, so C = η_max·(|step| + 1e-8)
    assert ga.threshold().tolist() == pytest.approx([0.5 * (2 + 1e-8), 0.5 * (4 + 1e-8)])


def test_zero_gap_is_the_plain_update():
    ga, _ = _history(0)
    grad = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    corrected, gap = ga.correct(grad, torch.zeros(64, dtype=torch.float64))
    assert torch.equal(gap, torch.ones(64, dtype=torch.float64))
    assert torch.equal(corrected, grad)


@pytest.mark.parametrize("tau", [1, 2, 5, 16])
def test_gap_of_tau_bounded_steps_is_at_most_one_plus_tau(tau):
    ga, _ = _history(1)
    c = ga.threshold()
    g = torch.Generator().manual_seed(tau)
    steps = [c * (2 * torch.rand(64, generator=g, dtype=torch.float64) - 1) for _ in range(tau)]  # |step| <= C
    gap = ga.penalty(sum(steps))
    assert bool((gap <= 1 + tau + 1e-12).all())
    worst = ga.penalty(tau * c)  # all τ steps of size C in the same direction
    torch.testing.assert_close(worst, torch.full_like(worst, 1.0 + tau))


@pytest.mark.parametrize("tau", [2, 4, 16])
def test_gap_is_below_sa_when_steps_cancel(tau):
    ga, _ = _history(2)
    c = ga.threshold()
    steps = [c * (-1) ** k for k in range(tau)]  # oscillating: |Δ| <= C
    gap = ga.penalty(sum(steps))
    assert bool((gap <= 2.0 + 1e-12).all())
    sa_divisor = max(1, tau)
    assert bool((gap <= sa_divisor).all())  # GA penalizes no more than SA here
    if tau >= 4:
        assert float(gap.mean()) < sa_divisor / 2  # and much less


def test_feeding_back_penalized_steps_would_over_penalize():
    # the documented failure mode: observe() must get the unpenalized step
    honest, steps = _history(3)
    delta = 5 * honest.threshold()
    looped = GapAware(lr_max=0.1)
    looped.observe(steps[0])
    for step in steps[1:]:
        looped.observe(step / looped.penalty(delta))  # wrong on purpose
    assert float(looped.penalty(delta).mean()) > float(honest.penalty(delta).mean())


def test_errors():
    with pytest.raises(AggregationInputError) as e:
        GapAware(lr_max=0.1).penalty(torch.zeros(2))
    assert str(e.value) == "GapAware needs at least one observe() before a penalty: C is undefined"
    ga = GapAware(lr_max=0.1)
    ga.observe(torch.ones(3))
    with pytest.raises(AggregationInputError) as e:
        ga.correct(torch.ones(3), torch.ones(4))
    assert str(e.value) == "g and delta must have the same shape, got (3,) and (4,)"
    with pytest.raises(AggregationInputError) as e:
        ga.observe(torch.tensor([1.0, math.nan, 0.0]))
    assert str(e.value) == "unpenalized_step is not finite; GapAware would carry NaN forever"
    with pytest.raises(AggregationInputError) as e:
        GapAware(lr_max=0.0)
    assert str(e.value) == "lr_max must be a positive finite number, got 0.0"
    with pytest.raises(AggregationInputError) as e:
        staleness_aware(torch.ones(1), -1)
    assert str(e.value) == "tau must be a finite number >= 0, got -1"

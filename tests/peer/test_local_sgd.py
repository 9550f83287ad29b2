"""The asynchronous modes' math: LASGD's merge, staleness corrections (as aggregation says), DANA's
look-ahead, and the straggler delays."""

import asyncio

import pytest
import torch

from phalanx.aggregation.staleness import GapAware, staleness_aware
from phalanx.errors import ConfigError
from phalanx.peer.local_sgd import LocalState, StalenessCorrection, look_ahead, merge
from phalanx.peer.slowdown import parse_slowdown


def test_merge_keeps_local_progress():
    g = torch.Generator().manual_seed(0)
    snapshot, average = torch.randn(100, generator=g), torch.randn(100, generator=g)
    progress = torch.randn(100, generator=g)  # steps taken while the exchange was in flight
    merged = merge(average, snapshot + progress, snapshot)
    assert torch.allclose(merged - average, progress)
    assert torch.equal(merge(average, snapshot, snapshot), average)  # no progress: just the average


def _state(version, base, snapshot):
    state = LocalState(base=base, version=version)
    state.snapshot = snapshot
    return state


def test_fresh_contribution_is_untouched():
    base, snap = torch.zeros(10), torch.ones(10)
    correction = StalenessCorrection("gap_aware", lr=0.1)
    correction.observe(torch.full((10,), 0.5))

    async def never(i):
        raise AssertionError("a fresh peer must not download")

    part = asyncio.run(_state(4, base, snap).contribution([4, 3, 4], never, correction, max_gap=8))
    assert torch.equal(part.update, snap - base) and part.weight == 1.0 and part.penalty.gap_versions == 0
    assert part.base_ref is base


@pytest.mark.parametrize("method", ["gap_aware", "sa", "dc", "none"])
def test_stale_contribution_is_corrected_as_aggregation_says(method):
    g = torch.Generator().manual_seed(1)
    own_base, ref_base = torch.randn(50, generator=g), torch.randn(50, generator=g)
    snapshot = own_base + 0.1 * torch.randn(50, generator=g)
    steps = [0.3 * torch.randn(50, generator=g) for _ in range(5)]
    correction = StalenessCorrection(method, lr=0.05)
    reference = GapAware(0.05)
    for step in steps:
        correction.observe(step)
        reference.observe(step)
    fetched = []

    async def fetch(i):
        fetched.append(i)
        return ref_base

    part = asyncio.run(_state(2, own_base, snapshot).contribution([2, 5, 4], fetch, correction, max_gap=8))
    update, delta = snapshot - own_base, ref_base - own_base
    expected = {
        "gap_aware": reference.correct(update, delta)[0],
        "sa": staleness_aware(update, 3),
        "dc": -0.05 * (-(update / 0.05) + 0.04 * (update / 0.05) ** 2 * delta),
        "none": update,
    }[method]
    assert fetched == [1]  # the freshest member's base
    assert torch.allclose(part.update, expected, atol=1e-6)
    assert part.base_ref is ref_base and part.penalty.gap_versions == 3


def test_too_far_behind_gives_up_its_progress():
    async def fetch(i):
        return torch.full((5,), 7.0)

    part = asyncio.run(_state(0, torch.zeros(5), torch.ones(5)).contribution([0, 20], fetch, StalenessCorrection("sa", 0.1), max_gap=8))
    assert part.weight == 0.0 and torch.count_nonzero(part.update) == 0
    assert torch.equal(part.reset_to, torch.full((5,), 7.0)) and part.penalty.method == "download"


def test_dana_look_ahead_position_equals_the_formula():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):  # build some momentum
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    buffers = [opt.state[p]["momentum_buffer"] for p in params]
    with look_ahead(params, buffers, lr=0.1, momentum=0.9):
        for p, theta, v in zip(params, before, buffers):
            assert torch.allclose(p, theta - 0.1 * 0.9 * v)
    for p, theta in zip(params, before):
        assert torch.equal(p, theta)  # restored exactly afterwards


@pytest.mark.parametrize(
    "spec, mean",
    [("const:0.2", 0.2), ("exp:0.5", 0.5), ("shifted-exp:0.1:0.4", 0.5), ("pareto:0.1:3", 0.15)],
)
def test_slowdown_draws_have_the_documented_mean(spec, mean):
    slowdown = parse_slowdown(spec)
    rng = slowdown.sampler(0, "peer")
    draws = [slowdown.draw(rng) for _ in range(20000)]
    assert abs(sum(draws) / len(draws) - mean) < 0.05 * mean + 1e-9
    again = slowdown.sampler(0, "peer")
    assert [slowdown.draw(again) for _ in range(5)] == draws[:5]


@pytest.mark.parametrize("spec", ["zzz:1", "exp", "exp:x", "exp:-1", "pareto:1:0"])
def test_bad_slowdown_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="--slowdown"):
        parse_slowdown(spec)

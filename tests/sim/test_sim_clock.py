"""sim/clock.py: delay models, per-worker determinism, volunteer churn."""

from __future__ import annotations

import statistics

import pytest

from phalanx.errors import ConfigError
from phalanx.sim.clock import DELAYS, VolunteerClock, VolunteerParams, make_clocks


def draws(clock, count=2000):
    t, out = 0.0, []
    for _ in range(count):
        end = clock.finish(t)
        out.append(end - t)
        t = end
    return out


def test_const_is_exactly_one():
    assert draws(make_clocks("const", 1, seed=0)[0], 10) == [1.0] * 10


@pytest.mark.parametrize("name", ["exp", "shifted-exp", "gamma"])
def test_random_models_have_mean_one(name):
    assert statistics.fmean(draws(make_clocks(name, 1, seed=3)[0])) == pytest.approx(1.0, abs=0.07)


def test_shifted_exp_never_below_its_shift():
    assert min(draws(make_clocks("shifted-exp", 1, seed=0, shift=0.8)[0], 500)) >= 0.8


@pytest.mark.parametrize("name", DELAYS)
def test_a_workers_delays_depend_only_on_seed_and_index(name):
    a = draws(make_clocks(name, 4, seed=5)[2], 50)
    b = draws(make_clocks(name, 8, seed=5)[2], 50)
    c = draws(make_clocks(name, 8, seed=5)[3], 50)
    assert a == b
    assert name == "const" or a != c


def test_volunteer_work_only_progresses_while_online():
    clock = make_clocks("volunteer", 1, seed=1, online_mean=5.0, offline_mean=50.0)[0]
    assert isinstance(clock, VolunteerClock)
    t = 0.0
    for _ in range(200):
        end = clock.finish(t)
        # online time inside [t, end] is the work; the rest was spent offline
        assert end >= t
        t = end
    leave, back = clock._leave[0], clock._back[0]
    assert clock.online(leave - 1e-9) and not clock.online(leave + 1e-9) and clock.online(back + 1e-9)
    # a minibatch started just before the first departure ends after the return
    fresh = make_clocks("volunteer", 1, seed=1, online_mean=5.0, offline_mean=50.0, tail_prob=0.0)[0]
    first_leave, first_back = fresh._leave[0], fresh._back[0]
    assert fresh.finish(first_leave - 1e-6) > first_back


def test_volunteer_speeds_are_persistent_and_spread():
    speeds = [c.speed for c in make_clocks("volunteer", 64, seed=0)]
    assert 0.8 < statistics.fmean(speeds) < 1.2
    assert max(speeds) / min(speeds) > 3


def test_volunteer_churn_gives_long_delays():
    clock = make_clocks("volunteer", 1, seed=2, tail_prob=0.0)[0]
    d = draws(clock, 3000)
    assert max(d) > 5 * statistics.median(d)  # someone left mid-minibatch
    assert VolunteerParams().offline_mean == 10.0


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("weibull", {}, "unknown delay model 'weibull'; valid names: const, exp, shifted-exp, gamma, volunteer"),
        ("exp", {"rate": 2}, "delay exp: unknown parameter(s) rate; valid parameters: none"),
        ("shifted-exp", {"shift": 1.5}, r"delay shifted-exp: shift must be in \[0, 1\)"),
        ("gamma", {"shape": 0}, "delay gamma: shape must be > 0, got 0.0"),
        ("volunteer", {"speed": 1}, "delay volunteer: unknown parameter(s) speed"),
        ("volunteer", {"offline_mean": 0}, "delay volunteer: online_mean, offline_mean and tail_alpha must be > 0"),
    ],
)
def test_errors(name, params, message):
    with pytest.raises(ConfigError, match=message.replace("(s)", r"\(s\)")):
        make_clocks(name, 2, seed=0, **params)

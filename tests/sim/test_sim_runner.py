"""The simulator's contract: N = 1 is plain SGD for every method, staleness is exact, runs are deterministic."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import ConfigError
from phalanx.sim.config import Budget, ByzantineConfig, SimConfig
from phalanx.sim.methods import METHODS
from phalanx.sim.runner import load_task, run_sim
from phalanx.tasks import compute_gradient, flat_params

STEPS = 24
NESTEROV = {"nag_asgd", "ga_momentum", "dana_zero", "dana_slim", "dana_ga", "grouped"}  # DANA with one worker too
HEAVY_BALL = {"multi_asgd", "lasgd", "gossip"}


def plain_sgd(momentum: float, nesterov: bool, steps: int, seed: int = 0) -> torch.Tensor:
    """One worker, torch's SGD on the model's own parameters, the task's compute_gradient."""
    task = load_task("digits-mlp")
    model = task.build_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=momentum, nesterov=nesterov)
    for step in range(steps):
        compute_gradient(task, model, seed, "sim-0", step, task.batch_size)
        opt.step()
    return flat_params(model)


@pytest.mark.parametrize("method", list(METHODS))
def test_one_worker_equals_plain_sgd(method):
    result = run_sim(SimConfig(method=method, workers=1, budget=Budget(kind="gradients", amount=STEPS), eval_points=2))
    assert result.gradients == STEPS
    assert result.mean_staleness == 0
    momentum = 0.9 if method in NESTEROV | HEAVY_BALL else 0.0
    expected = plain_sgd(momentum, method in NESTEROV, STEPS)
    torch.testing.assert_close(result.params, expected, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("method", ["asgd", "nag_asgd", "sa", "ga", "dana_zero", "dana_slim", "dana_ga", "dc_asgd"])
@pytest.mark.parametrize("n", [4, 8])
def test_const_delays_give_staleness_n_minus_1_after_warm_up(method, n):
    result = run_sim(
        SimConfig(method=method, workers=n, delay="const", budget=Budget(kind="gradients", amount=6 * n), eval_points=1)
    )
    # The first round all read θ0 at t = 0 and arrive together (ties by worker index): 0, 1, …, N − 1.
    assert result.staleness[:n] == list(range(n))
    assert result.staleness[n:] == [n - 1] * (5 * n)
    assert result.time_s == 6.0


def test_k_sync_has_no_staleness_and_k_async_with_k_n_is_ssgd():
    budget = Budget(kind="updates", amount=8)
    ssgd = run_sim(SimConfig(method="ssgd", workers=4, budget=budget, eval_points=2))
    k_async = run_sim(SimConfig(method="k_async", workers=4, sync="k:4", budget=budget, eval_points=2))
    assert ssgd.max_staleness == 0 and ssgd.gradients == 32
    assert k_async.max_staleness == 0
    torch.testing.assert_close(ssgd.params, k_async.params)
    assert ssgd.time_s == k_async.time_s


def test_k_sync_cancels_stragglers():
    result = run_sim(SimConfig(method="k_sync", workers=8, sync="k:2", budget=Budget(kind="updates", amount=5)))
    assert (result.updates, result.gradients, result.max_staleness) == (5, 10, 0)


@pytest.mark.parametrize("method", ["asgd", "dana_ga", "k_batch_async", "lasgd", "gossip", "adasync"])
def test_same_seed_same_result(method):
    config = SimConfig(method=method, workers=6, delay="volunteer", budget=Budget(kind="gradients", amount=60))
    a, b = run_sim(config), run_sim(config)
    assert a.curve == b.curve and a.staleness == b.staleness
    assert torch.equal(a.params, b.params)
    c = run_sim(SimConfig(method=method, workers=6, delay="volunteer", seed=1, budget=config.budget))
    assert not torch.equal(a.params, c.params)


@pytest.mark.parametrize("attack", ["sign_flip", "label_flip", "delayed", "alie"])
@pytest.mark.parametrize("method", ["ssgd", "asgd"])
def test_byzantine_run_with_b_zero_equals_the_honest_run(attack, method):
    budget = Budget(kind="gradients", amount=48)
    honest = run_sim(SimConfig(method=method, workers=4, budget=budget, aggregator="centered_clip:tau=1"))
    zero = run_sim(
        SimConfig(
            method=method,
            workers=4,
            budget=budget,
            aggregator="centered_clip:tau=1",
            byzantine=ByzantineConfig(count=0, attack=attack),
        )
    )
    assert zero.curve == honest.curve
    assert torch.equal(zero.params, honest.params)


def test_time_budget_stops_at_the_virtual_time():
    result = run_sim(SimConfig(method="asgd", workers=4, budget=Budget(kind="time", amount=10.0), eval_points=5))
    assert result.time_s == 10.0
    assert 20 <= result.gradients <= 80  # about 4 per unit of time
    assert [round(p.time_s, 6) for p in result.curve][-1] == 10.0


def test_curve_has_every_clock():
    result = run_sim(SimConfig(method="k_async", workers=4, budget=Budget(kind="gradients", amount=40), eval_points=4))
    assert result.curve[0].updates == 0 and result.curve[0].time_s == 0.0
    assert [p.gradients >= 10 * i for i, p in enumerate(result.curve)] == [True] * len(result.curve)
    assert result.curve[-1].k == 1  # default K = N/4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(method="sgd"), "unknown method 'sgd'; valid names: ssgd, k_sync"),
        (dict(method="asgd", sync="k:2"), "method 'asgd' is asynchronous with K = 1 by definition"),
        (dict(method="lasgd", byzantine=ByzantineConfig(count=1)), "Byzantine workers are simulated for parameter"),
        (dict(method="asgd", delay="weibull"), "unknown delay model 'weibull'; valid names: const, exp"),
        (dict(method="ssgd", aggregator="krum:b=x"), "b must be an integer >= 0, got 'x'"),
        (dict(method="ssgd", byzantine=ByzantineConfig(count=1, attack="bribe")), "unknown attack 'bribe'"),
        (dict(method="dana_zero", momentum=0.0), "method 'dana_zero' needs momentum > 0"),
    ],
)
def test_config_errors(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        run_sim(SimConfig(workers=4, budget=Budget(amount=4), **config))


def test_config_checks_fields_early():
    with pytest.raises(ConfigError, match=r"byzantine count must be in \[0, workers\) = \[0, 4\), got 4"):
        SimConfig(workers=4, byzantine=ByzantineConfig(count=4))
    with pytest.raises(ConfigError, match="budget kind must be one of gradients, updates, time, got 'epochs'"):
        Budget(kind="epochs")

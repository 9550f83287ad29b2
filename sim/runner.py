"""`run_sim(config)`: build the task, workers, method and adversary of one run, run it, return a SimResult.

Everything random derives from ``config.seed``: the initial model (Task.build_model), every
minibatch (Task.batch under peer ID "sim-<k>"), each worker's delays, the attacks and the
gossip partners. The same config gives the same result; two methods with the same seed
see the same initial model, minibatches and worker speeds.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from phalanx.aggregation.registry import BoundAggregator, make_aggregator
from phalanx.aggregation.spec import parse_spec
from phalanx.errors import ConfigError
from phalanx.protocol.sync_policy import parse_sync_policy
from phalanx.sim.byzantine import Adversary
from phalanx.sim.clock import make_clocks
from phalanx.sim.config import SimConfig
from phalanx.sim.decentral import run_gossip, run_lasgd
from phalanx.sim.gradients import GradientOracle
from phalanx.sim.groups import run_grouped
from phalanx.sim.methods import build_rule, get_method, momentum_for, time_horizon
from phalanx.sim.record import Recorder, SimResult
from phalanx.sim.server import ParameterServerSim
from phalanx.sim.workers import Workers
from phalanx.tasks import Task, resolve_task


@functools.lru_cache(maxsize=4)
def load_task(name: str) -> Task:
    """Tasks are immutable in the simulator: build each once per process."""
    return resolve_task(name)


def make_sim_aggregator(spec: str, n: int, b: int) -> BoundAggregator:
    """The aggregator of a spec; rules that need b (trimmed_mean, krum, multi_krum) default to the run's b.

    Krum needs n > 2b + 2 and trimmed mean n > 2b: b is capped to fit groups of n rows.
    """
    name, params = parse_spec(spec, "aggregator")
    if name in ("trimmed_mean", "krum", "multi_krum") and "b" not in params:
        cap = (n - 1) // 2 if name == "trimmed_mean" else (n - 3) // 2
        params["b"] = max(0, min(b, cap))
    if name == "multi_krum" and "m" not in params:
        params["m"] = max(1, n - params["b"])
    return make_aggregator(name, **params)


def run_sim(config: SimConfig) -> SimResult:
    """Run one simulation (see the module docstring)."""
    t0 = time.perf_counter()
    spec = get_method(config.method)
    task = load_task(config.task)
    n = config.workers
    lr = task.lr if config.lr is None else config.lr
    momentum = momentum_for(spec, config.momentum, task.momentum)
    oracle = GradientOracle(
        task, seed=config.seed, batch_size=config.batch_size or task.batch_size, engine=config.engine
    )
    delay_name, delay_params = parse_spec(config.delay, "delay")
    workers = Workers(oracle, make_clocks(delay_name, n, config.seed, **delay_params))
    aggregator = make_sim_aggregator(config.aggregator, n, config.byzantine.count)
    recorder = Recorder(oracle, config.budget, config.eval_points)
    if config.group_size is not None and spec.family != "grouped":
        raise ConfigError(f"method {spec.name!r} has no groups; drop --group-size, or use --method grouped")
    if spec.family == "grouped":
        if config.sync is not None:
            raise ConfigError("method 'grouped' is synchronous by definition; drop --sync")
        progress = run_grouped(
            oracle, n, group_size=config.group_size or n, lr=lr, momentum=momentum, aggregator=aggregator,
            adversary=Adversary(config.byzantine, n, config.seed), seed=config.seed, budget=config.budget,
            recorder=recorder,
        )  # fmt: skip
    elif spec.family != "ps":
        if config.byzantine.count:
            raise ConfigError(
                f"method {spec.name!r}: Byzantine workers are simulated for parameter-server methods only; "
                "use --byzantine 0 or a parameter-server method such as ssgd"
            )
        if config.sync is not None:
            raise ConfigError(f"method {spec.name!r} has no sync policy; drop --sync")
        if spec.family == "lasgd":
            progress = run_lasgd(
                oracle.theta0, workers, lr=lr, momentum=momentum, local_steps=config.local_steps,
                aggregator=aggregator, budget=config.budget, recorder=recorder,
            )  # fmt: skip
        else:
            progress = run_gossip(
                oracle.theta0, workers, lr=lr, momentum=momentum, tau=config.gossip_tau, seed=config.seed,
                budget=config.budget, recorder=recorder,
            )  # fmt: skip
    else:
        sim = ParameterServerSim(
            engine=spec.engine or "k_batch_async",
            rule=build_rule(spec, oracle.theta0, n, lr=lr, momentum=momentum, aggregator=aggregator),
            workers=workers,
            policy=parse_sync_policy(policy_spec(config)),
            adversary=Adversary(config.byzantine, n, config.seed),
            budget=config.budget,
            recorder=recorder,
        )
        progress = sim.run()
    return SimResult.from_run(config, progress, recorder, time.perf_counter() - t0)


def policy_spec(config: SimConfig) -> str:
    """The sync policy a parameter-server run uses: --sync for K-family methods, else the method's default."""
    spec = get_method(config.method)
    if not spec.k_family:
        if config.sync is not None:
            raise ConfigError(
                f"method {spec.name!r} is asynchronous with K = 1 by definition; drop --sync, "
                "or use k_async / k_batch_async with --sync"
            )
        return "k:1"
    if config.sync is not None:
        return config.sync
    assert spec.policy is not None
    horizon = time_horizon(config.budget.kind, config.budget.amount, config.workers)
    return spec.policy(config.workers, horizon)


def describe(config: SimConfig) -> dict[str, Any]:
    """The effective settings of a run (defaults resolved), for tables and reports."""
    spec = get_method(config.method)
    task = load_task(config.task)
    out: dict[str, Any] = {
        "method": spec.name,
        "lr": task.lr if config.lr is None else config.lr,
        "momentum": momentum_for(spec, config.momentum, task.momentum),
        "batch_size": config.batch_size or task.batch_size,
    }
    if spec.family == "ps":
        out["sync"] = policy_spec(config)
    if spec.family == "grouped":
        out["group_size"] = config.group_size or config.workers
    return out

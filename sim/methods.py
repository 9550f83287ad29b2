"""The METHODS registry: every training method the simulator compares, by stable name.

Parameter-server methods are one engine with a schedule for K (protocol/sync_policy.py)
and a server rule (rules.py). Engines (Dutta et al.), given K:

- ``k_sync``: all N read the same θ; the update waits for the first K, the other N − K
  are cancelled and everybody restarts on the new θ. No staleness. K = N is SSGD.
- ``k_async``: the update waits for the first K gradients to arrive (possibly stale);
  only those K workers restart on the new θ, the others keep computing. Finished workers
  idle until the update. K = 1 is ASGD, K = N is SSGD.
- ``k_batch_async``: like k_async, but a finished worker never idles: it reads the current
  θ at once (before the update unless its row completed the group), so a fast worker can
  put several minibatches into one update.

Methods without momentum step with plain SGD; ``nag_asgd`` and ``ga_momentum`` use
Nesterov momentum at the server; DANA and Multi-ASGD keep one momentum per worker
(aggregation/dana.py). ``lasgd`` and ``gossip`` are decentralized (decentral.py): N local
models, each stepping with heavy-ball momentum. ``grouped`` (groups.py): N local models in
synchronous rounds, aggregated in random groups of at most G.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from phalanx.aggregation.registry import BoundAggregator
from phalanx.errors import ConfigError
from phalanx.sim.rules import DanaRule, DanaSlimRule, ServerRule, SgdRule


def default_k(n: int) -> int:
    """Fixed K of the K-family methods when --sync is not given: a quarter of the workers."""
    return max(1, n // 4)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str
    family: str
    """``ps`` (parameter server), ``lasgd`` or ``gossip``."""
    engine: str | None = None
    """k_sync, k_async or k_batch_async for ``ps``."""
    rule: str = "sgd"
    """sgd, dana, dana_slim or multi."""
    correction: str | None = None
    """None, sa, dc or ga (sgd rule only)."""
    uses_momentum: bool = False
    """Default momentum: the task's if True, else 0."""
    policy: Callable[[int, float], str] | None = None
    """Default sync policy spelling from (N, time horizon); None: K = 1, fixed (asynchronous methods)."""

    @property
    def k_family(self) -> bool:
        """Whether --sync may change K (the synchronous/K-family methods)."""
        return self.policy is not None


METHODS: dict[str, MethodSpec] = {}


def _register(spec: MethodSpec) -> None:
    if spec.name in METHODS:
        raise ConfigError(f"method {spec.name!r} is already registered")
    METHODS[spec.name] = spec


def _async(name: str, summary: str, **kw: object) -> None:
    """An asynchronous method: K = 1, workers never idle."""
    _register(MethodSpec(name, summary, "ps", engine="k_batch_async", **kw))  # type: ignore[arg-type]


def _k_family(name: str, summary: str, engine: str, policy: Callable[[int, float], str]) -> None:
    """A method whose K comes from a sync policy (plain SGD at the server)."""
    _register(MethodSpec(name, summary, "ps", engine=engine, policy=policy))


def _fixed_k(n: int, horizon: float) -> str:
    return f"k:{default_k(n)}"


_k_family("ssgd", "synchronous SGD: wait for all N", "k_sync", lambda n, h: "full")
_k_family("k_sync", "K-sync SGD: first K of N, cancel the rest", "k_sync", _fixed_k)
_k_family("k_async", "K-async SGD: first K arrivals, stale allowed", "k_async", _fixed_k)
_k_family("k_batch_async", "K-batch-async SGD: first K minibatches, no idling", "k_batch_async", _fixed_k)
_async("asgd", "asynchronous SGD, no momentum")
_async("nag_asgd", "ASGD with Nesterov momentum at the server", uses_momentum=True)
_async("multi_asgd", "ASGD with one momentum per worker at the server", rule="multi", uses_momentum=True)
_async("sa", "staleness-aware ASGD: g / max(1, tau)", correction="sa")
_async("dc_asgd", "delay-compensated ASGD: g + lambda g*g*Delta", correction="dc")
_async("ga", "Gap-Aware ASGD, no momentum", correction="ga")
_async("ga_momentum", "Gap-Aware ASGD with Nesterov momentum", correction="ga", uses_momentum=True)
_async("dana_zero", "DANA-Zero: gradients at the look-ahead", rule="dana", uses_momentum=True)
_async("dana_slim", "DANA-Slim: worker-side momentum, ASGD master", rule="dana_slim", uses_momentum=True)
_async("dana_ga", "DANA with the Gap-Aware penalty", rule="dana_ga", uses_momentum=True)
# AdaSync: K0 = N/8, checked 20 times over the run; hybrid: K reaches N halfway through the run.
_k_family(
    "adasync",
    "AdaSync: K-sync, K grows as the loss falls",
    "k_sync",
    lambda n, h: f"adasync:{max(1, n // 8)}:{h / 20:.6g}",
)
_k_family(
    "hybrid", "hybrid threshold: K-async from K = 1 to K = N", "k_async", lambda n, h: f"hybrid:linear:{h / 2:.6g}"
)
_register(MethodSpec("lasgd", "local SGD, non-blocking model all-reduce every H steps", "lasgd", uses_momentum=True))
_register(MethodSpec("gossip", "AD-PSGD: average with one random peer, then step", "gossip", uses_momentum=True))
_register(
    MethodSpec(
        "grouped",
        "synchronous rounds: every peer steps, then random groups of at most G aggregate their models",
        "grouped",
        uses_momentum=True,
    )
)


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; valid names: {', '.join(METHODS)}") from None


def momentum_for(spec: MethodSpec, configured: float | None, task_momentum: float) -> float:
    """The run's momentum: the configured one, else the task's for momentum methods, else 0."""
    if configured is not None:
        return configured
    return task_momentum if spec.uses_momentum else 0.0


def build_rule(
    spec: MethodSpec, theta0: Tensor, n: int, *, lr: float, momentum: float, aggregator: BoundAggregator
) -> ServerRule:
    """The server rule of a parameter-server method."""
    if spec.rule == "sgd":
        return SgdRule(theta0, lr=lr, momentum=momentum, aggregator=aggregator, correction=spec.correction)
    if momentum <= 0:
        raise ConfigError(f"method {spec.name!r} needs momentum > 0 (it is a momentum method); drop --momentum 0")
    if spec.rule == "dana_slim":
        return DanaSlimRule(theta0, n, lr=lr, momentum=momentum)
    return DanaRule(
        theta0, n, lr=lr, momentum=momentum, look_ahead=spec.rule != "multi", gap_aware=spec.rule == "dana_ga"
    )


def time_horizon(kind: str, amount: float, n: int) -> float:
    """Virtual time a run is expected to last, for policies that need one (hybrid's T, AdaSync's T0).

    A time budget is its own horizon; a gradient or update budget is the time N workers
    need for that many minibatches at full speed (mean compute time 1).
    """
    return amount if kind == "time" else amount / n

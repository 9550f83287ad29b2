"""Registries of pluggable rules by stable name, and ``make_aggregator`` for configs and the CLI.

Peers exchange these names (they go into the matchmaking key), so names never change.
A factory takes keyword parameters, checks them at once and returns an aggregator
``(x, weights=None) -> AggregateResult``. Unknown names and parameters raise ConfigError
with the valid choices; duplicate registration raises.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from phalanx.aggregation.base import AggregateResult, check_int, check_nonnegative, check_positive
from phalanx.aggregation.bucketing import bucketing
from phalanx.aggregation.centered_clip import TAU_HINT, centered_clip
from phalanx.aggregation.coordinatewise import coordinate_median, mean, trimmed_mean
from phalanx.aggregation.geometric_median import MAX_ITERS, geometric_median
from phalanx.aggregation.krum import krum, multi_krum
from phalanx.errors import ConfigError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """name → item for one pluggable kind; unknown names and duplicates raise ConfigError."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ConfigError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self._items)}") from None

    def __contains__(self, name: object) -> bool:  # Mapping's default would raise our ConfigError
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


Aggregator = Callable[..., AggregateResult]  # (x: Tensor (n, d), weights: Tensor (n,) | None) -> AggregateResult
AggregatorFactory = Callable[..., Aggregator]

AGGREGATORS: Registry[AggregatorFactory] = Registry("aggregator")


@dataclass(frozen=True)
class BoundAggregator:
    """An aggregator with its registry name and parameters (for logs, health records and config hashes)."""

    name: str
    params: Mapping[str, Any]
    fn: Aggregator = field(repr=False, compare=False)

    def __call__(self, x: Tensor, weights: Tensor | None = None) -> AggregateResult:
        return self.fn(x, weights)


TypicalParams = Callable[[int, int], dict[str, Any]]  # (n rows, b Byzantine) -> the rule's parameters
_TYPICAL: dict[str, TypicalParams] = {}
TYPICAL_TAU = 1.0  # CenteredClip's radius where nobody chose one, in units of honest noise norms (~1)


def register_aggregator(
    name: str, *, typical: TypicalParams = lambda n, b: {}
) -> Callable[[AggregatorFactory], AggregatorFactory]:
    """Decorator: add a factory to AGGREGATORS under ``name``; `typical` gives legal parameters for n rows
    with b of them Byzantine (what a benchmark runs the rule with), so a new rule is declared in one place."""
    _TYPICAL[name] = typical
    return functools.partial(AGGREGATORS.register, name)


def typical_params(name: str, n: int) -> dict[str, Any]:
    """Legal parameters for ``name`` at n rows, b a quarter of them (kept legal for Krum: n > 2b + 2)."""
    AGGREGATORS[name]  # an unknown name raises, listing the valid ones
    return _TYPICAL[name](n, max(0, min(n // 4, (n - 3) // 2)))


def make_aggregator(name: str, **params: Any) -> BoundAggregator:
    """Build the aggregator registered as ``name`` with ``params``.

    Example: ``make_aggregator("centered_clip", tau=1.0)``, ``make_aggregator("trimmed_mean", b=2)``.
    """
    factory = AGGREGATORS[name]
    check_params(f"aggregator {name!r}", factory, params)
    try:
        fn = factory(**params)
    except ConfigError as e:
        raise ConfigError(f"aggregator {name!r}: {e}") from e
    return BoundAggregator(name, dict(params), fn)


def name_parameters(name: str) -> frozenset[str]:
    """Parameters of aggregator ``name`` that take a registry name, not a number (bucketing's ``inner``):
    a config parser keeps their values as text. Empty for an unknown aggregator."""
    if name not in AGGREGATORS:
        return frozenset()
    sig = inspect.signature(AGGREGATORS[name], eval_str=True)
    return frozenset(p.name for p in sig.parameters.values() if p.annotation is str)


def check_params(
    what: str, fn: Callable[..., Any], params: Mapping[str, Any], *, skip: int = 0, runtime: tuple[str, ...] = ()
) -> None:
    """Raise ConfigError naming any unknown or missing keyword parameter of ``fn``.

    skip: leading positional parameters that are not configuration (e.g. an attack's inputs);
    runtime: keyword parameters given at call time, not in the config (e.g. ``generator``).
    """
    sig = [p for p in list(inspect.signature(fn).parameters.values())[skip:] if p.name not in runtime]
    names = [p.name for p in sig if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    forwards = any(p.kind is p.VAR_KEYWORD for p in sig)  # bucketing: extras go to the inner rule
    valid = ", ".join(names) or "none"
    for key in params:
        if key not in names and not forwards:
            raise ConfigError(f"{what}: unknown parameter {key!r}; valid parameters: {valid}")
    for p in sig:
        if p.default is p.empty and p.name in names and p.name not in params:
            raise ConfigError(f"{what}: missing required parameter {p.name!r}")


# ---- factories: check parameters eagerly, return (x, weights) -> AggregateResult ----------


@register_aggregator("mean")
def _mean() -> Aggregator:
    return mean


@register_aggregator("centered_clip", typical=lambda n, b: {"tau": TYPICAL_TAU})
def _centered_clip(*, tau: float, eps: float = 1e-6, max_iter: int = 500) -> Aggregator:
    tau = check_positive("tau", tau, allow_inf=True, hint=TAU_HINT)
    eps = check_nonnegative("eps", eps)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    return functools.partial(centered_clip, tau=tau, eps=eps, max_iter=max_iter)


@register_aggregator("median")
def _median() -> Aggregator:
    return coordinate_median


@register_aggregator("trimmed_mean", typical=lambda n, b: {"b": b})
def _trimmed_mean(*, b: int) -> Aggregator:
    b = check_int("b", b, minimum=0)
    return lambda x, weights=None: trimmed_mean(x, b, weights)


@register_aggregator("krum", typical=lambda n, b: {"b": b})
def _krum(*, b: int) -> Aggregator:
    b = check_int("b", b, minimum=0)
    return lambda x, weights=None: krum(x, b, weights)


@register_aggregator("multi_krum", typical=lambda n, b: {"b": b, "m": max(1, n - 2 * b)})
def _multi_krum(*, b: int, m: int) -> Aggregator:
    b, m = check_int("b", b, minimum=0), check_int("m", m, minimum=1)
    return lambda x, weights=None: multi_krum(x, b, m, weights)


@register_aggregator("geometric_median")
def _geometric_median(*, nu: float = 0.1, iters: int = MAX_ITERS, eps: float = 1e-6) -> Aggregator:
    nu, eps = check_positive("nu", nu), check_nonnegative("eps", eps)
    return functools.partial(geometric_median, nu=nu, iters=check_int("iters", iters, minimum=1), eps=eps)


@register_aggregator("bucketing", typical=lambda n, b: {"s": 2, "inner": "centered_clip", "tau": TYPICAL_TAU})
def _bucketing(*, s: int, inner: str, seed: int = 0, **inner_params: Any) -> Aggregator:
    """Bucketing around another registered rule; extra parameters go to that rule.

    seed: seeds the permutation generator, which advances with every call (use the round's
    public randomness as the seed so that every peer draws the same buckets).
    """
    s = check_int("s", s, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    if not isinstance(inner, str):
        raise ConfigError(f"inner must be an aggregator name, got {inner!r}")
    if inner == "bucketing":
        raise ConfigError("inner must be another aggregator than 'bucketing'")
    if inner not in AGGREGATORS:
        valid = ", ".join(name for name in AGGREGATORS if name != "bucketing")
        raise ConfigError(f"inner: unknown aggregator {inner!r}; valid names: {valid}")
    inner_agg = make_aggregator(inner, **inner_params)
    generator = torch.Generator().manual_seed(seed)
    return lambda x, weights=None: bucketing(x, s, inner_agg, weights, generator=generator)

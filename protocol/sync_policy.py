"""Sync policies: how many contributions K of N an update waits for, as a pure schedule.

One engine with a schedule for K covers the family (Dutta et al.): K = 1 is ASGD, K = N is
synchronous SGD. The live swarm and the simulator both ask a policy for K; nothing here
does I/O or knows about rounds. CLI spellings: ``full``, ``k:<K>``, ``hybrid:<linear|exp>:<T>``,
``adasync:<K0>:<T0>`` (times in seconds of wall-clock time, virtual seconds in the simulator).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

from phalanx.errors import ConfigError

VALID_FORMS = "full, k:<K>, hybrid:<linear|exp>:<T>, adasync:<K0>:<T0>"


class SyncPolicy(ABC):
    """A schedule for K. ``k`` may keep state (AdaSync), so use one instance per run."""

    name: ClassVar[str]

    @abstractmethod
    def k(self, n: int, time_s: float, loss: float | None = None) -> int:
        """K for an update decided at ``time_s`` with ``n`` workers: an int in [1, n].

        loss: the current estimate of the training loss F(w_t), or None while none is known.
        """

    @property
    @abstractmethod
    def spec(self) -> str:
        """The CLI spelling that parses back to an equal policy."""

    @classmethod
    @abstractmethod
    def from_args(cls, args: list[str]) -> SyncPolicy:
        """Build from the ':'-separated fields after the name; raise ValueError on bad fields."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


SYNC_POLICIES: dict[str, type[SyncPolicy]] = {}


def register_sync_policy(cls: type[SyncPolicy]) -> type[SyncPolicy]:
    """Class decorator: add a policy under its stable ``name`` (peers exchange these names)."""
    if cls.name in SYNC_POLICIES:
        raise ConfigError(f"sync policy {cls.name!r} is already registered")
    SYNC_POLICIES[cls.name] = cls
    return cls


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n (number of workers) must be an integer >= 1, got {n!r}")
    return n


def _ceil(x: float) -> int:
    """⌈x⌉ that ignores float noise just above an integer (t/T·N = 2.0000000001 gives 2)."""
    return math.ceil(x - 1e-9)


@register_sync_policy
class FullSync(SyncPolicy):
    """K = N: synchronous SGD."""

    name = "full"

    def k(self, n: int, time_s: float, loss: float | None = None) -> int:
        return _check_n(n)

    @property
    def spec(self) -> str:
        return "full"

    @classmethod
    def from_args(cls, args: list[str]) -> FullSync:
        if args:
            raise ValueError("'full' takes no fields")
        return cls()


@register_sync_policy
class FixedK(SyncPolicy):
    """A fixed K, capped at N (K = 1 is ASGD's schedule)."""

    name = "k"

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"K must be an integer >= 1, got {k!r}")
        self.fixed_k = k

    def k(self, n: int, time_s: float, loss: float | None = None) -> int:
        return min(self.fixed_k, _check_n(n))

    @property
    def spec(self) -> str:
        return f"k:{self.fixed_k}"

    @classmethod
    def from_args(cls, args: list[str]) -> FixedK:
        if len(args) != 1:
            raise ValueError("'k' takes one field, K")
        return cls(_parse_int("K", args[0]))


@register_sync_policy
class HybridThreshold(SyncPolicy):
    """Hybrid threshold ("Hybrid Approach to Parallel SGD"): asynchronous early, synchronous late.

    s(t) = min(1, t/T) (shape ``linear``) or 1 − e^{−t/T} (shape ``exp``), the share of
    synchronous aggregation at time t; K(t) = max(1, ⌈s(t)·N⌉). With ``linear`` K reaches N
    at t = T; with ``exp`` it reaches N once s(t) > (N − 1)/N, i.e. t > T·ln N.
    """

    name = "hybrid"
    SHAPES = ("linear", "exp")

    def __init__(self, shape: str, t_s: float) -> None:
        if shape not in self.SHAPES:
            raise ConfigError(f"hybrid shape must be one of {', '.join(self.SHAPES)}, got {shape!r}")
        self.shape = shape
        self.t_s = _check_positive("T", t_s)

    def share(self, time_s: float) -> float:
        """s(t) in [0, 1]."""
        t = max(0.0, float(time_s))
        if self.shape == "linear":
            return min(1.0, t / self.t_s)
        return 1.0 - math.exp(-t / self.t_s)

    def k(self, n: int, time_s: float, loss: float | None = None) -> int:
        n = _check_n(n)
        return min(n, max(1, _ceil(self.share(time_s) * n)))

    @property
    def spec(self) -> str:
        return f"hybrid:{self.shape}:{self.t_s:g}"

    @classmethod
    def from_args(cls, args: list[str]) -> HybridThreshold:
        if len(args) != 2:
            raise ValueError("'hybrid' takes two fields, shape and T")
        return cls(args[0], _parse_float("T", args[1]))


@register_sync_policy
class AdaSync(SyncPolicy):
    """AdaSync (Dutta et al.): every T0 of wall-clock time, K = min(N, ⌈√(F(w0)/F(w_t))·K0⌉).

    Asynchronous early, synchronous late: K grows as the training loss F falls. State:
    F(w0) is the first loss passed to ``k`` (the loss at the initial model); K starts at
    min(N, K0) and is recomputed at the first call at or after each multiple of T0 (a call
    that skips several periods recomputes once, with the loss it is given). A loss <= 0
    means fully converged: K = N. Without a loss at a check, K stays.
    """

    name = "adasync"

    def __init__(self, k0: int, t0_s: float) -> None:
        if isinstance(k0, bool) or not isinstance(k0, int) or k0 < 1:
            raise ConfigError(f"K0 must be an integer >= 1, got {k0!r}")
        self.k0 = k0
        self.t0_s = _check_positive("T0", t0_s)
        self.f0: float | None = None
        self.current_k = k0
        self.next_check_s = self.t0_s

    def k(self, n: int, time_s: float, loss: float | None = None) -> int:
        n = _check_n(n)
        if self.f0 is None and loss is not None:
            self.f0 = float(loss)
        if time_s >= self.next_check_s:
            self.next_check_s = (math.floor(time_s / self.t0_s) + 1) * self.t0_s
            if loss is not None and self.f0 is not None:
                self.current_k = n if loss <= 0 else _ceil(math.sqrt(max(self.f0, 0.0) / loss) * self.k0)
        return min(n, max(1, self.current_k))

    @property
    def spec(self) -> str:
        return f"adasync:{self.k0}:{self.t0_s:g}"

    @classmethod
    def from_args(cls, args: list[str]) -> AdaSync:
        if len(args) != 2:
            raise ValueError("'adasync' takes two fields, K0 and T0")
        return cls(_parse_int("K0", args[0]), _parse_float("T0", args[1]))


def parse_sync_policy(text: str) -> SyncPolicy:
    """A fresh policy from its CLI spelling, e.g. ``k:4``, ``hybrid:exp:50``, ``adasync:2:10``."""
    if not isinstance(text, str):
        raise ConfigError(f"sync policy must be a string; valid forms: {VALID_FORMS}")
    name, *args = text.strip().split(":")
    cls = SYNC_POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown sync policy {text!r}; valid forms: {VALID_FORMS}")
    try:
        return cls.from_args(args)
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"sync policy {text!r} is not valid ({e}); valid forms: {VALID_FORMS}") from None


def _parse_int(field: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{field} must be an integer, got {text!r}") from None


def _parse_float(field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{field} must be a number, got {text!r}") from None


def _check_positive(field: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{field} must be a positive finite number, got {value!r}")
    return float(value)

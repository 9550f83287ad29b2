"""Virtual compute times: how long each simulated worker takes for one minibatch gradient.

Time is virtual and unitless: every model has mean compute time 1.0 per minibatch for an
average worker (docs/algorithms.md §7, after Dutta et al.), so "time 100" is about a hundred
minibatches of one worker. Each worker draws from its own generator, seeded from (run
seed, worker), so a worker's delays do not depend on what other workers or the method do:
two methods run with the same seed see the same workers (common random numbers).

Models: ``const`` (exactly 1: round-robin arrivals), ``exp`` (Exp(1)), ``shifted-exp``
(shift + Exp(1 − shift)), ``gamma`` (Gamma(shape, 1/shape)) and ``volunteer`` (see
`VolunteerClock`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from phalanx.errors import ConfigError

_DELAY_STREAM = 0xDE1A7  # separates the delay generators from every other seeded stream


class WorkerClock:
    """One worker's compute times; ``finish(start_s)`` is when a minibatch started at start_s is done."""

    def __init__(self, rng: np.random.Generator, draw: Callable[[np.random.Generator], float]) -> None:
        self.rng = rng
        self.draw = draw

    def finish(self, start_s: float) -> float:
        return start_s + self.draw(self.rng)


@dataclass(frozen=True, kw_only=True)
class VolunteerParams:
    """Parameters of the volunteer model (defaults in units of the mean compute time)."""

    speed_sigma: float = 0.5
    """σ of the persistent per-worker slowness, LogNormal with mean 1 (a 1-σ slow worker is 1.65× slower)."""
    jitter_sigma: float = 0.25
    """σ of the per-minibatch jitter, LogNormal with mean 1."""
    tail_prob: float = 0.05
    """Chance that a minibatch hits a heavy tail (the owner uses the machine, thermal throttling...)."""
    tail_alpha: float = 1.5
    """Pareto index of the tail: the minibatch takes Pareto(α, x_m = 1) times longer (mean α/(α−1) = 3)."""
    online_mean: float = 100.0
    """Mean of the exponential time a worker stays online before it leaves (churn)."""
    offline_mean: float = 10.0
    """Mean of the exponential time a worker stays away before it rejoins."""


class VolunteerClock(WorkerClock):
    """A volunteer: persistent speed × jitter, Pareto tails and churn.

    Work for one minibatch = speed · jitter · (tail factor). Churn: the worker alternates
    online and offline periods (exponential lengths, starting online); work only
    progresses while online. A worker that leaves mid-minibatch keeps its state and
    delivers the gradient when it comes back: computed on the parameters it read before
    it left, so it arrives very stale.
    """

    def __init__(self, rng: np.random.Generator, params: VolunteerParams) -> None:
        super().__init__(rng, lambda _: 0.0)
        self.params = params
        self.speed = float(rng.lognormal(-(params.speed_sigma**2) / 2, params.speed_sigma))
        # Churn timeline from its own generator, so it does not shift with the number of minibatches.
        self._churn_rng = np.random.Generator(np.random.PCG64(rng.integers(2**63)))
        self._leave: list[float] = []  # sorted leave times
        self._back: list[float] = []  # _back[i] > _leave[i]: when the worker returns
        self._extend(0.0)

    def _extend(self, until_s: float) -> None:
        """Draw online/offline periods until the timeline covers ``until_s``."""
        t = self._back[-1] if self._back else 0.0
        while t <= until_s:
            leave = t + float(self._churn_rng.exponential(self.params.online_mean))
            back = leave + float(self._churn_rng.exponential(self.params.offline_mean))
            self._leave.append(leave)
            self._back.append(back)
            t = back

    def work(self) -> float:
        """Online time one minibatch needs."""
        p = self.params
        w = self.speed * float(self.rng.lognormal(-(p.jitter_sigma**2) / 2, p.jitter_sigma))
        if self.rng.random() < p.tail_prob:
            w *= 1.0 + float(self.rng.pareto(p.tail_alpha))  # numpy's pareto is Lomax: + 1 gives x_m = 1
        return w

    def finish(self, start_s: float) -> float:
        remaining = self.work()
        t = start_s
        i = bisect.bisect_right(self._back, t)  # the first period whose return is after t
        while True:
            self._extend(t + remaining)
            leave, back = self._leave[i], self._back[i]
            if t < leave:
                if t + remaining <= leave:
                    return t + remaining
                remaining -= leave - t
            t = max(t, back)  # offline: wait for the return
            i += 1

    def online(self, time_s: float) -> bool:
        """Whether the worker is online at ``time_s`` (for reports and tests)."""
        self._extend(time_s)
        i = bisect.bisect_right(self._back, time_s)
        return time_s < self._leave[i]


def _draws(name: str, params: dict[str, Any]) -> Callable[[np.random.Generator], float]:
    if name == "const":
        _no_params(name, params, ())
        return lambda rng: 1.0
    if name == "exp":
        _no_params(name, params, ())
        return lambda rng: float(rng.exponential(1.0))
    if name == "shifted-exp":
        _no_params(name, params, ("shift",))
        shift = float(params.get("shift", 0.5))
        if not 0 <= shift < 1:
            raise ConfigError(f"delay shifted-exp: shift must be in [0, 1) (the mean stays 1), got {shift!r}")
        return lambda rng: shift + float(rng.exponential(1.0 - shift))
    if name == "gamma":
        _no_params(name, params, ("shape",))
        shape = float(params.get("shape", 2.0))
        if not shape > 0:
            raise ConfigError(f"delay gamma: shape must be > 0, got {shape!r}")
        return lambda rng: float(rng.gamma(shape, 1.0 / shape))
    raise ConfigError(f"unknown delay model {name!r}; valid names: {', '.join(DELAYS)}")


def _no_params(name: str, params: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ConfigError(
            f"delay {name}: unknown parameter(s) {', '.join(unknown)}; valid parameters: {', '.join(allowed) or 'none'}"
        )


DELAYS = ("const", "exp", "shifted-exp", "gamma", "volunteer")


def make_clocks(name: str, n: int, seed: int, **params: Any) -> list[WorkerClock]:
    """One clock per worker for delay model ``name`` (see the module docstring)."""
    if name not in DELAYS:
        raise ConfigError(f"unknown delay model {name!r}; valid names: {', '.join(DELAYS)}")
    rngs = [np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _DELAY_STREAM, k]))) for k in range(n)]
    if name == "volunteer":
        fields = VolunteerParams.__dataclass_fields__
        _no_params(name, params, tuple(fields))
        try:
            vp = VolunteerParams(**{k: float(v) for k, v in params.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"delay volunteer: {e}") from None
        if min(vp.online_mean, vp.offline_mean, vp.tail_alpha) <= 0 or not 0 <= vp.tail_prob <= 1:
            raise ConfigError(
                "delay volunteer: online_mean, offline_mean and tail_alpha must be > 0, tail_prob in [0, 1]"
            )
        return [VolunteerClock(rng, vp) for rng in rngs]
    draw = _draws(name, params)
    return [WorkerClock(rng, draw) for rng in rngs]

"""`--slowdown KIND:...`: make a peer a realistic straggler by delaying each local step.

    const:S            every step waits S seconds
    exp:M              Exp with mean M seconds
    shifted-exp:S:M    S + Exp(mean M)
    pareto:S:A         S · Pareto(A) (heavy tail; mean S·A/(A−1) for A > 1)

Draws come from a generator seeded by (seed, peer), so a run is reproducible.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from phalanx.errors import ConfigError

FORMS = "const:S, exp:M, shifted-exp:S:M, pareto:S:A"


@dataclass(frozen=True)
class Slowdown:
    kind: str
    params: tuple[float, ...]

    def sampler(self, seed: int, peer: str) -> "random.Random":
        digest = hashlib.sha256(f"slowdown\0{seed}\0{peer}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))

    def draw(self, rng: random.Random) -> float:
        """One step's extra delay in seconds."""
        if self.kind == "const":
            return self.params[0]
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.params[0])
        if self.kind == "shifted-exp":
            return self.params[0] + rng.expovariate(1.0 / self.params[1])
        return self.params[0] * rng.paretovariate(self.params[1])


def parse_slowdown(text: str) -> Slowdown:
    kind, *fields = text.strip().split(":")
    arity = {"const": 1, "exp": 1, "shifted-exp": 2, "pareto": 2}
    if kind not in arity:
        raise ConfigError(f"--slowdown {text!r}: unknown kind {kind!r}; use one of {FORMS}")
    if len(fields) != arity[kind]:
        raise ConfigError(f"--slowdown {text!r}: {kind} takes {arity[kind]} number(s); forms: {FORMS}")
    try:
        params = tuple(float(f) for f in fields)
    except ValueError:
        raise ConfigError(f"--slowdown {text!r}: fields must be numbers; forms: {FORMS}") from None
    if any(p < 0 for p in params) or (kind in ("exp", "shifted-exp") and params[-1] <= 0) or (kind == "pareto" and params[1] <= 0):
        raise ConfigError(f"--slowdown {text!r}: times must be ≥ 0 and means/shape > 0")
    return Slowdown(kind, params)

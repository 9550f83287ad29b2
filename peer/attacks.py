"""`--attack NAME`: turn a peer into an attacker, for tests, demos and benchmarks.

Gradient attacks change what the peer contributes (it still follows the protocol);
protocol attacks (protocol.adversary) break the protocol itself. The math of the
gradient attacks is aggregation.attacks, applied to what a lone attacker can estimate:
its own gradients.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from phalanx.aggregation.attacks import make_attack
from phalanx.aggregation.spec import parse_spec
from phalanx.errors import ConfigError
from phalanx.protocol.adversary import PROTOCOL_ATTACKS, Behavior

GRADIENT_ATTACKS = ("sign_flip", "random_direction", "label_flip", "delayed", "ipm", "alie", "nan")
DELAY_STEPS = 20
ALIE_SAMPLES = 4


@dataclass
class GradientAttack:
    """Turns the honest gradient of a step into the attacker's contribution."""

    name: str
    seed: int
    _history: deque = field(default_factory=lambda: deque(maxlen=DELAY_STEPS))

    def contribution(self, step: int, honest: torch.Tensor, extra: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """`extra(k)` computes the honest gradient on another (k-th) batch of this step."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)  # colluders share it
        row = honest.reshape(1, -1)
        if self.name == "sign_flip":
            return make_attack("sign_flip", scale=-1000.0)(row, 1, generator=generator)[0]
        if self.name in ("random_direction", "ipm", "nan"):
            return make_attack(self.name)(row, 1, generator=generator)[0]
        if self.name == "alie":
            samples = torch.stack([honest] + [extra(k) for k in range(1, ALIE_SAMPLES)])
            return make_attack("alie")(samples, 1, generator=generator)[0]
        if self.name == "delayed":
            self._history.append(honest.clone())
            return self._history[0]
        if self.name == "label_flip":
            return honest  # the trainer computes it on flipped labels (see `flips_labels`)
        raise ConfigError(f"unknown gradient attack {self.name!r}")

    @property
    def flips_labels(self) -> bool:
        return self.name == "label_flip"


def parse_attack(spec: Optional[str], seed: int) -> tuple[Behavior, Optional[GradientAttack]]:
    """(protocol behavior, gradient attack) for `--attack NAME`; (honest, None) without one. The spec
    syntax is every rule's (aggregation.spec), though no attack of a peer takes parameters yet."""
    if spec is None:
        return Behavior(), None
    name, params = parse_spec(spec, "--attack")
    if params:
        raise ConfigError(f"--attack {spec}: {name} takes no parameters; give its name alone")
    if name in GRADIENT_ATTACKS:
        return Behavior(), GradientAttack(name, seed)
    if name in PROTOCOL_ATTACKS:
        return PROTOCOL_ATTACKS[name](), None
    valid = ", ".join([*GRADIENT_ATTACKS, *PROTOCOL_ATTACKS])
    raise ConfigError(f"--attack: unknown attack {name!r}; valid: {valid}")

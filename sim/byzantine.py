"""Byzantine workers in the simulator: which workers attack and what they send.

The b Byzantine workers are the last b indices. They compute like honest workers (so they
take the same virtual time) and replace what they send when the server collects a group:

- gradient-level attacks of aggregation/attacks.py (``sign_flip``, ``random_direction``,
  ``constant_direction``, ``ipm``, ``alie``, ``gaussian``, ``nan``, ``inf``): omniscient and
  colluding, they see the honest rows of the same group. A group with no honest row (e.g.
  ASGD's single-row updates) gives them their own honest computations as the reference.
- ``label_flip``: an honest computation on the same minibatch with labels y → C − 1 − y.
- ``delayed:lag=L``: the worker replays what it honestly computed L of its own
  contributions earlier (the oldest it kept until it has L), i.e. gradients from far back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from phalanx.aggregation.attacks import ATTACKS, make_attack
from phalanx.aggregation.spec import parse_spec
from phalanx.errors import ConfigError
from phalanx.sim.config import ByzantineConfig

SIM_ONLY_ATTACKS = ("label_flip", "delayed")
DEFAULT_LAG = 100
_ATTACK_STREAM = 0xBAD


def attack_names() -> list[str]:
    """Every attack the simulator knows: aggregation's gradient-level ones and the two above."""
    return [*ATTACKS, *SIM_ONLY_ATTACKS]


class Adversary:
    """The colluding Byzantine workers of one run."""

    def __init__(self, config: ByzantineConfig, n: int, seed: int) -> None:
        self.count = config.count
        self.byzantine = frozenset(range(n - config.count, n))
        self.start = config.start
        self.name, params = parse_spec(config.attack, "attack")
        self.lag = DEFAULT_LAG
        if self.name in SIM_ONLY_ATTACKS:
            allowed = ("lag",) if self.name == "delayed" else ()
            unknown = sorted(set(params) - set(allowed))
            if unknown:
                raise ConfigError(
                    f"attack {self.name!r}: unknown parameter(s) {', '.join(unknown)}; "
                    f"valid parameters: {', '.join(allowed) or 'none'}"
                )
            self.lag = int(params.get("lag", DEFAULT_LAG))
            if self.lag < 1:
                raise ConfigError(f"attack delayed: lag must be >= 1, got {self.lag}")
            self._forge = None
        elif self.name in ATTACKS:
            self._forge = make_attack(self.name, **params)
        else:
            raise ConfigError(f"unknown attack {self.name!r}; valid names: {', '.join(attack_names())}")
        self.generator = torch.Generator().manual_seed(seed * 7919 + _ATTACK_STREAM)
        self._kept: dict[int, deque[Tensor]] = {}

    def is_byzantine(self, worker: int) -> bool:
        return worker in self.byzantine

    def flips_labels(self, worker: int, update: int) -> bool:
        """Whether ``worker``'s minibatch started at model update ``update`` uses flipped labels."""
        return self.name == "label_flip" and update >= self.start and worker in self.byzantine

    def forge(self, workers: Sequence[int], sent: list[Tensor], update: int) -> list[Tensor]:
        """What the group's rows really are: honest rows unchanged, Byzantine rows attacked. sent: (d,) each."""
        bad = [i for i, w in enumerate(workers) if w in self.byzantine]
        if not bad:
            return sent
        if self.name == "delayed":
            out = list(sent)
            for i in bad:
                kept = self._kept.setdefault(workers[i], deque(maxlen=self.lag + 1))
                kept.append(sent[i])
                if update >= self.start:
                    out[i] = kept[0]
            return out
        if update < self.start or self._forge is None:  # not yet, or label flip (already in the gradient)
            return sent
        honest = [v for i, v in enumerate(sent) if i not in bad]
        reference = torch.stack(honest if honest else [sent[i] for i in bad])  # (h, d)
        rows = self._forge(reference, len(bad), generator=self.generator)  # (b_group, d)
        out = list(sent)
        for row, i in zip(rows, bad, strict=True):
            out[i] = row
        return out

"""What one simulated run is: `SimConfig` and its parts.

Rules are named by specs in the one ``name:key=value`` syntax (aggregation.spec), e.g.
``centered_clip:tau=1``, ``sign_flip:scale=-1000``, ``volunteer:offline_mean=20``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from phalanx.errors import ConfigError

BUDGET_KINDS = ("gradients", "updates", "time")


@dataclass(frozen=True, kw_only=True)
class Budget:
    """When a run stops; equal budgets make comparisons fair.

    ``gradients``: gradients applied to the model (each is one minibatch of data: equal
    data). ``updates``: model updates (one server step, or one local step for lasgd and
    gossip). ``time``: virtual time (equal wall-clock). Cancelled or unfinished gradients
    count in none of them.
    """

    kind: str = "gradients"
    """One of gradients, updates, time."""
    amount: float = 2000
    """How many (gradients, updates) or how long (virtual time units)."""

    def __post_init__(self) -> None:
        if self.kind not in BUDGET_KINDS:
            raise ConfigError(f"budget kind must be one of {', '.join(BUDGET_KINDS)}, got {self.kind!r}")
        if not 0 < self.amount < math.inf:
            raise ConfigError(f"budget {self.kind} must be a positive finite number, got {self.amount!r}")


@dataclass(frozen=True, kw_only=True)
class ByzantineConfig:
    """b of N workers attack from update ``start`` on; the last b worker indices are the Byzantine ones."""

    count: int = 0
    """b, the number of Byzantine workers (0: an honest run)."""
    attack: str = "sign_flip"
    """Attack spec, e.g. ``ipm:eps=0.5``; see sim/byzantine.py for the list."""
    start: int = 0
    """First model update at which the Byzantine workers attack (before it they behave honestly)."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run. Fields left as None take the method's or the task's default."""

    method: str = "asgd"
    """Registry name of the method, see sim/methods.py."""
    workers: int = 16
    """N, the number of virtual workers."""
    delay: str = "exp"
    """Compute-time model spec: const, exp, shifted-exp, gamma, volunteer (sim/clock.py)."""
    budget: Budget = field(default_factory=Budget)
    seed: int = 0
    """Seeds the model, every minibatch, every delay and every attack."""
    task: str = "digits-mlp"
    lr: float | None = None
    """Learning rate η; None: the task's."""
    momentum: float | None = None
    """Momentum γ; None: the method's default (0 for plain methods, the task's for momentum methods)."""
    batch_size: int | None = None
    """Minibatch per gradient; None: the task's."""
    sync: str | None = None
    """Sync-policy spelling overriding a K-family method's default (full, k:<K>, hybrid:..., adasync:...)."""
    aggregator: str = "mean"
    """Aggregator spec for groups of two or more rows (and LASGD's model average)."""
    byzantine: ByzantineConfig = field(default_factory=ByzantineConfig)
    local_steps: int = 8
    """H of LASGD: local steps between model all-reduces."""
    gossip_tau: float = math.inf
    """ClippedGossip radius for gossip (inf: plain pairwise averaging)."""
    group_size: int | None = None
    """G of the grouped method: groups of at most G peers, redrawn every round; None: one group of all N."""
    eval_points: int = 20
    """Test evaluations spread evenly over the budget (plus one at the start)."""
    engine: str = "auto"
    """Gradient engine: auto, mlp, vmap, loop (sim/gradients.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"workers must be an integer >= 1, got {self.workers!r}")
        if not 0 <= self.byzantine.count < self.workers:
            raise ConfigError(
                f"byzantine count must be in [0, workers) = [0, {self.workers}), got {self.byzantine.count!r}"
            )
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if self.group_size is not None and (
            isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2
        ):
            raise ConfigError(f"group size must be an integer >= 2, got {self.group_size!r}")
        if self.local_steps < 1 or self.eval_points < 1:
            raise ConfigError("local_steps and eval_points must be >= 1")

"""Progress counters, the evaluation schedule and what a run returns (`SimResult`).

The test set is evaluated at ``eval_points`` marks spread evenly over the budget (in the
budget's own unit) plus once at the start and once at the end; each point carries all
three clocks (updates, gradients, virtual time), so one run gives accuracy against
updates and against virtual time. "Best" accuracy is the best of these points (picked on
the test set: optimistic, like the papers' best-epoch numbers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from torch import Tensor

from phalanx.sim.config import Budget, SimConfig
from phalanx.sim.gradients import GradientOracle


@dataclass
class Progress:
    """Counters of a run. staleness: one entry per applied row (see SimResult.staleness)."""

    updates: int = 0
    gradients: int = 0
    time_s: float = 0.0
    staleness: list[int] = field(default_factory=list)
    train_loss: float | None = None
    """EMA (weight 0.1 per gradient) of honest minibatch losses: the F(w_t) AdaSync reads."""
    k: int | None = None
    """K of the last update (K-family methods)."""
    diverged: bool = False
    spread: float | None = None
    """Grouped rounds: max over honest peers of ‖θ_i − θ̄‖ / ‖θ̄‖ after the last round."""
    captured_groups: int | None = None
    """Grouped rounds: groups so far in which Byzantine members were a majority."""
    worst_accuracy: float | None = None
    """Grouped rounds: the lowest test accuracy of one honest peer's own model, at the end."""

    def value(self, kind: str) -> float:
        return {"updates": self.updates, "gradients": self.gradients, "time": self.time_s}[kind]

    def observe_loss(self, loss: float) -> None:
        if math.isfinite(loss):
            self.train_loss = loss if self.train_loss is None else 0.9 * self.train_loss + 0.1 * loss


@dataclass(frozen=True)
class CurvePoint:
    updates: int
    gradients: int
    time_s: float
    accuracy: float
    loss: float
    k: int | None = None
    spread: float | None = None


class Recorder:
    """Evaluates the model when progress crosses the next mark of the budget."""

    def __init__(self, oracle: GradientOracle, budget: Budget, points: int) -> None:
        self.oracle = oracle
        self.budget = budget
        self.marks = [budget.amount * i / points for i in range(1, points + 1)]
        self.next = 0
        self.curve: list[CurvePoint] = []
        self.final: Tensor | None = None  # (d,) the last evaluated model

    def done(self, p: Progress) -> bool:
        """Whether a gradient or update budget is used up (time budgets stop in the event loop)."""
        return p.diverged or (self.budget.kind != "time" and p.value(self.budget.kind) >= self.budget.amount)

    def maybe(self, p: Progress, model: Callable[[], Tensor]) -> None:
        """Record a point if the budget's counter passed the next mark."""
        value = p.value(self.budget.kind)
        if self.next < len(self.marks) and value >= self.marks[self.next]:
            while self.next < len(self.marks) and value >= self.marks[self.next]:
                self.next += 1
            self.record(p, model())

    def record(self, p: Progress, theta: Tensor) -> None:
        if self.curve and (self.curve[-1].updates, self.curve[-1].time_s) == (p.updates, p.time_s):
            return
        self.final = theta.detach().clone()
        metrics = self.oracle.evaluate(theta)
        self.curve.append(
            CurvePoint(p.updates, p.gradients, p.time_s, metrics["accuracy"], metrics["loss"], p.k, p.spread)
        )


@dataclass
class SimResult:
    """What one run gives. Staleness: for parameter-server methods the model updates between
    a row's read and its application; lasgd: local steps between a snapshot and its merge;
    gossip: changes to the worker's model between its read and its step."""

    config: SimConfig
    final_accuracy: float
    best_accuracy: float
    final_loss: float
    mean_staleness: float
    max_staleness: int
    updates: int
    gradients: int
    time_s: float
    diverged: bool
    curve: list[CurvePoint]
    staleness: list[int] = field(repr=False)
    wall_s: float = 0.0
    grad_calls: int = 0
    grad_rows: int = 0
    params: Tensor | None = field(default=None, repr=False)
    """(d,) the final model (not serialized)."""
    final_spread: float | None = None
    """Grouped rounds: see Progress.spread; None for other methods."""
    captured_groups: int | None = None
    worst_peer_accuracy: float | None = None

    @classmethod
    def from_run(cls, config: SimConfig, p: Progress, recorder: Recorder, wall_s: float) -> SimResult:
        st, curve, oracle = p.staleness, recorder.curve, recorder.oracle
        return cls(
            config=config,
            final_accuracy=curve[-1].accuracy,
            best_accuracy=max(c.accuracy for c in curve),
            final_loss=curve[-1].loss,
            mean_staleness=sum(st) / len(st) if st else 0.0,
            max_staleness=max(st) if st else 0,
            updates=p.updates,
            gradients=p.gradients,
            time_s=p.time_s,
            diverged=p.diverged,
            curve=curve,
            staleness=st,
            wall_s=wall_s,
            grad_calls=oracle.calls,
            grad_rows=oracle.rows,
            params=recorder.final,
            final_spread=p.spread,
            captured_groups=p.captured_groups,
            worst_peer_accuracy=p.worst_accuracy,
        )

    def to_dict(self, *, staleness_trace: bool = False) -> dict[str, Any]:
        """JSON-ready: config, metrics and curve (the staleness trace only if asked, never the parameters)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("params", "staleness")}
        out["config"] = asdict(self.config)
        out["curve"] = [asdict(c) for c in self.curve]
        if staleness_trace:
            out["staleness"] = list(self.staleness)
        return out

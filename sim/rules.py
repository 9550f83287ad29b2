"""Server-side update rules of the parameter-server methods, built on aggregation/ (never a copy of it).

A rule owns the model θ: (d,). ``read(k)`` is what worker k computes its gradient at,
``send(k, g)`` what worker k sends for gradient g (DANA-Slim's momentum lives on the
worker), and ``apply(rows)`` one model update from a group of received rows. Groups of two
or more rows go through the configured robust aggregator; a single row is used as it is
(every rule returns a lone row unchanged) unless it is non-finite, then it is dropped as
aggregators drop non-finite rows. Momentum steps are torch's SGD, as in a live trainer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from phalanx.aggregation.dana import AsgdMaster, DanaSlimWorker, DanaZero
from phalanx.aggregation.registry import BoundAggregator
from phalanx.aggregation.staleness import GapAware, dc_asgd, staleness_aware

CORRECTIONS = (None, "sa", "dc", "ga")
DC_LAMBDA = 0.04  # DC-ASGD's λ (Zheng et al.'s default for CIFAR)


@dataclass(frozen=True)
class Row:
    """One received contribution: what worker ``worker`` sent, computed at ``read`` (d,), ``staleness`` updates ago."""

    worker: int
    vector: Tensor
    read: Tensor
    staleness: int


class ServerRule(ABC):
    @abstractmethod
    def read(self, worker: int) -> Tensor:
        """Parameters worker ``worker`` computes its next gradient at: a fresh (d,) tensor."""

    def send(self, worker: int, grad: Tensor) -> Tensor:
        """What the worker sends for ``grad`` (the gradient itself unless the method says otherwise)."""
        return grad

    @abstractmethod
    def apply(self, rows: list[Row]) -> None:
        """One model update from a group of rows."""

    @abstractmethod
    def model(self) -> Tensor:
        """The parameters to evaluate: (d,), not a copy."""


class SgdRule(ServerRule):
    """θ ← SGD step with the aggregate of the (corrected) rows; optional Nesterov momentum at the server.

    correction: None; ``sa`` (g / max(1, τ)); ``dc`` (g + λ·g⊙g⊙Δ); ``ga`` (g / Gap, Gap from
    Δ = θ_now − θ_read). GA observes the unpenalized step: the raw row without momentum, the
    momentum buffer the raw row would make (γ·buf + g) with momentum.
    """

    def __init__(
        self,
        theta0: Tensor,
        *,
        lr: float,
        momentum: float,
        aggregator: BoundAggregator,
        correction: str | None = None,
    ) -> None:
        self.theta = theta0.detach().clone()
        self.momentum = momentum
        # Nesterov: v ← γv + u, θ ← θ − η(γv + u) (torch's form; plain SGD when γ = 0)
        self.opt = torch.optim.SGD([self.theta], lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=False)
        self.aggregator = aggregator
        self.correction = correction
        self.gap = GapAware(lr) if correction == "ga" else None

    def read(self, worker: int) -> Tensor:
        return self.theta.clone()

    def apply(self, rows: list[Row]) -> None:
        corrected = [self._correct(r) for r in rows]
        update = _combine(corrected, self.aggregator)
        if update is None:
            return
        self.theta.grad = update
        self.opt.step()

    def model(self) -> Tensor:
        return self.theta

    def _correct(self, row: Row) -> Tensor:
        if self.correction is None:
            return row.vector
        if self.correction == "sa":
            return staleness_aware(row.vector, row.staleness)
        delta = self.theta - row.read  # Δ = θ_now − θ_read: (d,)
        if self.correction == "dc":
            return dc_asgd(row.vector, delta, DC_LAMBDA)
        if self.gap is None or not finite(row.vector):
            return row.vector  # the aggregator drops non-finite rows; GapAware must never observe one
        buf = self.opt.state[self.theta].get("momentum_buffer") if self.momentum > 0 else None
        self.gap.observe(row.vector if buf is None else self.momentum * buf + row.vector)
        return self.gap.correct(row.vector, delta)[0]


class DanaRule(ServerRule):
    """DANA-Zero (look_ahead), DANA-GA (look_ahead + Gap-Aware) or Multi-ASGD (per-worker momentum, no look-ahead).

    Single-row updates only (these are asynchronous methods). The evaluated model is the
    look-ahead θ̂ for DANA (what DANA-Slim's master holds, and Nesterov's iterate for one
    worker), θ for Multi-ASGD.
    """

    def __init__(
        self, theta0: Tensor, n: int, *, lr: float, momentum: float, look_ahead: bool, gap_aware: bool = False
    ) -> None:
        self.look_ahead = look_ahead
        self.zero = DanaZero(theta0, n, lr=lr, momentum=momentum, gap_aware=GapAware(lr) if gap_aware else None)

    def read(self, worker: int) -> Tensor:
        return self.zero.read(worker) if self.look_ahead else self.zero.theta.clone()

    def apply(self, rows: list[Row]) -> None:
        for row in _single(rows):
            self.zero.write(row.worker, row.vector)

    def model(self) -> Tensor:
        return self.zero.look_ahead() if self.look_ahead else self.zero.theta


class DanaSlimRule(ServerRule):
    """DANA-Slim: workers keep their momentum and send γ·v + g; the master is plain ASGD."""

    def __init__(self, theta0: Tensor, n: int, *, lr: float, momentum: float) -> None:
        self.master = AsgdMaster(theta0, lr=lr)
        self.workers = [DanaSlimWorker(theta0, momentum=momentum) for _ in range(n)]

    def read(self, worker: int) -> Tensor:
        return self.master.read()

    def send(self, worker: int, grad: Tensor) -> Tensor:
        return self.workers[worker].update(grad)

    def apply(self, rows: list[Row]) -> None:
        for row in _single(rows):
            self.master.write(row.vector)

    def model(self) -> Tensor:
        return self.master.theta


def finite(v: Tensor) -> bool:
    """Whether every entry of v is finite: one sum (NaN and ±Inf propagate), 7× cheaper than isfinite().all()."""
    return math.isfinite(float(v.sum()))


def _single(rows: list[Row]) -> list[Row]:
    """The lone row of an asynchronous update, or nothing if it is non-finite."""
    if len(rows) != 1:
        raise ValueError(f"this rule applies one row per update, got {len(rows)}")
    return rows if finite(rows[0].vector) else []


def _combine(vectors: list[Tensor], aggregator: BoundAggregator) -> Tensor | None:
    """Aggregate two or more rows; a single row as it is (None if non-finite: nothing to apply)."""
    if len(vectors) == 1:
        return vectors[0] if finite(vectors[0]) else None
    return aggregator(torch.stack(vectors)).value  # (K, d) → (d,)

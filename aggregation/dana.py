"""DANA (Hakimi et al.): compute each gradient where the parameters will be when it lands.

DANA-Zero: the master keeps a momentum v^k per worker k and hands out the look-ahead
θ̂ = θ − η·γ·Σ_k v^k; a write from k does v^k ← γ·v^k + g, θ ← θ − η·v^k.
DANA-Slim: worker k keeps its own v, computes g at the Θ it received, sets v ← γ·v + g and
sends γ·v + g; the master does plain ASGD, Θ ← Θ − η·(what it received).

Equivalence (tested to 1e-10 in float64 over random asynchronous schedules): start both
from θ₀ with all v = 0 and apply the same schedule of reads and writes, each write by k
using the gradient at the parameters k last read. Then at every moment Slim's Θ equals
Zero's θ̂, Slim worker k's v equals Zero's v^k, and every read returns the same vector.
Induction over one write by k with gradient g: Zero gives v' = γv + g and
θ̂' = θ − ηv' − ηγ(Σ_{j≠k} v^j + v') = θ̂ + ηγv − η(1 + γ)v' = θ̂ − η(γv' + g),
which is exactly Slim's Θ' = Θ − η(γv' + g).
"""

from __future__ import annotations

import torch
from torch import Tensor

from phalanx.aggregation.base import check_int, check_nonnegative, check_positive
from phalanx.aggregation.staleness import GapAware
from phalanx.errors import AggregationInputError


def _check_momentum(momentum: float) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise AggregationInputError(f"momentum must be a number in [0, 1), got {momentum!r}")
    return float(momentum)


def _check_vector(v: Tensor, like: Tensor, name: str) -> None:
    if not isinstance(v, Tensor) or v.shape != like.shape:
        shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise AggregationInputError(f"{name} must have shape {tuple(like.shape)}, got {shape}")


class DanaZero:
    """DANA-Zero master for ``n_workers`` workers over flat parameters θ: (d,).

    With ``gap_aware`` it is DANA-GA: a gradient is divided by the Gap-Aware penalty for
    Δ = θ̂_now − θ̂_read (how far the look-ahead point moved since worker k read), before it
    enters v^k. GapAware observes the unpenalized buffer γ·v^k + g first, so the very first
    write has a defined C.
    """

    def __init__(
        self,
        theta0: Tensor,
        n_workers: int,
        *,
        lr: float,
        momentum: float,
        gap_aware: GapAware | None = None,
    ) -> None:
        n_workers = check_int("n_workers", n_workers, minimum=1)
        self.lr = check_positive("lr", lr)
        self.momentum = _check_momentum(momentum)
        self.theta = theta0.detach().clone()  # (d,)
        self.velocities = theta0.new_zeros((n_workers, *theta0.shape))  # (K, d): v^k
        self.gap_aware = gap_aware
        self._read_at: dict[int, Tensor] = {}  # worker → θ̂ it last read (DANA-GA only)

    def look_ahead(self) -> Tensor:
        """θ̂ = θ − η·γ·Σ_k v^k: (d,)."""
        return self.theta - self.lr * self.momentum * self.velocities.sum(dim=0)

    def read(self, worker: int) -> Tensor:
        """Parameters to send to ``worker``: the look-ahead θ̂ (a fresh tensor)."""
        self._check_worker(worker)
        theta_hat = self.look_ahead()
        if self.gap_aware is not None:
            self._read_at[worker] = theta_hat.clone()
        return theta_hat

    def write(self, worker: int, grad: Tensor) -> None:
        """Apply ``worker``'s gradient, computed at the θ̂ it last read."""
        self._check_worker(worker)
        _check_vector(grad, self.theta, "grad")
        v = self.velocities[worker]
        if self.gap_aware is not None:
            if worker not in self._read_at:
                raise AggregationInputError(f"worker {worker} wrote before it read: DANA-GA cannot know its gap")
            self.gap_aware.observe(self.momentum * v + grad)  # the unpenalized step
            grad, _ = self.gap_aware.correct(grad, self.look_ahead() - self._read_at[worker])
        v.mul_(self.momentum).add_(grad)
        self.theta.sub_(v, alpha=self.lr)

    def _check_worker(self, worker: int) -> None:
        k = self.velocities.shape[0]
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < k:
            raise AggregationInputError(f"worker must be an integer in [0, {k}), got {worker!r}")


class DanaSlimWorker:
    """DANA-Slim worker state: its own momentum buffer v, (d,)."""

    def __init__(self, like: Tensor, *, momentum: float) -> None:
        self.momentum = _check_momentum(momentum)
        self.v = torch.zeros_like(like)

    def update(self, grad: Tensor) -> Tensor:
        """v ← γ·v + g; returns γ·v + g (with the new v): the update to send to the ASGD master."""
        _check_vector(grad, self.v, "grad")
        self.v.mul_(self.momentum).add_(grad)
        return self.momentum * self.v + grad


class AsgdMaster:
    """Plain ASGD master: Θ ← Θ − η·update for each update received, in arrival order."""

    def __init__(self, theta0: Tensor, *, lr: float) -> None:
        self.lr = check_positive("lr", lr)
        self.theta = theta0.detach().clone()

    def read(self) -> Tensor:
        """Current parameters (a fresh tensor)."""
        return self.theta.clone()

    def write(self, update: Tensor, *, scale: float = 1.0) -> None:
        """Θ ← Θ − η·scale·update; ``scale`` carries a staleness correction such as SA's 1/max(1, τ)."""
        _check_vector(update, self.theta, "update")
        self.theta.sub_(update, alpha=self.lr * check_nonnegative("scale", scale))

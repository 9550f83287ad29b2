"""The state a peer keeps in the asynchronous modes (lasgd, gossip): local steps never wait.

A peer holds a base b (the last averaged model it merged, with its version r = how many
averages lie behind it) and its local model x. When an exchange starts it snapshots s = x
and contributes its progress u = s − b. If the group's freshest member holds a newer base
b_ref (version r_ref > r), the contribution is stale: it is corrected with Δ = b_ref − b
(the parameters' move it did not see) before it is sent:

    gap_aware   u / G,  G = 1 + |Δ|/C   (aggregation.staleness.GapAware, fed the local
                                         unpenalized steps: the momentum buffer)
    sa          u / max(1, r_ref − r)
    dc          the DC-ASGD compensation of the gradient −u/η
    none        u

The exchange averages the contributions; everyone then holds the same new base
b' = b_ref + avg(u') and merges x ← b' + (x_now − s), keeping the steps taken meanwhile.
A peer more than `max_gap` versions behind gives up its progress instead: it takes b_ref.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, Literal, Optional

import torch

from phalanx.aggregation.staleness import GapAware, dc_asgd, staleness_aware

Staleness = Literal["gap_aware", "sa", "dc", "none"]


def merge(new_base: torch.Tensor, x_now: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """LASGD's merge: the group's average plus the local progress made since the snapshot."""
    return new_base + (x_now - snapshot)


@contextlib.contextmanager
def look_ahead(params: list[torch.Tensor], buffers: list[Optional[torch.Tensor]], lr: float, momentum: float) -> Iterator[None]:
    """DANA: inside the block the parameters sit at θ − η·γ·v, where the momentum will carry them
    (DANA-Slim keeps v on the peer); they are restored exactly on exit."""
    saved = [p.detach().clone() if v is not None else None for p, v in zip(params, buffers)]
    with torch.no_grad():
        for p, v in zip(params, buffers):
            if v is not None:
                p.add_(v, alpha=-lr * momentum)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, original in zip(params, saved):
                if original is not None:
                    p.copy_(original)


@dataclass
class Penalty:
    """What a staleness correction did to one contribution (for the log and the round report)."""

    gap_versions: int
    method: str
    mean_divisor: float  # average elementwise divisor (1 = untouched)


@dataclass
class StalenessCorrection:
    method: Staleness
    lr: float
    dc_lambda: float = 0.04
    gap_aware: Optional[GapAware] = None

    def __post_init__(self) -> None:
        if self.method == "gap_aware":
            self.gap_aware = GapAware(self.lr)

    def observe(self, unpenalized_step: torch.Tensor) -> None:
        """Feed one local, unpenalized step (the momentum buffer) to Gap-Aware's statistic."""
        if self.gap_aware is not None:
            self.gap_aware.observe(unpenalized_step)

    def correct(self, update: torch.Tensor, delta: torch.Tensor, gap_versions: int) -> tuple[torch.Tensor, Penalty]:
        """The corrected contribution of a peer `gap_versions` behind, whose base lags by `delta`."""
        if gap_versions <= 0 or self.method == "none":
            return update, Penalty(max(gap_versions, 0), self.method, 1.0)
        if self.method == "sa":
            corrected = staleness_aware(update, gap_versions)
        elif self.method == "gap_aware":
            if self.gap_aware is None or self.gap_aware.v is None:  # no step observed yet: SA's bound
                corrected = staleness_aware(update, gap_versions)
            else:
                corrected, _ = self.gap_aware.correct(update, delta)
        else:  # dc: compensate the gradient the update stands for (g = −u/η)
            corrected = -self.lr * dc_asgd(-update / self.lr, delta, self.dc_lambda)
        ratio = (update.abs().sum() / corrected.abs().sum().clamp_min(1e-30)).item() if self.method != "dc" else 1.0
        return corrected, Penalty(gap_versions, self.method, ratio if math.isfinite(ratio) else 1.0)


@dataclass
class Contribution:
    update: torch.Tensor  # what this peer sends: its (corrected) progress since its base
    weight: float  # 0 when it gave up its progress (too far behind)
    base_ref: torch.Tensor  # the base every member of the group merges onto
    penalty: Penalty
    reset_to: Optional[torch.Tensor] = None  # set when the peer must take base_ref as its model


@dataclass
class LocalState:
    """Base, version and the snapshot of the exchange in flight."""

    base: torch.Tensor  # (numel,) CPU float32
    version: int = 0
    snapshot: Optional[torch.Tensor] = None
    penalties: list[Penalty] = field(default_factory=list)

    async def contribution(
        self,
        versions: list[int],
        fetch_base: Callable[[int], Awaitable[torch.Tensor]],
        correction: StalenessCorrection,
        max_gap: int,
    ) -> Contribution:
        """This peer's contribution to a group whose members hold bases of `versions`.
        `fetch_base(i)` downloads member i's base (only called when we are behind)."""
        ref_version = max(versions) if versions else self.version
        gap = ref_version - self.version
        base_ref = self.base if gap <= 0 else await fetch_base(versions.index(ref_version))
        update = self.snapshot - self.base
        if gap > max_gap:
            penalty = Penalty(gap, "download", math.inf)
            self.penalties.append(penalty)
            return Contribution(torch.zeros_like(update), 0.0, base_ref, penalty, reset_to=base_ref)
        corrected, penalty = correction.correct(update, base_ref - self.base, gap)
        self.penalties.append(penalty)
        return Contribution(corrected, 1.0, base_ref, penalty)

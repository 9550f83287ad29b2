"""The monitor's memory: the latest valid records and a bounded history of what they said.

Pure data (no I/O): `SwarmHistory.add(now, records)` after each poll, then read `latest`,
`series(field)` for per-peer plots and `states()` for peers-by-state over time.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

from phalanx.peer.health.record import HealthRecord

STATES = ("joining", "online", "offline")


@dataclass(frozen=True)
class Point:
    """What one peer reported, as seen at one poll."""

    state: str
    step: int
    loss: Optional[float]
    accuracy: Optional[float]
    samples_per_s: float
    eval_loss: Optional[float]


@dataclass
class SwarmHistory:
    """At most `max_points` polls (oldest dropped first); `t` values are DHT time in seconds."""

    max_points: int = 1800
    latest: dict[str, HealthRecord] = field(default_factory=dict)
    polls: int = 0
    last_poll_at: Optional[float] = None
    _points: deque[tuple[float, dict[str, Point]]] = field(default_factory=deque)

    def add(self, now: float, records: dict[str, HealthRecord]) -> None:
        self.latest = dict(records)
        self.polls += 1
        self.last_poll_at = now
        self._points.append(
            (
                now,
                {
                    p: Point(r.state, r.step, r.loss, r.accuracy, r.samples_per_s, r.eval_loss)
                    for p, r in records.items()
                    if r.role == "trainer"
                },
            )
        )
        while len(self._points) > self.max_points:
            self._points.popleft()

    def series(self, name: str) -> dict[str, tuple[list[float], list[float]]]:
        """{peer: (times, values)} of `name` (loss, accuracy, eval_loss, samples_per_s, step), skipping polls
        without a value."""
        out: dict[str, tuple[list[float], list[float]]] = {}
        for t, points in self._points:
            for peer, point in points.items():
                value = getattr(point, name)
                if value is None:
                    continue
                times, values = out.setdefault(peer, ([], []))
                times.append(t)
                values.append(float(value))
        return out

    def states(self) -> tuple[list[float], dict[str, list[int]]]:
        """(times, {state: trainer counts at each time}) for a stacked plot."""
        times: list[float] = []
        counts: dict[str, list[int]] = {s: [] for s in STATES}
        for t, points in self._points:
            times.append(t)
            c = Counter(p.state for p in points.values())
            for s in STATES:
                counts[s].append(c.get(s, 0))
        return times, counts

    @property
    def start(self) -> Optional[float]:
        return self._points[0][0] if self._points else None

"""Peers this one keeps out of its rounds for a while, on its own evidence.

Unverified rounds have no proofs and no bans: a member caught in what no honest peer does (declaring a
part larger than its codec can take, to make reducers allocate it) is refused and kept out of this
peer's next groups for a cool-off instead. The reducer that caught it adds it (protocol.allreduce); the
matchmaker neither admits it to the groups this peer leads nor follows it as a leader. Nobody else has
to believe it: each peer quarantines only what it saw itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Quarantine:
    """Peer → when its cool-off ends, on `clock` (time.monotonic unless a test injects one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[str, float] = {}

    def add(self, peer: str, for_s: float) -> None:
        """Keep `peer` out for `for_s` seconds from now (a longer cool-off already running stays)."""
        now = self._clock()
        self._expire(now)
        self._until[peer] = max(self._until.get(peer, now), now + for_s)

    def __contains__(self, peer: object) -> bool:
        until = self._until.get(peer) if isinstance(peer, str) else None
        return until is not None and until > self._clock()

    def remaining_s(self, peer: str) -> float:
        """Seconds left of `peer`'s cool-off (0 when it is not in quarantine)."""
        return max(self._until.get(peer, 0.0) - self._clock(), 0.0)

    def peers(self) -> frozenset[str]:
        """The peers in quarantine now."""
        self._expire(self._clock())
        return frozenset(self._until)

    def _expire(self, now: float) -> None:
        for peer in [p for p, until in self._until.items() if until <= now]:
            del self._until[peer]

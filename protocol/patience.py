"""How long a reducer waits for each member's bytes, learned from that member's last rounds.

A fixed idle limit either drops members on long links or loaded machines (too short) or makes every
dead member cost the others its full length (too long). A reducer instead notes, for each sender whose
part it got, the longest the sender kept it waiting in that round (before its first byte, or between
two bytes), and waits for it at most the median of its last HISTORY such waits plus SPREADS times their
spread (the longest minus the median), at least FLOOR_S, at most the configured limit. A sender with
fewer than MIN_ROUNDS rounds noted gets the configured limit. See docs/algorithms.md §10.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Optional

FLOOR_S = 2.0  # a descheduled process on a loaded machine, a few lost packets: not a dead member
HISTORY = 16  # rounds per sender
MIN_ROUNDS = 4  # before this many, the configured limit
SPREADS = 2.0
MAX_PEERS = 1024  # senders remembered (the least recently noted are forgotten first)


class Patience:
    """Per-sender idle limits; `cap_s` None turns idle limits off (wait for every part until the deadline)."""

    def __init__(self, cap_s: Optional[float]) -> None:
        self.cap_s = cap_s
        self._waits: dict[str, deque[float]] = {}

    def limit(self, peer: str) -> Optional[float]:
        """How long `peer`'s part may move no bytes before this reducer stops waiting for it."""
        if self.cap_s is None:
            return None
        waits = self._waits.get(peer)
        if waits is None or len(waits) < MIN_ROUNDS:
            return self.cap_s
        median = statistics.median(waits)
        return min(self.cap_s, max(FLOOR_S, median + SPREADS * (max(waits) - median)))

    def note(self, peer: str, waited_s: float) -> None:
        """`peer`'s part came in whole; it kept us waiting at most `waited_s` at a time."""
        waits = self._waits.pop(peer, None)
        if waits is None:
            waits = deque(maxlen=HISTORY)
            while len(self._waits) >= MAX_PEERS:
                self._waits.pop(next(iter(self._waits)))
        waits.append(max(waited_s, 0.0))
        self._waits[peer] = waits  # (re-inserted: most recently noted last)

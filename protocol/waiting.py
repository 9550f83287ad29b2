"""Calls held until the round they name opens here, counted in all and per caller.

A member's part or phase message may arrive before this peer has the round (it is a step behind), so
such calls wait a while. Rounds are named by the caller, so made-up ids cost it nothing: without a
per-caller cap one peer could fill the whole list with them and every other peer's early calls would be
refused until they expired.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from phalanx.errors import RoundAbortedError

# A member has about one call per round in flight to us (its part, or one phase message); a few rounds at
# once (asynchronous modes, a retried call) stay far under this.
MAX_WAITING_PER_CALLER = 8


class WaitingCalls:
    """At most `total` calls waiting at once, and at most `per_caller` of them from one peer."""

    def __init__(self, total: int, per_caller: int = MAX_WAITING_PER_CALLER) -> None:
        self.total, self.per_caller = total, per_caller
        self._by_caller: Counter[str] = Counter()

    def __len__(self) -> int:
        return self._by_caller.total()

    def of(self, peer: str) -> int:
        """How many of `peer`'s calls are waiting."""
        return self._by_caller[peer]

    @contextlib.contextmanager
    def hold(self, peer: str) -> Iterator[None]:
        """One waiting call of `peer`'s, for the block's duration; RoundAbortedError when a cap is reached
        (a refusal, not a protocol error: a loaded swarm may reach the total honestly)."""
        if self._by_caller[peer] >= self.per_caller:
            raise RoundAbortedError(f"too many of this caller's calls for rounds not open here ({self.per_caller})")
        if len(self) >= self.total:
            raise RoundAbortedError("too many calls for rounds not open here")
        self._by_caller[peer] += 1
        try:
            yield
        finally:
            self._by_caller[peer] -= 1
            if self._by_caller[peer] <= 0:
                del self._by_caller[peer]

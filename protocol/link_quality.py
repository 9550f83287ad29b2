"""Link quality: which peers this one finds slow, and whether it steps down as leader.

A member whose parts reach this peer's reducers far behind the others' round after round (a lossy or thin
link), or a leader whose link keeps this peer's joins long, is marked slow for SLOW_FOR_S. The marks go into
this peer's membership record; once most of the others name a peer, it leads no group and forming groups do
not wait for it (`Membership.slow_votes`), so one bad link does not set the pace of every round it gets into.
A leader whose joiners report its link slow names itself (steps down), then leads none on probation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)

SLOW_FOR_S = 30.0
SLOW_ROUNDS_OF, SLOW_ROUNDS = 8, 3  # a member is slow when its parts were late in this many of its last rounds with us
# A leader is slow to its joiners when, of their last SLOW_JOINS_OF calls, SLOW_JOINS took more than
# SLOW_JOIN_MIN_S (and SLOW_JOIN_FACTOR times the typical one) beyond the time it held them: every join and
# group reply crosses the leader's link, and a lossy leader set the pace of every group of a k:3 swarm.
SLOW_JOINS_OF, SLOW_JOINS = 8, 3
SLOW_JOINS_TOTAL_S = 1.0  # ... or two took this much beyond the bound together (a lossy link's joins take seconds)
SLOW_JOIN_MIN_S = 0.2
SLOW_JOIN_FACTOR = 4.0


@dataclass
class LinkQuality:
    """This peer's marks of slow peers (itself included while it steps down), published by its membership."""

    peer_id: str
    announce: Callable[[], None]  # publish our record now, not at the next period (Membership.announce_soon)
    in_view: Callable[[], Collection[str]]  # the peers in the swarm now (Membership.peers)
    _slow: dict[str, float] = field(default_factory=dict)  # peer -> time.monotonic() its mark ends
    _late_parts: dict[str, list[bool]] = field(default_factory=dict)  # member -> were its parts late, last rounds
    _overheads_of: Optional[str] = None  # the leader our last joins went to ...
    _overheads: list[float] = field(default_factory=list)  # ... and how long each took beyond its wait
    _last_overhead: tuple[Optional[str], float] = (None, 0.0)  # (leader, seconds) of our last join, reported in the next
    _reports: list[tuple[str, float]] = field(default_factory=list)  # leader: (joiner, overhead) of the last joins served
    _stepping_down_until: float = 0.0  # leader: named slow by itself until then (see note_report) ...
    _probation_until: float = 0.0  # ... then back in groups, but leading none until then (see on_probation)

    def note_round(self, members: list[str], slow_senders: tuple[str, ...] | list[str]) -> None:
        """After a round of ours: mark members whose parts came in far behind the others' in SLOW_ROUNDS of
        their last SLOW_ROUNDS_OF rounds with us (a thin link is late every round, a descheduled process once)."""
        slow = set(slow_senders)
        marked = []
        for peer in members:
            if peer == self.peer_id:
                continue
            history = [*self._late_parts.get(peer, [])[1 - SLOW_ROUNDS_OF :], peer in slow]
            if sum(history) >= SLOW_ROUNDS:
                marked.append(peer)
                history = []
            self._late_parts[peer] = history
        absent = [p for p in self._late_parts if p not in members]
        if absent:
            view = self.in_view()
            for peer in [p for p in absent if p not in view]:
                del self._late_parts[peer]  # gone from the swarm
        if marked:
            now = time.monotonic()
            fresh = [p[-8:] for p in marked if self._slow.get(p, 0.0) <= now]
            if fresh:
                logger.info(f"member(s) {fresh} slow: their parts came late in {SLOW_ROUNDS} of their last {SLOW_ROUNDS_OF} rounds with us")
            self.note_slow(marked)

    def note_slow(self, peers: tuple[str, ...] | list[str]) -> None:
        """Mark peers slow for SLOW_FOR_S: their parts kept coming in late (note_round), or their link kept our
        joins long (note_join_overhead)."""
        now = time.monotonic()
        new = False
        for peer in peers:
            if peer != self.peer_id:
                new = new or self._slow.get(peer, 0.0) <= now
                self._slow[peer] = now + SLOW_FOR_S
        if new:
            self.announce()  # the others count our mark at their next read, not 2 s later
        for peer in [p for p, until in self._slow.items() if until <= now]:
            del self._slow[peer]

    def note_join_overhead(self, leader: str, overhead_s: float) -> None:
        """After a join of ours: how long it took beyond what `leader` held it (its link; our next join to it
        reports this). Mark the leader slow when its link, not its waiting for others, keeps our joins long;
        while this peer steps down or is on probation after that, late joins to the next leader say its own
        link still is slow."""
        self._last_overhead = (leader, overhead_s)
        if self._overheads_of != leader:
            self._overheads_of, self._overheads = leader, []
        self._overheads = [*self._overheads[1 - SLOW_JOINS_OF :], max(overhead_s, 0.0)]
        if len(self._overheads) < SLOW_JOINS_OF:
            return
        late, limit = _late(self._overheads)
        if not _too_late(self._overheads, late, limit):
            return
        self._overheads = []
        if self._probation_until > time.monotonic():  # we stepped down lately: it is our link that is slow
            logger.info(f"stepping down (again): {sum(late)} of our last {SLOW_JOINS_OF} joins took over {limit:.2f} s")
            self.step_down()
            return
        logger.info(f"leader {leader[-8:]} is slow: {sum(late)} of our last {SLOW_JOINS_OF} joins took over "
                    f"{limit:.2f} s beyond its wait")  # fmt: skip
        self.note_slow([leader])

    def overhead_to_report(self, leader: str) -> float:
        """What our next join to `leader` reports: our last join's overhead if it went there too (else 0)."""
        last, overhead_s = self._last_overhead
        return overhead_s if last == leader else 0.0

    def note_report(self, joiner: str, overhead_s: float) -> None:
        """Leader: step down (name itself slow) when its joiners' reports say its link keeps their joins long.
        It sees every joiner's report, so it finds out several times sooner than each joiner alone; it takes
        late reports from most of its reporters, so a minority cannot talk it out of leading."""
        if overhead_s <= 0.0:
            return
        self._reports = [*self._reports[1 - SLOW_JOINS_OF :], (joiner, overhead_s)]
        if len(self._reports) < SLOW_JOINS_OF or self._stepping_down_until > time.monotonic():
            return
        overheads = [o for _, o in self._reports]
        flags, limit = _late(overheads)
        late = [j for (j, _), is_late in zip(self._reports, flags) if is_late]
        reporters, late_reporters = {j for j, _ in self._reports}, set(late)
        slow = _too_late(overheads, flags, limit)
        if slow and len(late_reporters) >= 2 and 2 * len(late_reporters) > len(reporters):
            logger.info(
                f"stepping down as leader: {len(late)} of the last {SLOW_JOINS_OF} joins took over {limit:.2f} s "
                f"beyond our wait, for {len(late_reporters)} of {len(reporters)} joiners"
            )
            self.step_down()
            self._reports = []

    def step_down(self) -> None:
        now = time.monotonic()
        self._stepping_down_until, self._probation_until = now + SLOW_FOR_S, now + 2 * SLOW_FOR_S
        self.announce()

    def stepping_down_s(self) -> float:
        """For how much longer this peer steps down (0 or less: it does not); its redirects say so."""
        return self._stepping_down_until - time.monotonic()

    def on_probation(self) -> bool:
        """After stepping down: back in groups (where slow parts get it marked again), not leading yet. A link that
        was slow when it stepped down often still is when that ends, and a leader's link costs every group."""
        return self._stepping_down_until <= time.monotonic() < self._probation_until

    def slow_peers(self) -> list[str]:
        """The peers marked slow now, this one too while it steps down (published in its membership record)."""
        now = time.monotonic()
        marked = [p for p, until in self._slow.items() if until > now]
        return marked + [self.peer_id] if self._stepping_down_until > now else marked


def _late(overheads: list[float]) -> tuple[list[bool], float]:
    """Which join overheads are late, and the bound: SLOW_JOIN_MIN_S, or SLOW_JOIN_FACTOR times the median
    where that is more (a far leader's 300 ms round trips are its typical time, not lateness)."""
    limit = max(SLOW_JOIN_MIN_S, SLOW_JOIN_FACTOR * sorted(overheads)[len(overheads) // 2])
    return [o > limit for o in overheads], limit


def _too_late(overheads: list[float], late: list[bool], limit: float) -> bool:
    """SLOW_JOINS late joins, or two or more that add up to SLOW_JOINS_TOTAL_S beyond the bound: each join
    under a lossy leader can take a second, and waiting for a third costs the swarm another."""
    beyond = sum(o - limit for o, is_late in zip(overheads, late) if is_late)
    return sum(late) >= SLOW_JOINS or (sum(late) >= 2 and beyond >= SLOW_JOINS_TOTAL_S)

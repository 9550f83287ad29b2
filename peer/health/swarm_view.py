"""Whether a peer still sees its whole swarm (pure functions over health records, no I/O).

Readiness used to check only that a peer's own view was fresh, so a peer cut off from the others
(or one half of a split swarm) trained alone with `/readyz` 200. Each rule here is a reason for
503 and a problem `phalanx health` shows:

- cut off: it sees at most half of the peers it saw in the last RECENT_S (peers that left cleanly
  do not count), e.g. "cut off: sees 1 of 5 peers";
- training alone: its last round had no other member while other trainers were around;
- behind: in lockstep modes, its step is more than BEHIND_STEPS below the other trainers' median
  (a frozen peer that woke up);
- split: the run's trainers form groups that train apart (disjoint recent rounds) under different
  leaders. Matchmaking resolves it once the groups see each other (see README, "split swarms").
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from phalanx.peer.health.record import HealthRecord

RECENT_S = 120.0  # how long a peer that vanished without saying goodbye still counts as "recently seen"
BEHIND_STEPS = 10  # lockstep: more steps than this below the others' median is "behind"
SPLIT_WINDOW_S = 30.0  # rounds finished this recently show which trainers train together


@dataclass
class RecentPeers:
    """Peers of the run seen in health records within RECENT_S (this peer included)."""

    self_id: str
    seen_at: dict[str, float] = field(default_factory=dict)

    def update(self, records: Mapping[str, HealthRecord], now: float) -> None:
        """`now` is monotonic; peers whose record says offline left cleanly and are forgotten."""
        for peer, record in records.items():
            if record.state == "offline":
                self.seen_at.pop(peer, None)
            else:
                self.seen_at[peer] = now
        self.seen_at[self.self_id] = now
        for peer in [p for p, t in self.seen_at.items() if now - t > RECENT_S]:
            del self.seen_at[peer]

    def count(self) -> int:
        return len(self.seen_at)


def cut_off(visible: int, recent: int) -> Optional[str]:
    """A peer seeing at most half of the peers it saw recently is on the wrong side of a cut."""
    if recent >= 2 and 2 * visible <= recent:
        return f"cut off: sees {visible} of {recent} peers"
    return None


@dataclass(frozen=True)
class Group:
    """Trainers that trained together recently (one side of a split)."""

    members: tuple[str, ...]  # sorted peer IDs
    step: int  # the highest step among them
    leaders: tuple[str, ...]  # the leaders its members follow


def training_groups(records: Mapping[str, HealthRecord], *, now: float, config_hash: Optional[str] = None) -> list[Group]:
    """Online trainers of one configuration (default: the most common) with a round in the last
    SPLIT_WINDOW_S, grouped: members of one recent round belong together, and so do groups that follow a
    common leader (one leader can form several groups at once, as `--sync-policy k:<K>` does). Trainers
    of another configuration never train with these (legality flags them). Largest group first."""
    if config_hash is None:
        counts = Counter(r.config_hash for r in records.values() if r.role == "trainer")
        config_hash = counts.most_common(1)[0][0] if counts else ""
    active = {
        p: r for p, r in records.items()
        if r.role == "trainer" and r.state == "online" and r.config_hash == config_hash
        and r.last_round is not None and now - r.last_round.finished_at <= SPLIT_WINDOW_S
    }  # fmt: skip
    parent = {p: p for p in active}

    def root(p: str) -> str:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    def join(a: str, b: str) -> None:
        parent[root(a)] = root(b)

    by_leader: dict[str, str] = {}
    for peer, record in active.items():
        for member in record.last_round.members:
            if member in active:
                join(peer, member)
        if record.leader:
            join(peer, by_leader.setdefault(record.leader, peer))
    components: dict[str, list[str]] = {}
    for peer in active:
        components.setdefault(root(peer), []).append(peer)
    groups = [
        Group(
            members=tuple(sorted(members)),
            step=max(active[p].step for p in members),
            leaders=tuple(sorted({active[p].leader for p in members if active[p].leader})),
        )
        for members in components.values()
    ]
    return sorted(groups, key=lambda g: (-len(g.members), -g.step, g.members))


def split_problem(groups: list[Group]) -> Optional[str]:
    if len(groups) < 2:
        return None
    sides = "; ".join(f"{len(g.members)} at step {g.step}" for g in groups)
    return f"split: {len(groups)} groups ({sides})"


@dataclass(frozen=True)
class Self:
    """What a peer knows of itself for these rules."""

    peer_id: str
    role: str  # "trainer" or "bootstrap"
    step: int
    lockstep: bool  # sync mode: every member's step moves together
    config_hash: str  # only trainers of the same configuration can train together
    last_round_members: tuple[str, ...]  # () before its first round
    dials_out_only: bool = False  # nobody can dial this peer (a home router, a firewall, --client-mode)


def swarm_reasons(me: Self, records: Mapping[str, HealthRecord], recent: int, *, now: float) -> list[str]:
    """Why `me` does not see its whole swarm (empty: it does). `records` are the run's valid, unexpired
    health records as `me` read them; `recent` is `RecentPeers.count()`; `now` is DHT time."""
    reasons: list[str] = []
    visible = len({p for p, r in records.items() if r.state != "offline"} | {me.peer_id})
    found = cut_off(visible, recent)
    if found:
        reasons.append(found)
    if me.role != "trainer":
        split = split_problem(training_groups(records, now=now))
        return reasons + ([split] if split else [])
    others = {
        p: r for p, r in records.items()
        if p != me.peer_id and r.role == "trainer" and r.state != "offline" and r.config_hash == me.config_hash
    }  # fmt: skip
    if me.dials_out_only and all(r.reachability == "client" for r in others.values()):
        reasons.append(
            "unreachable: no relay: nobody can dial this peer, no relay leads to it (its initial peers relay while "
            "they run), and no trainer in view can be dialed either (restart its relay, or forward --port and pass "
            "--public-ip)"
        )
    if me.last_round_members == (me.peer_id,) and (others or recent > 2):
        reasons.append("training alone: its last round had no other member while other trainers are around")
    if me.lockstep and others:
        swarm_step = statistics.median_low(r.step for r in others.values())
        if swarm_step - me.step > BEHIND_STEPS:
            reasons.append(f"behind: step {me.step}, the swarm is at step {swarm_step}")
    split = split_problem(training_groups(records, now=now, config_hash=me.config_hash))
    if split:
        reasons.append(split)
    return reasons

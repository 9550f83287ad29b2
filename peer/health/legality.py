"""Local checks that the swarm a peer sees is a legal configuration (pure functions, no I/O).

A peer compares itself with the members of its last round, as they describe themselves in
their signed health records: same protocol version, same run-configuration hash, no member
it has banned, and ban lists that agree once they had time to spread. Observers (`phalanx
health`, the monitor) add what only a swarm-wide view shows: stale records, peers whose
version or configuration differs from the majority, groups of trainers training apart (a split
swarm), and what each peer says is wrong with its own view (cut off, behind: swarm_view).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from phalanx.peer.health.record import PUBLISH_EVERY_S, HealthRecord
from phalanx.peer.health.swarm_view import split_problem, training_groups

BAN_GRACE_S = 30.0  # ban lists may differ this long after either side changed (bans spread through the DHT)
STALE_AFTER_S = 3 * PUBLISH_EVERY_S


@dataclass(frozen=True)
class LocalView:
    """What a peer knows about itself for the check."""

    peer_id: str
    protocol: int
    config_hash: str
    bans: frozenset[str]
    bans_digest: str
    bans_changed_at: float  # DHT time
    round_members: tuple[str, ...]  # members of its last round (itself included)


def check_legality(me: LocalView, records: Mapping[str, HealthRecord], *, now: float) -> list[str]:
    """Violations of a legal swarm configuration seen from `me`; empty means legal."""
    problems: list[str] = []
    for member in me.round_members:
        if member == me.peer_id:
            continue
        if member in me.bans:
            problems.append(f"round member {member[-8:]} is banned here")
        record = records.get(member)
        if record is None:
            continue  # not published yet (or expired): nothing to compare
        if record.protocol != me.protocol:
            problems.append(f"round member {member[-8:]} speaks protocol {record.protocol}, this peer {me.protocol}")
        if record.config_hash != me.config_hash:
            problems.append(
                f"round member {member[-8:]} has config hash {record.config_hash[:12]}, this peer {me.config_hash[:12]}"
            )
        settled = now - max(record.bans_changed_at, me.bans_changed_at) > BAN_GRACE_S
        if record.bans_digest != me.bans_digest and settled:
            problems.append(f"ban list differs from round member {member[-8:]}'s")
    for peer, record in sorted(records.items()):
        if peer != me.peer_id and me.peer_id in record.bans and record.config_hash == me.config_hash:
            problems.append(f"banned by {peer[-8:]}")
    return problems


def swarm_problems(records: Mapping[str, HealthRecord], *, now: float) -> dict[str, list[str]]:
    """Per peer: its own violations plus what an observer sees across all records."""
    trainers = [r for r in records.values() if r.role == "trainer" and r.state != "offline"]
    config = _majority(r.config_hash for r in trainers)
    version = _majority(r.version for r in records.values())
    protocol = _majority(r.protocol for r in records.values())
    split = split_problem(training_groups(records, now=now))
    problems: dict[str, list[str]] = {}
    for peer, record in records.items():
        found = list(record.violations)
        found += [p for p in record.swarm_problems if not (split and p.startswith("split:"))]
        if split and record.role == "trainer" and record.state == "online":
            found.append(split)
        if now - record.published_at > STALE_AFTER_S and record.state != "offline":
            found.append(f"stale: last record {now - record.published_at:.0f} s ago")
        if record.role == "trainer" and config is not None and record.config_hash != config:
            found.append(f"config hash {record.config_hash[:12]} differs from the swarm's {config[:12]}")
        if version is not None and record.version != version:
            found.append(f"version {record.version} differs from the swarm's {version}")
        if protocol is not None and record.protocol != protocol:
            found.append(f"protocol {record.protocol} differs from the swarm's {protocol}")
        problems[peer] = found
    return problems


def _majority(values) -> object:
    """The most common value unless tied with another, else None (no side to call wrong)."""
    counts = Counter(values)
    if not counts:
        return None
    (value, count), *rest = counts.most_common(2) + [(None, 0)]
    return value if count > rest[0][1] else None

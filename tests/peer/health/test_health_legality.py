"""The local legality check and the observer's per-peer problems (pure functions)."""

from __future__ import annotations

import pytest

from phalanx.peer.health.legality import BAN_GRACE_S, STALE_AFTER_S, LocalView, check_legality, swarm_problems
from phalanx.peer.health.record import HealthRecord, bans_digest

NOW = 1_800_000_000.0
A, B, C, D = (
    "QmAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "QmBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
    "QmCccccccccccccccccccccccccccccccccccccccccccc",
    "QmDddddddddddddddddddddddddddddddddddddddddddd",
)
HASH, OTHER = "ab" * 32, "cd" * 32


def rec(peer: str, **changes) -> HealthRecord:
    fields = dict(
        peer_id=peer, role="trainer", state="online", version="0.1.0", protocol=1, run_id="phalanx", config_hash=HASH,
        published_at=NOW, started_at=NOW - 60, addresses=[], reachability="direct", step=10, samples_per_s=100.0,
        bans_digest=bans_digest(set()),
    )  # fmt: skip
    return HealthRecord(**{**fields, **changes})


def me(**changes) -> LocalView:
    fields = dict(
        peer_id=A, protocol=1, config_hash=HASH, bans=frozenset(), bans_digest=bans_digest(set()), bans_changed_at=0.0,
        round_members=(A, B, C),
    )  # fmt: skip
    return LocalView(**{**fields, **changes})


def test_a_consistent_swarm_is_legal():
    assert check_legality(me(), {A: rec(A), B: rec(B), C: rec(C)}, now=NOW) == []


def test_config_hash_mismatch_among_round_members_is_flagged():
    problems = check_legality(me(), {B: rec(B), C: rec(C, config_hash=OTHER)}, now=NOW)
    assert problems == [f"round member {C[-8:]} has config hash {OTHER[:12]}, this peer {HASH[:12]}"]


def test_protocol_mismatch_is_flagged():
    assert check_legality(me(), {B: rec(B, protocol=2)}, now=NOW) == [
        f"round member {B[-8:]} speaks protocol 2, this peer 1"
    ]


def test_mismatch_outside_the_round_is_not_a_violation():
    assert check_legality(me(), {D: rec(D, config_hash=OTHER, protocol=2)}, now=NOW) == []


def test_members_without_a_record_are_not_judged():
    assert check_legality(me(), {}, now=NOW) == []


def test_banned_round_member_is_flagged():
    assert check_legality(me(bans=frozenset({C}), bans_digest=bans_digest({C})), {}, now=NOW) == [
        f"round member {C[-8:]} is banned here"
    ]


@pytest.mark.parametrize(("since_change_s", "flagged"), [(BAN_GRACE_S - 1, False), (BAN_GRACE_S + 1, True)])
def test_ban_lists_must_agree_once_settled(since_change_s, flagged):
    changed = NOW - since_change_s
    theirs = rec(B, bans=[D], bans_digest=bans_digest({D}), bans_changed_at=changed)
    problems = check_legality(me(), {B: theirs}, now=NOW)
    assert problems == ([f"ban list differs from round member {B[-8:]}'s"] if flagged else [])


def test_being_banned_by_a_peer_of_the_same_run_is_reported():
    assert check_legality(me(round_members=()), {D: rec(D, bans=[A])}, now=NOW) == [f"banned by {D[-8:]}"]
    assert check_legality(me(round_members=()), {D: rec(D, bans=[A], config_hash=OTHER)}, now=NOW) == []


def test_observer_flags_minority_config_stale_records_and_own_violations():
    records = {
        A: rec(A),
        B: rec(B),
        C: rec(C, config_hash=OTHER),
        D: rec(D, published_at=NOW - STALE_AFTER_S - 1, violations=["banned by x"], legal=False),
    }
    problems = swarm_problems(records, now=NOW)
    assert problems[A] == [] and problems[B] == []
    assert problems[C] == [f"config hash {OTHER[:12]} differs from the swarm's {HASH[:12]}"]
    assert problems[D] == ["banned by x", f"stale: last record {STALE_AFTER_S + 1:.0f} s ago"]


def test_observer_names_no_side_in_a_tie():
    assert swarm_problems({A: rec(A), B: rec(B, config_hash=OTHER)}, now=NOW) == {A: [], B: []}

"""Whether a peer sees its whole swarm: cut off, alone, behind, split (pure functions on health records)."""

from __future__ import annotations

import pytest

from phalanx.peer.health.legality import swarm_problems
from phalanx.peer.health.record import HealthRecord, LastRound, bans_digest
from phalanx.peer.health.swarm_view import (
    BEHIND_STEPS,
    RECENT_S,
    SPLIT_WINDOW_S,
    RecentPeers,
    Self,
    cut_off,
    swarm_reasons,
    training_groups,
)

NOW = 1_800_000_000.0
A, B, C, D, E, BOOT = (
    "QmAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "QmBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
    "QmCccccccccccccccccccccccccccccccccccccccccccc",
    "QmDddddddddddddddddddddddddddddddddddddddddddd",
    "QmEeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee",
    "QmFfffffffffffffffffffffffffffffffffffffffffff",
)


def rec(peer: str, members: tuple[str, ...] = (), *, ago_s: float = 1.0, **changes) -> HealthRecord:
    last = None
    if members:
        last = LastRound(round_id="ab" * 8, members=list(members), outcome="ok", duration_s=0.1, finished_at=NOW - ago_s)
    fields = dict(
        peer_id=peer, role="trainer", state="online", version="0.1.0", protocol=1, run_id="phalanx", config_hash="ab",
        published_at=NOW, started_at=NOW - 60, addresses=[], reachability="direct", step=100, samples_per_s=10.0,
        bans_digest=bans_digest(set()), last_round=last, leader=min(members) if members else None,
    )  # fmt: skip
    return HealthRecord(**{**fields, **changes})


def boot() -> HealthRecord:
    return rec(BOOT, role="bootstrap", leader=None)


def me(peer: str = A, *, step: int = 100, members: tuple[str, ...] = (A, B, C), lockstep: bool = True) -> Self:
    return Self(peer_id=peer, role="trainer", step=step, lockstep=lockstep, config_hash="ab", last_round_members=members)


def test_a_whole_swarm_has_no_problems():
    records = {p: rec(p, (A, B, C, D)) for p in (A, B, C, D)} | {BOOT: boot()}
    assert swarm_reasons(me(members=(A, B, C, D)), records, 5, now=NOW) == []


@pytest.mark.parametrize(
    "visible, recent, expected",
    [
        (1, 5, "cut off: sees 1 of 5 peers"),
        (2, 5, "cut off: sees 2 of 5 peers"),  # the smaller side of 2 + 3
        (3, 5, None),  # the larger side goes on training
        (2, 4, "cut off: sees 2 of 4 peers"),  # an even split: neither side has a majority
        (4, 5, None),  # one peer died
        (1, 2, "cut off: sees 1 of 2 peers"),
        (1, 1, None),  # alone from the start: nothing was lost
    ],
)
def test_cut_off_is_seeing_at_most_half_of_the_recent_peers(visible, recent, expected):
    assert cut_off(visible, recent) == expected


def test_a_cut_off_trainer_says_so_and_that_it_trains_alone():
    records = {A: rec(A, (A,))}  # the others' records expired on its side of the cut
    reasons = swarm_reasons(me(members=(A,)), records, 5, now=NOW)
    assert reasons == [
        "cut off: sees 1 of 5 peers",
        "training alone: its last round had no other member while other trainers are around",
    ]


def test_recent_peers_forget_the_ones_that_left_cleanly_and_the_long_gone():
    recent = RecentPeers(A)
    recent.update({B: rec(B), C: rec(C), BOOT: boot()}, now=0.0)
    assert recent.count() == 4
    recent.update({B: rec(B, state="offline")}, now=10.0)  # B said goodbye; C vanished
    assert sorted(recent.seen_at) == sorted([A, C, BOOT])
    recent.update({}, now=10.0 + RECENT_S + 1)
    assert sorted(recent.seen_at) == [A]


def test_a_peer_far_behind_the_others_median_step_is_behind_in_lockstep_modes_only():
    records = {p: rec(p, (A, B, C), step=500) for p in (B, C)} | {A: rec(A, (A, B, C), step=100)}
    assert swarm_reasons(me(step=100), records, 3, now=NOW) == ["behind: step 100, the swarm is at step 500"]
    assert swarm_reasons(me(step=500 - BEHIND_STEPS), records, 3, now=NOW) == []
    assert swarm_reasons(me(step=100, lockstep=False), records, 3, now=NOW) == []


def test_trainers_of_another_configuration_are_not_the_swarm_it_is_behind_or_trains_without():
    records = {A: rec(A, (A,)), B: rec(B, (B,), step=10**6, config_hash="cd")}
    assert swarm_reasons(me(step=100, members=(A,)), records, 2, now=NOW) == []


def test_one_peer_claiming_a_huge_step_does_not_make_the_others_behind():
    records = {B: rec(B, (A, B, C), step=10**9), C: rec(C, (A, B, C), step=100), D: rec(D, (A, B, C, D), step=100)}
    assert swarm_reasons(me(step=100), records, 4, now=NOW) == []


def test_two_groups_training_apart_under_different_leaders_are_a_split():
    records = {A: rec(A, (A, B), step=300), B: rec(B, (A, B), step=300)}
    records |= {C: rec(C, (C, D), step=305), D: rec(D, (C, D), step=305)}
    groups = training_groups(records, now=NOW)
    assert [g.members for g in groups] == [(C, D), (A, B)]  # same size: the higher step first
    assert swarm_reasons(me(step=300, members=(A, B)), records, 5, now=NOW) == [
        "split: 2 groups (2 at step 305; 2 at step 300)"
    ]


def test_groups_one_leader_formed_at_once_are_one_swarm():
    # --sync-policy k:2 with four peers: two groups of two per round, both formed by A
    records = {A: rec(A, (A, C)), C: rec(C, (A, C)), B: rec(B, (B, D), leader=A), D: rec(D, (B, D), leader=A)}
    assert len(training_groups(records, now=NOW)) == 1


def test_a_peer_that_switched_leader_but_last_trained_with_the_others_is_no_split():
    records = {A: rec(A, (A, B, C)), B: rec(B, (A, B, C)), C: rec(C, (A, B, C), leader=E)}  # E just joined
    assert len(training_groups(records, now=NOW)) == 1


def test_old_rounds_and_peers_without_rounds_do_not_form_groups():
    records = {A: rec(A, (A, B)), B: rec(B, (A, B)), C: rec(C, (C,), ago_s=SPLIT_WINDOW_S + 1), D: rec(D)}
    assert len(training_groups(records, now=NOW)) == 1


def test_the_observer_shows_the_split_on_every_online_trainer_and_what_each_peer_reports():
    records = {A: rec(A, (A, B)), B: rec(B, (A, B)), C: rec(C, (C, D), step=90), D: rec(D, (C, D), step=90)}
    records[BOOT] = boot().model_copy(update={"swarm_problems": ["cut off: sees 1 of 5 peers"]})
    problems = swarm_problems(records, now=NOW)
    split = "split: 2 groups (2 at step 100; 2 at step 90)"
    assert all(problems[p] == [split] for p in (A, B, C, D))
    assert problems[BOOT] == ["cut off: sees 1 of 5 peers"]


class _LiveDHT:
    def is_alive(self) -> bool:
        return True


def test_a_cut_off_bootstrap_is_unready_with_the_reason_and_its_metrics_say_so(tmp_path):
    from hivemind.utils import get_dht_time

    from phalanx.peer.config import NetworkSettings
    from phalanx.peer.health.metrics import PeerMetrics, render
    from phalanx.peer.health.service import HealthService
    from phalanx.security.identity import Identity

    identity = Identity.generate_ed25519(tmp_path / "boot.id")
    service = HealthService(
        dht=_LiveDHT(), identity=identity, metrics=PeerMetrics(role="bootstrap"), settings=NetworkSettings()
    )
    now = get_dht_time()
    service.published_at = now
    fresh = {p: rec(p, (A, B, C, D), ago_s=0.0).model_copy(update={"published_at": now}) for p in (A, B, C, D)}
    for p, r in fresh.items():  # the swarm's last round finished just now
        fresh[p] = r.model_copy(update={"last_round": r.last_round.model_copy(update={"finished_at": now})})
    service.records = fresh
    service._track_swarm()
    assert service.readiness() == (True, [])
    service.records = {}  # a cut: the others' records expired
    service._track_swarm()
    assert service.readiness() == (False, ["cut off: sees 1 of 5 peers"])
    text = render(service.metrics.registry).decode()
    assert "phalanx_ready 0.0" in text and "phalanx_swarm_problems 1.0" in text and "phalanx_peers_recent 5.0" in text
    service.recent.seen_at = {p: t - RECENT_S - 1 for p, t in service.recent.seen_at.items()}  # two minutes on
    service._track_swarm()
    assert service.readiness() == (True, [])  # the lost peers no longer count


def test_records_that_expire_between_reads_count_at_once(tmp_path):
    """A cut-off peer's next read can be a publish period (or a slow lookup) away: /readyz must not
    wait for it once the others' records in its storage have expired."""
    from hivemind.utils import get_dht_time

    from phalanx.peer.config import NetworkSettings
    from phalanx.peer.health.metrics import PeerMetrics
    from phalanx.peer.health.service import HealthService
    from phalanx.security.identity import Identity

    service = HealthService(
        dht=_LiveDHT(), identity=Identity.generate_ed25519(tmp_path / "boot.id"),
        metrics=PeerMetrics(role="bootstrap"), settings=NetworkSettings(),
    )  # fmt: skip
    now = get_dht_time()
    service.published_at = now
    service.records = {p: boot().model_copy(update={"peer_id": p, "published_at": now}) for p in (A, B, C, D)}
    service.expirations = {A: now + 60, B: now + 60, C: now - 1, D: now - 1}
    service._track_swarm()  # read while every record was alive
    assert service.swarm_problems == []
    assert service.readiness() == (True, []), "3 of 5 live records: not cut off"
    service.expirations[B] = now - 1
    assert service.readiness() == (False, ["cut off: sees 2 of 5 peers"])
    assert service.status()["swarm"]["problems"] == ["cut off: sees 2 of 5 peers"]


def test_a_peer_nobody_can_dial_with_no_dialable_trainer_in_view_says_it_is_unreachable():
    homes = {p: rec(p, (A, B, C), reachability="client") for p in (A, B, C)} | {BOOT: boot()}
    alone = Self(peer_id=A, role="trainer", step=100, lockstep=True, config_hash="ab", last_round_members=(A, B, C), dials_out_only=True)
    assert swarm_reasons(alone, homes, 4, now=NOW)[0].startswith("unreachable: no relay")
    assert swarm_reasons(alone, {A: rec(A, (A, B, C), reachability="client")}, 1, now=NOW)[0].startswith("unreachable")  # all gone
    with_public = homes | {D: rec(D, (A, B, C, D))}  # one trainer the others can dial: they train through it
    assert not [r for r in swarm_reasons(alone, with_public, 5, now=NOW) if r.startswith("unreachable")]
    dialable_me = Self(peer_id=A, role="trainer", step=100, lockstep=True, config_hash="ab", last_round_members=(A, B, C))
    assert not [r for r in swarm_reasons(dialable_me, homes, 4, now=NOW) if r.startswith("unreachable")]

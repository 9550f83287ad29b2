"""Who leads matchmaking: the lowest peer ID, or in verified runs a draw per period that no key wins
every time; a forming group whose leader's period ends sends its joiners to the new leader."""

import asyncio
import dataclasses
import time
from collections import Counter

import pytest
import torch
from hivemind.utils import get_dht_time

from phalanx.protocol.config import MatchmakingConfig, RoundConfig
from phalanx.protocol.engine import Averaged, RoundRequest
from phalanx.protocol.link_quality import SLOW_FOR_S, LinkQuality
from phalanx.protocol.matchmaking import JOIN_METHOD, PROBE_METHOD
from phalanx.protocol.membership import Membership, PeerRecord
from tests.protocol.swarm_fixture import open_swarm

PERIOD_S = 600.0
PEERS = [f"12D3KooW{c}" + "x" * 45 for c in "ABCDEFGH"]  # fixed base58 IDs, in leading order: the draw is deterministic


def _membership(me: str, period_s=None, clock=lambda: 0.0) -> Membership:
    membership = Membership(None, "k.peers", me, leader_period_s=period_s, leader_clock=clock)
    far = get_dht_time() + 3600
    membership._view = {p: (PeerRecord(state="online", step=0), far) for p in PEERS}
    membership.link = LinkQuality(me, membership.announce_soon, membership.peers)  # as the engine wires it
    return membership


def test_without_periods_the_lowest_peer_id_leads():
    assert {_membership(me).leader() for me in PEERS} == {min(PEERS)}


def test_each_period_every_peer_draws_the_same_leader_and_no_key_leads_every_period():
    now = [0.0]
    views = [_membership(me, PERIOD_S, lambda: now[0]) for me in PEERS]
    leaders = Counter()
    for period in range(400):
        now[0] = period * PERIOD_S + 1.0
        drawn = {m.leader() for m in views}
        assert len(drawn) == 1, f"period {period}: peers disagree on the leader: {drawn}"
        leaders[drawn.pop()] += 1
        now[0] = (period + 1) * PERIOD_S - 1.0  # the same period, later: the same leader
        assert len({m.leader() for m in views}) == 1
    assert set(leaders) == set(PEERS), leaders  # everyone leads some periods ...
    assert leaders[min(PEERS)] < 100, leaders  # ... and the lowest peer ID about its share (50 of 400)


def test_a_suspected_leader_is_passed_over():
    now = [0.0]
    first = _membership(PEERS[0], PERIOD_S, lambda: now[0]).leader()
    membership = _membership(next(p for p in PEERS if p != first), PERIOD_S, lambda: now[0])  # (no peer suspects itself)
    membership.suspect(first, for_s=60)
    assert membership.leader() not in (first,) and membership.leader() in PEERS


def _flag(membership: Membership, flaggers: list[str], slow: str) -> None:
    far = get_dht_time() + 3600
    for peer in flaggers:
        membership._view[peer] = (PeerRecord(state="online", step=0, slow=[slow]), far)
        if peer == membership.peer_id:  # its own marks count as they are now
            membership.link.note_slow([slow])


@pytest.mark.parametrize("me", PEERS)
def test_a_leader_most_others_find_slow_stops_leading_in_every_view_its_own_included(me):
    """A lossy leader held every group of a k:3 swarm back: the others' records name it, and every peer,
    the slow one too, then agrees on the next one."""
    membership = _membership(me)
    _flag(membership, PEERS[1:4], PEERS[0])  # 3 of the 7 others: not a majority
    assert membership.leader() == PEERS[0]
    _flag(membership, PEERS[1:5], PEERS[0])  # 4 of 7
    assert membership.leader() == PEERS[1]
    far = get_dht_time() + 3600
    for voter, names in {PEERS[4]: [PEERS[0], PEERS[7]], PEERS[0]: [PEERS[7]], PEERS[5]: [PEERS[7]], PEERS[6]: [PEERS[7]]}.items():
        membership._view[voter] = (PeerRecord(state="online", step=0, slow=names), far)
    assert membership.slow_flagged() == {PEERS[0]}  # 4 of 7 name PEERS[7], but one of them is the slow PEERS[0]


def test_a_peer_naming_itself_steps_down():
    membership = _membership(PEERS[5])
    _flag(membership, [PEERS[0]], PEERS[0])
    assert membership.slow_flagged() == {PEERS[0]} and membership.leader() == PEERS[1]


def test_a_peer_on_probation_is_in_groups_but_does_not_lead(monkeypatch):
    membership = _membership(PEERS[5])
    membership._view[PEERS[0]] = (PeerRecord(state="online", step=0, probation=True), get_dht_time() + 3600)
    assert membership.leader() == PEERS[1] and membership.slow_flagged() == set()
    assert membership.leader(excluding=frozenset(PEERS[1:5] + PEERS[6:])) == PEERS[5]
    for peer in PEERS:
        membership._view[peer] = (PeerRecord(state="online", step=0, probation=True), get_dht_time() + 3600)
    assert membership.leader() == PEERS[5]  # its own state counts as it is now, not as last published
    membership.link.step_down()
    later = time.monotonic() + SLOW_FOR_S + 1  # done stepping down: on probation
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert membership.leader() == PEERS[0]  # everyone on probation: someone still leads


def test_two_peers_naming_each_other_slow_cancel_out():
    membership = _membership(PEERS[0])
    membership._view = {p: membership._view[p] for p in PEERS[:2]}
    far = get_dht_time() + 3600
    _flag(membership, [PEERS[0]], PEERS[1])
    membership._view[PEERS[1]] = (PeerRecord(state="online", step=0, slow=[PEERS[0]]), far)
    assert membership.slow_flagged() == set() and membership.leader() == PEERS[0]


def test_a_record_names_at_most_16_slow_peers():
    with pytest.raises(ValueError):
        PeerRecord(state="online", step=0, slow=PEERS * 3)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_new_leader_period_during_formation_sends_the_joiners_to_the_new_leader():
    """Three peers wait at the period's leader when the period ends; the fourth joins the new leader.
    The old leader's group never reaches its deadline (an hour): it notices it no longer leads and
    redirects its joiners, and all four average in one group formed by the new leader."""
    config = RoundConfig(matchmaking=MatchmakingConfig(matchmaking_timeout_s=3600.0, join_timeout_s=7200.0))

    async def main():
        async with open_swarm(4, config) as peers:
            now = [1e9]
            for peer in peers:
                peer.membership.leader_period_s = PERIOD_S
                peer.membership.leader_clock = lambda: now[0]
                peer.engine.set_state(b"v0", 0)
            old = peers[0].membership.leader()
            later = now[0]
            while True:  # the next period another peer leads in
                later += PERIOD_S
                now[0] = later
                new = peers[0].membership.leader()
                if new != old:
                    break
            now[0] = 1e9
            assert {p.membership.leader() for p in peers} == {old}
            by_id = {p.peer_id: p for p in peers}
            early = [p for p in peers if p.peer_id != new]
            xs = [torch.full((1000,), float(i)) for i in range(4)]
            rounds = {p.peer_id: asyncio.create_task(p.engine.run_round(RoundRequest(xs[i]))) for i, p in enumerate(early)}
            async with asyncio.timeout(120):  # a hang here is the old leader waiting out its deadline
                while len(by_id[old].engine.matchmaker._pending) < len(early):
                    await asyncio.sleep(0.01)
                now[0] = later  # the period ends while the three wait at the old leader
                rounds[new] = asyncio.create_task(by_id[new].engine.run_round(RoundRequest(xs[3])))
                outcomes = {peer: await task for peer, task in rounds.items()}
            for peer, outcome in outcomes.items():
                assert isinstance(outcome, Averaged), outcome
                assert sorted(outcome.group.members) == sorted(by_id)
                assert by_id[peer].engine.matchmaker.last_leader == new
            for peer in early:
                assert peer.engine.matchmaker.stats.redirects >= 1

    asyncio.run(main())


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("frozen_count", [1, 2], ids=["leader", "leader-and-next"])
def test_joiners_give_up_on_a_leader_that_stops_answering_and_regroup_without_it(frozen_count):
    """The leader (and with 2 the peer that would lead next, as a split takes both away) freezes: its join
    and probe handlers never answer while its DHT record stays fresh. The joiners' probes go unanswered,
    they suspect it and form a group of their own. The join call's own timeout is two hours here, so
    only the probes can end the wait."""
    config = RoundConfig(matchmaking=MatchmakingConfig(matchmaking_timeout_s=3600.0, join_timeout_s=7200.0))

    async def never(peer, header, payload):
        await asyncio.Event().wait()

    async def main():
        async with open_swarm(2 + frozen_count, config) as peers:
            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            frozen_ids = sorted(p.peer_id for p in peers)[:frozen_count]  # the lowest IDs lead first
            assert {p.membership.leader() for p in peers} == {frozen_ids[0]}
            for frozen in (p for p in peers if p.peer_id in frozen_ids):
                for method in (JOIN_METHOD, PROBE_METHOD):
                    entry = frozen.transport._methods[method]
                    frozen.transport._methods[method] = dataclasses.replace(entry, handler=never)
            others = [p for p in peers if p.peer_id not in frozen_ids]
            xs = [torch.full((1000,), float(i)) for i in range(len(others))]
            async with asyncio.timeout(120):  # a hang here is the joiners waiting on the frozen leader
                outcomes = await asyncio.gather(*(p.engine.run_round(RoundRequest(x)) for p, x in zip(others, xs)))
            for peer, outcome in zip(others, outcomes):
                assert isinstance(outcome, Averaged), outcome
                assert sorted(outcome.group.members) == sorted(p.peer_id for p in others)
                assert peer.engine.matchmaker.last_leader not in frozen_ids
                assert peer.engine.matchmaker.stats.leaders_unresponsive >= 1
                assert all(peer.membership.is_suspect(f) for f in frozen_ids)
                assert (outcome.result.vector - 0.5).abs().max() < 1e-6

    asyncio.run(main())

"""Peers that went silent (cut off, frozen) are found by probes, not waited for until their DHT record
lapses: the leader probes expected peers that have not joined, and a joiner that would lead next probes
the peers it would wait for. A fake transport answers for live peers and never for silent ones."""

import asyncio

import pytest
from hivemind.utils import get_dht_time

from phalanx.protocol import matchmaking
from phalanx.protocol.channel import CallFailed
from phalanx.protocol import link_quality
from phalanx.protocol.config import MatchmakingConfig
from phalanx.protocol.link_quality import LinkQuality
from phalanx.protocol.matchmaking import JoinRequest, Matchmaker, ProbeReply
from phalanx.protocol.membership import Membership, PeerRecord
from phalanx.security.wire import pack

PEERS = [f"12D3KooW{c}" + "x" * 45 for c in "ABCDE"]  # base58, in leading order
RUN = b"r" * 32


class _Transport:
    def __init__(self, peer_id: str, silent: set[str]) -> None:
        self.peer_id, self.silent, self.calls = peer_id, silent, []

    def register(self, *args, **kwargs) -> None:
        pass

    async def call(self, peer, method, header, payload=b"", *, max_reply_payload, timeout_s, **kwargs):
        self.calls.append((peer, method))
        if peer in self.silent or method == matchmaking.JOIN_METHOD:
            await asyncio.sleep(timeout_s)  # no byte comes back (a join is held: the leader waits for others)
            raise CallFailed(f"{method} to {peer[-8:]} timed out after {timeout_s} s")
        return pack(ProbeReply(leading=False)), b""


@pytest.fixture(autouse=True)
def _quick_probes(monkeypatch):
    monkeypatch.setattr(matchmaking, "LEADER_PROBE_S", 0.05)
    monkeypatch.setattr(matchmaking, "LEADER_ALIVE_S", 0.2)


def _matchmaker(me: str, silent: set[str]) -> Matchmaker:
    membership = Membership(None, "k.peers", me)
    far = get_dht_time() + 3600
    membership._view = {p: (PeerRecord(state="online", step=0), far) for p in PEERS[:4]}
    # no deadline in reach: only a probe can end the wait for a silent peer
    config = MatchmakingConfig(matchmaking_timeout_s=3600.0, join_timeout_s=7200.0, lockstep=True, min_group_size=2)
    membership.link = LinkQuality(me, membership.announce_soon, membership.peers)  # as the engine wires it
    return Matchmaker(_Transport(me, silent), membership, config, RUN, membership.link)


def _request(step: int = 5) -> JoinRequest:
    return JoinRequest(run=RUN, version=bytes([step]) * 32, step=step)


def test_the_leader_stops_waiting_for_an_expected_peer_that_does_not_answer_probes():
    """Everyone expected (`full`): A leads, B and C join, D was cut off. Its record is valid for an hour, the
    deadline too: the group closes because D's probe goes unanswered, and D is not expected next time."""

    async def main():
        leader = _matchmaker(PEERS[0], silent={PEERS[3]})
        joins = [asyncio.create_task(leader._submit(p, _request())) for p in PEERS[:3]]
        replies = await asyncio.wait_for(asyncio.gather(*joins), 30)
        assert {r.kind for r in replies} == {"group"}
        assert sorted(replies[0].group.members) == PEERS[:3]
        assert leader.membership.is_suspect(PEERS[3]) and not leader.membership.is_suspect(PEERS[1])
        assert (PEERS[3], matchmaking.PROBE_METHOD) in leader.transport.calls
        await leader.aclose()

    asyncio.run(main())


def test_a_live_expected_peer_is_probed_but_still_waited_for():
    async def main():
        leader = _matchmaker(PEERS[0], silent=set())
        joins = [asyncio.create_task(leader._submit(p, _request())) for p in PEERS[:3]]
        while (PEERS[3], matchmaking.PROBE_METHOD) not in leader.transport.calls:
            await asyncio.sleep(0.05)
        await asyncio.sleep(2 * matchmaking.LEADER_ALIVE_S)  # its probes are answered: no reason to give up on it
        assert not any(t.done() for t in joins) and not leader.membership.is_suspect(PEERS[3])
        last = asyncio.create_task(leader._submit(PEERS[3], _request()))
        replies = await asyncio.wait_for(asyncio.gather(*joins, last), 30)
        assert sorted(replies[0].group.members) == PEERS[:4]
        await leader.aclose()

    asyncio.run(main())


def test_the_next_leader_probes_the_peers_it_would_wait_for_while_its_leader_is_silent():
    """A split took A (the leader) and D away from B and C. B would lead next: while its join to A hangs it
    probes C and D too, so when it gives up on A it already knows not to wait for D."""

    async def main():
        joiner = _matchmaker(PEERS[1], silent={PEERS[0], PEERS[3]})
        with pytest.raises(CallFailed, match="does not answer probes"):
            await joiner._join_remote(PEERS[0], _request())
        await asyncio.gather(*joiner._probes.values(), return_exceptions=True)
        assert joiner.membership.is_suspect(PEERS[3]) and not joiner.membership.is_suspect(PEERS[2])
        await joiner.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    "overheads, slow",
    [
        ([0.002] * 5 + [0.25, 0.6, 0.3], True),  # a lossy leader: retransmissions on 3 of 8 joins
        ([0.002] * 6 + [0.25, 0.6], False),  # two late joins: not enough ...
        ([0.002] * 6 + [1.3, 0.5], True),  # ... unless they took a second beyond the bound together
        ([0.3] * 5 + [0.4, 0.5, 0.45], False),  # a far leader (300 ms round trips): late against 0.2 s, not against its own
        ([0.3] * 5 + [1.3, 1.5, 2.0], True),
    ],
)
def test_a_joiner_marks_a_leader_whose_link_keeps_its_joins_long(overheads, slow):
    """The time a join takes beyond what the leader held it (`held_ms`) is the leader's link; a joiner marks
    the leader slow (and publishes it) when 3 of its last 8 joins took far longer than its typical one."""
    joiner = _matchmaker(PEERS[1], silent=set())
    for overhead in overheads:
        joiner.link.note_join_overhead(PEERS[0], overhead)
    assert (PEERS[0] in joiner.link.slow_peers()) is slow
    joiner.link.note_join_overhead(PEERS[2], 5.0)  # another leader: its own count
    assert PEERS[2] not in joiner.link.slow_peers()


@pytest.mark.parametrize(
    "reports, steps_down",
    [
        ([(1, 0.002), (2, 0.003), (3, 0.002), (1, 0.4), (2, 0.5), (3, 0.002), (1, 0.3), (2, 0.002)], True),
        ([(1, 0.002), (2, 0.003), (3, 0.002), (1, 0.4), (2, 0.003), (3, 0.002), (1, 0.3), (1, 0.5)], False),  # one joiner
        ([(1, 0.002), (2, 0.003), (3, 0.002), (1, 0.4), (2, 0.5), (3, 0.002), (2, 0.002), (1, 0.002)], False),  # two late
    ],
)
def test_a_leader_steps_down_when_most_of_its_joiners_report_its_link_slow(reports, steps_down):
    """Each join carries how long the joiner's previous one took beyond the leader's wait. The leader sees
    them all: 3 late of its last 8, from most of its joiners, and it names itself slow (its record then
    takes it out of the election for every peer, itself included)."""
    leader = _matchmaker(PEERS[0], silent=set())
    for joiner, overhead in reports:
        leader.link.note_report(PEERS[joiner], overhead)
    assert (PEERS[0] in leader.link.slow_peers()) is steps_down


class _Swarm:
    """Routes each call to the matchmaker of the peer called, as the transport would."""

    def __init__(self) -> None:
        self.by_peer: dict[str, Matchmaker] = {}

    def transport(self, me: str):
        swarm = self

        class Routed(_Transport):
            async def call(self, peer, method, header, payload=b"", *, max_reply_payload, timeout_s, **kwargs):
                serve = swarm.by_peer[peer]._serve_join if method == matchmaking.JOIN_METHOD else swarm.by_peer[peer]._serve_probe
                return await serve(me, header, bytearray())

        return Routed(me, set())


def test_a_leader_stepping_down_says_so_in_its_redirects_and_its_joiners_regroup_at_once():
    """A stepped down (its joiners found its link slow), but its record, stored over that link, has not reached
    the others: they still see it lead. Its redirects carry how long it steps down, so B, C and D regroup around
    B at their next join instead of bouncing between A and B until A's record lands."""

    async def main():
        swarm = _Swarm()
        for me in PEERS[:4]:
            mm = _matchmaker(me, silent=set())
            mm.transport = swarm.transport(me)
            swarm.by_peer[me] = mm
        a = swarm.by_peer[PEERS[0]]
        a.link.step_down()  # for SLOW_FOR_S (30 s)
        assert all(swarm.by_peer[p].membership.leader() == PEERS[0] for p in PEERS[1:4])
        joins = [swarm.by_peer[p].join(version=bytes([5]) * 32, step=5) for p in PEERS[:4]]
        replies = await asyncio.wait_for(asyncio.gather(*joins), 30)
        assert {r.kind for r in replies} == {"group"} and sorted(replies[0].group.members) == PEERS[:4]
        assert {swarm.by_peer[p].last_leader for p in PEERS[:4]} == {PEERS[1]}
        assert all(swarm.by_peer[p].membership.leader() == PEERS[1] for p in PEERS[1:4])
        assert 25 < swarm.by_peer[PEERS[2]].membership._stepping_down[PEERS[0]] - asyncio.get_running_loop().time() <= 30
        for mm in swarm.by_peer.values():
            await mm.aclose()

    asyncio.run(main())


def test_a_stepped_down_leader_is_on_probation_and_late_joins_then_step_it_down_again(monkeypatch):
    """Stepping down ends in probation: back in groups, leading none. Its link is measured by its joins to the
    next leader meanwhile: late ones step it down again, and mark nobody (they say nothing about that leader)."""
    clock = [1000.0]
    monkeypatch.setattr(link_quality.time, "monotonic", lambda: clock[0])
    peer = _matchmaker(PEERS[0], silent=set())
    link, membership = peer.link, peer.membership
    link.step_down()
    assert link.slow_peers() == [PEERS[0]] and not link.on_probation()
    clock[0] += link_quality.SLOW_FOR_S + 1
    assert link.slow_peers() == [] and link.on_probation()
    assert membership.leader() == PEERS[1]  # in its own view too
    for overhead in [0.002] * 5 + [0.3, 0.5, 0.4]:
        link.note_join_overhead(PEERS[1], overhead)
    assert link.slow_peers() == [PEERS[0]] and not link.on_probation()
    clock[0] += 2 * link_quality.SLOW_FOR_S + 1
    assert link.slow_peers() == [] and not link.on_probation() and membership.leader() == PEERS[0]


@pytest.mark.parametrize(
    "late_rounds, slow",
    [
        ([False] * 6 + [True, True], False),  # a descheduled process now and then
        ([False] * 5 + [True, False, True, True], True),  # a thin link: late round after round
        ([True, True] + [False] * 7 + [True], False),  # three, but not within its last eight rounds
    ],
)
def test_a_member_is_marked_slow_when_its_parts_were_late_in_several_of_its_last_rounds(late_rounds, slow):
    peer = _matchmaker(PEERS[0], silent=set())
    members = PEERS[:3]
    for late in late_rounds:
        peer.link.note_round(members, [PEERS[2]] if late else [])
    assert (PEERS[2] in peer.link.slow_peers()) is slow
    assert PEERS[1] not in peer.link.slow_peers() and PEERS[0] not in peer.link.slow_peers()


def test_a_suspected_leader_that_answers_again_is_trusted_again(monkeypatch):
    """A's probe failed just before a partition healed: B suspects it (for 2 × ttl_s) while C, which did
    not, still joins A. B probes the peer that would lead but for its suspicion, and follows it again as
    soon as it answers, instead of leading a group of its own that waits for C."""
    monkeypatch.setattr(matchmaking, "RECHECK_LEADER_S", 0.05)

    async def main():
        joiner = _matchmaker(PEERS[1], silent={PEERS[0]})
        joiner.membership.suspect(PEERS[0], for_s=3600)
        joiner._recheck_leader()
        await asyncio.gather(*joiner._probes.values(), return_exceptions=True)
        assert joiner.membership.leader() == PEERS[1]  # still silent: still suspected
        joiner.transport.silent = set()  # healed
        await asyncio.sleep(0.1)
        joiner._recheck_leader()
        await asyncio.gather(*joiner._probes.values(), return_exceptions=True)
        assert joiner.membership.leader() == PEERS[0]
        await joiner.aclose()

    asyncio.run(main())


def test_a_joiner_silent_since_its_join_is_left_out_of_the_group(monkeypatch):
    """B joined, then was cut off (no probes of the leader since); C keeps probing; D is expected but cut off
    before joining. Once D's probe fails the group closes with A and C only: B's parts would have held
    the round up to the all-reduce's idle timeout. B is suspected, and answered "retry"."""
    monkeypatch.setattr(matchmaking, "JOINER_SILENT_S", 0.15)  # D is given up on after 0.25 s

    async def main():
        leader = _matchmaker(PEERS[0], silent={PEERS[1], PEERS[3]})
        joins = {p: asyncio.create_task(leader._submit(p, _request())) for p in PEERS[:3]}

        async def keep_probing(peer):
            while not joins[peer].done():
                await leader._serve_probe(peer, pack(matchmaking.LeaderProbe(run=RUN)), bytearray())
                await asyncio.sleep(matchmaking.LEADER_PROBE_S)

        prober = asyncio.create_task(keep_probing(PEERS[2]))
        replies = await asyncio.wait_for(asyncio.gather(*joins.values()), 30)
        await prober
        assert replies[1].kind == "retry" and leader.membership.is_suspect(PEERS[1])
        assert replies[0].kind == replies[2].kind == "group"
        assert sorted(replies[0].group.members) == [PEERS[0], PEERS[2]]
        await leader.aclose()

    asyncio.run(main())


def test_a_joiner_asks_a_leader_that_is_still_starting_again_instead_of_leading_alone(monkeypatch):
    """A swarm restarted whole: B finds A's record from before and joins A while A's host is up but serves
    no joins yet. B asks A again rather than suspect it, and both train in one group from the first round;
    suspecting A, B led a group of its own and each trained its first rounds alone."""
    monkeypatch.setattr(matchmaking, "LEADER_STARTING_RETRY_S", 0.05)

    async def main():
        swarm = _Swarm()
        serving = asyncio.Event()
        for me in PEERS[:2]:
            mm = _matchmaker(me, silent=set())
            mm.membership._view = {p: v for p, v in mm.membership._view.items() if p in PEERS[:2]}
            swarm.by_peer[me] = mm
            routed = swarm.transport(me)

            async def call(peer, method, header, payload=b"", *, _routed=routed, **kwargs):
                if not serving.is_set():
                    raise CallFailed(f"{method} to {peer[-8:]}: protocols not supported", not_serving=True)
                return await type(_routed).call(_routed, peer, method, header, payload, **kwargs)

            routed.call = call
            mm.transport = routed
        a, b = swarm.by_peer[PEERS[0]], swarm.by_peer[PEERS[1]]
        b_joins = asyncio.create_task(b.join(version=bytes([5]) * 32, step=5))
        await asyncio.sleep(0.5)  # B has been refused several times meanwhile
        assert not b_joins.done() and not b.membership.is_suspect(PEERS[0])
        serving.set()
        replies = await asyncio.wait_for(asyncio.gather(a.join(version=bytes([5]) * 32, step=5), b_joins), 30)
        assert [sorted(r.group.members) for r in replies] == [PEERS[:2], PEERS[:2]]
        assert b.stats.leader_failures == 0
        for mm in swarm.by_peer.values():
            await mm.aclose()

    asyncio.run(main())


def test_a_leader_that_keeps_not_serving_is_suspected_after_a_while(monkeypatch):
    """A peer that never serves joins (not this swarm's, or stuck starting) is given up on after
    LEADER_STARTING_S and the joiner leads."""
    monkeypatch.setattr(matchmaking, "LEADER_STARTING_RETRY_S", 0.05)
    monkeypatch.setattr(matchmaking, "LEADER_STARTING_S", 0.3)

    async def main():
        b = _matchmaker(PEERS[1], silent=set())
        b.membership._view = {p: v for p, v in b.membership._view.items() if p in PEERS[:2]}

        async def call(peer, method, header, payload=b"", **kwargs):
            raise CallFailed(f"{method} to {peer[-8:]}: protocols not supported", not_serving=True)

        b.transport.call = call
        reply = await asyncio.wait_for(b.join(version=bytes([5]) * 32, step=5), 30)
        assert reply.group.members == [PEERS[1]] and b.membership.is_suspect(PEERS[0])
        assert b.stats.leader_failures == 1
        await b.aclose()

    asyncio.run(main())

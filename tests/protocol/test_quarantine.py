"""Quarantine (protocol/quarantine.py) on an injected clock, the per-caller cap on calls waiting for a round
(protocol/waiting.py), and how the matchmaker keeps quarantined peers out: no group of ours admits or waits
for them, and we follow none of them as leader. No network."""

import asyncio

import pytest
from hivemind.utils import get_dht_time

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.config import MatchmakingConfig
from phalanx.protocol.link_quality import LinkQuality
from phalanx.protocol.matchmaking import JoinRequest, Matchmaker
from phalanx.protocol.membership import Membership, PeerRecord
from phalanx.protocol.quarantine import Quarantine
from phalanx.protocol.waiting import WaitingCalls
from phalanx.security.wire import pack

pytestmark = pytest.mark.timeout(60)
PEERS = [f"12D3KooW{c}" + "x" * 45 for c in "ABCDE"]  # base58, in leading order
RUN = b"r" * 32


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_stays_in_quarantine_for_its_cool_off_and_leaves_by_itself():
    clock = _Clock()
    quarantine = Quarantine(clock)
    quarantine.add(PEERS[1], for_s=60.0)
    assert PEERS[1] in quarantine and PEERS[2] not in quarantine
    assert quarantine.peers() == {PEERS[1]} and quarantine.remaining_s(PEERS[1]) == 60.0
    clock.now += 59.0
    assert PEERS[1] in quarantine and quarantine.remaining_s(PEERS[1]) == pytest.approx(1.0)
    clock.now += 1.0
    assert PEERS[1] not in quarantine and quarantine.peers() == frozenset() and quarantine.remaining_s(PEERS[1]) == 0.0


def test_a_shorter_cool_off_does_not_cut_a_longer_one_and_a_new_offense_extends_it():
    clock = _Clock()
    quarantine = Quarantine(clock)
    quarantine.add(PEERS[1], for_s=60.0)
    quarantine.add(PEERS[1], for_s=10.0)
    assert quarantine.remaining_s(PEERS[1]) == 60.0
    clock.now += 50.0
    quarantine.add(PEERS[1], for_s=60.0)  # caught again: 60 s from now
    clock.now += 59.0
    assert PEERS[1] in quarantine
    assert 42 not in quarantine  # anything but a peer ID is simply not in it


def test_expired_entries_are_dropped_as_new_ones_come():
    clock = _Clock()
    quarantine = Quarantine(clock)
    for i, peer in enumerate(PEERS):
        quarantine.add(peer, for_s=10.0 * (i + 1))
    clock.now += 25.0
    quarantine.add("12D3KooWnew" + "x" * 42, for_s=5.0)
    assert len(quarantine._until) == 4  # the two expired ones went (the set holds only who is in quarantine)


def test_one_caller_fills_only_its_own_share_of_the_waiting_calls():
    waiting = WaitingCalls(total=20, per_caller=8)

    async def main():
        release = asyncio.Event()

        async def wait(peer: str) -> None:
            with waiting.hold(peer):
                await release.wait()

        flood = [asyncio.create_task(wait(PEERS[1])) for _ in range(300)]
        await asyncio.sleep(0)
        refused = [t for t in flood if t.done()]
        assert len(refused) == 292 and all(isinstance(t.exception(), RoundAbortedError) for t in refused)
        assert waiting.of(PEERS[1]) == 8 and len(waiting) == 8
        others = [asyncio.create_task(wait(peer)) for peer in PEERS[2:] for _ in range(4)]
        await asyncio.sleep(0)
        assert not any(t.done() for t in others) and len(waiting) == 20
        with pytest.raises(RoundAbortedError, match="too many calls for rounds not open here"):
            with waiting.hold(PEERS[0]):  # the total still caps everyone together
                pass
        release.set()
        await asyncio.gather(*others, *(t for t in flood if t not in refused))
        assert len(waiting) == 0 and waiting.of(PEERS[1]) == 0

    asyncio.run(main())


# ---- the matchmaker -----------------------------------------------------------------------------


class _Transport:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.handlers = {}

    def register(self, method, handler, **kwargs) -> None:
        self.handlers[method] = handler


def _matchmaker(me: str, quarantine: Quarantine) -> Matchmaker:
    membership = Membership(None, "k.peers", me)
    far = get_dht_time() + 3600
    membership._view = {p: (PeerRecord(state="online", step=0), far) for p in PEERS[:4]}
    config = MatchmakingConfig(matchmaking_timeout_s=3600.0, join_timeout_s=7200.0, min_group_size=2)
    link = LinkQuality(me, membership.announce_soon, membership.peers)
    return Matchmaker(_Transport(me), membership, config, RUN, link, quarantine=quarantine)


def _request() -> JoinRequest:
    return JoinRequest(run=RUN, version=b"v" * 32, step=3)


def test_a_leader_neither_admits_nor_waits_for_a_quarantined_peer():
    async def main():
        quarantine = Quarantine()
        quarantine.add(PEERS[3], for_s=60.0)
        matchmaker = _matchmaker(PEERS[0], quarantine)
        assert PEERS[3] not in matchmaker._expected()
        with pytest.raises(PeerProtocolError, match="in quarantine for 60 s more"):
            await matchmaker.transport.handlers["join"](PEERS[3], pack(_request()), b"")
        joins = [asyncio.create_task(matchmaker._submit(p, _request())) for p in PEERS[:3]]
        replies = await asyncio.wait_for(asyncio.gather(*joins), timeout=30)  # the whole group is in: no deadline
        assert {r.kind for r in replies} == {"group"} and sorted(replies[0].group.members) == PEERS[:3]
        await matchmaker.aclose()

    asyncio.run(main())


def test_a_joiner_quarantined_while_the_group_forms_is_sent_away():
    async def main():
        quarantine = Quarantine()
        matchmaker = _matchmaker(PEERS[0], quarantine)
        early = asyncio.create_task(matchmaker._submit(PEERS[3], _request()))
        await asyncio.sleep(0.01)
        quarantine.add(PEERS[3], for_s=60.0)  # its part to another round of ours was oversized
        assert (await asyncio.wait_for(early, timeout=30)).kind == "retry"  # at the former's next pass (≤ 1 s)
        joins = [asyncio.create_task(matchmaker._submit(p, _request())) for p in PEERS[:3]]
        replies = await asyncio.wait_for(asyncio.gather(*joins), timeout=30)
        assert sorted(replies[0].group.members) == PEERS[:3]
        await matchmaker.aclose()

    asyncio.run(main())


def test_a_joiner_follows_no_quarantined_leader():
    async def main():
        quarantine = Quarantine()
        matchmaker = _matchmaker(PEERS[2], quarantine)
        assert matchmaker._leader() == PEERS[0]
        quarantine.add(PEERS[0], for_s=60.0)
        assert matchmaker._leader() == PEERS[1]  # the next in line, as every peer that caught it sees it
        quarantine.add(PEERS[1], for_s=60.0)
        assert matchmaker._leader() == PEERS[2] == matchmaker._leader(trusting=True)
        await matchmaker.aclose()

    asyncio.run(main())

"""Aggregates a reducer keeps from a member reach it through the others (protocol/btard/relay.py):
nobody is banned for a reducer's failure, lying or stalling relays are passed over, relays are rationed,
and a reducer that withholds from everyone (or dies) is banned alone."""

import asyncio
import dataclasses

import pytest
import torch

from phalanx.errors import RoundAbortedError
from phalanx.protocol.adversary import Behavior
from phalanx.protocol.config import Codec
from phalanx.protocol.engine import Averaged, RoundRequest
from tests.protocol.btard.btard_rounds import CONFIG, NUMEL, inputs, run_round
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


class _HoldReply(Exception):
    """Raised from a test behavior's aggregate_reply: the reducer answers that member nothing for a while."""


def _hold_replies(monkeypatch, seconds: float) -> None:
    from phalanx.protocol.allreduce import AllReduceService

    serve = AllReduceService._serve_part

    async def serve_part(self, peer, header, payload):
        try:
            return await serve(self, peer, header, payload)
        except _HoldReply:
            await asyncio.sleep(seconds)
            raise RoundAbortedError("gave up")

    monkeypatch.setattr(AllReduceService, "_serve_part", serve_part)


def _holding_back(monkeypatch, how: str, seconds: float = 8.0):
    """A reducer behavior that answers the members in `victims` late (its signed statement, or only the
    bytes after it, `seconds` late) or refuses them at once (`how` = "refused")."""
    from phalanx.protocol.channel import Channel

    held_back: set[int] = set()

    class HoldBack(Behavior):
        name = "hold_back"

        def __init__(self, victims: set[str]) -> None:
            self.victims = victims

        def aggregate_reply(self, vr, receiver, header, payload):
            if vr.members[receiver] not in self.victims:
                return header, payload
            if how == "refused":
                raise RoundAbortedError("not for you")
            if how == "statement":
                raise _HoldReply()
            copy = bytearray(payload)  # marks this one reply for the channel below
            held_back.add(id(copy))
            return header, copy

    _hold_replies(monkeypatch, seconds)  # CONFIG's phases wait 3 s; the caller's timeout is 15 s
    send_message = Channel.send_message

    async def send_late(self, head, payload):
        if id(payload) in held_back:
            await self.send_record(head)  # the signed statement goes out on time, the bytes do not
            await asyncio.sleep(seconds)
        await send_message(self, head, payload)

    monkeypatch.setattr(Channel, "send_message", send_late)
    return HoldBack


def _assert_nothing_lost(peers, outcomes, victim, failed_reducers) -> None:
    """Nobody banned, nothing dropped, and only the victim took aggregates (those of `failed_reducers`)
    from other members."""
    assert all(isinstance(o, Averaged) for o in outcomes), outcomes
    members = outcomes[0].group.members
    for peer, outcome in zip(peers, outcomes):
        assert outcome.verdict.banned == set() and not peer.membership.banned
        assert outcome.verdict.bad_parts == outcome.verdict.disputed == set()
        assert outcome.result.missing_parts == ()
        relayed = {members.index(p.peer_id) for p in failed_reducers} if peer is victim else set()
        assert outcome.verdict.relayed == relayed
    for outcome in outcomes[1:]:
        assert torch.equal(outcome.result.vector, outcomes[0].result.vector)


@pytest.mark.parametrize(
    "how, codec", [("statement", Codec.NONE), ("bytes", Codec.NONE), ("refused", Codec.NONE), ("refused", Codec.FP16)]
)
def test_member_a_reducer_fails_takes_the_aggregate_from_the_others(monkeypatch, how, codec):
    """A reducer holds back its aggregate from one member (its signed statement, or the bytes after it,
    past the others' phase deadlines) or refuses it. The victim takes the aggregate from another member
    (checked against the reducer's signed hash) and reports in time: nobody is banned and nothing is
    lost (before relays, the victim was banned for being late, then the part was dropped by all).
    Compressed parts are relayed as the reducer encoded them and decoded by the victim."""
    HoldBack = _holding_back(monkeypatch, how)
    victims: set[str] = set()
    config = dataclasses.replace(CONFIG, compression=codec)

    async def main():
        async with open_swarm(4, config, behaviors=[None, None, None, HoldBack(victims)]) as peers:
            victims.add(peers[0].peer_id)
            numel = 2_000_000  # 2 MB parts: the aggregates take the direct path, statement first
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
            _assert_nothing_lost(peers, await run_round(peers, xs), peers[0], [peers[3]])

    asyncio.run(main())


def test_two_reducers_holding_back_from_one_member_get_nobody_banned(monkeypatch):
    """Two colluding reducers hold their aggregates' bytes back from the same member: it disputes
    nothing, since the other members relay both (before relays, that member was banned for two disputes)."""
    HoldBack = _holding_back(monkeypatch, "bytes")
    victims: set[str] = set()

    async def main():
        behaviors = [None, None, None, HoldBack(victims), HoldBack(victims)]
        async with open_swarm(5, CONFIG, behaviors=behaviors) as peers:
            victims.add(peers[0].peer_id)
            numel = 2_500_000
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(5)]
            _assert_nothing_lost(peers, await run_round(peers, xs), peers[0], peers[3:])

    asyncio.run(main())


def test_reducer_that_withholds_its_aggregate_from_everyone_is_banned(monkeypatch):
    """Statement on time, bytes never (to anyone): no member can relay what none got, so every other
    member disputes the part; a majority disputing a part convicts its reducer."""
    HoldBack = _holding_back(monkeypatch, "bytes")
    victims: set[str] = set()

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, HoldBack(victims)]) as peers:
            victims.update(p.peer_id for p in peers[:3])
            numel = 2_000_000
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
            outcomes = await run_round(peers, xs)
            withheld = outcomes[0].group.members.index(peers[3].peer_id)
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == {peers[3].peer_id} and peer.membership.banned == {peers[3].peer_id}
                assert outcome.verdict.bad_parts == outcome.verdict.disputed == {withheld}
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)

    asyncio.run(main())


@pytest.mark.parametrize("lie", ["other bytes", "stall"])
def test_a_member_that_relays_wrong_bytes_or_stalls_is_passed_over(monkeypatch, lie):
    """The victim asks the other members for a refused aggregate; the first to answer sends bytes
    other than those the reducer signed, or stalls them past everyone's patience. The victim takes
    the aggregate from the next one in time (a stalling relay would otherwise get it banned)."""
    from phalanx.protocol.btard.relay import AggregateRelay

    HoldBack = _holding_back(monkeypatch, "refused")
    victims: set[str] = set()
    liar: list[str] = []
    lied = asyncio.Event()
    serve = AggregateRelay.serve

    async def lying_relay_for(self, peer, part, payload):
        if self.vr.identity.peer_id != liar[0]:
            await asyncio.wait_for(lied.wait(), timeout=20.0)  # the liar answers first
            return await serve(self, peer, part, payload)
        header, data = await serve(self, peer, part, payload)
        if payload:
            lied.set()
            if lie == "stall":
                await asyncio.sleep(30.0)
            data = bytearray(data)
            data[100] ^= 1
        return header, data

    monkeypatch.setattr(AggregateRelay, "serve", lying_relay_for)

    async def main():
        lied.__init__()  # bound to this test's event loop
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, HoldBack(victims)]) as peers:
            victims.add(peers[0].peer_id)
            liar.append(peers[1].peer_id)
            xs = inputs(4)
            _assert_nothing_lost(peers, await run_round(peers, xs), peers[0], [peers[3]])
            assert lied.is_set()

    asyncio.run(main())


def test_a_member_gets_no_more_relayed_aggregates_than_an_honest_one_needs():
    """Fewer than half the reducers can fail an honest member, so a member serves any one requester
    at most ⌊(n − 1)/2⌋ relayed aggregates a round (else one member could double another's upload),
    and never the requester's own or the server's own part."""
    from phalanx.protocol.btard.messages import RELAY_METHOD, RelayRequest
    from phalanx.protocol.transport import CallFailed
    from phalanx.security.commitments import part_hash
    from phalanx.security.wire import pack

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            server, asker = peers[0], peers[1]
            rounds = asyncio.ensure_future(run_round(peers, inputs(4)))
            while (
                not server.engine.btard.open
                or asker.peer_id not in next(iter(server.engine.btard.open.values())).commits
            ):
                assert not rounds.done(), "the round ended before the server collected the commitments"
                await asyncio.sleep(0.01)  # until the server's round is open and has the asker's commitment
            vr = next(iter(server.engine.btard.open.values()))
            others = [i for i, p in enumerate(vr.members) if p not in (server.peer_id, asker.peer_id)]

            async def ask(part):
                request = pack(RelayRequest(round_id=vr.round_id, part=part, payload=True))
                return await asker.transport.call(
                    server.peer_id, RELAY_METHOD, request, max_reply_payload=1 << 20, timeout_s=30
                )

            outcomes = await asyncio.gather(
                *(ask(i) for i in [*others, vr.members.index(asker.peer_id)]), return_exceptions=True
            )
            await rounds
            served = [(i, o) for i, o in zip(others, outcomes) if not isinstance(o, BaseException)]
            assert len(served) == 1  # ⌊3/2⌋ = 1 for 4 members
            part, (header, data) = served[0]
            assert part_hash(data) == vr.aggregates[part][1].hash
            refused = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(refused) == 2 and all(isinstance(o, CallFailed) for o in refused)
            assert any("more relayed aggregates" in str(o) for o in refused)
            assert any("no relayable part" in str(o) for o in refused)

    asyncio.run(main())


def test_two_reducers_dying_after_commit_get_only_themselves_banned(monkeypatch):
    """Every other member misses both their aggregates, i.e. disputes two parts: that is no offense when
    the reducers themselves fell silent."""

    class Dies(Behavior):
        name = "dies_after_commit"

        def speaks(self, phase):
            return phase == "commit"

        def aggregate_reply(self, vr, receiver, header, payload):
            raise _HoldReply()

    _hold_replies(monkeypatch, 20.0)

    async def main():
        async with open_swarm(5, CONFIG, behaviors=[None, None, None, Dies(), Dies()]) as peers:
            dead = {peers[3].peer_id, peers[4].peer_id}
            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            xs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(5)]
            outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)], return_exceptions=True)
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == dead and peer.membership.banned == dead

    asyncio.run(main())

"""A part sent again, with real peers on loopback. A relayed connection that resets under a unary call makes
the sender send the call again whole (`Transport._through_relay`), though the reducer may have its part and
only the reply was lost: the reducer answers the same bytes as it answered the first time, during the round
and after it forgot the round, and refuses other bytes for the same part."""

import asyncio

import pytest
import torch

from phalanx.protocol.allreduce import PART_METHOD
from phalanx.protocol.config import MatchmakingConfig, RoundConfig
from phalanx.protocol.engine import Averaged, RoundRequest
from phalanx.protocol.transport import CallFailed, Transport
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NUMEL = 3_000  # parts of a few KB: unary calls, the kind a relayed reset sends again
CONFIG = RoundConfig(
    part_idle_timeout_s=None,  # reducers wait for every part until the deadline: no timing in play
    allreduce_timeout_s=60.0,
    matchmaking=MatchmakingConfig(matchmaking_timeout_s=5.0, join_timeout_s=60.0),
)


def _sending_twice(monkeypatch, sender: str, *, at_once: bool) -> list[tuple]:
    """`sender` sends each part twice: after the first reply came, or both calls at once. Returns each
    part call's arguments and first reply."""
    real_call = Transport.call
    calls: list[tuple] = []

    async def call(self, peer, method, header, payload=b"", **kwargs):
        if self.peer_id != sender or method != PART_METHOD:
            return await real_call(self, peer, method, header, payload, **kwargs)
        if at_once:
            first, again = await asyncio.gather(
                real_call(self, peer, method, header, payload, **kwargs),
                real_call(self, peer, method, header, payload, **kwargs),
            )
        else:
            first = await real_call(self, peer, method, header, payload, **kwargs)
            first = (first[0], bytes(first[1]))
            again = await real_call(self, peer, method, header, payload, **kwargs)
        assert (again[0], bytes(again[1])) == (first[0], bytes(first[1]))
        calls.append((peer, header, bytes(payload), first))
        return again

    monkeypatch.setattr(Transport, "call", call)
    return calls


@pytest.mark.parametrize("at_once", [False, True], ids=["after its reply", "at once"])
def test_a_part_sent_again_gets_the_same_reply_and_the_round_completes(monkeypatch, at_once):
    async def main():
        async with open_swarm(3, CONFIG, direct=False) as peers:
            calls = _sending_twice(monkeypatch, peers[0].peer_id, at_once=at_once)
            xs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(3)]
            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            outcomes = await asyncio.gather(*(p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)))
            mean = torch.stack(xs).mean(0)
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.result.missing_parts == () and outcome.result.dropped_senders == ()
                assert (outcome.result.vector - mean).abs().max().item() < 1e-6
            assert len(calls) == 2  # one part to each other member, each sent twice

            # the round is over and forgotten: the same part still gets its reply, another part is refused
            reducer, header, payload, first = calls[0]
            again = await peers[0].transport.call(reducer, PART_METHOD, header, payload, max_reply_payload=len(first[1]), timeout_s=30)
            assert (again[0], bytes(again[1])) == first
            other = bytearray(payload)
            other[-1] ^= 1
            with pytest.raises(CallFailed, match="sent two different parts"):
                await peers[0].transport.call(reducer, PART_METHOD, header, bytes(other), max_reply_payload=len(first[1]), timeout_s=30)

    asyncio.run(main())

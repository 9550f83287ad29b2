"""Each sender's idle limit is learned from its last rounds (protocol/patience.py): a dead member costs
the others about its usual wait, not the configured limit, and a member on a long link keeps its place."""

import asyncio
import os
import time

import pytest
import torch

from phalanx.protocol.codec import Codec
from phalanx.protocol.config import RoundConfig
from phalanx.protocol.patience import FLOOR_S, HISTORY, MIN_ROUNDS, Patience
from phalanx.protocol.round_spec import RoundSpec
from tests.protocol.swarm_fixture import open_swarm


def test_a_sender_gets_the_configured_limit_until_it_has_rounds_noted():
    patience = Patience(5.0)
    for _ in range(MIN_ROUNDS - 1):
        patience.note("a", 0.01)
        assert patience.limit("a") == 5.0
    patience.note("a", 0.01)
    assert patience.limit("a") == FLOOR_S
    assert patience.limit("b") == 5.0


def test_the_limit_is_the_median_plus_twice_the_spread_between_the_floor_and_the_cap():
    patience = Patience(30.0)
    for wait in (1.0, 1.0, 1.0, 2.0, 5.0):
        patience.note("far", wait)
    assert patience.limit("far") == pytest.approx(1.0 + 2 * (5.0 - 1.0))
    patience.note("far", 40.0)  # one very long wait: the cap holds
    assert patience.limit("far") == 30.0
    assert Patience(1.0).limit("far") == 1.0  # a cap below the floor wins
    assert Patience(None).limit("far") is None  # idle limits off


def test_only_the_last_rounds_count_and_senders_are_forgotten_oldest_first():
    patience = Patience(30.0)
    patience.note("a", 20.0)
    for _ in range(HISTORY):
        patience.note("a", 0.1)
    assert patience.limit("a") == FLOOR_S  # the long wait fell out of the window
    from phalanx.protocol import patience as module

    small = Patience(30.0)
    module_max, module.MAX_PEERS = module.MAX_PEERS, 3
    try:
        for peer in "abcd":
            small.note(peer, 0.1)
        small.note("b", 0.1)
        small.note("e", 0.1)
        assert set(small._waits) == {"b", "d", "e"}
    finally:
        module.MAX_PEERS = module_max


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_member_that_stops_sending_is_dropped_at_its_learned_limit_not_the_configured_one():
    """Three real peers on loopback with a 60 s idle limit: after rounds in which the third member's
    part came promptly, a round in which it sends nothing costs the reducers its learned limit."""
    cap_s = 60.0

    async def round_of(peers, senders):
        spec = RoundSpec(
            os.urandom(16), tuple(p.peer_id for p in peers), 3000, Codec.NONE, deadline=time.monotonic() + 2 * cap_s,
            reducers=2,  # the third member sends its parts and reduces none: nobody waits on it as a reducer
        )  # fmt: skip
        runs = [p.engine.allreduce.run(spec, torch.full((3000,), float(i)), p.engine.reducer, call_timeout_s=3 * cap_s)
                for i, p in enumerate(peers) if p in senders]  # fmt: skip
        return await asyncio.gather(*runs)

    async def main():
        async with open_swarm(3, RoundConfig(part_idle_timeout_s=cap_s, allreduce_timeout_s=2 * cap_s)) as peers:
            third = peers[2].peer_id
            for _ in range(MIN_ROUNDS):
                for result in await round_of(peers, peers):
                    assert result.dropped_senders == () and result.missing_parts == ()
            limits = [p.engine.allreduce.patience.limit(third) for p in peers[:2]]
            assert all(FLOOR_S <= limit < cap_s for limit in limits), limits
            began = time.monotonic()
            results = await round_of(peers, peers[:2])
            took = time.monotonic() - began
            for result in results:
                assert result.idle_senders == (third,) and result.late_senders == () and result.missing_parts == ()
            assert took < cap_s, (took, limits)  # dropped by its own limit, long before the configured one

    asyncio.run(main())

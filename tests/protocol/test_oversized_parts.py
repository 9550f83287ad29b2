"""What a round member may declare of its parts, with real peers on loopback: a member declaring 1 GiB
parts gets no honest reducer to allocate them, the round completes without its part, and it is kept out of
the next group (unverified rounds; verified ones ban it: tests/protocol/btard/test_part_size_proof.py).
One caller's calls for made-up round ids leave room for the others' early parts."""

import asyncio
import os
import time

import pytest
import torch

from phalanx.protocol.allreduce import PART_METHOD, PartHeader, RoundSpec
from phalanx.protocol.config import Codec, MatchmakingConfig, RoundConfig
from phalanx.protocol.engine import Averaged, RoundRequest
from phalanx.protocol.partition import partition_bounds
from phalanx.protocol.transport import CallFailed
from phalanx.security.wire import pack
from tests.protocol.oversized_parts import DECLARED, allocations, declaring_oversized_parts  # noqa: F401 (a fixture)
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NUMEL = 300_000  # honest fp16 parts of 75 K values: about 150 KB each
FP16_ATOL = 1e-2  # parts and aggregates crossed the wire as fp16: values under 15 lose ≤ 2^-11 of themselves, twice


def _inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(NUMEL, generator=g) * (i + 1) for i in range(n)]


# reducers wait for every part until the deadline (no idle timeout): nothing here depends on how fast the
# loaded test machine moves bytes
CONFIG = RoundConfig(
    compression=Codec.FP16,
    part_idle_timeout_s=None,
    allreduce_timeout_s=60.0,
    matchmaking=MatchmakingConfig(matchmaking_timeout_s=5.0, join_timeout_s=60.0),
)


def test_a_member_declaring_oversized_parts_is_refused_unread_and_kept_out_of_the_next_group(allocations):
    async def main():
        async with open_swarm(4, CONFIG) as peers:
            attacker, honest = peers[3], peers[:3]
            xs = _inputs(4)
            honest_mean = torch.stack(xs[:3]).mean(0)
            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            with declaring_oversized_parts(attacker.transport):
                rounds = (p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs))
                outcomes = await asyncio.gather(*rounds, return_exceptions=True)
            assert max(allocations, default=0) < DECLARED // 1024  # nobody allocated what the attacker declared
            members = outcomes[0].group.members
            bounds = partition_bounds(NUMEL, 4)
            for peer, outcome in zip(honest, outcomes[:3]):
                assert isinstance(outcome, Averaged), outcome
                assert attacker.peer_id in peer.engine.quarantine  # refused at the sink, so caught there
                assert outcome.result.missing_parts == () and outcome.result.dropped_senders == (attacker.peer_id,)
                for j, (a, b) in enumerate(bounds):  # the honest reducers' parts are the honest members' mean
                    if members[j] != attacker.peer_id:
                        assert (outcome.result.vector[a:b] - honest_mean[a:b]).abs().max() < FP16_ATOL

            # the next round: the attacker is in sync and tries to join, and no honest group takes it in
            for peer in peers:
                peer.engine.set_state(b"v1", 1)
            xs = _inputs(4)
            attempt = asyncio.ensure_future(attacker.engine.run_round(RoundRequest(xs[3])))
            try:
                async with asyncio.timeout(120):
                    outcomes = await asyncio.gather(*(p.engine.run_round(RoundRequest(x)) for p, x in zip(honest, xs)))
            finally:
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)
            honest_mean = torch.stack(xs[:3]).mean(0)
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert sorted(outcome.group.members) == sorted(p.peer_id for p in honest)
                assert (outcome.result.vector - honest_mean).abs().max() < FP16_ATOL

    asyncio.run(main())


def test_one_callers_parts_for_made_up_rounds_do_not_lock_out_a_real_early_part():
    """A reducer holds parts for rounds it has not started yet (the sender is a step ahead). One peer's
    300 calls for made-up round ids take only its own share of that wait list: another member's part for a
    real round still waits there and goes through once the reducer starts that round."""
    config = RoundConfig(part_idle_timeout_s=None, matchmaking=MatchmakingConfig(join_timeout_s=15.0))  # waits 15 s

    async def main():
        async with open_swarm(3, config) as peers:
            attacker, sender, reducer = peers
            service = reducer.engine.allreduce
            entered: dict[str, int] = {}
            wait_for_round = service._wait_for_round

            async def counting(round_id, peer):  # every call for a round passes here before it may wait
                entered[peer] = entered.get(peer, 0) + 1
                return await wait_for_round(round_id, peer)

            service._wait_for_round = counting
            made_up = pack(PartHeader(round_id=os.urandom(16), part=0, numel=1, codec="none", weight=1.0))
            flood = [
                asyncio.ensure_future(
                    attacker.transport.call(
                        reducer.peer_id, PART_METHOD, made_up, b"\0" * 4, max_reply_payload=4, timeout_s=120
                    )
                )
                for _ in range(300)
            ]
            try:
                async with asyncio.timeout(120):
                    while entered.get(attacker.peer_id, 0) < 300:  # each was refused or waits by now
                        await asyncio.sleep(0.05)
                spec = RoundSpec(
                    round_id=os.urandom(16),
                    members=(sender.peer_id, reducer.peer_id),
                    numel=1000,
                    codec=Codec.NONE,
                    deadline=time.monotonic() + 60.0,
                )
                x, y = torch.full((1000,), 1.0), torch.full((1000,), 3.0)
                mean = config.make_reducer()
                sent = asyncio.ensure_future(sender.engine.allreduce.run(spec, x, mean, call_timeout_s=60))
                async with asyncio.timeout(120):
                    while entered.get(sender.peer_id, 0) < 1:  # its part reached the reducer before the round
                        await asyncio.sleep(0.05)
                reduced = await reducer.engine.allreduce.run(spec, y, mean, call_timeout_s=60)
                result = await sent
                for outcome in (result, reduced):
                    assert outcome.missing_parts == () and outcome.dropped_senders == ()
                    assert torch.equal(outcome.vector, torch.full((1000,), 2.0))
            finally:
                outcomes = await asyncio.gather(*flood, return_exceptions=True)  # the waiting ones end in 15 s
            assert all(isinstance(o, CallFailed) for o in outcomes)
            assert sum("too many of this caller's calls" in str(o) for o in outcomes) == 292

    asyncio.run(main())

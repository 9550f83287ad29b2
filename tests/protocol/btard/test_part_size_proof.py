"""A verified round's member that signs and declares 1 GiB parts (protocol/adversary.py's oversized_part, its
transport declaring the same): every honest reducer refuses the part before allocating it, the signed size
proves the offense on its own, and the honest members ban it on one judge's vote each."""

import asyncio
import dataclasses

import pytest

from phalanx.protocol.adversary import PROTOCOL_ATTACKS
from phalanx.protocol.config import Codec
from phalanx.protocol.engine import Averaged
from phalanx.security.evidence import BanVote, Offense, Vote, banned
from phalanx.security.statements import open_statement
from tests.protocol.btard.btard_rounds import CONFIG, inputs, run_round
from tests.protocol.oversized_parts import DECLARED, allocations, declaring_oversized_parts  # noqa: F401 (a fixture)
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
# phases of 6 s as the other attack tests (a loaded machine must not stall an honest member past one); fp16
FP16_CONFIG = dataclasses.replace(
    CONFIG, compression=Codec.FP16, verify=dataclasses.replace(CONFIG.verify, phase_timeout_s=6.0)
)


def test_a_member_signing_oversized_parts_is_refused_unread_and_banned_on_its_own_statement(allocations):
    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS["oversized_part"]()]
        async with open_swarm(4, FP16_CONFIG, behaviors=behaviors) as peers:
            attacker, honest = peers[3], peers[:3]
            with declaring_oversized_parts(attacker.transport):
                outcomes = await run_round(peers, inputs(4))
            assert max(allocations, default=0) < DECLARED // 1024  # nobody allocated what the attacker declared
            for peer, outcome in zip(honest, outcomes[:3]):
                assert isinstance(outcome, Averaged), outcome
                assert attacker.peer_id in outcome.result.dropped_senders  # refused by every honest reducer
                assert outcome.verdict.banned == {attacker.peer_id}
                assert attacker.peer_id in peer.membership.banned
                assert attacker.peer_id in peer.engine.quarantine  # it declared the size too
                # each judge's vote carries the signed part statement: a proof on its own, for anyone
                votes = [open_statement(v, BanVote, kind="ban", round_id=b"") for v in outcome.verdict.votes]
                proofs = [(s.sender, b) for s, b in votes if b.offense is Offense.OVERSIZED_PART]
                assert proofs and all(b.accused == attacker.peer_id for _, b in proofs)
                judge, body = proofs[0]
                assert banned([Vote(judge, body)]) == {attacker.peer_id}
            first = outcomes[0]
            for outcome in outcomes[1:3]:  # honest members apply the same aggregate
                assert outcome.verdict.bad_parts == first.verdict.bad_parts
                assert bool((outcome.result.vector == first.result.vector).all())

    asyncio.run(main())

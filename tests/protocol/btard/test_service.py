"""The per-peer side of verified rounds (protocol/btard/service.py): held parts go to the round's members only."""

import asyncio

import pytest

from phalanx.protocol.adversary import PROTOCOL_ATTACKS
from tests.protocol.btard.btard_rounds import CONFIG, NUMEL, inputs, run_round
from tests.protocol.swarm_fixture import close_peer, open_peer, open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_held_parts_are_served_to_the_rounds_members_only():
    """The parts a reducer keeps as evidence are the contributors' gradients: a peer that was not in the
    round cannot download them (a member can, to judge)."""
    from phalanx.protocol.btard.messages import EVIDENCE_METHOD, EvidenceRequest
    from phalanx.protocol.transport import CallFailed
    from phalanx.security.wire import pack

    async def main():
        # a contested round (the weight is proof on sight), so that the parts are kept for the judges
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, PROTOCOL_ATTACKS["inflate_weight"]()]) as peers:
            outcomes = await run_round(peers, inputs(4))
            group = outcomes[0].group
            reducer, contributor = peers[0], peers[1]
            assert reducer.engine.btard.holds(group.round_id)  # a contested round: kept for the judges
            part = group.members.index(reducer.peer_id)
            request = pack(EvidenceRequest(round_id=group.round_id, part=part, contributor=contributor.peer_id))

            async def ask(peer):
                return await peer.transport.call(
                    reducer.peer_id, EVIDENCE_METHOD, request, b"", max_reply_payload=1 << 20, timeout_s=10
                )

            _, data = await ask(contributor)
            assert len(data) == 4 * (NUMEL // 4)
            outsider = await open_peer([str(m) for m in reducer.dht.get_visible_maddrs()], CONFIG)
            try:
                with pytest.raises(CallFailed, match="not in"):
                    await ask(outsider)
            finally:
                await close_peer(outsider)

    asyncio.run(main())

"""A donor serves the state it holds after a round; a round it left without one, or never joined, is
refused instead of left to the asker's state timeout."""

import asyncio
import secrets

import pytest
import torch
from hivemind.p2p import P2P

from phalanx.protocol.state_sync import StateService, StateSnapshot
from phalanx.protocol.transport import CallFailed, Status, Transport

pytestmark = pytest.mark.timeout(120)


def test_a_resyncing_peer_gets_the_rounds_snapshot_and_hears_at_once_of_one_the_donor_abandoned():
    async def main():
        a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await a.get_visible_maddrs())
        ta = await Transport.open(a, namespace="s", direct_host="127.0.0.1")
        tb = await Transport.open(b, namespace="s", direct_host="127.0.0.1")
        donor, recipient = StateService(ta), StateService(tb)
        template = {"w": torch.zeros(3)}
        done, failed, unknown = (secrets.token_bytes(16) for _ in range(3))
        try:
            # asked before the donor's round ends: the answer waits for its snapshot
            donor.joined(done)
            fetching = asyncio.ensure_future(recipient.fetch(ta.peer_id, done, template, timeout_s=60))
            await asyncio.sleep(0)
            await donor.publish(StateSnapshot(step=8, version=b"v", tensors={"w": torch.tensor([1.0, 2.0, 3.0])}), done)
            got = await fetching
            assert got.step == 8 and torch.equal(got.tensors["w"], torch.tensor([1.0, 2.0, 3.0]))

            # the donor's part in the round failed: the waiting request is refused, not left to its timeout
            donor.joined(failed)
            fetching = asyncio.ensure_future(recipient.fetch(ta.peer_id, failed, template, timeout_s=60))
            await asyncio.sleep(0)
            donor.abandon(failed)
            with pytest.raises(CallFailed, match="has no state after it") as info:
                await fetching
            assert info.value.status == Status.ABORTED
            with pytest.raises(CallFailed, match="has no state after it"):  # and so is a later one
                await recipient.fetch(ta.peer_id, failed, template, timeout_s=60)
            # a round the donor is not a member of (the leader's group never reached it): refused after a grace
            with pytest.raises(CallFailed, match="not a member of that round"):
                await recipient.fetch(ta.peer_id, unknown, template, timeout_s=60)
        finally:
            for t in (ta, tb):
                await t.aclose()
            for p in (a, b):
                await p.shutdown()

    asyncio.run(asyncio.wait_for(main(), 100))

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


def test_a_state_comes_in_chunks_from_several_donors_and_a_bad_chunk_again_from_the_designated_one(monkeypatch):
    from phalanx.protocol import state_sync

    monkeypatch.setattr(state_sync, "CHUNK_BYTES", 1024)  # 40 kB of state: 40 chunks
    state = {"w": torch.arange(10_000, dtype=torch.float32), "n": torch.tensor([7])}
    template = {k: torch.zeros_like(v) for k, v in state.items()}

    async def main():
        p2ps = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
        for _ in range(3):
            p2ps.append(
                await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await p2ps[0].get_visible_maddrs())
            )
        transports = [await Transport.open(p, namespace="s", direct_host="127.0.0.1") for p in p2ps]
        recipient, *donors = [StateService(t) for t in transports]
        ids = [t.peer_id for t in transports[1:]]
        honest, forged, gone = (secrets.token_bytes(16) for _ in range(3))
        try:
            for d in donors:
                await d.publish(StateSnapshot(step=3, version=b"v", tensors=state), honest)
            sent = [t.stats.bytes_sent for t in transports[1:]]
            got = await recipient.fetch_from(ids, honest, template, timeout_s=60)
            assert got.step == 3 and all(torch.equal(got.tensors[k], state[k]) for k in state)
            assert recipient.refetched_chunks == 0
            shares = [t.stats.bytes_sent - s for t, s in zip(transports[1:], sent, strict=True)]
            assert all(12_000 < s < 16_000 for s in shares), shares  # 13 or 14 of the 40 chunks each

            # the last donor holds another state: its chunks come again from the designated donor
            poisoned = {"w": state["w"] + 1, "n": state["n"]}
            for d, tensors in zip(donors, (state, state, poisoned), strict=True):
                await d.publish(StateSnapshot(step=3, version=b"v", tensors=tensors), forged)
            got = await recipient.fetch_from(ids, forged, template, timeout_s=60)
            assert torch.equal(got.tensors["w"], state["w"]) and recipient.refetched_chunks == 13

            # the middle donor's part in the round failed: the same
            for d in (donors[0], donors[2]):
                await d.publish(StateSnapshot(step=3, version=b"v", tensors=state), gone)
            donors[1].abandon(gone)
            got = await recipient.fetch_from(ids, gone, template, timeout_s=60)
            assert torch.equal(got.tensors["w"], state["w"]) and recipient.refetched_chunks == 13 + 13

            # the designated donor is the reference: without it there is no download
            with pytest.raises(CallFailed, match="has no state after it"):
                await recipient.fetch_from([ids[1], ids[0]], gone, template, timeout_s=60)
        finally:
            for t in transports:
                await t.aclose()
            for p in p2ps:
                await p.shutdown()

    asyncio.run(asyncio.wait_for(main(), 100))

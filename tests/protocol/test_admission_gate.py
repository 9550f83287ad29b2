"""A private swarm's gate on real peers: a caller without a certificate is refused, one with a valid
certificate gets through, and peers without one are invisible in the membership view."""

import asyncio

import hivemind
import pytest

from phalanx.peer.dht_keys import install, run_keys
from phalanx.protocol.admission import AdmissionGate
from phalanx.protocol.membership import Membership
from phalanx.protocol.transport import CallFailed, Transport
from phalanx.security.admission import generate_owner_key, issue, load_owner_private, load_owner_public
from phalanx.security.identity import Identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_gate_refuses_callers_without_a_certificate(tmp_path):
    generate_owner_key(tmp_path / "o.key", tmp_path / "o.pub")
    owner, public = load_owner_private(tmp_path / "o.key"), load_owner_public(tmp_path / "o.pub")

    async def main():
        ids = [Identity.generate_ed25519(tmp_path / f"{n}.id") for n in "ab"]
        a = hivemind.DHT(host_maddrs=LOOPBACK, identity_path=str(tmp_path / "a.id"), check_if_identity_free=False, start=True)
        b = hivemind.DHT(
            host_maddrs=LOOPBACK, initial_peers=a.get_visible_maddrs(), identity_path=str(tmp_path / "b.id"),
            check_if_identity_free=False, start=True,
        )  # fmt: skip
        try:
            ta = await Transport.open(await a.replicate_p2p(), namespace="t", direct_host="127.0.0.1")
            tb = await Transport.open(await b.replicate_p2p(), namespace="t", direct_host="127.0.0.1")

            async def echo(peer, header, payload):
                return b"ok", b""

            ta.register("echo", echo, max_payload=10)
            keys = run_keys("run", "t", public)
            for dht in (a, b):
                await install(dht, keys)
            gate = AdmissionGate(a, "t.certs", public, "run", ids[0].peer_id, issue(owner, ids[0].peer_id, "run", 3600))
            await gate.start()
            ta.admission = gate
            with pytest.raises(CallFailed, match="not admitted to this swarm"):
                await tb.call(ta.peer_id, "echo", b"", b"", max_reply_payload=0, timeout_s=20)

            membership = Membership(a, "t.peers", ta.peer_id, identity=ids[0], admitted=gate.knows)
            other = Membership(b, "t.peers", tb.peer_id, identity=ids[1])
            await other.refresh()
            await membership.refresh()
            assert set(membership.peers()) == {ta.peer_id}  # b announced itself but is invisible

            # b gets a certificate: after the gate's next look at the DHT, b is in
            gate_b = AdmissionGate(b, "t.certs", public, "run", ids[1].peer_id, issue(owner, ids[1].peer_id, "run", 3600))
            await gate_b.start()
            await asyncio.sleep(2.1)  # the gate reads the DHT at most every 2 s for unknown callers
            header, _ = await tb.call(ta.peer_id, "echo", b"", b"", max_reply_payload=0, timeout_s=20)
            assert header == b"ok"
            await membership.refresh()
            assert set(membership.peers()) == {ta.peer_id, tb.peer_id}
            await ta.aclose()
            await tb.aclose()
        finally:
            b.shutdown()
            a.shutdown()

    asyncio.run(main())

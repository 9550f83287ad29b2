"""The dial-back service's input checks and whom it dials: only the asker's own observed address, and
in a private swarm only an admitted asker."""

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo
from hivemind.utils.multiaddr import Multiaddr

from phalanx.errors import PeerProtocolError
from phalanx.protocol.dial_back import (
    MAGIC,
    MAX_DIALS,
    NONCE_BYTES,
    DialBackRequest,
    DialBackService,
    dialable,
    observed_host,
    request_dial_back,
)
from phalanx.security.wire import pack, unpack

ASKER = PeerID.from_base58("12D3KooWD2XqoBLqVUdzF3AGJudaRZg9NNrpxRnvhMDWD3BTdPQN")
OTHER = PeerID.from_base58("QmSzgc5qC2Ca4XD8gzVqgDKSvnndGBbUzMHRVexprAdrtK")


@pytest.mark.parametrize("port, nonce", [(0, b"n" * 16), (65536, b"n" * 16), (80, b"short"), (80, b"n" * 17)])
def test_requests_out_of_range_are_refused(port, nonce):
    raw = pack(DialBackRequest.model_construct(port=port, nonce=nonce))
    with pytest.raises(PeerProtocolError):
        unpack(raw, DialBackRequest, peer="x")


class _P2P:
    def __init__(self, infos):
        self.infos = infos

    async def list_peers(self):
        return self.infos


@pytest.mark.parametrize(
    "addrs, host",
    [
        (["/ip4/10.77.0.2/tcp/4001"], "10.77.0.2"),
        (["/ip4/203.0.113.9/tcp/4001/p2p/QmSzgc5qC2Ca4XD8gzVqgDKSvnndGBbUzMHRVexprAdrtK/p2p-circuit", "/ip6/::1/tcp/5"], "::1"),
        (["/ip4/203.0.113.9/tcp/4001/p2p/QmSzgc5qC2Ca4XD8gzVqgDKSvnndGBbUzMHRVexprAdrtK/p2p-circuit"], None),  # relayed only
    ],
)
def test_the_host_dialed_is_the_askers_own_connection_address(addrs, host):
    infos = [PeerInfo(OTHER, [Multiaddr("/ip4/198.51.100.1/tcp/1")]), PeerInfo(ASKER, [Multiaddr(a) for a in addrs])]
    assert asyncio.run(observed_host(_P2P(infos), ASKER)) == host
    assert asyncio.run(observed_host(_P2P(infos[:1]), ASKER)) is None  # not connected to us: nothing to dial


class _Gate:
    """A private swarm's admission gate that admits a fixed set of peers and remembers whom it was asked about."""

    def __init__(self, admitted: set[str]):
        self.admitted_peers, self.asked = admitted, []

    async def admitted(self, peer: str) -> bool:
        self.asked.append(peer)
        return peer in self.admitted_peers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("admit", [False, True])
def test_in_a_private_swarm_only_admitted_peers_are_dialed_back(admit):
    async def main():
        seen: list[tuple] = []  # the peer address of each connection the listener accepted, in order
        received: list[bytes] = []

        async def on_connection(reader, writer):
            seen.append(writer.get_extra_info("peername"))
            try:
                received.append(await reader.read(len(MAGIC) + NONCE_BYTES))
            finally:
                writer.close()

        listener = await asyncio.start_server(on_connection, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        asker = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
        try:
            gate = _Gate({asker.peer_id.to_base58()} if admit else set())
            await DialBackService.open(server, admission=gate)
            nonce = b"k" * NONCE_BYTES
            reply = await request_dial_back(asker, server.peer_id, port, nonce, timeout_s=60)
            assert gate.asked == [asker.peer_id.to_base58()]
            if admit:
                assert reply.reached and reply.address == f"127.0.0.1:{port}", reply
            else:
                assert not reply.reached and reply.address == "" and "not admitted" in reply.error, reply
            # a dial, if any, connected before the reply came; the listener accepts in order, so once our own
            # connection made after the reply is accepted, any dial's connection has been too
            _, probe = await asyncio.open_connection("127.0.0.1", port)
            mine = probe.get_extra_info("sockname")
            async with asyncio.timeout(60):
                while mine not in seen:
                    await asyncio.sleep(0.01)
            probe.close()
            assert seen[-1] == mine and len(seen) == (2 if admit else 1), seen
            if admit:
                async with asyncio.timeout(60):  # the dial's bytes, sent before the reply
                    while MAGIC + nonce not in received:
                        await asyncio.sleep(0.01)
        finally:
            for p in (asker, server):
                await p.shutdown()
            listener.close()
            await listener.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 100))


@pytest.mark.timeout(120)
def test_a_peer_learns_whether_others_can_dial_it():
    """An open port is reached, a closed one is not, a busy asker is asked again, and a peer that does
    not serve dial-backs gives no answer rather than a wrong one."""

    async def main():
        listener = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port = listener.sockets[0].getsockname()[1]
        closed = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        closed_port = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        silent = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # serves no dial-back
        asker = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[*await server.get_visible_maddrs(), *await silent.get_visible_maddrs()]
        )
        try:
            service = await DialBackService.open(server)
            assert await dialable(asker, [silent.peer_id, server.peer_id], open_port) is True
            assert await dialable(asker, [server.peer_id], closed_port) is False
            assert await dialable(asker, [silent.peer_id], open_port) is None
            service._dialing.update(f"x{i}" for i in range(MAX_DIALS))  # busy with others' dial-backs ...
            asyncio.get_running_loop().call_later(0.3, service._dialing.clear)  # ... for a moment
            assert await dialable(asker, [server.peer_id], open_port) is True
        finally:
            for p in (asker, silent, server):
                await p.shutdown()
            listener.close()
            await listener.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 100))

"""Calls to relayed peers (protocol/transport.py): a relayed connection that closes under a call, or a
peer p2pd cannot dial yet, costs one reconnect through the peer's relays, not the call."""

import asyncio
from types import SimpleNamespace

import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from phalanx.protocol.channel import CallFailed
from phalanx.protocol.transport import Transport
from phalanx.protocol.transport_wire import UnaryReply
from phalanx.security.wire import pack

ME = "12D3KooWS8x7BP4XMZPCduVsXJcDMkxnfNxXiw3GaFwbd9MkgwXx"
HOME = "12D3KooWGaAGP7zcs33D7ApBJb5sAq5Ba91tj8L8D2gF3MEBdAZ2"
CIRCUIT = f"/ip4/10.77.0.1/tcp/31337/p2p/12D3KooWKKZryKu8qZU7cPTqM1bwtUbaDLvtH6ZQLfkQNE8c9gQ9/p2p-circuit/p2p/{HOME}"


class _Stub:
    """p2pd's side of unary calls: the first ones fail as given, then the callee answers."""

    def __init__(self, failures: list[str]) -> None:
        self.failures, self.calls = list(failures), 0

    async def rpc_call(self, request):
        self.calls += 1
        if self.failures:
            raise P2PDaemonError(self.failures.pop(0))
        return BytesValue(value=pack(UnaryReply(status=0, reason="", header=b"head", payload=b"body")))


def _transport(stub: _Stub, connects: list) -> Transport:
    async def connect(peer, maddrs):
        connects.append((peer.to_base58(), [str(m) for m in maddrs]))

    p2p = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: ME), _client=SimpleNamespace(connect=connect))
    transport = Transport(p2p, namespace="test", direct_host=None)
    transport.prefer_direct = False
    transport.get_stub = lambda *args, **kwargs: stub
    return transport


@pytest.mark.parametrize("error", ["stream reset", "failed to dial: all dials failed"])
def test_a_relayed_call_that_broke_is_tried_once_more_through_the_relay(error):
    async def main():
        stub, connects = _Stub([error]), []
        transport = _transport(stub, connects)
        transport.circuits = {HOME: [CIRCUIT]}
        header, payload = await transport.call(HOME, "m", b"", b"x", max_reply_payload=16, timeout_s=5.0)
        assert (header, bytes(payload)) == (b"head", b"body")
        assert stub.calls == 2 and connects == [(HOME, [CIRCUIT])]

    asyncio.run(main())


def test_a_relayed_call_fails_after_its_second_try_and_others_after_their_first():
    async def main():
        stub, connects = _Stub(["stream reset", "stream reset"]), []
        transport = _transport(stub, connects)
        transport.circuits = {HOME: [CIRCUIT]}
        with pytest.raises(CallFailed, match="through a relay"):
            await transport.call(HOME, "m", b"", b"x", max_reply_payload=16, timeout_s=5.0)
        assert stub.calls == 2
        stub, connects = _Stub(["stream reset"]), []
        transport = _transport(stub, connects)  # not relayed: a reset is the callee's own doing
        with pytest.raises(CallFailed, match="stream reset"):
            await transport.call(HOME, "m", b"", b"x", max_reply_payload=16, timeout_s=5.0)
        assert stub.calls == 1 and connects == []

    asyncio.run(main())

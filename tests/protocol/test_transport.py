"""Transport between two real libp2p peers on loopback: every path, and what it refuses."""

import asyncio
import os

import pytest
from hivemind.p2p import P2P

from aggregation.errors import PeerProtocolError, RoundAbortedError
from protocol.transport import HELLO_MAGIC, CallFailed, Status, Transport

pytestmark = pytest.mark.timeout(120)


async def _pair(direct: bool = True):
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await a.get_visible_maddrs())
    ta = await Transport.open(a, namespace="t", direct_host="127.0.0.1" if direct else None)
    tb = await Transport.open(b, namespace="t", direct_host="127.0.0.1" if direct else None)

    async def echo(peer, header, payload):
        return header + peer.encode()[-4:], payload

    async def refuse(peer, header, payload):
        raise PeerProtocolError("bad header", peer=peer)

    async def abort(peer, header, payload):
        raise RoundAbortedError("round gone")

    async def crash(peer, header, payload):
        raise RuntimeError("bug")

    ta.register("echo", echo, max_payload=64 << 20)
    ta.register("refuse", refuse, max_payload=10)
    ta.register("abort", abort, max_payload=10)
    ta.register("crash", crash, max_payload=10)
    return a, b, ta, tb


async def _close(a, b, ta, tb):
    await ta.aclose()
    await tb.aclose()
    await a.shutdown()
    await b.shutdown()


def test_every_path_delivers_the_same_bytes():
    async def main():
        a, b, ta, tb = await _pair()
        try:
            small = os.urandom(1000)
            header, reply = await tb.call(ta.peer_id, "echo", b"h", small, max_reply_payload=1000, timeout_s=30)
            assert header == b"h" + tb.peer_id.encode()[-4:] and bytes(reply) == small
            assert tb.stats.unary_calls == 1

            big = os.urandom(3 << 20)  # 3 MiB: several sealed records
            _, reply = await tb.call(ta.peer_id, "echo", b"h", big, max_reply_payload=4 << 20, timeout_s=30)
            assert bytes(reply) == big and tb.stats.direct_calls == 1

            tb.prefer_direct = False
            _, reply = await tb.call(ta.peer_id, "echo", b"h", big, max_reply_payload=4 << 20, timeout_s=30)
            assert bytes(reply) == big and tb.stats.stream_calls == 1
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_peer_without_direct_path_is_reached_over_libp2p():
    async def main():
        a, b, ta, tb = await _pair(direct=False)
        try:
            big = os.urandom(1 << 20)
            _, reply = await tb.call(ta.peer_id, "echo", b"", big, max_reply_payload=2 << 20, timeout_s=30)
            assert bytes(reply) == big and tb.stats.stream_calls == 1 and tb.stats.direct_calls == 0
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


@pytest.mark.parametrize(
    "method, payload, status, text",
    [
        ("nope", b"", Status.UNKNOWN_METHOD, "unknown method 'nope'"),
        ("refuse", b"", Status.REJECTED, "bad header"),
        ("abort", b"", Status.ABORTED, "round gone"),
        ("crash", b"", Status.INTERNAL, "RuntimeError"),
        ("refuse", b"x" * 11, Status.REJECTED, "payload of 11 bytes exceeds 10"),
    ],
)
def test_handler_failures_become_status_codes(method, payload, status, text):
    async def main():
        a, b, ta, tb = await _pair()
        try:
            for large in (False, True):  # unary and direct paths answer alike
                with pytest.raises(CallFailed, match=text) as info:
                    await tb.call(ta.peer_id, method, b"", payload, max_reply_payload=10, timeout_s=30, expect_large_reply=large)
                assert info.value.status == status
            # and the server keeps serving
            _, reply = await tb.call(ta.peer_id, "echo", b"", b"ok", max_reply_payload=10, timeout_s=30)
            assert bytes(reply) == b"ok"
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_reply_larger_than_allowed_is_refused():
    async def main():
        a, b, ta, tb = await _pair()
        try:
            with pytest.raises(PeerProtocolError, match="reply of 1048576 bytes exceeds 1000"):
                await tb.call(ta.peer_id, "echo", b"", b"x" * (1 << 20), max_reply_payload=1000, timeout_s=30, expect_large_reply=True)
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


async def _read_all(reader) -> bytes:
    """What the server sends before closing (a reset counts as nothing)."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


def test_direct_socket_needs_a_fresh_ticket_and_the_right_key():
    """A stolen or replayed connection id gets nothing; altered ciphertext fails authentication."""

    async def main():
        a, b, ta, tb = await _pair()
        try:
            host, port = ta.direct_addresses[0].rsplit(":", 1)
            # an id nobody issued: the server closes the socket without a byte
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(HELLO_MAGIC + b"\x01" * 16 + b"\x00\x00\x00\x10" + b"junk" * 4)
            await writer.drain()
            assert await _read_all(reader) == b""
            writer.close()

            # a real ticket, then bytes not sealed with its key: refused, and the ticket is spent
            from google.protobuf.wrappers_pb2 import BytesValue
            from hivemind.p2p import PeerID

            from protocol.transport import _Ticket, _TicketRequest
            from security.wire import pack, unpack

            stub = tb.get_stub(tb.p2p, PeerID.from_base58(ta.peer_id), namespace="t")
            ticket = unpack((await stub.rpc_ticket(BytesValue(value=pack(_TicketRequest())))).value, _Ticket)
            for _ in range(2):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(HELLO_MAGIC + ticket.conn_id + (32).to_bytes(4, "little") + os.urandom(32))
                await writer.drain()
                assert await _read_all(reader) == b""
                writer.close()
            _, reply = await tb.call(ta.peer_id, "echo", b"", b"y" * (1 << 19), max_reply_payload=1 << 20, timeout_s=30)
            assert bytes(reply) == b"y" * (1 << 19)
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())

"""Transport between two real libp2p peers on loopback: every path, and what it refuses."""

import asyncio
import os

import pytest
from hivemind.p2p import P2P

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.channel import UploadLimiter
from phalanx.protocol.transport import HELLO_MAGIC, CallFailed, Landing, Status, Transport
from phalanx.security.commitments import part_hash, part_hasher

pytestmark = pytest.mark.timeout(120)


async def _pair(direct: bool = True, *, callee: dict | None = None, caller: dict | None = None):
    """Two transports on loopback: `ta` serves the test methods, `tb` calls them; `callee` and `caller` are
    extra Transport options of each."""
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await a.get_visible_maddrs())
    ta = await Transport.open(a, namespace="t", direct_host="127.0.0.1" if direct else None, **(callee or {}))
    tb = await Transport.open(b, namespace="t", direct_host="127.0.0.1" if direct else None, **(caller or {}))

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


def test_payloads_are_hashed_on_the_way_in_on_every_path():
    """Verified rounds check parts and aggregates against hashes the transport computes record by record."""

    async def main():
        a, b, ta, tb = await _pair()
        seen: list = []

        async def sink(peer, header, length):
            seen.append(part_hasher())
            return Landing(None, seen[-1])

        async def handler(peer, header, payload):
            return b"", bytes(reversed(payload))

        ta.register("hashed", handler, max_payload=64 << 20, sink=sink)
        try:
            for size, direct in ((1000, True), (3 << 20, True), (3 << 20, False)):
                tb.prefer_direct = direct
                data = os.urandom(size)
                reply_hasher = part_hasher()
                _, reply = await tb.call(
                    ta.peer_id, "hashed", b"", data, max_reply_payload=size, timeout_s=30, reply_hasher=reply_hasher
                )
                assert seen[-1].digest() == part_hash(data)
                assert reply_hasher.digest() == part_hash(bytes(reversed(data))) == part_hash(reply)
            assert (tb.stats.unary_calls, tb.stats.direct_calls, tb.stats.stream_calls) == (1, 1, 1)
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_reply_header_is_seen_before_the_payload_and_can_refuse_it():
    """Verified rounds start the MPRNG reveal on the aggregates' signed headers while the bytes still travel."""

    class Counting:
        def __init__(self):
            self.fed = 0

        def update(self, data):
            self.fed += len(data)

        def digest(self):
            return b""

    async def main():
        a, b, ta, tb = await _pair()

        async def handler(peer, header, payload):
            return b"head:" + header, bytes(payload)

        ta.register("echo_head", handler, max_payload=64 << 20)
        try:
            for size, direct in ((1000, True), (3 << 20, True), (3 << 20, False)):
                tb.prefer_direct = direct
                counting, seen = Counting(), []
                data = os.urandom(size)
                _, reply = await tb.call(
                    ta.peer_id, "echo_head", b"x", data, max_reply_payload=size, timeout_s=30, reply_hasher=counting,
                    on_reply_header=lambda h: seen.append((h, counting.fed)),
                )  # fmt: skip
                assert seen == [(b"head:x", 0)] and bytes(reply) == data and counting.fed == size

                def refuse(header):
                    raise PeerProtocolError("unsigned", peer=ta.peer_id)

                with pytest.raises(PeerProtocolError, match="unsigned"):
                    await tb.call(ta.peer_id, "echo_head", b"x", data, max_reply_payload=size, timeout_s=30, on_reply_header=refuse)
            _, reply = await tb.call(ta.peer_id, "echo_head", b"x", b"still", max_reply_payload=100, timeout_s=30)
            assert bytes(reply) == b"still"  # the callee keeps serving
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_upload_limiter_paces_sends_to_its_rate(monkeypatch):
    """A fake clock: the limiter asks to sleep exactly as long as the bytes beyond its burst take at its rate."""
    clock = [100.0]
    slept: list[float] = []

    async def fake_sleep(seconds):
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr("phalanx.protocol.channel.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("phalanx.protocol.channel.asyncio.sleep", fake_sleep)
    limiter = UploadLimiter(10e6)  # 10 MB/s

    async def main():
        for _ in range(30):
            await limiter.acquire(1 << 20)

    asyncio.run(main())
    total = 30 * (1 << 20)
    assert sum(slept) == pytest.approx((total - limiter.burst) / 10e6, rel=1e-9)
    clock[0] += 60.0  # an idle minute refills only the burst, not a minute's worth
    slept.clear()
    asyncio.run(limiter.acquire(int(limiter.burst)))
    assert slept == []
    asyncio.run(limiter.acquire(1 << 20))
    assert sum(slept) == pytest.approx((1 << 20) / 10e6, rel=1e-9)
    with pytest.raises(ValueError):
        UploadLimiter(0)


def test_upload_cap_covers_every_bulk_byte_sent():
    async def main():
        a, b, ta, tb = await _pair(caller={"upload_limit_bytes_per_s": 200e6})
        paced = [0]
        acquire = tb.limiter.acquire

        async def counting(size):
            paced[0] += size
            await acquire(size)

        tb.limiter.acquire = counting

        async def sink_hole(peer, header, payload):
            return b"", b""

        ta.register("hole", sink_hole, max_payload=64 << 20)
        try:
            for direct in (True, False):
                tb.prefer_direct = direct
                before, paced[0] = tb.stats.bytes_sent, 0
                await tb.call(ta.peer_id, "hole", b"", os.urandom(3 << 20), max_reply_payload=0, timeout_s=30)
                assert paced[0] == tb.stats.bytes_sent - before >= 3 << 20
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
            tb.prefer_direct = False  # a small call rides a libp2p unary RPC: its reply is held to the limit too
            with pytest.raises(PeerProtocolError, match="reply of 100 bytes exceeds 10"):
                await tb.call(ta.peer_id, "echo", b"", b"x" * 100, max_reply_payload=10, timeout_s=30)
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

            from phalanx.protocol.transport_wire import Ticket, TicketRequest
            from phalanx.security.wire import pack, unpack

            stub = tb.get_stub(tb.p2p, PeerID.from_base58(ta.peer_id), namespace="t")
            ticket = unpack((await stub.rpc_ticket(BytesValue(value=pack(TicketRequest())))).value, Ticket)
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


def test_a_cancelled_unary_call_finishes_in_the_background():
    """hivemind's daemon client dies if a unary reply lands in the same loop turn as the call's
    cancellation, and every later daemon request hangs. A caller that gives up (cancelled, or
    its timeout) leaves the libp2p call to finish; the daemon connection keeps working."""

    async def main():
        a, b, ta, tb = await _pair()
        answer = asyncio.Event()
        served: list[bytes] = []

        async def slow(peer, header, payload):
            await answer.wait()
            served.append(header)
            return b"late", b""

        ta.register("slow", slow, max_payload=10)
        tb.prefer_direct = False  # small calls ride libp2p unary RPCs only (no direct channel kept for later calls)
        try:
            caller = asyncio.ensure_future(tb.call(ta.peer_id, "slow", b"1", max_reply_payload=10, timeout_s=30))
            while not tb._unary:
                await asyncio.sleep(0.01)
            (inner,) = tb._unary
            caller.cancel()
            await asyncio.gather(caller, return_exceptions=True)
            assert caller.cancelled() and not inner.done()  # the daemon call itself was not cancelled
            with pytest.raises(CallFailed, match="timed out"):
                await tb.call(ta.peer_id, "slow", b"2", max_reply_payload=10, timeout_s=0.5)
            left = set(tb._unary)
            assert inner in left and len(left) == 2
            answer.set()
            await asyncio.wait_for(asyncio.gather(*left, return_exceptions=True), timeout=30)
            assert not any(t.cancelled() for t in left) and sorted(served) == [b"1", b"2"]
            assert not tb._unary  # both finished and were let go
            header, _ = await tb.call(ta.peer_id, "echo", b"h", b"x", max_reply_payload=10, timeout_s=30)
            assert header.startswith(b"h")
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


# ---- direct connections kept between calls ---------------------------------------------------


async def _kept_channel(tb, peer: str, timeout_s: float = 30.0):
    """Wait for the direct channel a small unary call opens in the background for later calls."""
    async with asyncio.timeout(timeout_s):
        while not tb._kept.get(peer):
            await asyncio.sleep(0.01)
    return tb._kept[peer][-1][0]


def test_calls_after_the_first_ride_the_kept_direct_connection():
    """The first small call goes over libp2p and opens a direct channel meanwhile; later calls, small or
    large, reuse it with the same bytes, and the callee does not count an idle kept one as busy."""

    async def main():
        a, b, ta, tb = await _pair()
        try:
            small = os.urandom(1000)
            _, reply = await tb.call(ta.peer_id, "echo", b"1", small, max_reply_payload=1000, timeout_s=30)
            assert bytes(reply) == small and (tb.stats.unary_calls, tb.stats.direct_calls) == (1, 0)
            kept = await _kept_channel(tb, ta.peer_id)
            for i in range(3):
                data = os.urandom(1000) if i < 2 else os.urandom(3 << 20)
                header, reply = await tb.call(ta.peer_id, "echo", b"h", data, max_reply_payload=4 << 20, timeout_s=30)
                assert bytes(reply) == data and header == b"h" + tb.peer_id.encode()[-4:]
                assert tb._kept[ta.peer_id] == [(kept, tb._kept[ta.peer_id][0][1])]  # the same channel, back
            assert (tb.stats.unary_calls, tb.stats.direct_calls, tb.stats.reused_calls) == (1, 3, 3)
            assert kept._in is None and kept._out is None  # an idle kept channel holds no record buffers
            assert await ta.wait_idle(5.0) and ta._served[tb.peer_id] == 1
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_a_kept_connection_the_callee_closed_is_not_used():
    """The callee waits idle_timeout_s for the next call and closes; a caller that expects it longer sees the
    close before it sends and calls over libp2p instead: nothing is sent into a dead connection."""

    async def main():
        a, b, ta, tb = await _pair(callee={"idle_timeout_s": 0.3})
        calls: list[bytes] = []

        async def count(peer, header, payload):
            calls.append(header)
            return b"", b""

        ta.register("count", count, max_payload=10)
        try:
            await tb.call(ta.peer_id, "count", b"1", max_reply_payload=10, timeout_s=30)
            await _kept_channel(tb, ta.peer_id)
            async with asyncio.timeout(30):
                while not ta._served:  # the callee took the connection (it may lag the caller's keeping it)
                    await asyncio.sleep(0.01)
                while ta._served:  # and gave up on it, idle
                    await asyncio.sleep(0.05)
            await tb.call(ta.peer_id, "count", b"2", max_reply_payload=10, timeout_s=30)
            assert calls == [b"1", b"2"] and tb.stats.reused_calls == 0 and tb.stats.unary_calls == 2
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_a_call_that_fails_on_a_kept_connection_is_not_sent_again():
    """A kept connection carries a call like a new one would: a refusal or a timeout closes it on both sides
    and fails the call, which is never retried (a handler must not run twice)."""

    async def main():
        a, b, ta, tb = await _pair()
        release = asyncio.Event()
        calls: list[bytes] = []

        async def stall(peer, header, payload):
            calls.append(header)
            await release.wait()
            return b"", b""

        ta.register("stall", stall, max_payload=10)
        try:
            await tb.call(ta.peer_id, "echo", b"", b"x", max_reply_payload=10, timeout_s=30)
            await _kept_channel(tb, ta.peer_id)
            with pytest.raises(CallFailed, match="timed out"):
                await tb.call(ta.peer_id, "stall", b"1", max_reply_payload=10, timeout_s=0.5)
            assert tb.stats.reused_calls == 1 and not tb._kept.get(ta.peer_id)
            release.set()
            assert await ta.wait_idle(10.0) and calls == [b"1"]

            await tb.call(ta.peer_id, "echo", b"", b"x" * 300_000, max_reply_payload=1 << 20, timeout_s=30)
            assert tb._kept.get(ta.peer_id)  # a new direct connection (large call), kept
            with pytest.raises(CallFailed, match="REJECTED"):
                await tb.call(ta.peer_id, "refuse", b"", b"", max_reply_payload=10, timeout_s=30)
            assert tb.stats.reused_calls == 2 and not tb._kept.get(ta.peer_id)
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_parallel_calls_keep_at_most_a_few_connections_per_peer():
    async def main():
        from phalanx.protocol.transport import KEEP_PER_PEER

        a, b, ta, tb = await _pair()
        try:
            big = os.urandom(1 << 20)
            replies = await asyncio.gather(*(
                tb.call(ta.peer_id, "echo", b"", big, max_reply_payload=2 << 20, timeout_s=60) for _ in range(6)
            ))  # fmt: skip
            assert all(bytes(r) == big for _, r in replies) and tb.stats.direct_calls == 6
            assert len(tb._kept[ta.peer_id]) == KEEP_PER_PEER
            async with asyncio.timeout(30):
                while sum(ta._served.values()) > KEEP_PER_PEER:  # the callee saw the others closed
                    await asyncio.sleep(0.05)
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_a_kept_connection_expires_before_the_callee_would_drop_it():
    async def main():
        a, b, ta, tb = await _pair(caller={"idle_timeout_s": 0.4})  # a connection is kept for 0.2 s
        try:
            await tb.call(ta.peer_id, "echo", b"", b"x" * 300_000, max_reply_payload=1 << 20, timeout_s=30)
            (kept, _), = tb._kept[ta.peer_id]
            await asyncio.sleep(0.3)
            await tb.call(ta.peer_id, "echo", b"", b"x", max_reply_payload=10, timeout_s=30)
            assert tb.stats.reused_calls == 0 and kept.pipe.sock.fileno() == -1  # closed, not used
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_only_direct_channels_are_kept():
    """The callee's word that it keeps a connection is not enough: a libp2p stream is closed after its call."""

    async def main():
        a, b, ta, tb = await _pair()
        try:
            tb.prefer_direct = False
            channel = await tb._open_stream(ta.peer_id)
            tb._keep(ta.peer_id, channel)
            assert not tb._kept.get(ta.peer_id)
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_both_sides_count_every_call_alike_on_every_path():
    """What one side counts as sent the other counts as received, replies included: a reducer's aggregates
    go back as replies (a libp2p unary reply once went uncounted, halving the bytes benchmarks printed)."""

    async def main():
        a, b, ta, tb = await _pair()
        try:
            for size, direct in ((1000, False), (1000, True), (100_000, True), (3 << 20, True), (3 << 20, False)):
                tb.prefer_direct = direct
                before = (tb.stats.bytes_sent, tb.stats.bytes_received, ta.stats.bytes_sent, ta.stats.bytes_received)
                await tb.call(ta.peer_id, "echo", b"h", os.urandom(size), max_reply_payload=size, timeout_s=30)
                assert await ta.wait_idle(10.0)  # the callee counts its reply's last bytes once they are sent
                sent, received, served, taken = (
                    now - then for now, then in zip(
                        (tb.stats.bytes_sent, tb.stats.bytes_received, ta.stats.bytes_sent, ta.stats.bytes_received), before
                    )
                )  # fmt: skip
                assert sent == taken >= size and served == received >= size, (size, direct)
            assert tb.stats.unary_calls >= 1 and tb.stats.direct_calls >= 1 and tb.stats.stream_calls == 1
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_a_peer_that_refused_our_call_gets_no_direct_channel_from_it():
    """A refusal (here the handler's; an admission gate's alike) opens nothing: no ticket request follows it,
    which would cost the refusing peer a second check."""

    async def main():
        a, b, ta, tb = await _pair()
        try:
            with pytest.raises(CallFailed, match="REJECTED"):
                await tb.call(ta.peer_id, "refuse", b"", b"", max_reply_payload=10, timeout_s=30)
            assert not tb._warming and not tb._kept and not ta._tickets
            await tb.call(ta.peer_id, "echo", b"", b"x", max_reply_payload=10, timeout_s=30)
            await _kept_channel(tb, ta.peer_id)  # an answered call does
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_a_peer_up_but_not_serving_is_told_apart_from_one_that_failed():
    """A host whose transport is not open yet (a peer still starting) answers "protocols not supported",
    and a transport without the method answers UNKNOWN_METHOD: both are `not_serving`, which a joiner
    waits out rather than suspect the peer. A refusal is not."""

    async def main():
        a, b, ta, tb = await _pair()
        bare = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await b.get_visible_maddrs())
        try:
            for large in (False, True):
                with pytest.raises(CallFailed, match="protocols not supported") as info:
                    await tb.call(bare.peer_id.to_base58(), "echo", b"", b"x", max_reply_payload=10, timeout_s=30, expect_large_reply=large)
                assert info.value.not_serving and info.value.status is None
                with pytest.raises(CallFailed) as info:
                    await tb.call(ta.peer_id, "nope", b"", b"", max_reply_payload=10, timeout_s=30, expect_large_reply=large)
                assert info.value.not_serving and info.value.status == Status.UNKNOWN_METHOD
                with pytest.raises(CallFailed) as info:
                    await tb.call(ta.peer_id, "abort", b"", b"", max_reply_payload=10, timeout_s=30, expect_large_reply=large)
                assert not info.value.not_serving
        finally:
            await bare.shutdown()
            await _close(a, b, ta, tb)

    asyncio.run(main())

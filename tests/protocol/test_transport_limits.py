"""The direct data port under connections that never authenticate: what it holds, for how long, and that
legitimate calls still go through. Loopback only; every wait is a bounded poll for a condition."""

import asyncio
import logging
import os
import socket
import sys

import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import PeerID

import phalanx.protocol.transport as transport
from phalanx.protocol.channel import Channel, ChannelStats, SocketPipe
from phalanx.protocol.transport import HELLO_MAGIC, MAX_PENDING_HELLOS, MAX_PENDING_PER_SOURCE, CallFailed, Landing
from phalanx.protocol.transport_wire import Ticket, TicketRequest
from phalanx.security.wire import pack, unpack
from tests.protocol.test_transport import _close, _pair

pytestmark = pytest.mark.timeout(300)

BOUND_S = 120.0  # how long a poll waits for its condition: far above any deadline it checks


async def _until(condition, what: str, bound_s: float = BOUND_S) -> None:
    try:
        async with asyncio.timeout(bound_s):
            while not condition():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {bound_s:.0f} s: {what}") from None


def _listener(ta) -> tuple[str, int]:
    host, port = ta.direct_addresses[0].rsplit(":", 1)
    return host, int(port)


async def _connect(host: str, port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.bind((source, 0))
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _open_silent(ta, count: int, sources: list[str], into: list[socket.socket]) -> tuple[list[int], list[int]]:
    """Open `count` connections that send nothing, round robin over `sources`, into `into` (the caller closes
    them). A batch at a time, each taken by the server before the next: more handshakes than the listen backlog
    at once and the kernel drops some silently (the client believes it connected, the server never sees it).
    Returns, after each batch, the transport's pending count and the kernel's count of server-side sockets."""
    host, port = _listener(ta)
    stats, pending, held = ta.stats, [], []
    for start in range(0, count, 100):
        into += await asyncio.gather(
            *(_connect(host, port, sources[i % len(sources)]) for i in range(start, min(count, start + 100)))
        )
        taken = len(into)
        await _until(lambda: stats.direct_refused + stats.direct_dropped + ta._pending_total == taken, "taken")
        # a refused connection is counted as the server closes it, and the kernel may list its socket a moment
        # longer (a loaded machine showed 72 for 64 pending): the count must settle at the pending ones
        counts = []
        await _until(lambda: counts.append(_server_sockets(host, port)) or counts[-1] <= ta._pending_total, "refused ones closed")
        pending.append(ta._pending_total)
        held.append(counts[-1])
    return pending, held


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the other end closed (end of file or reset); False while it stays open and silent."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _server_sockets(host: str, port: int) -> int:
    """This process's TCP sockets whose local end is the listener's address, the listener itself left out:
    the connections the server accepted and still holds, counted by the kernel rather than by the transport."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    listener = (socket.inet_aton(host), port)

    def endpoint(field: str) -> tuple[bytes, int]:
        ip, p = field.split(":")
        return int(ip, 16).to_bytes(4, sys.byteorder), int(p, 16)

    held = 0
    with open("/proc/self/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote, state, inode = endpoint(fields[1]), endpoint(fields[2]), fields[3], fields[9]
            held += local == listener and remote != listener and state != "0A" and inode in inodes  # 0A: LISTEN
    return held


async def _ticket(tb, ta) -> Ticket:
    stub = tb.get_stub(tb.p2p, PeerID.from_base58(ta.peer_id), namespace="t")
    return unpack((await stub.rpc_ticket(BytesValue(value=pack(TicketRequest())))).value, Ticket)


def test_a_flood_of_silent_connections_holds_no_more_than_the_cap():
    """5,000 connections that never say hello, from 20 addresses, held open by the attacker: the server holds
    at most MAX_PENDING_HELLOS of them at any time (the old code held every one for its idle timeout), closes
    every one, and calls between the two transports still go through while the attacker holds them."""

    async def main():
        a, b, ta, tb = await _pair(callee={"idle_timeout_s": 600.0})
        host, port = _listener(ta)
        flood: list[socket.socket] = []
        try:
            pending, held = await _open_silent(ta, 5000, [f"127.0.0.{2 + i}" for i in range(20)], flood)
            assert held == pending and max(held) <= MAX_PENDING_HELLOS, (held, pending)
            assert sum(ta._pending.values()) == ta._pending_total

            stats = ta.stats
            await _until(lambda: stats.direct_refused + stats.direct_dropped == 5000, "every flood connection closed")
            assert stats.direct_refused > 0 and ta._pending_total == 0 and not ta._pending
            assert _server_sockets(host, port) == 0
            assert all(_closed_by_server(sock) for sock in flood)

            # the attacker still holds its 5,000 sockets; a small call and a large one go through
            _, reply = await tb.call(ta.peer_id, "echo", b"", b"small", max_reply_payload=100, timeout_s=60)
            assert bytes(reply) == b"small"
            tb._direct_unreachable_until.clear()  # whatever the small call's background connection met
            big = os.urandom(1 << 20)
            _, reply = await tb.call(ta.peer_id, "echo", b"", big, max_reply_payload=2 << 20, timeout_s=60)
            assert bytes(reply) == big and tb.stats.direct_calls >= 1
        finally:
            for sock in flood:
                sock.close()
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_silent_connections_are_closed_at_the_hello_deadline(monkeypatch):
    """No cap gets in the way (both raised above 200), and the callee's idle timeout is 600 s: only the hello
    deadline can close these. Bounded far above it; no lower bound on when."""
    monkeypatch.setattr(transport, "MAX_PENDING_HELLOS", 1000)
    monkeypatch.setattr(transport, "MAX_PENDING_PER_SOURCE", 1000)

    async def main():
        a, b, ta, tb = await _pair(callee={"idle_timeout_s": 600.0})
        host, port = _listener(ta)
        silent: list[socket.socket] = []
        try:
            await _open_silent(ta, 200, ["127.0.0.1"], silent)
            assert transport.HELLO_TIMEOUT_S * 10 < BOUND_S
            await _until(lambda: all(_closed_by_server(sock) for sock in silent), "the server closed all 200")
            assert (ta.stats.direct_dropped, ta.stats.direct_refused, ta._pending_total) == (200, 0, 0)
            assert _server_sockets(host, port) == 0
        finally:
            for sock in silent:
                sock.close()
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_one_source_cannot_take_another_ones_slots(monkeypatch, caplog):
    """Beyond MAX_PENDING_PER_SOURCE, connections from one address are closed at once (the hello deadline is
    raised out of reach, so nothing else closes them), logged once; another address still gets all of its own,
    and a caller on it completes a call."""
    monkeypatch.setattr(transport, "HELLO_TIMEOUT_S", 3600.0)
    caplog.set_level(logging.INFO, logger=transport.__name__)
    extra = 4

    async def main():
        a, b, ta, tb = await _pair(callee={"idle_timeout_s": 600.0})
        host, port = _listener(ta)
        opened: list[socket.socket] = []
        try:
            first = [await _connect(host, port, "127.0.0.1") for _ in range(MAX_PENDING_PER_SOURCE + extra)]
            opened += first
            await _until(lambda: sum(map(_closed_by_server, first)) == extra, f"{extra} closed at once")
            assert ta.stats.direct_refused == extra and ta._pending["127.0.0.1"] == MAX_PENDING_PER_SOURCE

            second = [await _connect(host, port, "127.0.0.2") for _ in range(MAX_PENDING_PER_SOURCE - 1)]
            opened += second
            await _until(lambda: ta._pending["127.0.0.2"] == MAX_PENDING_PER_SOURCE - 1, "the other source's held")
            ticket = await _ticket(tb, ta)
            sock = await _connect(host, port, "127.0.0.2")  # its last slot: a legitimate caller
            opened.append(sock)
            pipe = SocketPipe(sock)
            await pipe.send(HELLO_MAGIC + ticket.conn_id)
            channel = Channel(pipe, ChannelStats(), ticket.key, initiator=True, idle_timeout_s=60.0)
            header, reply, _ = await tb._exchange(
                channel, ta.peer_id, "echo", b"h", b"data", 100, Landing(), None, patient=False
            )
            assert bytes(reply) == b"data" and header.startswith(b"h")
            assert ta.stats.direct_refused == extra and not any(map(_closed_by_server, second))
            assert sum(map(_closed_by_server, first)) == extra  # the first source's held ones are still held
            lines = [r for r in caplog.records if "closed a direct connection from 127.0.0.1" in r.getMessage()]
            assert len(lines) == 1 and lines[0].levelno == logging.INFO
        finally:
            for sock in opened:
                sock.close()
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_a_caller_whose_hello_is_in_gets_through_while_every_pending_slot_is_taken(monkeypatch):
    """A caller sends its hello right after connecting; one whose hello is already here when it is accepted
    makes the server wait for nothing, so no cap on waiting connections refuses it. A silent one is refused."""
    monkeypatch.setattr(transport, "HELLO_TIMEOUT_S", 3600.0)
    monkeypatch.setattr(transport, "MAX_PENDING_HELLOS", 2)

    async def main():
        a, b, ta, tb = await _pair(callee={"idle_timeout_s": 600.0})
        host, port = _listener(ta)
        opened: list[socket.socket] = []
        try:
            opened += [await _connect(host, port, f"127.0.0.{2 + i}") for i in range(2)]
            await _until(lambda: ta._pending_total == 2, "both pending slots taken")
            ticket = await _ticket(tb, ta)
            sock = socket.create_connection((host, port))  # blocking: the loop cannot accept before the hello is in
            opened.append(sock)
            sock.sendall(HELLO_MAGIC + ticket.conn_id)
            pipe = SocketPipe(sock)
            channel = Channel(pipe, ChannelStats(), ticket.key, initiator=True, idle_timeout_s=60.0)
            _, reply, _ = await tb._exchange(
                channel, ta.peer_id, "echo", b"", b"data", 100, Landing(), None, patient=False
            )
            assert bytes(reply) == b"data" and ta.stats.direct_refused == 0 and ta._pending_total == 2

            silent = await _connect(host, port, "127.0.0.4")
            opened.append(silent)
            await _until(lambda: _closed_by_server(silent), "a silent connection beyond the cap refused")
            assert ta.stats.direct_refused == 1 and ta._pending_total == 2
        finally:
            for sock in opened:
                sock.close()
            await _close(a, b, ta, tb)

    asyncio.run(main())


def test_a_made_up_ticket_is_dropped_at_once(monkeypatch):
    """A hello naming a ticket we never issued, or without our magic, is closed on the spot: the hello deadline
    and the idle timeout are both out of reach here."""
    monkeypatch.setattr(transport, "HELLO_TIMEOUT_S", 3600.0)

    async def main():
        a, b, ta, tb = await _pair(callee={"idle_timeout_s": 600.0})
        host, port = _listener(ta)
        opened: list[socket.socket] = []
        try:
            for hello in (HELLO_MAGIC + os.urandom(16), b"HTTP" + os.urandom(16)):
                sock = await _connect(host, port)
                opened.append(sock)
                await asyncio.get_running_loop().sock_sendall(sock, hello)
                await _until(lambda: _closed_by_server(sock), "a made-up ticket closed")
            assert (ta.stats.direct_dropped, ta.stats.direct_refused, ta._pending_total) == (2, 0, 0)
            assert not ta._served
        finally:
            for sock in opened:
                sock.close()
            await _close(a, b, ta, tb)

    asyncio.run(main())


@pytest.mark.parametrize(
    "cap", ["MAX_DIRECT_SERVED", "MAX_SERVED_PER_PEER", "MAX_PENDING_HELLOS", "MAX_PENDING_PER_SOURCE"]
)
def test_a_refused_direct_connection_fails_its_call_cleanly(monkeypatch, cap):
    """A caller whose direct connection a cap refuses gets a CallFailed, not a hang; small calls still ride
    libp2p, and direct calls work again once there is room. The served caps refuse right after the hello, every
    time; the pending ones only a connection whose hello is not in yet when it is accepted, so the call may
    also go through (directly, or over a libp2p stream when the refusal came before the hello was sent)."""
    original = getattr(transport, cap)
    monkeypatch.setattr(transport, cap, 0)
    after_hello = cap in ("MAX_DIRECT_SERVED", "MAX_SERVED_PER_PEER")

    async def main():
        a, b, ta, tb = await _pair()
        try:
            big = os.urandom(300_000)
            try:
                _, reply = await tb.call(ta.peer_id, "echo", b"", big, max_reply_payload=1 << 20, timeout_s=120)
                assert bytes(reply) == big and not after_hello
            except CallFailed as e:
                assert "timed out" not in str(e) and ta.stats.direct_refused >= 1
            _, reply = await tb.call(ta.peer_id, "echo", b"", b"small", max_reply_payload=100, timeout_s=60)
            assert bytes(reply) == b"small"
            await asyncio.gather(*tb._warming.values(), return_exceptions=True)  # its background connection

            monkeypatch.setattr(transport, cap, original)
            tb._direct_unreachable_until.clear()
            for channel, _ in tb._kept.pop(ta.peer_id, []):
                channel.close()
            direct = tb.stats.direct_calls
            _, reply = await tb.call(ta.peer_id, "echo", b"", big, max_reply_payload=1 << 20, timeout_s=60)
            assert bytes(reply) == big and tb.stats.direct_calls == direct + 1
        finally:
            await _close(a, b, ta, tb)

    asyncio.run(main())

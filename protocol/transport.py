"""Calls between peers: small ones over libp2p, bulk tensor bytes over a direct TCP connection.

A call is `(method, header, payload) -> (header, payload)`. Large ones take the direct path:
the caller asks the callee over libp2p (authenticated and encrypted) for a one-time ticket, a
connection id and a fresh 256-bit key; it then opens TCP to the callee's announced address,
presents the id, and seals every record after that with AES-256-GCM under that key (hardware
AES: ~9 GB/s a core). So the callee knows which libp2p peer holds the socket, and nobody on the
path can read, alter, reorder or replay its bytes: the fast path is no weaker than libp2p. When
TCP cannot connect, the same records flow over a libp2p stream (already encrypted) instead.

The data port is open to anyone, so the sockets it holds are capped at MAX_PENDING_HELLOS waiting
for their hello (MAX_PENDING_PER_SOURCE from one address, HELLO_TIMEOUT_S at most each) plus
MAX_DIRECT_SERVED authenticated ones (MAX_SERVED_PER_PEER a caller). One beyond a cap is closed at
once; the call it was opened for fails as CallFailed, never resent (the caller cannot tell it did not run).

A direct connection whose call went through (status OK, every byte read) is kept for the next
call to the same peer, small or large, for up to KEEP_IDLE_S: a verified round's four
all-to-all exchanges of small signed messages then skip the p2p daemon's hops. A small call
with no kept connection at hand rides a libp2p unary RPC and, once the peer answered it,
opens one in the background (a peer that refuses us gets no connection and no ticket request). A
kept connection is checked before use (no close or stray bytes from the callee) and never
retried on: a call that fails on it fails, as on a new one, so no handler runs twice.

Over 600 lines on purpose: the ticket, the direct connection (kept or new) and its libp2p fallback are one
protocol whose pieces only make sense together; its wire codes live in transport_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from multiaddr import Multiaddr

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.admission import Admission
from phalanx.protocol.channel import (
    Activity,
    CallFailed,
    Channel,
    ChannelAuthError,
    ChannelStats,
    Hasher,
    SocketPipe,
    StreamPipe,
    UploadLimiter,
)
from phalanx.protocol.transport_wire import (
    CallHeader,
    Handler,
    Landing,
    ReplyHeader,
    Sink,
    Status,
    Ticket,
    TicketRequest,
    RelayedStats,
    TransportStats,
    UnaryCall,
    UnaryReply,
)
from phalanx.security.wire import MAX_MESSAGE_BYTES, pack, unpack

logger = logging.getLogger(__name__)

SMALL_CALL_BYTES = 256 << 10  # requests and replies up to this size ride libp2p unary RPCs
# errors after which a call to a relayed peer is tried once more over a fresh connection through its relays
RELAY_RETRY_SIGNS = ("dial", "stream reset", "connection reset", "connection closed")
KEEP_IDLE_S = 20.0  # a kept direct connection unused this long is closed (callees wait idle_timeout_s for the next call)
KEEP_PER_PEER = 2  # idle direct connections kept per callee; parallel calls beyond them open more, closed after use
SERVE_KEPT_PER_PEER = 4  # connections a callee keeps serving per caller; beyond them, it closes each after its call
TICKET_TTL_S = 30.0
MAX_TICKETS_PER_PEER = 64
HELLO_MAGIC = b"PHX1"
HELLO_BYTES = len(HELLO_MAGIC) + 16  # the magic, then the ticket's connection id
HELLO_TIMEOUT_S = 5.0  # a caller sends its hello right after connecting: seconds cover a slow link or a busy loop
MAX_PENDING_HELLOS = 64  # legitimate ones wait a round trip at most, so a whole group connecting at once fits
MAX_PENDING_PER_SOURCE = 8  # per IPv4 address or IPv6 /64: one host cannot take all MAX_PENDING_HELLOS slots
MAX_DIRECT_SERVED = 512  # 128 callers with SERVE_KEPT_PER_PEER each, and the fd bound stays under a 1024 ulimit
MAX_SERVED_PER_PEER = MAX_TICKETS_PER_PEER  # one admitted peer cannot take every slot; it never needs more at once
REFUSAL_LOG_EVERY_S = 60.0  # one INFO line per source this often at most: an attacker must not flood the log
REFUSAL_LOG_SOURCES = 64  # sources logged per REFUSAL_LOG_EVERY_S at most (IPv6 hands out addresses freely)


@dataclass
class _Method:
    handler: Handler
    max_payload: int
    sink: Optional[Sink]


@dataclass
class _IssuedTicket:
    peer: str
    key: bytes
    expires_at: float


class Transport(ServicerBase):
    """Serves and makes calls for one peer. Open with `await Transport.open(...)`, close with `aclose()`."""

    def __init__(
        self,
        p2p: P2P,
        *,
        namespace: str,
        direct_host: Optional[str],
        direct_port: int = 0,
        announce_hosts: Optional[list[str]] = None,
        idle_timeout_s: float = 60.0,
        connect_timeout_s: float = 3.0,
        upload_limit_bytes_per_s: float = 0.0,
        admission: Optional[Admission] = None,
        banned: Optional[set[str]] = None,
    ) -> None:
        self.p2p, self.namespace = p2p, namespace
        self.peer_id: str = p2p.peer_id.to_base58()
        self._direct_host, self._direct_port = direct_host, direct_port
        default_hosts = [direct_host] if direct_host not in (None, "0.0.0.0", "") else ["127.0.0.1"]
        self._announce_hosts = announce_hosts or default_hosts
        self.idle_timeout_s, self.connect_timeout_s = idle_timeout_s, connect_timeout_s
        # bulk bytes (direct TCP and libp2p streams) share one uplink budget; small unary calls are not paced
        self.limiter = UploadLimiter(upload_limit_bytes_per_s) if upload_limit_bytes_per_s > 0 else None
        self._methods: dict[str, _Method] = {}
        self._tickets: dict[bytes, _IssuedTicket] = {}
        self._listener: Optional[socket.socket] = None
        self._accepting: Optional[asyncio.Task] = None
        self._addresses: list[str] = []
        self._direct_unreachable_until: dict[str, float] = {}
        self._connections: set[asyncio.Task] = set()
        self._kept: dict[str, list[tuple[Channel, float]]] = {}  # callee → its idle direct channels, since when
        self._warming: dict[str, asyncio.Task] = {}  # callee → a direct channel being opened for later calls
        self._served: Counter[str] = Counter()  # caller → direct connections we serve it on
        self._pending: Counter[str] = Counter()  # source address → accepted direct connections yet to send a hello
        self._pending_total = 0
        self._refusals_logged: dict[str, float] = {}  # source address → when we last logged refusing it
        self._busy = 0  # served calls in flight
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._closing = False
        self._unary: set[asyncio.Task] = set()  # libp2p unary calls, finishing after their caller left
        self.stats = TransportStats()
        # calls from these are refused; the node hands the one set membership and the ban book update too
        self.banned: set[str] = banned if banned is not None else set()
        self._in_round: Counter[str] = Counter()  # members of the rounds under way (see `round_with`)
        self.admission = admission  # private swarms: callers need its approval (protocol.admission.AdmissionGate)
        self.prefer_direct = True  # benchmarks turn this off to measure the libp2p path alone
        self.circuits: dict[str, list[str]] = {}  # relayed peers' circuit addresses (kept by protocol.relays)
        self._stream_proto = f"{namespace}.stream"

    @classmethod
    async def open(cls, p2p: P2P, **kwargs) -> Transport:
        self = cls(p2p, **kwargs)
        if self._direct_host is not None:
            self._listener = socket.create_server((self._direct_host, self._direct_port), backlog=128)
            self._listener.setblocking(False)
            port = self._listener.getsockname()[1]
            self._addresses = [f"{host}:{port}" for host in self._announce_hosts]
            self._accepting = asyncio.create_task(self._accept_direct(), name="direct-accept")
        await self.add_p2p_handlers(p2p, namespace=self.namespace)
        await p2p.add_binary_stream_handler(self._stream_proto, self._serve_stream)
        return self

    @property
    def direct_addresses(self) -> list[str]:
        return list(self._addresses)

    def register(self, method: str, handler: Handler, *, max_payload: int, sink: Optional[Sink] = None) -> None:
        """Serve `method`; requests with more than `max_payload` bytes are refused before they are read.
        `sink`, if given, chooses where the payload lands (e.g. straight into a tensor)."""
        if method in self._methods:
            raise ValueError(f"method {method!r} is already registered")
        self._methods[method] = _Method(handler, max_payload, sink)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no served call is in flight (replies still being sent count); False on timeout.
        Benchmarks read the byte counters at round boundaries only after this."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._busy:
                    await self._quiet.wait()
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        self._closing = True
        for task in list(self._warming.values()):
            task.cancel()
        await asyncio.gather(*self._warming.values(), return_exceptions=True)
        for kept in self._kept.values():
            for channel, _ in kept:
                channel.close()
        self._kept.clear()
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        try:
            await self.remove_p2p_handlers(self.p2p, namespace=self.namespace)
            await self.p2p.remove_binary_stream_handler(self._stream_proto)
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug(f"removing p2p handlers failed: {e!r}")
        for task in list(self._unary):  # nothing needs the daemon's control connection any more
            task.cancel()
        await asyncio.gather(*self._unary, return_exceptions=True)

    # ---- calling ----------------------------------------------------------------------------

    async def call(
        self,
        peer: str,
        method: str,
        header: bytes,
        payload: bytes | memoryview = b"",
        *,
        max_reply_payload: int,
        timeout_s: float,
        expect_large_reply: bool = False,
        reply_into: Optional[memoryview] = None,
        reply_hasher: Optional[Hasher] = None,
        on_reply_header: Optional[Callable[[bytes], None]] = None,
        activity: Optional[Activity] = None,
    ) -> tuple[bytes, bytearray | memoryview]:
        """Call `method` on `peer`; returns the reply's header and payload or raises CallFailed.
        With `reply_into`, the reply payload must have exactly its length and is written there;
        `reply_hasher` is fed the reply payload as it arrives. `on_reply_header` sees the reply's
        header before its payload is read (a bulk reply takes a while); raising from it fails the call.
        `activity` hears of every record sent or received on a connection (a libp2p unary call moves in one piece)."""
        reply = Landing(reply_into, reply_hasher, activity)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._call(
                    peer, method, header, payload, max_reply_payload, expect_large_reply, reply, on_reply_header
                )
        except TimeoutError:
            self.stats.failed_calls += 1
            raise CallFailed(f"{method} to {peer[-8:]} timed out after {timeout_s:.1f} s") from None
        except CallFailed:
            self.stats.failed_calls += 1
            raise

    async def _call(self, peer, method, header, payload, max_reply_payload, expect_large_reply, landing: Landing, on_header):
        small = len(payload) <= SMALL_CALL_BYTES and not expect_large_reply and max_reply_payload <= SMALL_CALL_BYTES
        channel = self._take_kept(peer) if self.prefer_direct else None
        if channel is None and small:
            reply_header, reply = await self._call_unary(peer, method, header, payload)
            if len(reply) > max_reply_payload:  # libp2p bounded its size; the caller's limit is tighter
                raise PeerProtocolError(f"{method} reply of {len(reply)} bytes exceeds {max_reply_payload}", peer=peer)
            if self.prefer_direct:  # a peer that answered: later calls to it get a direct channel
                self._warm(peer)
            if on_header is not None:
                on_header(reply_header)
            if landing.hasher is not None:
                landing.hasher.update(memoryview(reply))
            if landing.into is None:
                return reply_header, reply
            if len(reply) != len(landing.into):
                raise PeerProtocolError(f"{method} reply of {len(reply)} bytes, expected {len(landing.into)}", peer=peer)
            landing.into[:] = reply
            return reply_header, landing.into
        reused = channel is not None
        if channel is None and self.prefer_direct and self._direct_reachable(peer):
            channel = await self._open_direct(peer)
        if channel is None:
            channel = await self._open_stream(peer)
        if isinstance(channel.pipe, SocketPipe):
            self.stats.direct_calls += 1
            self.stats.reused_calls += reused
        channel.activity = landing.activity
        keep = False
        try:
            reply_header, reply, keep = await self._exchange(
                channel, peer, method, header, payload, max_reply_payload, landing, on_header, patient=small
            )
            return reply_header, reply
        finally:
            if keep:
                self._keep(peer, channel)
            else:
                channel.close()

    def _direct_reachable(self, peer: str) -> bool:
        return self._direct_unreachable_until.get(peer, 0.0) < time.monotonic()

    @property
    def _keep_s(self) -> float:
        """How long a direct channel stays kept: well inside the callee's idle timeout (ours, if shorter)."""
        return min(KEEP_IDLE_S, self.idle_timeout_s / 2)

    def _take_kept(self, peer: str) -> Optional[Channel]:
        """A kept direct channel to `peer` that is still good, or None; stale ones are closed on the way."""
        kept, limit = self._kept.get(peer), self._keep_s
        while kept:
            channel, since = kept.pop()
            if time.monotonic() - since < limit and channel.pipe.idle_and_open():
                return channel
            channel.close()
        self._kept.pop(peer, None)
        return None

    def _keep(self, peer: str, channel: Channel) -> None:
        """Keep a direct channel whose call went through for the next call to `peer`; close expired ones."""
        now, limit = time.monotonic(), self._keep_s
        for other, kept in list(self._kept.items()):
            for c, since in kept:
                if now - since >= limit:
                    c.close()
            kept[:] = [(c, since) for c, since in kept if now - since < limit]
            if not kept:
                del self._kept[other]
        kept = self._kept.get(peer, [])
        # only our own direct channels: a callee saying "keep" of a libp2p stream is not taken at its word
        if self._closing or len(kept) >= KEEP_PER_PEER or not isinstance(channel.pipe, SocketPipe):
            channel.close()
            return
        channel.activity = None
        channel.park()
        self._kept.setdefault(peer, []).append((channel, now))

    def _warm(self, peer: str) -> None:
        """Open a direct channel to `peer` in the background, for the calls after this one."""
        if self._closing or peer in self._warming or not self._direct_reachable(peer):
            return
        task = asyncio.create_task(self._warm_up(peer), name=f"direct-warm-up-{peer[-8:]}")
        self._warming[peer] = task
        task.add_done_callback(lambda _: self._warming.pop(peer, None))

    async def _warm_up(self, peer: str) -> None:
        try:
            async with asyncio.timeout(2 * self.connect_timeout_s + 5.0):
                channel = await self._open_direct(peer)
        except (CallFailed, PeerProtocolError, TimeoutError) as e:
            logger.debug(f"no direct channel to {peer[-8:]} for later calls: {e!r}")
            return
        if channel is not None:
            self._keep(peer, channel)

    async def _call_unary(self, peer, method, header, payload):
        stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        request = BytesValue(value=pack(UnaryCall(method=method, header=header, payload=bytes(payload))))
        try:
            response = await self._unary_call(stub.rpc_call(request))
        except Exception as e:
            if not await self._through_relay(peer, e):
                raise _libp2p_failed(f"{method} to {peer[-8:]} failed over libp2p", e) from None
            logger.debug(f"{method} to {peer[-8:]} failed ({e!r}); trying once more through its relay")
            try:
                response = await self._unary_call(stub.rpc_call(request))
            except Exception as e:
                raise _libp2p_failed(f"{method} to {peer[-8:]} failed over libp2p (through a relay)", e) from None
        self.stats.unary_calls += 1
        self.stats.bytes_sent += len(request.value)
        self.stats.bytes_received += len(response.value)
        if peer in self.circuits:
            self.stats.relayed_bytes += len(request.value) + len(response.value)
        reply = unpack(response.value, UnaryReply, peer=peer)
        _raise_for_status(reply.status, reply.reason, method, peer)
        return reply.header, bytearray(reply.payload)

    async def _unary_call(self, call: Awaitable[BytesValue]) -> BytesValue:
        """A libp2p unary call that a cancelled caller leaves to finish in the background. hivemind's
        daemon client loses its control connection (its reader dies with InvalidStateError, and every
        later daemon request hangs) when a reply lands in the same loop turn as the call's cancellation:
        likely when both sides give up on the same clock, as relay requests do."""
        task = asyncio.ensure_future(call)
        self._unary.add(task)
        task.add_done_callback(self._unary_done)
        return await asyncio.shield(task)

    def _unary_done(self, task: asyncio.Task) -> None:
        self._unary.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that left does not want it logged as unhandled

    async def _through_relay(self, peer: str, error: Exception) -> bool:
        """After p2pd failed to dial `peer`, or a relayed connection to it broke under the call: whether
        a connection through one of its relays is open now, for one more try (a relayed peer's circuits
        reach p2pd's address book only by `protocol.relays.RelayKeeper`, which may not have dialed a peer
        that just appeared; a relayed connection that closes resets every call on it at once, and its
        callers would otherwise lose a round's parts to one reconnect)."""
        circuits = self.circuits.get(peer)
        if not circuits or not any(sign in str(error) for sign in RELAY_RETRY_SIGNS):
            return False
        try:
            async with asyncio.timeout(self.connect_timeout_s + 2.0):
                await self.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(c) for c in circuits])
        except Exception as e:
            logger.debug(f"no connection to {peer[-8:]} through its relays: {e!r}")
            return False
        return True

    async def _open_direct(self, peer: str) -> Optional[Channel]:
        stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        try:
            response = await self._unary_call(stub.rpc_ticket(BytesValue(value=pack(TicketRequest()))))
        except Exception as e:
            raise _libp2p_failed(f"ticket request to {peer[-8:]} failed", e) from None
        ticket = unpack(response.value, Ticket, peer=peer)
        if len(ticket.conn_id) != 16 or len(ticket.key) != 32:
            raise PeerProtocolError("ticket with malformed id or key", peer=peer)
        for address in ticket.addresses[:4]:
            host, _, port = address.rpartition(":")
            if not port.isdigit():
                continue
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    pipe = await SocketPipe.connect(host.strip("[]"), int(port))
            except (OSError, TimeoutError) as e:
                logger.debug(f"direct connection to {peer[-8:]} at {address} failed: {e!r}")
                continue
            try:
                await pipe.send(HELLO_MAGIC + ticket.conn_id)
            except OSError:
                pipe.close()
                continue
            return Channel(pipe, self.stats, ticket.key, initiator=True, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)
        self._direct_unreachable_until[peer] = time.monotonic() + 300.0
        logger.info(f"peer {peer[-8:]} is not reachable directly; using libp2p streams for 5 min")
        return None

    async def _open_stream(self, peer: str) -> Channel:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._stream_proto)
        except Exception as e:
            if not await self._through_relay(peer, e):
                raise _libp2p_failed(f"libp2p stream to {peer[-8:]} failed", e) from None
            logger.debug(f"libp2p stream to {peer[-8:]} failed ({e!r}); trying once more through its relay")
            try:
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._stream_proto)
            except Exception as e:
                raise _libp2p_failed(f"libp2p stream to {peer[-8:]} failed (through a relay)", e) from None
        self.stats.stream_calls += 1
        return Channel(StreamPipe(reader, writer), self._stats_for(peer), None, initiator=True, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)

    def _stats_for(self, peer: str) -> ChannelStats:
        """The counters a libp2p channel with `peer` adds to: relayed ones too, if a relay carries it."""
        return RelayedStats(self.stats) if peer in self.circuits else self.stats

    async def _exchange(
        self, channel: Channel, peer, method, header, payload, max_reply_payload, landing: Landing, on_header, *, patient: bool
    ) -> tuple[bytes, bytearray | memoryview, bool]:
        """One call on `channel`: its reply, and whether the callee serves another call on the channel.
        `patient`: the reply may take longer than the idle timeout to start (a small call's handler may
        wait, as a matchmaking leader does; unary RPCs are bounded by the call's timeout alone, too)."""
        head = pack(CallHeader(method=method, header=header, payload_len=len(payload)))
        await channel.send_message(head, payload)
        reply = unpack(await channel.recv_small(MAX_MESSAGE_BYTES, patient=patient), ReplyHeader, peer=peer)
        _raise_for_status(reply.status, reply.reason, method, peer)
        if not 0 <= reply.payload_len <= max_reply_payload:
            raise PeerProtocolError(f"{method} reply of {reply.payload_len} bytes exceeds {max_reply_payload}", peer=peer)
        if on_header is not None:
            on_header(reply.header)
        return reply.header, await channel.recv_payload(reply.payload_len, landing.into, landing.hasher), reply.keep_open

    # ---- serving ----------------------------------------------------------------------------

    async def rpc_ticket(self, request: BytesValue, context: P2PContext) -> BytesValue:
        peer = context.remote_id.to_base58()
        await self._check_caller(peer)
        unpack(request.value, TicketRequest, peer=peer)
        if not self._addresses:
            return BytesValue(value=pack(Ticket(conn_id=b"\0" * 16, key=b"\0" * 32, addresses=[])))
        now = time.monotonic()
        for conn_id in [c for c, t in self._tickets.items() if t.expires_at < now]:
            del self._tickets[conn_id]
        if sum(t.peer == peer for t in self._tickets.values()) >= MAX_TICKETS_PER_PEER:
            raise PeerProtocolError("too many open direct-connection tickets", peer=peer)
        conn_id, key = secrets.token_bytes(16), AESGCM.generate_key(bit_length=256)
        self._tickets[conn_id] = _IssuedTicket(peer, key, now + TICKET_TTL_S)
        return BytesValue(value=pack(Ticket(conn_id=conn_id, key=key, addresses=self._addresses)))

    async def rpc_call(self, request: BytesValue, context: P2PContext) -> BytesValue:
        peer = context.remote_id.to_base58()
        self.stats.bytes_received += len(request.value)
        try:
            call = unpack(request.value, UnaryCall, peer=peer)
            status, reason, header, payload = await self._dispatch(peer, call.method, call.header, call.payload)
        except PeerProtocolError as e:
            status, reason, header, payload = Status.REJECTED, str(e), b"", b""
        reply = pack(UnaryReply(status=int(status), reason=reason, header=header, payload=bytes(payload)))
        self.stats.bytes_sent += len(reply)  # a reducer's aggregate goes back this way: its uplink's bytes too
        if peer in self.circuits:
            self.stats.relayed_bytes += len(request.value) + len(reply)
        return BytesValue(value=reply)

    def _spawn_connection(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _accept_direct(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(self._listener)
            except OSError as e:
                logger.warning(f"direct listener failed: {e!r}")
                await asyncio.sleep(1.0)
                continue
            source, hello = _source_of(address), _buffered_hello(sock)
            if hello is None and (
                self._pending_total >= MAX_PENDING_HELLOS or self._pending[source] >= MAX_PENDING_PER_SOURCE
            ):
                sock.close()  # accepted only to close it: a connection in the kernel's backlog costs us no fd
                self._refused(source, "too many connections from it or from everyone waiting for their hello")
            else:
                try:
                    pipe = SocketPipe(sock)
                except OSError:  # reset before we got to it
                    sock.close()
                    continue
                if hello is None:
                    self._pending[source] += 1
                    self._pending_total += 1
                self._spawn_connection(self._serve_direct(pipe, source, hello))
            # accepting never waits while the backlog holds connections: let the new one read a hello that
            # arrived meanwhile (it frees its slot) and let the loop breathe under a flood
            await asyncio.sleep(0)

    async def _read_hello(self, pipe: SocketPipe, source: str) -> Optional[bytes]:
        """The hello of a connection holding a pending slot, or None when it did not come in HELLO_TIMEOUT_S."""
        hello = bytearray(HELLO_BYTES)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                await pipe.readinto(memoryview(hello))
        except TimeoutError:
            self._refused(source, f"no hello within {HELLO_TIMEOUT_S:.0f} s", dropped=True)
            return None
        finally:
            self._pending[source] -= 1
            if self._pending[source] <= 0:
                del self._pending[source]
            self._pending_total -= 1
        return bytes(hello)

    async def _serve_direct(self, pipe: SocketPipe, source: str, hello: Optional[bytes]) -> None:
        """Serve a direct connection; `hello` None: it holds a pending slot until its hello is read."""
        channel, peer = None, None
        try:
            if hello is None:
                hello = await self._read_hello(pipe, source)
                if hello is None:
                    return
            ticket = self._tickets.pop(hello[len(HELLO_MAGIC) :], None) if hello.startswith(HELLO_MAGIC) else None
            if ticket is None or ticket.expires_at < time.monotonic():
                self._refused(source, "an unknown or expired ticket", dropped=True)
                return
            if self._served.total() >= MAX_DIRECT_SERVED or self._served[ticket.peer] >= MAX_SERVED_PER_PEER:
                # the caller's call fails as CallFailed (the connection closes before any reply) and is not resent
                self._refused(source, f"too many direct connections served (to {ticket.peer[-8:]} or to everyone)")
                return
            channel = Channel(pipe, self.stats, ticket.key, initiator=False, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)
            peer = ticket.peer
            self._served[peer] += 1
            while await self._serve_channel(peer, channel, reusable=True):
                channel.park()  # until the caller's next call, or its close, or the idle timeout
        except (CallFailed, TimeoutError, OSError):
            pass
        finally:
            if peer is not None:
                self._served[peer] -= 1
                if self._served[peer] <= 0:
                    del self._served[peer]
            (channel or pipe).close()

    def _refused(self, source: str, why: str, *, dropped: bool = False) -> None:
        """Count a direct connection we closed (refused: a cap was full; `dropped`: no hello in time, or a ticket
        we never issued) and log it once a minute per source at most: a flood adds a few lines, not one each."""
        if dropped:
            self.stats.direct_dropped += 1
        else:
            self.stats.direct_refused += 1
        now, last = time.monotonic(), self._refusals_logged.get(source)
        if last is not None and now - last < REFUSAL_LOG_EVERY_S:
            return
        if len(self._refusals_logged) >= REFUSAL_LOG_SOURCES:
            self._refusals_logged = {s: t for s, t in self._refusals_logged.items() if now - t < REFUSAL_LOG_EVERY_S}
            if len(self._refusals_logged) >= REFUSAL_LOG_SOURCES:
                return  # the counters still count it
        self._refusals_logged[source] = now
        logger.info(
            f"closed a direct connection from {source}: {why} (so far {self.stats.direct_refused} refused, "
            f"{self.stats.direct_dropped} dropped; at most one line a minute per source)"
        )

    async def _serve_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            peer = stream_info.peer_id.to_base58()
            channel = Channel(StreamPipe(reader, writer), self._stats_for(peer), None, initiator=False, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)
            await self._serve_channel(peer, channel)
        finally:
            writer.close()
            self._connections.discard(task)

    async def _serve_channel(self, peer: str, channel: Channel, reusable: bool = False) -> bool:
        """Serve one call on `channel`. True when the caller may send another on it: a direct connection
        whose call went through, so both sides know where the next call's records start."""
        try:
            head: Optional[bytes] = await channel.recv_small(MAX_MESSAGE_BYTES)
        except ChannelAuthError as e:
            logger.info(f"dropped a direct connection claiming to be {peer[-8:]}: {e}")
            return False
        except PeerProtocolError as e:  # a header record too large: refused, unread
            head, status, reason, header, payload = None, Status.REJECTED, str(e), b"", b""
        except CallFailed:
            return False  # the caller closed a kept connection, or sent nothing for the idle timeout
        with self._serving():
            try:
                if head is not None:
                    call = unpack(head, CallHeader, peer=peer)
                    status, reason, header, payload = await self._dispatch(peer, call.method, call.header, call.payload_len, channel)
            except ChannelAuthError as e:
                logger.info(f"dropped a direct connection claiming to be {peer[-8:]}: {e}")
                return False
            except PeerProtocolError as e:
                logger.debug(f"rejected a call from {peer[-8:]}: {e}")
                status, reason, header, payload = Status.REJECTED, str(e), b"", b""
            except CallFailed as e:
                logger.debug(f"call from {peer[-8:]} broke off: {e}")
                return False
            keep = reusable and status == Status.OK and not self._closing and self._served[peer] <= SERVE_KEPT_PER_PEER
            head = pack(ReplyHeader(status=int(status), reason=reason, header=header, payload_len=len(payload), keep_open=keep))
            try:
                await channel.send_message(head, payload)
            except CallFailed as e:
                logger.debug(f"reply to {peer[-8:]} failed: {e!r}")
                return False
            return keep

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """A served call in flight, from its request's header to its reply's last byte (see wait_idle)."""
        self._busy += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if not self._busy:
                self._quiet.set()

    @contextlib.contextmanager
    def round_with(self, members: Iterable[str]) -> Iterator[None]:
        """Serve a round's members for its duration even if we banned one. Bans reach peers at different
        times (the DHT), so the leader may not know one yet: refusing that member would make us the one
        that failed the round, and its other members would ban us. The round's checks handle the member."""
        members = Counter(members)
        self._in_round += members
        try:
            yield
        finally:
            self._in_round -= members  # a Counter keeps positive counts only: members of no other round go

    async def _check_caller(self, peer: str) -> None:
        if peer in self.banned and peer not in self._in_round:
            raise PeerProtocolError("banned peer", peer=peer)
        if self.admission is not None and not await self.admission.admitted(peer):
            raise PeerProtocolError("not admitted to this swarm (no valid certificate)", peer=peer)

    async def _dispatch(self, peer: str, method: str, header: bytes, payload, channel: Optional[Channel] = None):
        """Run the handler. `payload` is the bytes themselves (unary) or their length, read from `channel`."""
        await self._check_caller(peer)
        entry = self._methods.get(method)
        if entry is None:
            return Status.UNKNOWN_METHOD, f"unknown method {method[:40]!r}", b"", b""
        payload_len = payload if channel is not None else len(payload)
        if not 0 <= payload_len <= entry.max_payload:
            raise PeerProtocolError(f"{method} payload of {payload_len} bytes exceeds {entry.max_payload}", peer=peer)
        try:
            into, hasher, activity = await entry.sink(peer, header, payload_len) if entry.sink is not None else Landing()
            if channel is not None:
                payload = await self._recv_watched(channel, payload_len, Landing(into, hasher, activity))
            else:
                if hasher is not None:
                    hasher.update(memoryview(payload))
                if into is not None:
                    into[:] = payload
                    payload = into
                else:
                    payload = bytearray(payload)
            reply_header, reply_payload = await entry.handler(peer, header, payload)
        except (PeerProtocolError, CallFailed):
            raise
        except RoundAbortedError as e:
            return Status.ABORTED, str(e), b"", b""
        except Exception as e:
            logger.exception(f"handler {method} failed on a call from {peer[-8:]}")
            return Status.INTERNAL, f"{type(e).__name__}", b"", b""
        return Status.OK, "", reply_header, reply_payload

    @staticmethod
    async def _recv_watched(channel: Channel, length: int, landing: Landing) -> bytearray | memoryview:
        """Read a request's payload, telling its watcher of each record and of a connection that broke."""
        channel.activity = landing.activity
        try:
            return await channel.recv_payload(length, landing.into, landing.hasher)
        except (CallFailed, PeerProtocolError):
            if landing.activity is not None:
                landing.activity.broke()
            raise
        finally:
            channel.activity = None


def _buffered_hello(sock: socket.socket) -> Optional[bytes]:
    """A connection's whole hello if it is already here (a caller sends it right after connecting): such a
    connection makes us wait for nothing, so it takes no pending slot and no cap on those refuses it."""
    try:
        if len(sock.recv(HELLO_BYTES, socket.MSG_PEEK)) == HELLO_BYTES:
            return sock.recv(HELLO_BYTES)
    except OSError:  # nothing yet (BlockingIOError), or a reset that its first read meets again
        pass
    return None


def _source_of(address) -> str:
    """Whom the per-source cap counts a connection against: its IPv4 address, or its IPv6 /64 (one host
    can hold a whole /64)."""
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%")[0])
    except (ValueError, IndexError, TypeError):
        return str(address)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _raise_for_status(status: int, reason: str, method: str, peer: Optional[str]) -> None:
    if status == Status.OK:
        return
    try:
        code = Status(status)
    except ValueError:
        raise PeerProtocolError(f"unknown status {status} in reply to {method}", peer=peer) from None
    raise CallFailed(f"{method} {code.name}: {reason[:200]}", code, not_serving=code == Status.UNKNOWN_METHOD)


def _libp2p_failed(what: str, error: Exception) -> CallFailed:
    """A libp2p call or stream that failed. "protocols not supported": the peer's host answered but has no
    handler for our protocol, so it has not opened its transport yet (`not_serving`)."""
    return CallFailed(f"{what}: {error!r}", not_serving="protocols not supported" in str(error))

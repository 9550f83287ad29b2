"""Calls between peers: small ones over libp2p, bulk tensor bytes over a direct TCP connection.

A call is `(method, header, payload) -> (header, payload)`. Small calls ride a libp2p
unary RPC. Large ones take the direct path: the caller asks the callee over libp2p
(authenticated and encrypted) for a one-time ticket, a connection id and a fresh
256-bit key; it then opens TCP to the callee's announced address, presents the id, and
seals every record after that with AES-256-GCM under that key (hardware AES: ~9 GB/s a core). So the callee knows
which libp2p peer holds the socket, and nobody on the path can read, alter, reorder or
replay its bytes: the fast path is no weaker than libp2p. When TCP cannot connect, the
same records flow over a libp2p stream (already encrypted) instead.

Over ~450 lines on purpose: the ticket, the direct connection and its libp2p fallback are one
protocol whose pieces only make sense together; its wire codes live in transport_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from phalanx.aggregation.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.channel import (
    Activity,
    CallFailed,
    Channel,
    ChannelAuthError,
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
    TransportStats,
    UnaryCall,
    UnaryReply,
)
from phalanx.security.wire import MAX_MESSAGE_BYTES, pack, unpack

logger = logging.getLogger(__name__)

SMALL_CALL_BYTES = 256 << 10  # requests and replies up to this size ride libp2p unary RPCs
TICKET_TTL_S = 30.0
MAX_TICKETS_PER_PEER = 64
HELLO_MAGIC = b"PHX1"


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
        self._unary: set[asyncio.Task] = set()  # libp2p unary calls, finishing after their caller left
        self.stats = TransportStats()
        self.banned: set[str] = set()  # shared with membership and the ban book: calls from these are refused
        self._in_round: Counter[str] = Counter()  # members of the rounds under way (see `round_with`)
        self.admission = None  # private swarms: a protocol.admission.AdmissionGate; callers need its approval
        self.prefer_direct = True  # benchmarks turn this off to measure the libp2p path alone
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
        deadline = time.monotonic() + timeout_s
        while self._connections:
            if time.monotonic() >= deadline:
                return False
            await asyncio.wait(set(self._connections), timeout=deadline - time.monotonic())
        return True

    async def aclose(self) -> None:
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
        `activity` hears of every record sent or received on a bulk call (small calls move in one piece)."""
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
        if small:
            reply_header, reply = await self._call_unary(peer, method, header, payload)
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
        channel = None
        if self.prefer_direct and self._direct_unreachable_until.get(peer, 0.0) < time.monotonic():
            channel = await self._open_direct(peer)
        if channel is None:
            channel = await self._open_stream(peer)
        channel.activity = landing.activity
        try:
            return await self._exchange(channel, peer, method, header, payload, max_reply_payload, landing, on_header)
        finally:
            channel.close()

    async def _call_unary(self, peer, method, header, payload):
        stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        request = BytesValue(value=pack(UnaryCall(method=method, header=header, payload=bytes(payload))))
        try:
            response = await self._unary_call(stub.rpc_call(request))
        except Exception as e:
            raise CallFailed(f"{method} to {peer[-8:]} failed over libp2p: {e!r}") from None
        self.stats.unary_calls += 1
        self.stats.bytes_sent += len(request.value)
        self.stats.bytes_received += len(response.value)
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

    async def _open_direct(self, peer: str) -> Optional[Channel]:
        stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        try:
            response = await self._unary_call(stub.rpc_ticket(BytesValue(value=pack(TicketRequest()))))
        except Exception as e:
            raise CallFailed(f"ticket request to {peer[-8:]} failed: {e!r}") from None
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
            self.stats.direct_calls += 1
            return Channel(pipe, self.stats, ticket.key, initiator=True, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)
        self._direct_unreachable_until[peer] = time.monotonic() + 300.0
        logger.info(f"peer {peer[-8:]} is not reachable directly; using libp2p streams for 5 min")
        return None

    async def _open_stream(self, peer: str) -> Channel:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._stream_proto)
        except Exception as e:
            raise CallFailed(f"libp2p stream to {peer[-8:]} failed: {e!r}") from None
        self.stats.stream_calls += 1
        return Channel(StreamPipe(reader, writer), self.stats, None, initiator=True, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)

    async def _exchange(self, channel: Channel, peer, method, header, payload, max_reply_payload, landing: Landing, on_header):
        head = pack(CallHeader(method=method, header=header, payload_len=len(payload)))
        await channel.send_message(head, payload)
        reply = unpack(await channel.recv_small(MAX_MESSAGE_BYTES), ReplyHeader, peer=peer)
        _raise_for_status(reply.status, reply.reason, method, peer)
        if not 0 <= reply.payload_len <= max_reply_payload:
            raise PeerProtocolError(f"{method} reply of {reply.payload_len} bytes exceeds {max_reply_payload}", peer=peer)
        if on_header is not None:
            on_header(reply.header)
        return reply.header, await channel.recv_payload(reply.payload_len, landing.into, landing.hasher)

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
        try:
            call = unpack(request.value, UnaryCall, peer=peer)
            status, reason, header, payload = await self._dispatch(peer, call.method, call.header, call.payload)
        except PeerProtocolError as e:
            status, reason, header, payload = Status.REJECTED, str(e), b"", b""
        reply = UnaryReply(status=int(status), reason=reason, header=header, payload=bytes(payload))
        return BytesValue(value=pack(reply))

    def _spawn_connection(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _accept_direct(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as e:
                logger.warning(f"direct listener failed: {e!r}")
                await asyncio.sleep(1.0)
                continue
            self._spawn_connection(self._serve_direct(SocketPipe(sock)))

    async def _serve_direct(self, pipe: SocketPipe) -> None:
        channel = None
        try:
            hello = bytearray(len(HELLO_MAGIC) + 16)
            async with asyncio.timeout(self.idle_timeout_s):
                await pipe.readinto(memoryview(hello))
            ticket = self._tickets.pop(bytes(hello[len(HELLO_MAGIC) :]), None) if hello.startswith(HELLO_MAGIC) else None
            if ticket is None or ticket.expires_at < time.monotonic():
                logger.debug("direct connection with an unknown or expired ticket refused")
                return
            channel = Channel(pipe, self.stats, ticket.key, initiator=False, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)
            await self._serve_channel(ticket.peer, channel)
        except (CallFailed, TimeoutError, OSError):
            pass
        finally:
            (channel or pipe).close()

    async def _serve_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            channel = Channel(StreamPipe(reader, writer), self.stats, None, initiator=False, idle_timeout_s=self.idle_timeout_s, limiter=self.limiter)
            await self._serve_channel(stream_info.peer_id.to_base58(), channel)
        finally:
            writer.close()
            self._connections.discard(task)

    async def _serve_channel(self, peer: str, channel: Channel) -> None:
        try:
            call = unpack(await channel.recv_small(MAX_MESSAGE_BYTES), CallHeader, peer=peer)
            status, reason, header, payload = await self._dispatch(peer, call.method, call.header, call.payload_len, channel)
        except ChannelAuthError as e:
            logger.info(f"dropped a direct connection claiming to be {peer[-8:]}: {e}")
            return
        except PeerProtocolError as e:
            logger.debug(f"rejected a call from {peer[-8:]}: {e}")
            status, reason, header, payload = Status.REJECTED, str(e), b"", b""
        except CallFailed as e:
            logger.debug(f"call from {peer[-8:]} broke off: {e}")
            return
        head = pack(ReplyHeader(status=int(status), reason=reason, header=header, payload_len=len(payload)))
        try:
            await channel.send_message(head, payload)
        except CallFailed as e:
            logger.debug(f"reply to {peer[-8:]} failed: {e!r}")

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


def _raise_for_status(status: int, reason: str, method: str, peer: Optional[str]) -> None:
    if status == Status.OK:
        return
    try:
        code = Status(status)
    except ValueError:
        raise PeerProtocolError(f"unknown status {status} in reply to {method}", peer=peer) from None
    raise CallFailed(f"{method} {code.name}: {reason[:200]}", code)

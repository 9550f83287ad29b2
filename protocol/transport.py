"""Calls between peers: small ones over libp2p, bulk tensor bytes over a direct TCP connection.

A call is `(method, header, payload) -> (header, payload)`. Small calls ride a libp2p
unary RPC. Large ones take the direct path: the caller asks the callee over libp2p
(authenticated and encrypted) for a one-time ticket, a connection id and a fresh
256-bit key; it then opens TCP to the callee's announced address, presents the id, and
seals every record after that with ChaCha20-Poly1305 under that key. So the callee knows
which libp2p peer holds the socket, and nobody on the path can read, alter, reorder or
replay its bytes: the fast path is no weaker than libp2p. When TCP cannot connect, the
same records flow over a libp2p stream (already encrypted) instead.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase

from aggregation.errors import PeerProtocolError, RoundAbortedError
from protocol.wire import MAX_MESSAGE_BYTES, Address, WireModel, pack, unpack

logger = logging.getLogger(__name__)

RECORD_BYTES = 1 << 20  # plaintext per sealed record; bounds memory per read and keeps the loop responsive
SMALL_CALL_BYTES = 256 << 10  # requests and replies up to this size ride libp2p unary RPCs
TICKET_TTL_S = 30.0
MAX_TICKETS_PER_PEER = 64
HELLO_MAGIC = b"PHX1"
_TAG = 16


class Status(enum.IntEnum):
    """Reply codes of a call; a handler never crashes the server, it answers one of these."""

    OK = 0
    UNKNOWN_METHOD = 1  # the callee serves no such method
    REJECTED = 2  # the request broke the protocol (bad header, size, round, membership)
    ABORTED = 3  # the callee gave up on the round this call belongs to
    INTERNAL = 4  # the callee failed for a reason of its own


class CallFailed(RoundAbortedError):
    """A call did not produce a reply; `status` says why (None: transport failure)."""

    def __init__(self, message: str, status: Optional[Status] = None) -> None:
        super().__init__(message)
        self.status = status


class ChannelAuthError(PeerProtocolError):
    """A sealed record failed authentication: the socket is not the peer's; drop it without a reply."""


Handler = Callable[[str, bytes, bytearray], Awaitable[tuple[bytes, bytes | memoryview]]]


@dataclass
class _Method:
    handler: Handler
    max_payload: int


@dataclass
class TransportStats:
    """Counters for the health server and the benchmark; bytes are payload + framing."""

    bytes_sent: int = 0
    bytes_received: int = 0
    direct_calls: int = 0
    stream_calls: int = 0
    unary_calls: int = 0
    failed_calls: int = 0


class _CallHeader(WireModel):
    method: str  # registered method name
    header: bytes  # the method's own msgpack header
    payload_len: int  # bytes of payload records that follow


class _ReplyHeader(WireModel):
    status: int  # a Status code
    reason: str  # one line for logs when status != OK
    header: bytes
    payload_len: int


class _UnaryCall(WireModel):
    method: str
    header: bytes
    payload: bytes


class _UnaryReply(WireModel):
    status: int
    reason: str
    header: bytes
    payload: bytes


class _TicketRequest(WireModel):
    pass


class _Ticket(WireModel):
    conn_id: bytes  # 16 random bytes, presented on the TCP socket, usable once
    key: bytes  # 32-byte ChaCha20-Poly1305 key for this connection only
    addresses: list[Address]  # host:port pairs the callee listens on


@dataclass
class _IssuedTicket:
    peer: str
    key: bytes
    expires_at: float


class _Channel:
    """Length-prefixed records on a byte stream, sealed with AEAD when a key is set."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stats: TransportStats,
        key: Optional[bytes] = None,
        *,
        initiator: bool,
        idle_timeout_s: float,
    ) -> None:
        self.reader, self.writer, self.stats = reader, writer, stats
        self.cipher = ChaCha20Poly1305(key) if key is not None else None
        # Distinct nonce spaces per direction, so the two sides never reuse a (key, nonce) pair.
        self._send_dir, self._recv_dir = (b"\x00", b"\x01") if initiator else (b"\x01", b"\x00")
        self._send_ctr = self._recv_ctr = 0
        self.idle_timeout_s = idle_timeout_s

    def _nonce(self, direction: bytes, counter: int) -> bytes:
        return direction + b"\x00\x00\x00" + counter.to_bytes(8, "little")

    async def send(self, data: bytes | memoryview) -> None:
        if self.cipher is not None:
            data = self.cipher.encrypt(self._nonce(self._send_dir, self._send_ctr), data, None)
            self._send_ctr += 1
        self.writer.write(len(data).to_bytes(4, "little"))
        self.writer.write(data)
        self.stats.bytes_sent += 4 + len(data)
        await self.writer.drain()

    async def recv(self, max_len: int) -> bytes:
        limit = max_len + (_TAG if self.cipher is not None else 0)
        size = int.from_bytes(await self._read(4), "little")
        if size > limit:
            raise PeerProtocolError(f"record of {size} bytes exceeds the limit of {limit}")
        data = await self._read(size)
        self.stats.bytes_received += 4 + size
        if self.cipher is not None:
            try:
                data = self.cipher.decrypt(self._nonce(self._recv_dir, self._recv_ctr), data, None)
            except InvalidTag:
                raise ChannelAuthError("record failed authentication (altered, replayed or wrong key)") from None
            self._recv_ctr += 1
        return data

    async def _read(self, n: int) -> bytes:
        try:
            return await asyncio.wait_for(self.reader.readexactly(n), self.idle_timeout_s)
        except asyncio.IncompleteReadError:
            raise CallFailed("connection closed mid-message") from None
        except asyncio.TimeoutError:
            raise CallFailed(f"no bytes for {self.idle_timeout_s:.0f} s") from None

    async def send_message(self, head: bytes, payload: bytes | memoryview) -> None:
        await self.send(head)
        view = memoryview(payload).cast("B")
        for start in range(0, len(view), RECORD_BYTES):
            await self.send(view[start : start + RECORD_BYTES])

    async def recv_payload(self, length: int) -> bytearray:
        out = bytearray(length)
        pos = 0
        while pos < length:
            chunk = await self.recv(min(RECORD_BYTES, length - pos))
            if not chunk:
                raise PeerProtocolError("empty payload record")
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        return out

    def close(self) -> None:
        self.writer.close()


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
    ) -> None:
        self.p2p, self.namespace = p2p, namespace
        self.peer_id: str = p2p.peer_id.to_base58()
        self._direct_host, self._direct_port = direct_host, direct_port
        self._announce_hosts = announce_hosts or ([direct_host] if direct_host not in (None, "0.0.0.0", "") else ["127.0.0.1"])
        self.idle_timeout_s, self.connect_timeout_s = idle_timeout_s, connect_timeout_s
        self._methods: dict[str, _Method] = {}
        self._tickets: dict[bytes, _IssuedTicket] = {}
        self._server: Optional[asyncio.base_events.Server] = None
        self._addresses: list[str] = []
        self._direct_unreachable_until: dict[str, float] = {}
        self._connections: set[asyncio.Task] = set()
        self.stats = TransportStats()
        self.prefer_direct = True  # benchmarks turn this off to measure the libp2p path alone
        self._stream_proto = f"{namespace}.stream"

    @classmethod
    async def open(cls, p2p: P2P, **kwargs) -> "Transport":
        self = cls(p2p, **kwargs)
        if self._direct_host is not None:
            self._server = await asyncio.start_server(
                self._serve_direct, self._direct_host, self._direct_port, limit=RECORD_BYTES
            )
            port = self._server.sockets[0].getsockname()[1]
            self._addresses = [f"{host}:{port}" for host in self._announce_hosts]
        await self.add_p2p_handlers(p2p, namespace=self.namespace)
        await p2p.add_binary_stream_handler(self._stream_proto, self._serve_stream)
        return self

    @property
    def direct_addresses(self) -> list[str]:
        return list(self._addresses)

    def register(self, method: str, handler: Handler, *, max_payload: int) -> None:
        """Serve `method`; requests with more than `max_payload` bytes are refused before they are read."""
        if method in self._methods:
            raise ValueError(f"method {method!r} is already registered")
        self._methods[method] = _Method(handler, max_payload)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        try:
            await self.remove_p2p_handlers(self.p2p, namespace=self.namespace)
            await self.p2p.remove_binary_stream_handler(self._stream_proto)
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug(f"removing p2p handlers failed: {e!r}")
        if self._server is not None:
            await self._server.wait_closed()

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
    ) -> tuple[bytes, bytearray]:
        """Call `method` on `peer`; returns the reply's header and payload or raises CallFailed."""
        try:
            return await asyncio.wait_for(
                self._call(peer, method, header, payload, max_reply_payload, expect_large_reply), timeout_s
            )
        except asyncio.TimeoutError:
            self.stats.failed_calls += 1
            raise CallFailed(f"{method} to {peer[-8:]} timed out after {timeout_s:.1f} s") from None
        except CallFailed:
            self.stats.failed_calls += 1
            raise

    async def _call(self, peer, method, header, payload, max_reply_payload, expect_large_reply):
        small = len(payload) <= SMALL_CALL_BYTES and not expect_large_reply and max_reply_payload <= SMALL_CALL_BYTES
        if small:
            return await self._call_unary(peer, method, header, payload)
        channel = None
        if self.prefer_direct and self._direct_unreachable_until.get(peer, 0.0) < time.monotonic():
            channel = await self._open_direct(peer)
        if channel is None:
            channel = await self._open_stream(peer)
        try:
            return await self._exchange(channel, method, header, payload, max_reply_payload)
        finally:
            channel.close()

    async def _call_unary(self, peer, method, header, payload):
        stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        request = BytesValue(value=pack(_UnaryCall(method=method, header=header, payload=bytes(payload))))
        try:
            response = await stub.rpc_call(request)
        except Exception as e:
            raise CallFailed(f"{method} to {peer[-8:]} failed over libp2p: {e!r}") from None
        self.stats.unary_calls += 1
        self.stats.bytes_sent += len(request.value)
        self.stats.bytes_received += len(response.value)
        reply = unpack(response.value, _UnaryReply, peer=peer)
        _raise_for_status(reply.status, reply.reason, method, peer)
        return reply.header, bytearray(reply.payload)

    async def _open_direct(self, peer: str) -> Optional[_Channel]:
        stub = self.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        try:
            response = await stub.rpc_ticket(BytesValue(value=pack(_TicketRequest())))
        except Exception as e:
            raise CallFailed(f"ticket request to {peer[-8:]} failed: {e!r}") from None
        ticket = unpack(response.value, _Ticket, peer=peer)
        if len(ticket.conn_id) != 16 or len(ticket.key) != 32:
            raise PeerProtocolError("ticket with malformed id or key", peer=peer)
        for address in ticket.addresses[:4]:
            host, _, port = address.rpartition(":")
            if not port.isdigit():
                continue
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port), limit=RECORD_BYTES), self.connect_timeout_s
                )
            except (OSError, asyncio.TimeoutError) as e:
                logger.debug(f"direct connection to {peer[-8:]} at {address} failed: {e!r}")
                continue
            writer.write(HELLO_MAGIC + ticket.conn_id)
            self.stats.direct_calls += 1
            return _Channel(reader, writer, self.stats, ticket.key, initiator=True, idle_timeout_s=self.idle_timeout_s)
        self._direct_unreachable_until[peer] = time.monotonic() + 300.0
        logger.info(f"peer {peer[-8:]} is not reachable directly; using libp2p streams for 5 min")
        return None

    async def _open_stream(self, peer: str) -> _Channel:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._stream_proto)
        except Exception as e:
            raise CallFailed(f"libp2p stream to {peer[-8:]} failed: {e!r}") from None
        self.stats.stream_calls += 1
        return _Channel(reader, writer, self.stats, None, initiator=True, idle_timeout_s=self.idle_timeout_s)

    async def _exchange(self, channel: _Channel, method, header, payload, max_reply_payload):
        head = pack(_CallHeader(method=method, header=header, payload_len=len(payload)))
        await channel.send_message(head, payload)
        reply = unpack(await channel.recv(MAX_MESSAGE_BYTES), _ReplyHeader)
        _raise_for_status(reply.status, reply.reason, method, None)
        if not 0 <= reply.payload_len <= max_reply_payload:
            raise PeerProtocolError(f"{method} reply of {reply.payload_len} bytes exceeds {max_reply_payload}")
        return reply.header, await channel.recv_payload(reply.payload_len)

    # ---- serving ----------------------------------------------------------------------------

    async def rpc_ticket(self, request: BytesValue, context: P2PContext) -> BytesValue:
        peer = context.remote_id.to_base58()
        unpack(request.value, _TicketRequest, peer=peer)
        if not self._addresses:
            return BytesValue(value=pack(_Ticket(conn_id=b"\0" * 16, key=b"\0" * 32, addresses=[])))
        now = time.monotonic()
        for conn_id in [c for c, t in self._tickets.items() if t.expires_at < now]:
            del self._tickets[conn_id]
        if sum(t.peer == peer for t in self._tickets.values()) >= MAX_TICKETS_PER_PEER:
            raise PeerProtocolError("too many open direct-connection tickets", peer=peer)
        conn_id, key = secrets.token_bytes(16), ChaCha20Poly1305.generate_key()
        self._tickets[conn_id] = _IssuedTicket(peer, key, now + TICKET_TTL_S)
        return BytesValue(value=pack(_Ticket(conn_id=conn_id, key=key, addresses=self._addresses)))

    async def rpc_call(self, request: BytesValue, context: P2PContext) -> BytesValue:
        peer = context.remote_id.to_base58()
        try:
            call = unpack(request.value, _UnaryCall, peer=peer)
            status, reason, header, payload = await self._dispatch(peer, call.method, call.header, len(call.payload), bytearray(call.payload))
        except PeerProtocolError as e:
            status, reason, header, payload = Status.REJECTED, str(e), b"", b""
        return BytesValue(value=pack(_UnaryReply(status=int(status), reason=reason, header=header, payload=bytes(payload))))

    async def _serve_direct(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            hello = await asyncio.wait_for(reader.readexactly(len(HELLO_MAGIC) + 16), self.idle_timeout_s)
            ticket = self._tickets.pop(hello[len(HELLO_MAGIC) :], None) if hello.startswith(HELLO_MAGIC) else None
            if ticket is None or ticket.expires_at < time.monotonic():
                logger.debug("direct connection with an unknown or expired ticket refused")
                return
            channel = _Channel(reader, writer, self.stats, ticket.key, initiator=False, idle_timeout_s=self.idle_timeout_s)
            await self._serve_channel(ticket.peer, channel)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            self._connections.discard(task)

    async def _serve_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            channel = _Channel(reader, writer, self.stats, None, initiator=False, idle_timeout_s=self.idle_timeout_s)
            await self._serve_channel(stream_info.peer_id.to_base58(), channel)
        finally:
            writer.close()
            self._connections.discard(task)

    async def _serve_channel(self, peer: str, channel: _Channel) -> None:
        try:
            call = unpack(await channel.recv(MAX_MESSAGE_BYTES), _CallHeader, peer=peer)
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
        head = pack(_ReplyHeader(status=int(status), reason=reason, header=header, payload_len=len(payload)))
        try:
            await channel.send_message(head, payload)
        except (ConnectionError, CallFailed) as e:
            logger.debug(f"reply to {peer[-8:]} failed: {e!r}")

    async def _dispatch(self, peer: str, method: str, header: bytes, payload_len: int, source):
        """Run the handler; `source` is the payload itself (unary) or the channel to read it from."""
        entry = self._methods.get(method)
        if entry is None:
            return Status.UNKNOWN_METHOD, f"unknown method {method[:40]!r}", b"", b""
        if not 0 <= payload_len <= entry.max_payload:
            raise PeerProtocolError(f"{method} payload of {payload_len} bytes exceeds {entry.max_payload}", peer=peer)
        payload = source if isinstance(source, bytearray) else await source.recv_payload(payload_len)
        try:
            reply_header, reply_payload = await entry.handler(peer, header, payload)
        except PeerProtocolError:
            raise
        except RoundAbortedError as e:
            return Status.ABORTED, str(e), b"", b""
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception(f"handler {method} failed on a call from {peer[-8:]}")
            return Status.INTERNAL, f"{type(e).__name__}", b"", b""
        return Status.OK, "", reply_header, reply_payload


def _raise_for_status(status: int, reason: str, method: str, peer: Optional[str]) -> None:
    if status == Status.OK:
        return
    try:
        code = Status(status)
    except ValueError:
        raise PeerProtocolError(f"unknown status {status} in reply to {method}", peer=peer) from None
    raise CallFailed(f"{method} {code.name}: {reason[:200]}", code)

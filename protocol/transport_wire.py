"""What the transport's calls look like: reply codes, the call and reply headers on a channel, the
unary messages for small calls, the one-time tickets for direct connections, and where a payload lands.
The transport (transport.py) speaks these; they hold no connection state."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple, Optional

from phalanx.protocol.channel import Activity, ChannelStats, Hasher
from phalanx.security.wire import Address, WireModel


class Status(enum.IntEnum):
    """Reply codes of a call; a handler never crashes the server, it answers one of these."""

    OK = 0
    UNKNOWN_METHOD = 1  # the callee serves no such method
    REJECTED = 2  # the request broke the protocol (bad header, size, round, membership)
    ABORTED = 3  # the callee gave up on the round this call belongs to
    INTERNAL = 4  # the callee failed for a reason of its own


Handler = Callable[[str, bytes, bytearray | memoryview], Awaitable[tuple[bytes, bytes | memoryview]]]


class Landing(NamedTuple):
    """Where a payload lands (None: a fresh buffer), what hashes it on the way in, and what watches its
    bytes arrive (told when the connection breaks before the payload is complete)."""

    into: Optional[memoryview] = None
    hasher: Optional[Hasher] = None
    activity: Optional[Activity] = None


# (peer, header, payload length) -> its Landing; raising PeerProtocolError refuses the call before a byte
# of payload is read
Sink = Callable[[str, bytes, int], Awaitable[Landing]]


@dataclass
class TransportStats(ChannelStats):
    """Counters for the health server and the benchmark; bytes are payload + framing."""

    direct_calls: int = 0  # calls carried by a direct connection, new or kept from an earlier call
    reused_calls: int = 0  # of those, calls on a kept one
    stream_calls: int = 0
    unary_calls: int = 0
    failed_calls: int = 0
    direct_refused: int = 0  # direct connections closed as soon as accepted or authenticated: a cap was reached
    direct_dropped: int = 0  # direct connections closed for no hello in time, or a ticket unknown or expired
    relayed_bytes: int = 0  # of the bytes sent and received, those to and from peers reached through a relay


class RelayedStats(ChannelStats):
    """A channel's counters for a peer reached through a relay: every byte also counts in `totals`,
    and there as relayed."""

    def __init__(self, totals: TransportStats) -> None:
        self._totals = totals
        self._sent = self._received = 0

    @property
    def bytes_sent(self) -> int:
        return self._sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        self._totals.bytes_sent += value - self._sent
        self._totals.relayed_bytes += value - self._sent
        self._sent = value

    @property
    def bytes_received(self) -> int:
        return self._received

    @bytes_received.setter
    def bytes_received(self, value: int) -> None:
        self._totals.bytes_received += value - self._received
        self._totals.relayed_bytes += value - self._received
        self._received = value


class CallHeader(WireModel):
    method: str  # registered method name
    header: bytes  # the method's own msgpack header
    payload_len: int  # bytes of payload records that follow


class ReplyHeader(WireModel):
    status: int  # a Status code
    reason: str  # one line for logs when status != OK
    header: bytes
    payload_len: int
    keep_open: bool  # the callee serves another call on this direct connection (see transport.py)


class UnaryCall(WireModel):
    method: str
    header: bytes
    payload: bytes


class UnaryReply(WireModel):
    status: int
    reason: str
    header: bytes
    payload: bytes


class TicketRequest(WireModel):
    pass


class Ticket(WireModel):
    conn_id: bytes  # 16 random bytes, presented on the TCP socket, usable once
    key: bytes  # 32-byte AES-256-GCM key for this connection only
    addresses: list[Address]  # host:port pairs the callee listens on

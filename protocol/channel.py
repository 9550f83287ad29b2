"""Length-prefixed records over a byte pipe, sealed with AES-256-GCM on the direct path.

Two pipes: a raw non-blocking TCP socket driven by the loop's `sock_*` calls (bytes
land straight in the caller's buffer, then decrypt into their final place: one copy
from the kernel to the destination tensor), and hivemind's libp2p stream
(StreamReader/StreamWriter; libp2p already encrypts it, so its records are not sealed).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from phalanx.errors import PeerProtocolError, RoundAbortedError

RECORD_BYTES = 1 << 20  # plaintext per record; bounds memory per read and keeps the loop responsive
SEND_SLICE_BYTES = 128 << 10  # a watched send reports progress this often (1 s at 1 Mbit/s, not 8 s a record)
TAG_BYTES = 16


class CallFailed(RoundAbortedError):
    """A call did not produce a reply; `status` says why (None: the connection failed). `not_serving`: the
    peer is up but does not serve the method or this swarm's protocol (yet: a peer still starting)."""

    def __init__(self, message: str, status=None, *, not_serving: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.not_serving = not_serving


class ChannelAuthError(PeerProtocolError):
    """A sealed record failed authentication: the socket is not the peer's; drop it without a reply."""


@dataclass
class ChannelStats:
    """Bytes on the wire (payload + framing + tags), for the health server and benchmarks."""

    bytes_sent: int = 0
    bytes_received: int = 0


class UploadLimiter:
    """Paces every bulk send of one peer to `bytes_per_s` (a volunteer's uplink is shared with its owner).

    Each send takes its size from a token bucket that refills at the rate and holds a short burst;
    a send that drives the bucket negative waits until the debt is repaid, so concurrent senders
    share the rate between them.
    """

    def __init__(self, bytes_per_s: float, burst_s: float = 0.02) -> None:
        if not bytes_per_s > 0:
            raise ValueError("upload limit must be positive")
        self.rate = float(bytes_per_s)
        self.burst = max(self.rate * burst_s, float(RECORD_BYTES))
        self.tokens = self.burst
        self.updated = time.monotonic()

    async def acquire(self, size: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate) - size
        self.updated = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class Activity:
    """When bytes last moved on one call, and a callback for when its connection broke: a round drops a
    member that stopped sending (dead, frozen, cut off) this way, without waiting out the phase deadline."""

    def __init__(self, on_broken: Optional[Callable[[], None]] = None) -> None:
        self.at = time.monotonic()
        self.on_broken = on_broken
        self.pacing = 0  # sends held back by our own upload limiter: not the other side's stall
        self.longest = 0.0  # the longest stretch without movement so far (what a reducer learns patience from)

    def moved(self) -> None:
        now = time.monotonic()
        self.longest = max(self.longest, now - self.at)
        self.at = now

    def idle_s(self, since: float = 0.0) -> float:
        """Seconds without movement, counting from `since` at the earliest (0 while we pace ourselves)."""
        if self.pacing:
            return 0.0
        return time.monotonic() - max(self.at, since)

    def broke(self) -> None:
        if self.on_broken is not None:
            self.on_broken()


class Hasher(Protocol):
    """An incremental hash (blake3, hashlib): fed each record while it is still in cache."""

    def update(self, data: memoryview, /) -> object: ...


Moved = Optional[Callable[[], None]]  # told whenever some bytes of a read or send went through


class Pipe(Protocol):
    async def readinto(self, view: memoryview, moved: Moved = None) -> None: ...  # fill `view` exactly or raise CallFailed
    async def send(self, data: bytes | memoryview, moved: Moved = None) -> None: ...
    def close(self) -> None: ...


class SocketPipe:
    """A connected TCP socket; reads go directly into the caller's buffer."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, host: str, port: int) -> "SocketPipe":
        info = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = info[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def readinto(self, view: memoryview, moved: Moved = None) -> None:
        while view:
            n = await self.loop.sock_recv_into(self.sock, view)
            if n == 0:
                raise CallFailed("connection closed mid-message")
            view = view[n:]
            if moved is not None:
                moved()

    async def send(self, data: bytes | memoryview, moved: Moved = None) -> None:
        if moved is None:
            await self.loop.sock_sendall(self.sock, data)
            return
        data = memoryview(data).cast("B")
        for start in range(0, len(data), SEND_SLICE_BYTES):
            await self.loop.sock_sendall(self.sock, data[start : start + SEND_SLICE_BYTES])
            moved()

    def idle_and_open(self) -> bool:
        """Whether a connection kept between calls is still good: no bytes waiting (nothing is owed to us
        between calls) and no close or reset from the other side."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # its end of file, or stray bytes

    def close(self) -> None:
        self.sock.close()


class StreamPipe:
    """hivemind's libp2p stream (through the p2pd daemon)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def readinto(self, view: memoryview, moved: Moved = None) -> None:
        if moved is None:
            try:
                view[:] = await self.reader.readexactly(len(view))
            except asyncio.IncompleteReadError:
                raise CallFailed("connection closed mid-message") from None
            return
        while view:
            chunk = await self.reader.read(len(view))
            if not chunk:
                raise CallFailed("connection closed mid-message")
            view[: len(chunk)] = chunk
            view = view[len(chunk) :]
            moved()

    async def send(self, data: bytes | memoryview, moved: Moved = None) -> None:
        if moved is None:
            self.writer.write(data)
            await self.writer.drain()
            return
        data = memoryview(data).cast("B")
        for start in range(0, len(data), SEND_SLICE_BYTES):
            self.writer.write(data[start : start + SEND_SLICE_BYTES])
            await self.writer.drain()
            moved()

    def close(self) -> None:
        self.writer.close()


class _RecordBuffers:
    """Reused record buffers: fresh 1 MiB buffers cost page faults on every connection."""

    def __init__(self, keep: int = 32) -> None:
        self.keep = keep
        self._free: list[bytearray] = []

    def take(self) -> bytearray:
        return self._free.pop() if self._free else bytearray(4 + RECORD_BYTES + TAG_BYTES)

    def give(self, buf: bytearray) -> None:
        if len(self._free) < self.keep:
            self._free.append(buf)


_buffers = _RecordBuffers()


class Channel:
    """Records on a pipe. Every read has an idle timeout, so a peer that stops sending cannot hold us."""

    def __init__(
        self,
        pipe: Pipe,
        stats: ChannelStats,
        key: Optional[bytes],
        *,
        initiator: bool,
        idle_timeout_s: float,
        limiter: Optional[UploadLimiter] = None,
    ) -> None:
        self.pipe, self.stats, self.idle_timeout_s, self.limiter = pipe, stats, idle_timeout_s, limiter
        self.cipher = AESGCM(key) if key is not None else None
        # Distinct nonce spaces per direction, so the two sides never reuse a (key, nonce) pair.
        self._send_dir, self._recv_dir = (b"\x00", b"\x01") if initiator else (b"\x01", b"\x00")
        self._send_ctr = self._recv_ctr = 0
        self._out: Optional[bytearray] = None  # record buffers, taken while a call uses the channel (see park)
        self._in: Optional[bytearray] = None
        self._size = bytearray(4)
        self.activity: Optional[Activity] = None  # the call using this channel, told of every record that moves

    @staticmethod
    def _nonce(direction: bytes, counter: int) -> bytes:
        return direction + b"\x00\x00\x00" + counter.to_bytes(8, "little")

    async def _read(self, view: memoryview, patient: bool = False) -> None:
        activity = self.activity
        try:
            async with asyncio.timeout(None if patient else self.idle_timeout_s):
                await self.pipe.readinto(view, activity.moved if activity is not None else None)
        except TimeoutError:
            raise CallFailed(f"no bytes for {self.idle_timeout_s:.0f} s") from None
        except (ConnectionError, OSError) as e:
            raise CallFailed(f"connection failed: {e!r}") from None

    async def _send(self, data: bytes | memoryview) -> None:
        activity = self.activity
        if self.limiter is not None:
            if activity is not None:
                activity.pacing += 1
            try:
                await self.limiter.acquire(len(data))
            finally:
                if activity is not None:
                    activity.pacing -= 1
                    activity.moved()
        try:
            await self.pipe.send(data, activity.moved if activity is not None else None)
        except (ConnectionError, OSError) as e:
            raise CallFailed(f"connection failed: {e!r}") from None
        self.stats.bytes_sent += len(data)

    async def send_record(self, data: bytes | memoryview) -> None:
        size = len(data)
        if size > RECORD_BYTES:
            raise ValueError("record too large")
        if self.cipher is None:
            await self._send(size.to_bytes(4, "little"))
            await self._send(data)
            return
        if self._out is None:
            self._out = _buffers.take()
        out = memoryview(self._out)
        sealed = size + TAG_BYTES
        out[:4] = sealed.to_bytes(4, "little")
        self.cipher.encrypt_into(self._nonce(self._send_dir, self._send_ctr), data, None, out[4 : 4 + sealed])
        self._send_ctr += 1
        await self._send(out[: 4 + sealed])

    async def _record_size(self, max_plain: int, patient: bool = False) -> int:
        await self._read(memoryview(self._size), patient)
        size = int.from_bytes(self._size, "little")
        overhead = TAG_BYTES if self.cipher is not None else 0
        if not overhead < size <= max_plain + overhead:
            raise PeerProtocolError(f"record of {size} bytes where at most {max_plain + overhead} fit")
        self.stats.bytes_received += 4 + size
        return size

    async def _record_body(self, size: int, dest: memoryview) -> int:
        if self.cipher is None:
            await self._read(dest[:size])
            return size
        if self._in is None:
            self._in = _buffers.take()
        sealed = memoryview(self._in)[:size]
        await self._read(sealed)
        try:
            self.cipher.decrypt_into(self._nonce(self._recv_dir, self._recv_ctr), sealed, None, dest[: size - TAG_BYTES])
        except InvalidTag:
            raise ChannelAuthError("record failed authentication (altered, replayed or wrong key)") from None
        self._recv_ctr += 1
        return size - TAG_BYTES

    async def recv_record_into(self, dest: memoryview) -> int:
        """Read one record into the front of `dest` (at most len(dest) bytes of plaintext); returns its length."""
        return await self._record_body(await self._record_size(len(dest)), dest)

    async def recv_small(self, max_len: int, *, patient: bool = False) -> bytes:
        """One record of at most `max_len` bytes. `patient`: its first byte may take longer than the idle
        timeout (a reply whose handler waits, bounded by the call's own timeout)."""
        size = await self._record_size(min(max_len, RECORD_BYTES), patient)
        buf = bytearray(size - (TAG_BYTES if self.cipher is not None else 0))
        await self._record_body(size, memoryview(buf))
        return bytes(buf)

    async def send_message(self, head: bytes, payload: bytes | memoryview) -> None:
        await self.send_record(head)
        view = memoryview(payload).cast("B")
        for start in range(0, len(view), RECORD_BYTES):
            await self.send_record(view[start : start + RECORD_BYTES])

    async def recv_payload(
        self, length: int, into: Optional[memoryview] = None, hasher: Optional[Hasher] = None
    ) -> bytearray | memoryview:
        """`length` payload bytes, written into `into` when given (it must be exactly that long).
        `hasher` sees every record right after it is decrypted, instead of a second pass over memory later.
        Without `into`, `length` bytes are allocated before the first record arrives: callers hold a length
        the peer declared to what was agreed first (a method's max_payload and sink, a call's max_reply_payload)."""
        out = memoryview(bytearray(length)) if into is None else into
        if len(out) != length:
            raise PeerProtocolError(f"payload of {length} bytes where {len(out)} were agreed")
        pos = 0
        while pos < length:
            n = await self.recv_record_into(out[pos : min(length, pos + RECORD_BYTES)])
            if hasher is not None:
                hasher.update(out[pos : pos + n])
            pos += n
        return out.obj if into is None else out

    def park(self) -> None:
        """Between calls on a kept connection: its record buffers go back for other calls to use."""
        for buf in (self._out, self._in):
            if buf is not None:
                _buffers.give(buf)
        self._out = self._in = None

    def close(self) -> None:
        self.pipe.close()
        self.park()

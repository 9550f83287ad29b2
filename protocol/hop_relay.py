"""The relay of peers nobody can dial: libp2p's circuit relay v2 (`/libp2p/circuit/relay/0.2.0/hop`),
served by us over p2pd's stream API.

hivemind 1.1.12's p2pd starts its own relay twice, once with the limits it is given and once with
libp2p's defaults (128 KiB each way and 2 minutes per relayed connection), and whichever registers last
serves every circuit: a start-up race that the defaults won in 2 of 5 starts on loopback and 6 of 6 in the
fault lab. Through those defaults every relayed connection closes after 128 KiB and resets every call on it. Registering
this handler after p2pd is up replaces both, so a relay's limits are the ones its flags say, its relayed
bytes are counted, and homes' p2pd clients (go-libp2p's, unchanged) reserve and connect as with any relay.

The wire (libp2p's circuit-v2 spec): varint-delimited protobuf messages. A home sends RESERVE and gets a
reservation; a caller sends CONNECT naming a home with a reservation; the relay opens a STOP stream to
the home, and once the home says OK, bytes flow between the two streams until either closes, the
connection's data budget is spent, or its time runs out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

logger = logging.getLogger(__name__)

HOP = "/libp2p/circuit/relay/0.2.0/hop"
STOP = "/libp2p/circuit/relay/0.2.0/stop"
MAX_MESSAGE_BYTES = 4096  # as libp2p's relay
RESERVATION_S = 3600  # a home renews its slot before this runs out
HANDSHAKE_S = 10.0  # for a message of the handshake, and for the home to answer a STOP
CHUNK = 64 << 10
MAX_RESERVATIONS = 1024
MAX_RESERVATIONS_PER_IP = 8  # as libp2p's relay: one host cannot take every slot with fresh identities
MAX_CIRCUITS = 1024  # relayed connections open at once, all peers together
# statuses (the spec's numbers)
OK, RESERVATION_REFUSED, RESOURCE_LIMIT_EXCEEDED, CONNECTION_FAILED, NO_RESERVATION = 100, 200, 201, 203, 204
MALFORMED_MESSAGE, UNEXPECTED_MESSAGE = 400, 401
HOP_RESERVE, HOP_CONNECT, HOP_STATUS = 0, 1, 2
STOP_CONNECT, STOP_STATUS = 0, 1


def _messages() -> tuple[type, type]:
    """HopMessage and StopMessage classes, built from the spec's schema (no generated code to ship)."""
    f = descriptor_pb2.FileDescriptorProto(name="phalanx_circuit_v2.proto", package="phalanx.circuit.pb", syntax="proto2")
    opt, rep = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL, descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    T = descriptor_pb2.FieldDescriptorProto

    def message(name, *fields):
        m = f.message_type.add(name=name)
        for number, (fname, ftype, label, type_name) in enumerate(fields, start=1):
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = f".phalanx.circuit.pb.{type_name}"
        return m

    message("Peer", ("id", T.TYPE_BYTES, opt, None), ("addrs", T.TYPE_BYTES, rep, None))
    message("Reservation", ("expire", T.TYPE_UINT64, opt, None), ("addrs", T.TYPE_BYTES, rep, None), ("voucher", T.TYPE_BYTES, opt, None))
    message("Limit", ("duration", T.TYPE_UINT32, opt, None), ("data", T.TYPE_UINT64, opt, None))
    message(
        "HopMessage", ("type", T.TYPE_UINT32, opt, None), ("peer", T.TYPE_MESSAGE, opt, "Peer"),
        ("reservation", T.TYPE_MESSAGE, opt, "Reservation"), ("limit", T.TYPE_MESSAGE, opt, "Limit"), ("status", T.TYPE_UINT32, opt, None),
    )  # fmt: skip
    message(
        "StopMessage", ("type", T.TYPE_UINT32, opt, None), ("peer", T.TYPE_MESSAGE, opt, "Peer"),
        ("limit", T.TYPE_MESSAGE, opt, "Limit"), ("status", T.TYPE_UINT32, opt, None),
    )  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = message_factory.GetMessageClass
    return get(pool.FindMessageTypeByName("phalanx.circuit.pb.HopMessage")), get(pool.FindMessageTypeByName("phalanx.circuit.pb.StopMessage"))


HopMessage, StopMessage = _messages()  # enums are uint32 here: an unknown value parses, and is refused below


async def read_message(reader: asyncio.StreamReader, cls: type):
    """One varint-delimited message of `cls`; ValueError for one too long or malformed."""
    length, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift > 28:
            raise ValueError("varint too long")
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {length} bytes")
    message = cls()
    try:
        message.ParseFromString(await reader.readexactly(length))
    except DecodeError as e:
        raise ValueError(str(e)) from None
    return message


def _host_of(addr) -> str:
    """The IP (or whatever the first component holds) of a stream's remote multiaddr: /ip4/1.2.3.4/tcp/…"""
    parts = str(addr).split("/")
    return parts[2] if len(parts) > 2 else str(addr)


def is_peer_id(raw: bytes) -> bool:
    """Whether `raw` is a libp2p peer ID: a multihash, identity (a key of up to 42 bytes) or sha2-256."""
    if len(raw) >= 2 and raw[0] == 0x00:
        return raw[1] == len(raw) - 2 <= 42
    return len(raw) == 34 and raw[:2] == b"\x12\x20"


def write_message(writer: asyncio.StreamWriter, message) -> None:
    body = message.SerializeToString()
    length, head = len(body), bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        head.append(byte | (0x80 if length else 0))
        if not length:
            break
    writer.write(bytes(head) + body)


@dataclass
class HopRelayStats:
    reservations: int = 0  # homes holding a slot now
    circuits: int = 0  # relayed connections open now
    circuits_total: int = 0
    refused: int = 0  # CONNECTs and RESERVEs refused (no slot, a cap, a malformed message)
    relayed_bytes: int = 0  # both directions, all circuits


@dataclass
class HopRelay:
    """Serves the hop protocol on `p2p` (a replica of this peer's p2pd): start with `start()`, stop with
    `aclose()`. `data_limit`: bytes each way per relayed connection; `time_limit_s`: its lifetime;
    `max_circuits`: relayed connections per peer (either end)."""

    p2p: P2P
    data_limit: int
    time_limit_s: int
    max_circuits: int
    stats: HopRelayStats = field(default_factory=HopRelayStats)
    _reservations: dict[str, tuple[float, str]] = field(default_factory=dict)  # peer -> (expiry, monotonic; its IP)
    _circuits: Counter = field(default_factory=Counter)  # peer -> open circuits it is an end of
    _tasks: set = field(default_factory=set)
    _addresses: list[bytes] = field(default_factory=list)

    async def start(self) -> None:
        me = self.p2p.peer_id.to_base58()
        self._addresses = [
            Multiaddr(f"{m}/p2p/{me}" if "/p2p/" not in str(m) else str(m)).to_bytes()
            for m in await self.p2p.get_visible_maddrs()
            if "p2p-circuit" not in str(m)
        ]
        await self.p2p.add_binary_stream_handler(HOP, self._serve)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.p2p.remove_binary_stream_handler(HOP)
        except Exception as e:  # p2pd already gone
            logger.debug(f"could not remove the relay handler: {e!r}")

    def _limit(self):
        return dict(duration=min(self.time_limit_s, 2**32 - 1), data=self.data_limit)

    async def _serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        source = stream_info.peer_id.to_base58()
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_S):
                    request = await read_message(reader, HopMessage)
            except (ValueError, asyncio.IncompleteReadError, TimeoutError) as e:
                self.stats.refused += 1
                logger.debug(f"relay: a malformed hop message from {source[-8:]}: {e!r}")
                return self._status(writer, MALFORMED_MESSAGE)
            if request.type == HOP_RESERVE:
                return await self._reserve(source, _host_of(stream_info.addr), writer)
            if request.type == HOP_CONNECT:
                return await self._connect(source, request, reader, writer)
            self.stats.refused += 1
            self._status(writer, UNEXPECTED_MESSAGE)
        finally:
            self._tasks.discard(task)
            writer.close()

    def _status(self, writer: asyncio.StreamWriter, status: int, **fields) -> None:
        write_message(writer, HopMessage(type=HOP_STATUS, status=status, **fields))

    async def _reserve(self, source: str, host: str, writer: asyncio.StreamWriter) -> None:
        now = time.monotonic()
        self._reservations = {p: (t, h) for p, (t, h) in self._reservations.items() if t > now}
        if source not in self._reservations and self._full(host):
            # as libp2p's relay, a slot lasts while its peer stays connected: a home that restarted under a
            # new identity (the default) frees the old one
            connected = {info.peer_id.to_base58() for info in await self.p2p.list_peers()}
            self._reservations = {p: v for p, v in self._reservations.items() if p in connected}
        if source not in self._reservations and self._full(host):  # a renewal always goes through
            self.stats.refused += 1
            self.stats.reservations = len(self._reservations)
            return self._status(writer, RESERVATION_REFUSED)
        self._reservations[source] = (now + RESERVATION_S, host)
        self.stats.reservations = len(self._reservations)
        reservation = dict(expire=int(time.time()) + RESERVATION_S, addrs=self._addresses)
        self._status(writer, OK, reservation=reservation, limit=self._limit())

    def _full(self, host: str) -> bool:
        same_host = sum(h == host for _, h in self._reservations.values())
        return len(self._reservations) >= MAX_RESERVATIONS or same_host >= MAX_RESERVATIONS_PER_IP

    async def _connect(self, source: str, request, reader, writer) -> None:
        if not is_peer_id(request.peer.id):
            self.stats.refused += 1
            return self._status(writer, MALFORMED_MESSAGE)
        target = PeerID(request.peer.id).to_base58()
        if self._reservations.get(target, (0.0, ""))[0] < time.monotonic():
            self.stats.refused += 1
            return self._status(writer, NO_RESERVATION)
        if self.stats.circuits >= MAX_CIRCUITS or max(self._circuits[source], self._circuits[target]) >= self.max_circuits:
            self.stats.refused += 1
            return self._status(writer, RESOURCE_LIMIT_EXCEEDED)
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                _, home_reader, home_writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(target), STOP)
        except Exception as e:
            logger.debug(f"relay: no stop stream to {target[-8:]}: {e!r}")
            return self._status(writer, CONNECTION_FAILED)
        try:
            write_message(home_writer, StopMessage(type=STOP_CONNECT, peer=dict(id=PeerID.from_base58(source).to_bytes()), limit=self._limit()))
            try:
                async with asyncio.timeout(HANDSHAKE_S):
                    answer = await read_message(home_reader, StopMessage)
            except (ValueError, asyncio.IncompleteReadError, TimeoutError, OSError) as e:
                logger.debug(f"relay: {target[-8:]} did not answer a stop: {e!r}")
                return self._status(writer, CONNECTION_FAILED)
            if answer.type != STOP_STATUS or answer.status != OK:
                return self._status(writer, CONNECTION_FAILED)
            self._status(writer, OK, limit=self._limit())
            await self._splice(source, target, reader, writer, home_reader, home_writer)
        finally:
            home_writer.close()

    async def _splice(self, source, target, reader, writer, home_reader, home_writer) -> None:
        self._circuits[source] += 1
        self._circuits[target] += 1
        self.stats.circuits += 1
        self.stats.circuits_total += 1
        try:
            async with asyncio.timeout(self.time_limit_s):
                copies = [asyncio.ensure_future(self._copy(reader, home_writer)), asyncio.ensure_future(self._copy(home_reader, writer))]
                try:
                    await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for copy in copies:
                        copy.cancel()
                    await asyncio.gather(*copies, return_exceptions=True)
        except TimeoutError:
            logger.debug(f"relay: the connection {source[-8:]} -> {target[-8:]} reached its time limit")
        finally:
            self.stats.circuits -= 1
            for peer in (source, target):
                self._circuits[peer] -= 1
                if self._circuits[peer] <= 0:
                    del self._circuits[peer]

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        left = self.data_limit
        try:
            while left > 0:
                chunk = await reader.read(min(CHUNK, left))
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
                left -= len(chunk)
                self.stats.relayed_bytes += len(chunk)
        except (OSError, ConnectionError):
            pass
        if left <= 0:
            logger.info(f"relay: a relayed connection used up its {self.data_limit} bytes; closing it")

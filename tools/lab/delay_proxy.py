"""Added latency for fault-lab hosts, in user space: this kernel has no netem, so `tc` cannot delay
packets; a transparent TCP proxy inside each host's namespace holds what passes through it instead.

Delay model: a host's one-way delay d applies to both directions of every TCP connection it takes
part in, dialing or accepting, so a connection between A and B sees d_A + d_B one way and a round
trip of 2·(d_A + d_B), its connect included. The dialer's proxy carries the whole of it: once any
host is delayed every host runs a proxy, and a connection from A to B goes through A's proxy, which
adds d_A + d_B. Nothing arriving at a host is redirected, so B sees A's own address (or, beyond a
home's LAN, its router's), and B's firewall (the lab's `split`, `block_port`, `loss`) acts on a
real connection, as without a proxy.

What is redirected (iptables nat OUTPUT REDIRECT to the proxy's port on 127.0.0.1): TCP leaving the
host for the lab's subnets when the host itself is delayed (`Host.links`: eth0 to the lab subnet;
a home's LAN through eth0 too, a router's through its LAN bridge), else only TCP to the delayed
hosts' addresses (a router has two). Never loopback, never the host's own addresses (they stay on
`lo`, undelayed), nothing outside the lab's subnets, and never the proxy's own upstream
connections (SO_MARK MARK_UPSTREAM, which the rules exclude). The proxy reads the real destination
with SO_ORIGINAL_DST.

Connect: the client's SYN is held in an NFQUEUE (mangle OUTPUT, before the REDIRECT). The proxy
waits the one-way delay, opens its upstream connection, waits the one-way delay again, and only
then lets the SYN on to its listener: the client's connect returns one round trip after the target
accepted. A refused upstream refuses the client (the SYN is marked and REJECTed with a TCP reset),
an unreachable one makes it unreachable (ICMP host-unreachable), a silent one leaves the client to
time out on its own.

Data: a chunk read at t is written at t + delay, in order per direction, and reading goes on
meanwhile (up to MAX_QUEUED bytes a direction), so throughput is not one chunk per delay. EOF
(half-close) and resets pass with the same delay; a connection is closed on both sides once both
directions ended or either side reset.

Not faithful: the source port the target sees (the proxy dials from an ephemeral port, as a NAT
does), and TCP's own view of the path (both kernels see a fast link: their RTT estimates, windows
and retransmission timers do not include the added delay; a client's own socket never sees a
partition of the path, only the application does, by its keepalives or when the proxy passes the
upstream's reset on). A changed delay applies to what is read after the change; removing the last
delay stops the proxies and ends the connections through them.

Run inside a host as `python delay_proxy.py --ip <host ip>`: it prints `ready <port>`, then takes
one command a line on stdin (`delays <ip>=<seconds> ...` replaces every host's delay, `stats`),
answers each with one line, and exits when stdin closes (its lab is gone). `DelayProxies` is the
lab's side of it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import errno
import itertools
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any, Optional, Union

# (hosts.py imports this module: its Lab and Host appear here as Any)
Lab = Host = Any

# ---- marks, queue and rules ------------------------------------------------------------------

MARK_BASE, MARK_MASK = 0x7A10, 0xFFF0  # every mark below matches BASE/MASK: the redirect rules skip them
MARK_UPSTREAM = 0x7A11  # the proxy's own connections: never redirected again
MARK_REFUSED = 0x7A12  # a held SYN whose upstream was refused: REJECTed with a TCP reset
MARK_UNREACHABLE = 0x7A13  # a held SYN whose upstream was unreachable: REJECTed with ICMP host-unreachable
QUEUE_NUM = 7710  # NFQUEUE number; queues are per network namespace, so every host can use the same
SO_ORIGINAL_DST = 80  # <linux/netfilter_ipv4.h>: the destination a REDIRECT replaced

# ---- proxy tuning ----------------------------------------------------------------------------

READ_BYTES = 256 * 1024  # asyncio reads at most this much a chunk
MAX_QUEUED = 16 * 1024 * 1024  # bytes held a direction before reading pauses: caps throughput at MAX_QUEUED / delay
WRITE_BUFFER_HIGH = 1024 * 1024  # a side's kernel-bound write buffer before reading the other side pauses
ACCEPT_WAIT_S = 10.0  # a released SYN's upstream waits this long for the client's handshake, then closes
LISTEN_BACKLOG = 4096
NETLINK_RCVBUF = 4 * 1024 * 1024  # room for a burst of queued SYNs
QUEUE_MAXLEN = 8192  # SYNs the kernel holds for the proxy at most; beyond that they pass undelayed (fail-open)
COPY_BYTES = 128  # of each queued packet: IPv4 header (options included) and the TCP ports

# ---- the lab's side ----------------------------------------------------------------------------

START_TIMEOUT_S = 60.0  # a proxy's Python start on a loaded 2-core machine
REPLY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

# ---- nfnetlink_queue (<linux/netfilter/nfnetlink_queue.h>) ---------------------------------------

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_CFG_F_FAIL_OPEN = 1
NFQNL_COPY_PACKET = 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_MARK, NFQA_PAYLOAD = 1, 2, 3, 10
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NLMSG_HDR, NFGEN_HDR = 16, 4
NLA_TYPE_MASK = 0x3FFF

Addr = tuple[str, int]


def _attr(kind: int, value: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(value), kind) + value + b"\0" * (-len(value) % 4)


class SynQueue:
    """This namespace's NFQUEUE `num` over netlink: held packets in, verdicts out."""

    def __init__(self, num: int = QUEUE_NUM) -> None:
        self.num = num
        self._seq = itertools.count(1)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, NETLINK_RCVBUF)
        self.sock.bind((0, 0))
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)))
        self._config(
            _attr(NFQA_CFG_PARAMS, struct.pack("!IB", COPY_BYTES, NFQNL_COPY_PACKET)),
            _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)),
            _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN)),
            _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN)),
        )
        self.sock.setblocking(False)

    def _message(self, kind: int, flags: int, *attrs: bytes) -> bytes:
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, self.num) + b"".join(attrs)  # nfgenmsg: family, version, queue
        return (
            struct.pack("=IHHII", NLMSG_HDR + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, next(self._seq), 0)
            + body
        )

    def _config(self, *attrs: bytes) -> None:
        self.sock.send(self._message(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, *attrs))
        reply = self.sock.recv(65536)
        _, kind = struct.unpack_from("=IH", reply)
        if kind == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", reply, NLMSG_HDR)
            if error:
                raise OSError(-error, f"NFQUEUE {self.num}: {os.strerror(-error)}")

    def read(self) -> list[tuple[int, bytes]]:
        """(packet id, the packet's first COPY_BYTES) of every packet the kernel has handed over."""
        packets: list[tuple[int, bytes]] = []
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return packets
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                # messages were lost; their SYNs stay held until the clients retransmit (1 s)
                print("delay_proxy: netlink receive buffer overran", file=sys.stderr, flush=True)
                continue
            offset = 0
            while offset + NLMSG_HDR <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if length < NLMSG_HDR:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    packet = self._packet(data, offset + NLMSG_HDR + NFGEN_HDR, offset + length)
                    if packet is not None:
                        packets.append(packet)
                offset += (length + 3) & ~3

    @staticmethod
    def _packet(data: bytes, pos: int, end: int) -> Optional[tuple[int, bytes]]:
        packet_id, payload = None, b""
        while pos + 4 <= end:
            length, kind = struct.unpack_from("=HH", data, pos)
            if length < 4:
                break
            kind &= NLA_TYPE_MASK
            if kind == NFQA_PACKET_HDR:
                (packet_id,) = struct.unpack_from("!I", data, pos + 4)
            elif kind == NFQA_PAYLOAD:
                payload = data[pos + 4 : pos + length]
            pos += (length + 3) & ~3
        return None if packet_id is None else (packet_id, payload)

    def verdict(self, packet_id: int, verdict: int, mark: Optional[int] = None) -> None:
        attrs = [_attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id))]
        if mark is not None:
            attrs.append(_attr(NFQA_MARK, struct.pack("!I", mark)))
        self.sock.send(self._message(NFQNL_MSG_VERDICT, NLM_F_REQUEST, *attrs))

    def close(self) -> None:
        self.sock.close()  # the kernel unbinds the queue and drops what it still held


def tcp_endpoints(packet: bytes) -> Optional[tuple[Addr, Addr]]:
    """(source, destination) of an IPv4 TCP packet's first bytes."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != socket.IPPROTO_TCP:
        return None
    header = (packet[0] & 0x0F) * 4
    if len(packet) < header + 4:
        return None
    sport, dport = struct.unpack_from("!HH", packet, header)
    return (socket.inet_ntoa(packet[12:16]), sport), (socket.inet_ntoa(packet[16:20]), dport)


def original_dst(sock: socket.socket) -> Addr:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # struct sockaddr_in
    (port,) = struct.unpack_from("!H", raw, 2)
    return socket.inet_ntoa(raw[4:8]), port


# ---- one connection ----------------------------------------------------------------------------


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


EOF = _Marker("EOF")  # the source half-closed
RESET = _Marker("RESET")  # the source reset (or vanished): reset the destination
Item = Union[bytes, _Marker]


class Side(asyncio.Protocol):
    """One socket of a proxied connection (the client's or the upstream one)."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.transport: Optional[asyncio.Transport] = None
        self.eof = False
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)

    def data_received(self, data: bytes) -> None:
        self.conn.pipe_from(self).push(data)

    def eof_received(self) -> bool:
        if not self.eof:
            self.eof = True
            self.conn.pipe_from(self).push(EOF)
        return True  # keep the socket open: the other direction may still carry data

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.lost = True
        self.conn.side_lost(self, exc)

    def pause_writing(self) -> None:
        self.conn.pipe_into(self).set_dst_full(True)

    def resume_writing(self) -> None:
        self.conn.pipe_into(self).set_dst_full(False)


class Pipe:
    """One direction: what `src` reads is written to `dst` a delay later, in order."""

    def __init__(self, conn: Conn, src: Side, dst: Side) -> None:
        self.conn, self.src, self.dst = conn, src, dst
        self.loop = asyncio.get_running_loop()
        self.queue: collections.deque[tuple[float, Item]] = collections.deque()
        self.queued = 0  # bytes in `queue`
        self.timer: Optional[asyncio.TimerHandle] = None
        self.src_paused = False
        self.dst_full = False
        self.eof_sent = False

    def push(self, item: Item) -> None:
        now = self.loop.time()
        due = now + self.conn.delay()
        if not self.queue and due <= now and self.conn.started:
            self.deliver(item)  # no delay: straight through
            return
        self.queue.append((due, item))
        if isinstance(item, bytes):
            self.queued += len(item)
            self.throttle()
        if self.timer is None:
            self.timer = self.loop.call_at(self.queue[0][0], self.flush)

    def flush(self) -> None:
        self.timer = None
        if not self.conn.started:
            return
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, item = self.queue.popleft()
            if isinstance(item, bytes):
                self.queued -= len(item)
            self.deliver(item)
        if self.queue and self.timer is None:
            self.timer = self.loop.call_at(self.queue[0][0], self.flush)
        self.throttle()

    def deliver(self, item: Item) -> None:
        transport = self.dst.transport
        if item is RESET:
            self.conn.reset(self.dst)
        elif transport is None or self.dst.lost or transport.is_closing():
            return
        elif item is EOF:
            if not self.eof_sent:
                self.eof_sent = True
                try:
                    transport.write_eof()
                except OSError:  # ENOTCONN: the destination reset meanwhile, its loss not yet seen
                    self.conn.reset(self.dst)
                    return
                self.conn.check_done()
        else:
            transport.write(item)

    def discard(self) -> None:
        """Nothing more can be delivered (the destination is gone)."""
        self.queue.clear()
        self.queued = 0
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def set_dst_full(self, full: bool) -> None:
        self.dst_full = full
        self.throttle()

    def throttle(self) -> None:
        transport = self.src.transport
        if transport is None or self.src.eof or self.src.lost or transport.is_closing():
            return
        if not self.src_paused and (self.dst_full or self.queued > MAX_QUEUED):
            transport.pause_reading()
            self.src_paused = True
        elif self.src_paused and not self.dst_full and self.queued <= MAX_QUEUED // 2:
            transport.resume_reading()
            self.src_paused = False


class Conn:
    """A client's connection and the proxy's upstream one, joined by two delayed pipes."""

    def __init__(self, proxy: Proxy, target: Addr) -> None:
        self.proxy, self.target = proxy, target
        self.client, self.upstream = Side(self), Side(self)
        self.pipes = {
            self.client: Pipe(self, self.client, self.upstream),
            self.upstream: Pipe(self, self.upstream, self.client),
        }
        self.started = False
        self.closed = False

    def delay(self) -> float:
        return self.proxy.delay_to(self.target[0])

    def pipe_from(self, side: Side) -> Pipe:
        return self.pipes[side]

    def pipe_into(self, side: Side) -> Pipe:
        return self.pipes[self.other(side)]

    def other(self, side: Side) -> Side:
        return self.upstream if side is self.client else self.client

    async def start(self, client: socket.socket, upstream: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self.proxy.conns.add(self)
        try:
            await loop.connect_accepted_socket(lambda: self.client, client)
            await loop.create_connection(lambda: self.upstream, sock=upstream)
        except BaseException:
            self.close(abort=True)
            client.close()
            upstream.close()
            raise
        self.started = True
        for pipe in self.pipes.values():
            pipe.flush()  # what arrived while the other side's transport was being made

    def side_lost(self, side: Side, exc: Optional[Exception]) -> None:
        if self.closed:
            self.forget()
            return
        self.pipe_into(side).discard()
        out = self.pipe_from(side)
        if exc is not None:
            out.push(RESET)  # reset or vanished: so does the other side, a delay later
        elif not side.eof:
            side.eof = True
            out.push(EOF)
        self.check_done()

    def check_done(self) -> None:
        both_ended = all(p.eof_sent for p in self.pipes.values())
        if both_ended or (self.client.lost and self.upstream.lost):
            self.close()

    def reset(self, side: Side) -> None:
        """Reset `side` (SO_LINGER 0: an RST, not a FIN), then close the connection."""
        if side.transport is not None and not side.lost:
            sock = side.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            side.transport.abort()
        self.close(abort=True)

    def close(self, abort: bool = False) -> None:
        self.closed = True
        for side, pipe in ((self.client, self.pipes[self.client]), (self.upstream, self.pipes[self.upstream])):
            pipe.discard()
            if side.transport is not None and not side.transport.is_closing():
                side.transport.abort() if abort else side.transport.close()
        self.forget()

    def forget(self) -> None:
        if all(s.lost or s.transport is None for s in (self.client, self.upstream)):
            self.proxy.conns.discard(self)


# ---- the proxy ---------------------------------------------------------------------------------


@dataclass
class Held:
    """A SYN held in the queue while its upstream connection opens."""

    packet_id: int
    upstream: Optional[socket.socket] = None
    released: bool = False
    expiry: Optional[asyncio.TimerHandle] = None


class Proxy:
    def __init__(self, own_ip: str, queue: SynQueue, listener: socket.socket) -> None:
        self.own_ip, self.queue, self.listener = own_ip, queue, listener
        self.port = listener.getsockname()[1]
        self.loop = asyncio.get_running_loop()
        self.delays: dict[str, float] = {}
        self.held: dict[tuple[Addr, Addr], Held] = {}
        self.conns: set[Conn] = set()
        self.tasks: set[asyncio.Task] = set()
        self.accepted = 0

    def delay_to(self, ip: str) -> float:
        return self.delays.get(self.own_ip, 0.0) + self.delays.get(ip, 0.0)

    def spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            print(f"delay_proxy: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    # ---- SYNs ----

    def read_queue(self) -> None:
        for packet_id, packet in self.queue.read():
            self.on_syn(packet_id, packet)

    def on_syn(self, packet_id: int, packet: bytes) -> None:
        ends = tcp_endpoints(packet)
        if ends is None:
            self.queue.verdict(packet_id, NF_ACCEPT)
            return
        held = self.held.get(ends)
        if held is not None:  # a retransmitted SYN: lost while the first is held, let on once it was released
            self.queue.verdict(packet_id, NF_ACCEPT if held.released else NF_DROP)
            return
        self.held[ends] = held = Held(packet_id)
        self.spawn(self.open_for_syn(ends, held))

    async def open_for_syn(self, ends: tuple[Addr, Addr], held: Held) -> None:
        target = ends[1]
        await asyncio.sleep(self.delay_to(target[0]))  # the SYN's way there
        mark: Optional[int] = None
        try:
            held.upstream = await self.connect(target)
        except ConnectionRefusedError:
            mark = MARK_REFUSED
        except OSError as e:
            if e.errno not in (errno.EHOSTUNREACH, errno.ENETUNREACH):  # timed out: the client times out too
                del self.held[ends]
                self.queue.verdict(held.packet_id, NF_DROP)
                return
            mark = MARK_UNREACHABLE
        except BaseException:
            del self.held[ends]
            self.queue.verdict(held.packet_id, NF_DROP)
            raise
        await asyncio.sleep(self.delay_to(target[0]))  # the answer's way back
        if mark is not None:
            del self.held[ends]
            self.queue.verdict(held.packet_id, NF_ACCEPT, mark)
            return
        held.released = True
        held.expiry = self.loop.call_later(ACCEPT_WAIT_S, self.expire, ends, held)
        self.queue.verdict(held.packet_id, NF_ACCEPT)

    def expire(self, ends: tuple[Addr, Addr], held: Held) -> None:
        if self.held.get(ends) is held:  # the client never completed its handshake (it gave up)
            del self.held[ends]
            if held.upstream is not None:
                held.upstream.close()

    def claim(self, client: Addr, target: Addr) -> Optional[socket.socket]:
        """The upstream opened for this client's SYN. Its source port may differ from the SYN's: two
        connections from one port (SO_REUSEPORT dialing) get one remapped by the REDIRECT's NAT."""
        key = (client, target)
        if key not in self.held or not self.held[key].released:
            key = next(
                (k for k, h in self.held.items() if h.released and k[0][0] == client[0] and k[1] == target), None
            )
            if key is None:
                return None
        held = self.held.pop(key)
        if held.expiry is not None:
            held.expiry.cancel()
        return held.upstream

    # ---- connections ----

    async def connect(self, target: Addr) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK_UPSTREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            await self.loop.sock_connect(sock, target)
        except BaseException:
            sock.close()
            raise
        return sock

    async def serve(self) -> None:
        while True:
            client, peer = await self.loop.sock_accept(self.listener)
            self.accepted += 1
            self.spawn(self.handle(client, peer))

    async def handle(self, client: socket.socket, peer: Addr) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            target = original_dst(client)
        except OSError:  # reached the proxy's port without a REDIRECT: nothing to forward to
            client.close()
            return
        if target[1] == self.port and target[0] in ("127.0.0.1", self.own_ip):
            client.close()
            return
        upstream = self.claim(peer, target)
        if upstream is None:  # its SYN passed the queue undelayed (queue full): connect now
            try:
                upstream = await self.connect(target)
            except OSError:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                return
        await Conn(self, target).start(client, upstream)

    async def control(self) -> None:
        """Commands on stdin, one reply line each; returns when stdin closes."""
        reader = asyncio.StreamReader()
        await self.loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            words = line.decode().split()
            if words[:1] == ["delays"]:
                self.delays = {ip: float(s) for ip, s in (w.split("=", 1) for w in words[1:])}
                reply = "ok"
            elif words == ["stats"]:
                reply = f"stats accepted={self.accepted} open={len(self.conns)} held={len(self.held)}"
            else:
                reply = f"error: unknown command {line.decode().strip()!r}"
            sys.stdout.write(reply + "\n")
            sys.stdout.flush()

    def shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.conns):
            conn.close(abort=True)
        for held in self.held.values():
            if held.upstream is not None:
                held.upstream.close()
        self.loop.remove_reader(self.queue.sock.fileno())
        self.queue.close()
        self.listener.close()


async def run(own_ip: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # two sockets a proxied connection
    loop = asyncio.get_running_loop()
    queue = SynQueue()
    listener = socket.create_server(("127.0.0.1", 0), backlog=LISTEN_BACKLOG)
    listener.setblocking(False)
    proxy = Proxy(own_ip, queue, listener)
    loop.add_reader(queue.sock.fileno(), proxy.read_queue)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    server = loop.create_task(proxy.serve())
    control = loop.create_task(proxy.control())
    control.add_done_callback(lambda _: stop.set())
    print(f"ready {proxy.port}", flush=True)
    try:
        await stop.wait()
    finally:
        server.cancel()
        control.cancel()
        proxy.shutdown()
    if control.done() and not control.cancelled() and control.exception() is not None:
        raise control.exception()  # a broken command pipe, say: the lab should hear of it


def main() -> None:
    parser = argparse.ArgumentParser(description="transparent TCP delay proxy for one fault-lab host")
    parser.add_argument("--ip", required=True, help="this host's lab address")
    args = parser.parse_args()
    asyncio.run(run(args.ip))


# ---- the lab's side ------------------------------------------------------------------------------


class DelayProxies:
    """A lab's delays: a proxy in every host once any host is delayed, each host's redirect rules,
    and every proxy told every host's delay."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.delays: dict[str, float] = {}  # host name → one-way seconds; 0 still puts the proxy in the path
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.rules: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {}  # host name → (table, chain, spec)

    def set(self, name: str, one_way_s: Optional[float]) -> None:
        """Delay `name` by `one_way_s` each way (0: through the proxy, no delay); None removes it."""
        if one_way_s is None:
            self.delays.pop(name, None)
        elif one_way_s < 0:
            raise ValueError(f"delay must be >= 0 s, got {one_way_s}")
        else:
            self.delays[name] = float(one_way_s)
        if not self.delays:
            self.stop()
            return
        for host in self.lab.hosts.values():
            self._start(host)
        line = "delays " + " ".join(
            f"{ip}={s!r}" for n, s in self.delays.items() for ip in self.lab.hosts[n].addresses
        )  # a router is dialed at either of its addresses
        for proxied in self.procs:
            self._ask(proxied, line)
        for host in self.lab.hosts.values():
            self._apply_rules(host)

    def stats(self, name: str) -> dict[str, int]:
        """{accepted, open, held}: connections the host's proxy took, still carries, SYNs it holds."""
        reply = self._ask(name, "stats")
        return {k: int(v) for k, v in (w.split("=") for w in reply.split()[1:])}

    def stop(self) -> None:
        """Remove every rule and end every proxy (the connections through them end too)."""
        for host in self.lab.hosts.values():
            for table, chain, spec in self.rules.pop(host.name, []):
                host.run("iptables", "-w", "-t", table, "-D", chain, *spec, check=False)
        for name, proc in self.procs.items():
            assert proc.stdin is not None
            try:
                proc.stdin.close()  # the proxy's cue to exit
            except BrokenPipeError:
                pass
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            host = self.lab.hosts[name]
            if proc in host.procs:
                host.procs.remove(proc)
        self.procs.clear()
        self.ports.clear()

    def _start(self, host: Host) -> None:
        if host.name in self.procs:
            if self.procs[host.name].poll() is None:
                return
            raise RuntimeError(f"the delay proxy of {host.name} exited ({self.procs[host.name].returncode})")
        proc = host.popen(
            [sys.executable, str(Path(__file__).resolve()), "--ip", host.ip],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )  # fmt: skip
        self.procs[host.name] = proc
        ready = self._readline(host.name, START_TIMEOUT_S)
        if not ready.startswith("ready "):
            raise RuntimeError(f"the delay proxy of {host.name} did not start: {ready!r}")
        self.ports[host.name] = int(ready.split()[1])

    def _ask(self, name: str, line: str) -> str:
        proc = self.procs[name]
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        reply = self._readline(name, REPLY_TIMEOUT_S)
        if reply.startswith("error"):
            raise RuntimeError(f"the delay proxy of {name}: {reply}")
        return reply

    def _readline(self, name: str, timeout_s: float) -> str:
        """One line from the proxy (one command at a time: nothing is left in the pipe's buffer)."""
        proc = self.procs[name]
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if readable else ""
        if not line:
            raise RuntimeError(
                f"the delay proxy of {name} did not answer within {timeout_s:.0f} s (exit {proc.poll()})"
            )
        return line.strip()

    def _wanted_rules(self, host: Host) -> list[tuple[str, str, tuple[str, ...]]]:
        if host.name in self.delays:
            targets = host.links  # everything it dials in the lab (its own addresses stay on lo)
        else:  # the delayed hosts' addresses, on the interface toward each
            delayed = [ip for n in self.delays for ip in self.lab.hosts[n].addresses]
            targets = [(dev, ip) for ip in delayed for dev, net in host.links if ip_address(ip) in ip_network(net)]
        not_ours = ("-m", "mark", "!", "--mark", f"{MARK_BASE:#x}/{MARK_MASK:#x}")
        hold_syn = ("--syn", *not_ours, "-j", "NFQUEUE", "--queue-num", str(QUEUE_NUM), "--queue-bypass")
        redirect = (*not_ours, "-j", "REDIRECT", "--to-ports", str(self.ports[host.name]))
        rules = []
        for dev, dst in targets:
            match = ("-o", dev, "-d", dst, "-p", "tcp")
            rules += [("mangle", "OUTPUT", (*match, *hold_syn)), ("nat", "OUTPUT", (*match, *redirect))]
        for mark, answer in ((MARK_REFUSED, "tcp-reset"), (MARK_UNREACHABLE, "icmp-host-unreachable")):
            reject = ("-p", "tcp", "-m", "mark", "--mark", f"{mark:#x}", "-j", "REJECT", "--reject-with", answer)
            rules.append(("filter", "OUTPUT", reject))
        return rules

    def _apply_rules(self, host: Host) -> None:
        wanted = self._wanted_rules(host)
        installed = self.rules.setdefault(host.name, [])
        for rule in [r for r in installed if r not in wanted]:
            table, chain, spec = rule
            host.run("iptables", "-w", "-t", table, "-D", chain, *spec)
            installed.remove(rule)
        for rule in [r for r in wanted if r not in installed]:
            table, chain, spec = rule
            host.run("iptables", "-w", "-t", table, "-A", chain, *spec)
            installed.append(rule)


if __name__ == "__main__":
    main()

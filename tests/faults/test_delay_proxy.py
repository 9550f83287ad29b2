"""Added latency per lab host (delay_proxy.py): a delayed host's TCP connections take at least the
added round trip to connect and for each exchange, both hosts' delays add up, bytes pass intact and
in order, half-close and resets pass, loopback stays undelayed, the proxy keeps up with a few
hundred connections and tens of MB/s, and hivemind's DHT works through it. Only lower bounds are
asserted on the added time (delays only add), upper bounds are loose: the machine is small and shared."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from phalanx.tools.lab.hosts import Lab

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ECHO_PORT, SINK_PORT, RESET_PORT, CLOSED_PORT = 40100, 40101, 40102, 40103
DELAY_S = 0.1  # one-way delay of the timing tests: its round trip is far above this machine's noise
SLACK_S = 1.0  # loose upper bound over the added time: a loaded 2-core machine, not the proxy
TRAILER = b"\n--server saw EOF--\n"  # what the echo server sends once the client half-closed
CONNECTIONS = 300  # concurrent connections through one proxy
STREAM_BYTES = 8 * 1024 * 1024  # random bytes through and back, compared by hash
THROUGHPUT_BYTES = 256 * 1024 * 1024
MIN_THROUGHPUT_MBPS = 5.0  # a floor far below what the proxy does (hundreds of MB/s on loopback)


def in_host(host, fn: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    """Run `fn` in a thread inside `host`'s namespace; its value, or its exception raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller below
            out["error"] = e

    host.thread_in(run, "call").join(timeout_s)
    if "error" in out:
        raise out["error"]
    assert "value" in out, f"no answer within {timeout_s:.0f} s"
    return out["value"]


class EchoHandler(socketserver.BaseRequestHandler):
    """Echo every byte; at EOF send TRAILER and close (the half-close went through, and back)."""

    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)
        self.request.sendall(TRAILER)


class SinkHandler(socketserver.BaseRequestHandler):
    """Count the bytes to EOF, answer the count."""

    def handle(self) -> None:
        buf, total = bytearray(1024 * 1024), 0
        while n := self.request.recv_into(buf):
            total += n
        self.request.sendall(struct.pack("!Q", total))


class ResetHandler(socketserver.BaseRequestHandler):
    """Read one byte, then reset the connection (SO_LINGER 0: RST, not FIN)."""

    def handle(self) -> None:
        self.request.recv(1)
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.request.close()  # here: socketserver would shut the write side down (a FIN) first


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 1024


def serve(host) -> Callable[[], None]:
    """Echo, sink and reset servers on `host` (handler threads start in its namespace); returns stop."""
    servers: list[Server] = []
    ready = threading.Event()

    def run() -> None:
        servers.extend(
            Server(("0.0.0.0", port), handler)
            for port, handler in ((ECHO_PORT, EchoHandler), (SINK_PORT, SinkHandler), (RESET_PORT, ResetHandler))
        )
        for server in servers[1:]:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        ready.set()
        servers[0].serve_forever()

    host.thread_in(run, "servers")
    assert ready.wait(30)

    def stop() -> None:
        for server in servers:
            server.shutdown()
            server.server_close()

    return stop


def connect_and_rtt(ip: str, exchanges: int = 5) -> tuple[float, float]:
    """(seconds to connect, the shortest of `exchanges` one-byte round trips) to the echo server."""
    began = time.monotonic()
    with socket.create_connection((ip, ECHO_PORT), timeout=30) as sock:
        connect_s = time.monotonic() - began
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(exchanges):
            began = time.monotonic()
            sock.sendall(b"x")
            assert sock.recv(1) == b"x"
            rtts.append(time.monotonic() - began)
    return connect_s, min(rtts)


@pytest.fixture
def lab(lab_machine):
    with Lab(["a", "b"], tag="delay") as lab:
        stops = [serve(lab["a"]), serve(lab["b"])]
        yield lab
        for stop in stops:
            stop()
    assert not lab.namespaces_left()


def test_a_delayed_host_adds_a_round_trip_to_connect_and_to_each_exchange_until_cleared(lab):
    a, b = lab["a"], lab["b"]
    base = in_host(a, lambda: connect_and_rtt(b.ip))
    lab.delay("b", DELAY_S)
    procs = dict(lab.delay_proxies.procs)
    toward = in_host(a, lambda: connect_and_rtt(b.ip))  # b accepts: a's proxy carries it
    back = in_host(b, lambda: connect_and_rtt(a.ip))  # b dials
    local = in_host(b, lambda: connect_and_rtt("127.0.0.1"))
    own_ip = in_host(b, lambda: connect_and_rtt(b.ip))
    lab.clear("b")
    cleared = in_host(a, lambda: connect_and_rtt(b.ip))
    print(f"\none-way {DELAY_S * 1000:.0f} ms on b; (connect, rtt) in ms:")
    seen = {
        "no delay": base,
        "a->b": toward,
        "b->a": back,
        "b->127.0.0.1": local,
        "b->own ip": own_ip,
        "cleared": cleared,
    }
    for what, (connect_s, rtt_s) in seen.items():
        print(f"  {what:14} connect {connect_s * 1000:7.1f}  rtt {rtt_s * 1000:7.1f}")
    for connect_s, rtt_s in (toward, back):
        assert 2 * DELAY_S <= connect_s < 2 * DELAY_S + SLACK_S
        assert 2 * DELAY_S <= rtt_s < 2 * DELAY_S + SLACK_S
    for connect_s, rtt_s in (local, own_ip, cleared):  # loopback never delayed; cleared: gone
        assert connect_s < DELAY_S and rtt_s < DELAY_S
    assert lab.delay_proxies.procs == {} and all(p.returncode == 0 for p in procs.values())  # exited at the lab's word
    for host in (a, b):
        rules = host.run("iptables-save").stdout
        assert "REDIRECT" not in rules and "NFQUEUE" not in rules and "0x7a1" not in rules


def test_delays_of_both_ends_add_up_and_a_second_call_changes_a_delay(lab):
    a, b = lab["a"], lab["b"]
    lab.delay("a", 0.03)
    lab.delay("b", 0.06)
    both = in_host(a, lambda: connect_and_rtt(b.ip))
    reverse = in_host(b, lambda: connect_and_rtt(a.ip))
    lab["b"].delay(0.15)
    changed = in_host(a, lambda: connect_and_rtt(b.ip))
    print(f"\na 30 ms + b 60 ms: {both}, reverse {reverse}; b changed to 150 ms: {changed}")
    for connect_s, rtt_s in (both, reverse):
        assert 2 * 0.09 <= connect_s < 2 * 0.09 + SLACK_S
        assert 2 * 0.09 <= rtt_s < 2 * 0.09 + SLACK_S
    assert 2 * 0.18 <= changed[0] and 2 * 0.18 <= changed[1] < 2 * 0.18 + SLACK_S


def echo_stream(ip: str) -> tuple[bytes, bytes, bytes]:
    """Send STREAM_BYTES of random data while reading the echo, then half-close and read to EOF:
    (sha256 of what was sent, sha256 of what came back, the trailer)."""
    data = os.urandom(STREAM_BYTES)
    sock = socket.create_connection((ip, ECHO_PORT), timeout=60)

    def send() -> None:
        view = memoryview(data)
        for i in range(0, len(view), 100_000):  # many writes of an odd size: chunks cross reads
            sock.sendall(view[i : i + 100_000])
        sock.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)  # created here: inside the host's namespace too
    sender.start()
    received = bytearray()
    while chunk := sock.recv(1 << 20):
        received += chunk
    sender.join()
    sock.close()
    echoed, trailer = bytes(received[:STREAM_BYTES]), bytes(received[STREAM_BYTES:])
    return hashlib.sha256(data).digest(), hashlib.sha256(echoed).digest(), trailer


def reset_by_server(ip: str) -> str:
    with socket.create_connection((ip, RESET_PORT), timeout=30) as sock:
        sock.sendall(b"x")
        try:
            return "data" if sock.recv(1) else "eof"
        except ConnectionResetError:
            return "reset"


def refused(ip: str) -> float:
    began = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((ip, CLOSED_PORT), timeout=30)
    return time.monotonic() - began


def test_bytes_pass_intact_and_in_order_and_half_close_resets_and_refusals_pass(lab):
    a, b = lab["a"], lab["b"]
    lab.delay("a", 0.02)
    sent, echoed, trailer = in_host(a, lambda: echo_stream(b.ip))
    assert echoed == sent  # every byte, in order, both ways
    assert trailer == TRAILER  # the server saw the client's EOF and its reply came after it
    assert in_host(a, lambda: reset_by_server(b.ip)) == "reset"
    refused_s = in_host(a, lambda: refused(b.ip))
    print(f"\nrefused after {refused_s * 1000:.0f} ms (one-way 20 ms)")
    assert refused_s >= 2 * 0.02
    deadline = time.monotonic() + 30
    while lab.delay_proxies.stats("a")["open"] and time.monotonic() < deadline:
        time.sleep(0.1)
    # the stream and the reset one were carried and closed on both sides; the refused one never reached the proxy
    assert lab.delay_proxies.stats("a") == {"accepted": 2, "open": 0, "held": 0}


def sink(ip: str, total: int) -> float:
    """Seconds to push `total` bytes to the sink and hear its count."""
    block = os.urandom(1 << 20)
    began = time.monotonic()
    with socket.create_connection((ip, SINK_PORT), timeout=60) as sock:
        for _ in range(total // len(block)):
            sock.sendall(block)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < 8 and (chunk := sock.recv(8 - len(reply))):
            reply += chunk
    assert struct.unpack("!Q", reply)[0] == total
    return time.monotonic() - began


def many_connections(ip: str, count: int, while_open: Callable[[], Any]) -> tuple[list[float], float, Any]:
    """`count` connections open at once, each echoing its own 1 KiB: (each one's connect + echo
    seconds, seconds for all, `while_open()` called while all are still open)."""

    async def main() -> tuple[list[float], float, Any]:
        async def one(i: int) -> tuple[float, asyncio.StreamWriter]:
            payload = struct.pack("!I", i) * 256
            began = time.monotonic()
            reader, writer = await asyncio.open_connection(ip, ECHO_PORT)
            writer.write(payload)
            assert await reader.readexactly(len(payload)) == payload
            took = time.monotonic() - began
            return took, writer

        began = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(count)))
        took_all = time.monotonic() - began
        seen = await asyncio.get_running_loop().run_in_executor(None, while_open)
        for _, writer in results:
            writer.close()
        return [t for t, _ in results], took_all, seen

    return asyncio.run(main())


def test_throughput_and_a_few_hundred_concurrent_connections(lab):
    a, b = lab["a"], lab["b"]
    direct_s = in_host(a, lambda: sink(b.ip, THROUGHPUT_BYTES))
    lab.delay("a", 0)  # the proxy in the path, no delay
    proxied_s = in_host(a, lambda: sink(b.ip, THROUGHPUT_BYTES))
    lab.delay("a", 0.05)
    delayed_s = in_host(a, lambda: sink(b.ip, THROUGHPUT_BYTES))
    mb = THROUGHPUT_BYTES / 1e6
    print(f"\nthroughput a->b, MB/s: direct {mb / direct_s:.0f}, ", end="")
    print(f"through the proxy at 0 ms {mb / proxied_s:.0f}, at 50 ms one-way {mb / delayed_s:.0f}")
    assert mb / proxied_s >= MIN_THROUGHPUT_MBPS

    proxy_stats = lambda: lab.delay_proxies.stats("a")
    each, took_all, stats = in_host(a, lambda: many_connections(b.ip, CONNECTIONS, proxy_stats))
    print(f"{CONNECTIONS} concurrent connections at 50 ms one-way: all echoed in {took_all:.2f} s, ", end="")
    print(f"each {min(each) * 1000:.0f}-{max(each) * 1000:.0f} ms; proxy {stats}")
    assert len(each) == CONNECTIONS and min(each) >= 2 * 2 * 0.05  # connect, then one exchange: two round trips
    assert stats["open"] >= CONNECTIONS
    deadline = time.monotonic() + 60
    while lab.delay_proxies.stats("a")["open"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lab.delay_proxies.stats("a")["open"] == 0


DHT_NODE = """
import sys, time
import hivemind
from hivemind.utils import get_dht_time

name, ip, out, other, initial = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
dht = hivemind.DHT(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=initial, start=True)
assert dht.store(name, ip, get_dht_time() + 600)
with open(out + ".tmp", "w") as f:
    f.write(" ".join(str(m) for m in dht.get_visible_maddrs()))
import os; os.rename(out + ".tmp", out + ".maddrs")
while True:
    began = time.monotonic()
    found = dht.get(other, latest=True)
    took = time.monotonic() - began
    if found is not None:
        with open(out + ".tmp", "w") as f:
            f.write(f"{found.value} {took}")
        os.rename(out + ".tmp", out + ".found")
        break
    time.sleep(0.5)
time.sleep(3600)  # the lab ends it
"""


def wait_for(path: Path, timeout_s: float, procs: list[subprocess.Popen]) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name} within {timeout_s:.0f} s"
        assert all(p.poll() is None for p in procs), "a DHT node exited"
        time.sleep(0.2)
    return path.read_text()


def redirected(host) -> int:
    """Connections the host's REDIRECT rules sent to its proxy (the nat table sees a connection's first packet only)."""
    out = host.run("iptables", "-w", "-t", "nat", "-L", "OUTPUT", "-v", "-x", "-n").stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if "REDIRECT" in line)


@pytest.mark.timeout(400)
def test_hivemind_dht_nodes_find_each_other_through_the_proxies(lab, tmp_path):
    a, b = lab["a"], lab["b"]
    lab.delay("a", 0.05)
    lab.delay("b", 0.1)
    script = tmp_path / "dht_node.py"
    script.write_text(DHT_NODE)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = [open(tmp_path / f"{n}.log", "wb") for n in "ab"]

    def start(host, log, name: str, other: str, *initial: str) -> subprocess.Popen:
        args = [sys.executable, str(script), name, host.ip, str(tmp_path / name), other, *initial]
        return host.popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    procs = [start(a, logs[0], "a", "b")]
    try:
        maddrs = wait_for(tmp_path / "a.maddrs", 180, procs).split()
        procs.append(start(b, logs[1], "b", "a", *maddrs))
        found_by_b = wait_for(tmp_path / "b.found", 180, procs).split()
        found_by_a = wait_for(tmp_path / "a.found", 120, procs).split()
    except AssertionError:
        print("\n".join(f"--- {n}.log\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in "ab"))
        raise
    finally:
        for log in logs:
            log.close()
    print(f"\nDHT through the proxies (a 50 ms, b 100 ms one-way): b found a's key in {float(found_by_b[1]):.3f} s")
    for host in (a, b):
        print(f"  {host.name}: connections redirected {redirected(host)}, proxy {lab.delay_proxies.stats(host.name)}")
    assert found_by_b[0] == a.ip and found_by_a[0] == b.ip
    assert float(found_by_b[1]) >= 2 * (0.05 + 0.1)  # a's key lives only on a: at least one round trip to it
    assert redirected(b) > 0 and lab.delay_proxies.stats("b")["accepted"] > 0  # p2pd's own dials went through


def test_close_ends_the_proxies_and_leaves_nothing(lab_machine):
    lab = Lab(["a", "b"], tag="delayclose")
    lab.delay("a", 0.05)
    procs = list(lab.delay_proxies.procs.values())
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    lab.close()
    assert all(p.poll() is not None for p in procs)
    assert not lab.namespaces_left()

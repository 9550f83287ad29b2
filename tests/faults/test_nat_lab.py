"""Home routers in the lab (`phalanx.tools.lab.hosts`, `add_home`): a home dials out and nobody dials in, its
connections come from its router's address (with the home's own port, or a fresh random one per
connection behind a symmetric NAT), homes behind one router meet on their LAN, a home's link can be
capped per direction, delayed, cut, split and made lossy, and a hivemind DHT node in a home joins
through a public one while a public node cannot dial it. "Nothing gets through" is bounded by short
timeouts; rates are checked against generous bounds only (a small shared machine)."""

from __future__ import annotations

import errno
import http.client
import json
import os
import re
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest

from phalanx.tools.lab.hosts import Lab, sh
from tests.procs import alive, script_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WHO_PORT, ECHO_PORT, RATE_PORT, HTTP_PORT, UDP_PORT = 40200, 40201, 40202, 40203, 40204
BLOCKED_S = 2.0  # a connect that nothing answers gives up after this long
TRIALS = 4  # same-port connection pairs per NAT in the mapping test
UP_MBIT, DOWN_MBIT = 20, 100  # a home line: slow up, fast down
UP_BYTES, DOWN_BYTES = 4_000_000, 12_000_000  # ~1.6 s and ~1 s at those rates
RATE_SLACK = 1.3  # measured rate may exceed the cap by this factor (tbf's burst, timing)
DOWN_OVER_UP = 2.0  # capped at 100 and 20 Mbit/s: the download is at least twice the upload
FASTER = 3.0  # the unconstrained direction is at least this many times the capped one
D_HOME, D_PUBLIC, D_ROUTER = 0.05, 0.1, 0.03  # one-way delays, s: sums well above scheduling noise
DELAY_SLACK_S = 1.0  # loose upper bound over the added time
DATAGRAMS = 4000  # for the loss share: 20 % ± 10 points is > 15 standard deviations


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


# ---- servers ---------------------------------------------------------------------------------


class WhoHandler(socketserver.BaseRequestHandler):
    """Answer the address the connection came from, then close."""

    def handle(self) -> None:
        ip, port = self.client_address[:2]
        self.request.sendall(f"{ip} {port}\n".encode())


class EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class RateHandler(socketserver.BaseRequestHandler):
    """`U`: take bytes to EOF and answer (bytes, seconds from the first to the last byte);
    `D` + 8-byte count: send that many bytes, then close."""

    def handle(self) -> None:
        kind = self.request.recv(1)
        if kind == b"U":
            total, first, last = receive_all(self.request)
            self.request.sendall(struct.pack("!Qd", total, last - first))
        elif kind == b"D":
            (count,) = struct.unpack("!Q", recv_exactly(self.request, 8))
            send_bytes(self.request, count)


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def serve(host, handlers: dict[int, type[socketserver.BaseRequestHandler]]) -> Callable[[], None]:
    """TCP servers on `host`, one a port (handler threads start in its namespace); returns stop."""
    servers: list[Server] = []
    ready = threading.Event()

    def run() -> None:
        servers.extend(Server(("0.0.0.0", port), handler) for port, handler in handlers.items())
        for server in servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        ready.set()

    host.thread_in(run, "servers").join(30)
    assert ready.wait(30)

    def stop() -> None:
        for server in servers:
            server.shutdown()
            server.server_close()

    return stop


# ---- clients (each runs inside a host) -----------------------------------------------------------


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := sock.recv(n - len(data))):
        data += chunk
    return data


def receive_all(sock: socket.socket) -> tuple[int, float, float]:
    """Bytes to EOF: (count, monotonic time of the first byte, of the last)."""
    buf, total, first, last = bytearray(1 << 20), 0, 0.0, 0.0
    while n := sock.recv_into(buf):
        last = time.monotonic()
        first = first or last
        total += n
    return total, first, last


def send_bytes(sock: socket.socket, count: int) -> None:
    block = os.urandom(1 << 16)
    while count > 0:
        sock.sendall(block[: min(count, len(block))])
        count -= len(block)
    sock.shutdown(socket.SHUT_WR)


def who(ip: str, sock: Optional[socket.socket] = None) -> tuple[str, int, int]:
    """(address, port) the server at `ip` saw the connection come from, and the local port."""
    sock = sock or socket.socket()
    with sock:
        sock.settimeout(10)
        sock.connect((ip, WHO_PORT))
        local_port = sock.getsockname()[1]
        reply = b""
        while chunk := sock.recv(256):
            reply += chunk
    seen_ip, seen_port = reply.decode().split()
    return seen_ip, int(seen_port), local_port


def outcome(ip: str, port: int, timeout_s: float = BLOCKED_S) -> str:
    """How a connect ends: connected, refused, unreachable or timeout."""
    try:
        socket.create_connection((ip, port), timeout=timeout_s).close()
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return "unreachable"
        raise


def reaches(host, ip: str, port: int = WHO_PORT, tries: int = 20) -> bool:
    """`host` connects within `tries` attempts: a link just brought up may refuse the first ones."""
    for _ in range(tries):
        if in_host(host, lambda: outcome(ip, port, 1.0)) == "connected":
            return True
        time.sleep(0.25)
    return False


def blocked(host, ip: str, port: int = WHO_PORT) -> bool:
    return in_host(host, lambda: outcome(ip, port, 1.0)) != "connected"


# ---- labs ------------------------------------------------------------------------------------------


class Labs:
    """The labs and servers a test made: servers stopped, labs closed after it."""

    def __init__(self) -> None:
        self.made: list[Lab] = []
        self.stops: list[Callable[[], None]] = []

    def new(self, names: list[str], tag: str) -> Lab:
        lab = Lab(names, tag=tag)
        self.made.append(lab)
        return lab

    def serve(self, hosts: list, handlers: dict[int, type[socketserver.BaseRequestHandler]]) -> None:
        self.stops.extend(serve(host, handlers) for host in hosts)


@pytest.fixture
def labs(lab_machine):
    made = Labs()
    yield made
    for stop in made.stops:
        stop()
    for lab in made.made:
        lab.close()
        assert not lab.namespaces_left()


# ---- the tests ---------------------------------------------------------------------------------------


def http_get(ip: str, path: str) -> tuple[int, bytes]:
    deadline = time.monotonic() + 60  # the server is a fresh Python process: wait for it to listen
    while True:
        conn = http.client.HTTPConnection(ip, HTTP_PORT, timeout=10)
        try:
            conn.request("GET", path)
            reply = conn.getresponse()
            return reply.status, reply.read()
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            conn.close()


def forward_policy_drops(router) -> int:
    """Packets the router's FORWARD policy (DROP) dropped: new connections from outside to its LAN."""
    header = router.run("iptables", "-w", "-L", "FORWARD", "-v", "-x", "-n").stdout.splitlines()[0]
    match = re.search(r"policy DROP (\d+) packets", header)
    assert match, header
    return int(match.group(1))


def test_a_home_dials_out_and_nobody_dials_in(labs, tmp_path):
    lab = labs.new(["pub"], "nat")
    pub, home = lab["pub"], lab.add_home("home")
    router = home.router
    assert lab.router("home") is router and lab.router(router.name) is router and router.kind == "router"
    labs.serve([pub, home], {WHO_PORT: WhoHandler})

    (tmp_path / "hello.txt").write_text("hello from pub\n")
    log = tmp_path / "http.log"
    with open(log, "wb") as out:
        args = [sys.executable, "-m", "http.server", "--bind", pub.ip, "--directory", str(tmp_path), str(HTTP_PORT)]
        pub.popen(args, stdout=out, stderr=subprocess.STDOUT)
    status, body = in_host(home, lambda: http_get(pub.ip, "/hello.txt"))
    assert (status, body) == (200, b"hello from pub\n")
    deadline = time.monotonic() + 10
    while "GET /hello.txt" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    requests = [line for line in log.read_text().splitlines() if "GET /hello.txt" in line]
    assert requests and requests[0].split()[0] == router.ip  # the server saw the router's address: masqueraded

    seen_ip, seen_port, local_port = in_host(home, lambda: who(pub.ip))
    assert seen_ip == home.public_ip == router.ip
    assert in_host(router, lambda: who(home.ip))[0] == router.lan_ip  # the home listens; its LAN reaches it

    began = time.monotonic()
    to_private = in_host(pub, lambda: outcome(home.ip, WHO_PORT))  # no route to a private subnet
    to_router = in_host(pub, lambda: outcome(router.ip, WHO_PORT))  # no port forwarding
    pub.run("ip", "route", "add", router.lan, "via", router.ip)  # a neighbour routing into the LAN anyway
    drops_before = forward_policy_drops(router)
    routed = in_host(pub, lambda: outcome(home.ip, WHO_PORT))
    took = time.monotonic() - began
    print(f"\nhome -> pub seen as {seen_ip}:{seen_port} (home port {local_port}); pub -> home {to_private}, ")
    print(f"pub -> router:{WHO_PORT} {to_router}, pub -> home routed via the router {routed}; {took:.1f} s in all")
    assert to_private == "unreachable" and to_router == "refused"
    assert routed == "timeout" and forward_policy_drops(router) > drops_before  # the forward filter dropped it
    assert took < 3 * BLOCKED_S + 5


def same_port_to_both(ip_a: str, ip_b: str) -> tuple[int, tuple[str, int], tuple[str, int]]:
    """Two connections from one local port (SO_REUSEPORT) to two hosts: (the local port, the
    source each host saw). A NAT that keeps the mapping per port (hole punching works) shows both
    the same source; a symmetric one shows two."""
    socks = []
    for _ in range(2):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        socks.append(sock)
    socks[0].bind(("0.0.0.0", 0))
    local_port = socks[0].getsockname()[1]
    socks[1].bind(("0.0.0.0", local_port))
    a_ip, a_port, _ = who(ip_a, socks[0])
    b_ip, b_port, _ = who(ip_b, socks[1])
    return local_port, (a_ip, a_port), (b_ip, b_port)


def test_plain_nat_keeps_the_home_s_port_and_symmetric_nat_draws_a_fresh_one_per_connection(labs):
    lab = labs.new(["pub_a", "pub_b"], "natsym")
    a, b = lab["pub_a"], lab["pub_b"]
    plain, symmetric = lab.add_home("plain"), lab.add_home("sym", symmetric=True)
    assert not plain.router.symmetric and symmetric.router.symmetric
    assert "--random-fully" in symmetric.router.run("iptables", "-w", "-t", "nat", "-S").stdout
    labs.serve([a, b], {WHO_PORT: WhoHandler})
    trials = lambda: [same_port_to_both(a.ip, b.ip) for _ in range(TRIALS)]
    seen = {h.name: in_host(h, trials) for h in (plain, symmetric)}
    print()
    for name, trials in seen.items():
        print(f"{name}: " + ", ".join(f"{lp} -> {pa}/{pb}" for lp, (_, pa), (_, pb) in trials))
    for local_port, (a_ip, a_port), (b_ip, b_port) in seen["plain"]:
        assert a_ip == b_ip == plain.router.ip
        assert a_port == b_port == local_port  # nothing else on the router's address: the port is kept
    kept = 0
    for local_port, (a_ip, a_port), (b_ip, b_port) in seen["sym"]:
        assert a_ip == b_ip == symmetric.router.ip
        kept += a_port == local_port or b_port == local_port or a_port == b_port
    # --random-fully draws each port at random from ~64k: one coincidence in TRIALS is ~1e-4 likely, two ~1e-8
    assert kept <= 1


def test_two_homes_behind_one_router_meet_on_their_lan_and_share_its_address(labs):
    lab = labs.new(["pub"], "nat2")
    pub, h1 = lab["pub"], lab.add_home("h1")
    h2 = lab.add_home("h2", router=h1.router.name)
    router = lab.router("h2")
    assert router is lab.router("h1") and router.homes == [h1, h2] and h1.lan == h2.lan == router.lan
    with pytest.raises(ValueError):
        lab.add_home("h3", router=router, symmetric=True)  # a router has one NAT
    labs.serve([pub, h1, h2], {WHO_PORT: WhoHandler})
    assert in_host(h1, lambda: who(h2.ip))[0] == h1.ip  # directly on the LAN: no NAT between them
    assert in_host(h2, lambda: who(h1.ip))[0] == h2.ip
    assert in_host(h1, lambda: who(pub.ip))[0] == in_host(h2, lambda: who(pub.ip))[0] == router.ip
    assert in_host(pub, lambda: outcome(router.ip, WHO_PORT)) == "refused"


def upload(ip: str, count: int) -> float:
    """Mbit/s of `count` bytes sent to the rate server, as the server received them."""
    with socket.create_connection((ip, RATE_PORT), timeout=60) as sock:
        sock.sendall(b"U")
        send_bytes(sock, count)
        total, seconds = struct.unpack("!Qd", recv_exactly(sock, 16))
    assert total == count
    return total * 8 / seconds / 1e6


def download(ip: str, count: int) -> float:
    """Mbit/s of `count` bytes from the rate server, as received here."""
    with socket.create_connection((ip, RATE_PORT), timeout=60) as sock:
        sock.sendall(b"D" + struct.pack("!Q", count))
        total, first, last = receive_all(sock)
    assert total == count
    return total * 8 / (last - first) / 1e6


def qdisc(netns: str, dev: str) -> str:
    return sh("ip", "netns", "exec", netns, "tc", "qdisc", "show", "dev", dev).stdout


def test_a_home_line_is_capped_each_way_on_its_own_ends(labs):
    lab = labs.new(["pub"], "natcap")
    pub, home = lab["pub"], lab.add_home("home")
    router = home.router
    labs.serve([pub], {RATE_PORT: RateHandler})
    lab.cap("home", up=UP_MBIT, down=DOWN_MBIT)
    assert f"rate {UP_MBIT}Mbit" in qdisc(home.netns, "eth0")  # upload: what leaves the home
    assert f"rate {DOWN_MBIT}Mbit" in qdisc(router.netns, home.veth)  # download: what the router sends it
    up = in_host(home, lambda: upload(pub.ip, UP_BYTES))
    down = in_host(home, lambda: download(pub.ip, DOWN_BYTES))
    lab.cap("home", up=UP_MBIT)  # download unshaped
    assert "tbf" not in qdisc(router.netns, home.veth)
    free_down = in_host(home, lambda: download(pub.ip, DOWN_BYTES))
    lab.clear("home")
    assert "tbf" not in qdisc(home.netns, "eth0") and "tbf" not in qdisc(router.netns, home.veth)
    lab.cap(router.name, 50)  # a router's link is its uplink, shared by its homes: both ends of it
    assert "rate 50Mbit" in qdisc(router.netns, "eth0") and "rate 50Mbit" in qdisc(lab.bridge_ns, router.veth)
    lab.clear(router.name)
    assert "tbf" not in qdisc(router.netns, "eth0") and "tbf" not in qdisc(lab.bridge_ns, router.veth)
    print(f"\nMbit/s: capped {UP_MBIT} up / {DOWN_MBIT} down: up {up:.1f}, down {down:.1f}; ", end="")
    print(f"with the download unshaped {free_down:.0f}")
    assert up < UP_MBIT * RATE_SLACK and down < DOWN_MBIT * RATE_SLACK
    assert down > DOWN_OVER_UP * up
    assert free_down > FASTER * UP_MBIT


def connect_time(ip: str) -> float:
    """Seconds to connect to the echo server at `ip`, checked with a one-byte echo."""
    began = time.monotonic()
    with socket.create_connection((ip, ECHO_PORT), timeout=30) as sock:
        took = time.monotonic() - began
        sock.sendall(b"x")
        assert sock.recv(1) == b"x"
    return took


def test_delays_on_homes_routers_and_public_hosts_add_up(labs):
    lab = labs.new(["pub"], "natdelay")
    pub, home = lab["pub"], lab.add_home("home")
    router = home.router
    labs.serve([pub, router, home], {ECHO_PORT: EchoHandler})
    home.delay(D_HOME)
    pub.delay(D_PUBLIC)
    router.delay(D_ROUTER)
    late = lab.add_home("late", router=router)  # added while delays are on: it gets its proxy too
    measured = {
        "home->pub": (in_host(home, lambda: connect_time(pub.ip)), D_HOME + D_PUBLIC),
        "pub->router": (in_host(pub, lambda: connect_time(router.ip)), D_PUBLIC + D_ROUTER),
        "router->pub": (in_host(router, lambda: connect_time(pub.ip)), D_ROUTER + D_PUBLIC),
        "home->router lan": (in_host(home, lambda: connect_time(router.lan_ip)), D_HOME + D_ROUTER),
        "home->router public": (in_host(home, lambda: connect_time(router.ip)), D_HOME + D_ROUTER),
        "router->home": (in_host(router, lambda: connect_time(home.ip)), D_ROUTER + D_HOME),
        "late->home": (in_host(late, lambda: connect_time(home.ip)), D_HOME),
        "late->pub": (in_host(late, lambda: connect_time(pub.ip)), D_PUBLIC),
    }
    lab.clear()
    cleared = in_host(home, lambda: connect_time(pub.ip))
    print(f"\none-way ms: home {D_HOME * 1e3:.0f}, pub {D_PUBLIC * 1e3:.0f}, router {D_ROUTER * 1e3:.0f}; connect ms:")
    for what, (took, one_way) in measured.items():
        print(f"  {what:20} {took * 1e3:7.1f}  (added round trip {2 * one_way * 1e3:.0f})")
    print(f"  {'cleared home->pub':20} {cleared * 1e3:7.1f}")
    for what, (took, one_way) in measured.items():
        assert 2 * one_way <= took < 2 * one_way + DELAY_SLACK_S, what
    assert cleared < D_HOME
    for host in lab.hosts.values():
        assert "REDIRECT" not in host.run("iptables-save").stdout
    assert "MASQUERADE" in router.run("iptables-save").stdout  # the NAT is the lab's shape: clear keeps it


def udp_burst(ip: str, count: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(count):
            s.sendto(b"x", (ip, UDP_PORT))


def statistic_drops(host, chain: str) -> int:
    out = host.run("iptables", "-w", "-L", chain, "-v", "-x", "-n").stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if "statistic" in line)


def test_cut_split_and_loss_act_on_a_home_s_own_link_and_a_router_s_uplink(labs):
    lab = labs.new(["pub", "pub2"], "natfault")
    pub, pub2, h1 = lab["pub"], lab["pub2"], lab.add_home("h1")
    h2 = lab.add_home("h2", router=h1.router)
    router = h1.router
    labs.serve([pub, pub2, h2], {WHO_PORT: WhoHandler})

    lab.split(["h1"], ["pub"])
    assert blocked(h1, pub.ip)
    assert reaches(h1, pub2.ip) and reaches(h2, pub.ip) and reaches(h1, h2.ip)
    lab.clear("h1")
    assert reaches(h1, pub.ip)
    assert "DROP" not in router.run("iptables", "-w", "-S", "FORWARD").stdout.replace("-P FORWARD DROP", "")

    lab.block_port("h2", WHO_PORT)  # a home's own firewall: its LAN neighbour is dropped too
    assert blocked(h1, h2.ip) and in_host(h1, lambda: outcome(h2.ip, WHO_PORT)) == "timeout"
    lab.clear("h2")
    assert reaches(h1, h2.ip)

    lab.cut("h1")  # its own link: LAN and outside gone
    assert blocked(h1, pub.ip) and blocked(h1, h2.ip) and reaches(h2, pub.ip)
    lab.heal("h1")
    assert reaches(h1, pub.ip)
    lab.cut(router.name)  # the uplink: every home loses the outside, the LAN stays
    assert blocked(h1, pub.ip) and blocked(h2, pub.ip) and reaches(h1, h2.ip)
    lab.heal(router.name)
    assert reaches(h1, pub.ip) and reaches(h2, pub.ip)

    lab.loss("h1", 20)
    in_host(h1, lambda: udp_burst(pub.ip, DATAGRAMS))
    dropped = statistic_drops(router, "FORWARD")  # what h1 sends beyond its LAN is dropped at its router
    print(f"\nloss 20 % on h1: {dropped} of {DATAGRAMS} datagrams to pub dropped at the router")
    assert 0.10 * DATAGRAMS < dropped < 0.30 * DATAGRAMS
    lab.clear()
    assert not any("statistic" in h.run("iptables", "-w", "-S").stdout for h in lab.hosts.values())


DHT_NODE = """
import asyncio, json, os, sys
import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from multiaddr import Multiaddr

KEY = "from-public"


def write(path, value):
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.rename(path + ".tmp", path)


role, ip, out, *initial = sys.argv[1:]
if role == "stranger":  # a fresh public peer: dial the public node, then the home, with no DHT in between
    async def dial(p2p, peer_id, maddrs):
        try:
            await asyncio.wait_for(p2p._client.connect(peer_id, maddrs), timeout=20)
            return "connected"
        except Exception as e:
            return type(e).__name__

    async def main():
        targets = json.load(open(initial[0]))
        p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"])
        results = {}
        for name, maddrs in targets.items():
            for maddr in maddrs:
                addr, peer_id = maddr.rsplit("/p2p/", 1)
                results[f"{name} {maddr}"] = await dial(p2p, PeerID.from_base58(peer_id), [Multiaddr(addr)])
        write(out + ".dials", results)
        await p2p.shutdown()

    asyncio.run(main())
    sys.exit(0)

dht = hivemind.DHT(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=initial, start=True)
me = str(dht.peer_id)
write(out + ".maddrs", {"peer_id": me, "maddrs": [str(m) for m in dht.get_visible_maddrs()]})
if role == "public":
    assert dht.store(KEY, "hello from public", get_dht_time() + 600)

    async def watch():  # the remote address of every connection this node has
        p2p = await dht.replicate_p2p()
        while True:
            peers = {str(p.peer_id): [str(a) for a in p.addrs] for p in await p2p.list_peers()}
            write(out + ".peers", peers)
            await asyncio.sleep(0.5)

    asyncio.run(watch())
else:
    while (found := dht.get(KEY, latest=True)) is None:
        pass
    write(out + ".found", found.value)
    import time
    time.sleep(3600)  # the lab ends it
"""


def wait_json(path: Path, timeout_s: float, procs: list[subprocess.Popen], until: Callable[[Any], bool] = bool) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists():
            value = json.loads(path.read_text())
            if until(value):
                return value
        assert time.monotonic() < deadline, f"no {path.name} within {timeout_s:.0f} s"
        assert all(p.poll() is None for p in procs), "a DHT node exited"
        time.sleep(0.2)


@pytest.mark.timeout(400)
def test_a_dht_node_at_home_joins_through_a_public_one_which_cannot_dial_it(labs, tmp_path):
    lab = labs.new(["pub", "stranger"], "natdht")
    pub, stranger, home = lab["pub"], lab["stranger"], lab.add_home("home")
    script = tmp_path / "dht_node.py"
    script.write_text(DHT_NODE)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("pub", "home", "stranger")}

    def start(host, role: str, *initial: str) -> subprocess.Popen:
        args = [sys.executable, str(script), role, host.ip, str(tmp_path / host.name), *initial]
        return host.popen(args, stdout=logs[host.name], stderr=subprocess.STDOUT, env=env)

    procs = [start(pub, "public")]
    try:
        pub_info = wait_json(tmp_path / "pub.maddrs", 180, procs)
        procs.append(start(home, "home", *pub_info["maddrs"]))
        found = wait_json(tmp_path / "home.found", 180, procs)
        home_info = wait_json(tmp_path / "home.maddrs", 30, procs)
        peers = wait_json(tmp_path / "pub.peers", 30, procs, lambda p: home_info["peer_id"] in p)
        targets = tmp_path / "targets.json"
        at_router = [m.replace(f"/ip4/{home.ip}/", f"/ip4/{home.router.ip}/") for m in home_info["maddrs"]]
        targets.write_text(json.dumps({"pub": pub_info["maddrs"], "home": home_info["maddrs"] + at_router}))
        dialer = start(stranger, "stranger", str(targets))
        assert dialer.wait(120) == 0
        dials = json.loads((tmp_path / "stranger.dials").read_text())
    except AssertionError:
        print("\n".join(f"--- {n}.log\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in logs))
        raise
    finally:
        for log in logs.values():
            log.close()
    seen_from = peers[home_info["peer_id"]]
    print(f"\nhome found {found!r}; pub sees the home's connection from {seen_from}; ", end="")
    print(f"home announces {home_info['maddrs']}")
    print("a fresh public peer dialing: " + json.dumps(dials, indent=1))
    assert found == "hello from public"
    assert any(f"/ip4/{home.router.ip}/" in a for a in seen_from) and not any(home.ip in a for a in seen_from)
    assert all(result == "connected" for what, result in dials.items() if what.startswith("pub "))
    home_dials = {what.split()[1]: result for what, result in dials.items() if what.startswith("home ")}
    assert any(home.ip in m for m in home_dials) and any(home.router.ip in m for m in home_dials)
    assert all(result != "connected" for result in home_dials.values())  # neither its address nor the router's


DOOMED_SESSION = """
import time
from phalanx.tools.lab.hosts import Lab

lab = Lab(["pub"], tag="doomed")
home = lab.add_home("home")
lab.add_home("home2", router=home.router)
home.popen(["sleep", "600"])
print(lab.id, flush=True)
time.sleep(600)  # killed before its cleanup
"""


def test_sweep_stale_removes_a_dead_session_s_routers_homes_and_their_processes(lab_machine):
    from phalanx.tools.lab.hosts import sweep_stale

    session = subprocess.Popen(
        [sys.executable, "-c", DOOMED_SESSION], stdout=subprocess.PIPE, text=True, env=script_env()
    )
    try:
        lab_id = session.stdout.readline().strip()
        assert lab_id, "the doomed session did not build its lab"
    finally:
        session.kill()
        session.wait()
        session.stdout.close()
    left = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(lab_id + "-")]
    assert len(left) == 5  # the bridge's, the public host's, the router's, the two homes'
    home_ns = f"{lab_id}-h1"
    deadline = time.monotonic() + 30  # `ip netns exec` enters the namespace after Popen returns
    while not (stray := [int(p) for p in sh("ip", "netns", "pids", home_ns).stdout.split()]):
        assert time.monotonic() < deadline, "the doomed session's process never ran in its home"
        time.sleep(0.05)
    removed = sweep_stale()
    assert set(left) <= set(removed)
    assert not [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(lab_id + "-")]
    deadline = time.monotonic() + 10  # SIGKILL lands when the process is next scheduled
    while any(alive(pid) for pid in stray):
        assert time.monotonic() < deadline, f"processes of the dead session still run: {stray}"
        time.sleep(0.05)

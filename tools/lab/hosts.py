"""A lab of separate network hosts on one machine: each host a Linux network namespace with one
veth link to a bridge that lives in a namespace of its own, so nothing touches the machine's own
network and parallel sessions cannot collide (every name carries this process's PID).

Home routers: `add_home` puts a host behind a router of its own (or a shared one), the shape most
volunteers have: they can dial out, nobody can dial them. A router is a lab host with a second
interface, `lan0`, a bridge on a private subnet (10.78.<n>.0/24) whose ports are its homes' links;
it forwards, masquerades what leaves its uplink for the LAN (`--random-fully` when `symmetric`: a
fresh random source port per connection, so hole punching cannot work), and forwards from outside
to a home only what belongs to a connection the home opened (no port forwarding). Homes behind one
router reach each other directly on the LAN and share its public address.

Faults act on a host's link: a public host's or a router's is its veth to the lab bridge (a
router's is the uplink all its homes share), a home's is its veth to its router's LAN. `cut`/`heal`
(the link down/up at its far end), `split` (iptables DROP between two sets of hosts), `block_port`
(a firewall dropping TCP to one port), `loss` (iptables `statistic` drops, both directions), `cap`
(tc tbf, each direction its own rate: `up` on the host's own end, `down` on the far end), `delay`
(added TCP latency: a user-space proxy in each host, delay_proxy.py), `clear`. Drops happen where a
packet first arrives (for a home's traffic beyond its LAN, at its router): a sender sees silence.
Processes start inside a host with `ip netns exec`, peers as forks that entered its namespace
(`Host.fork_phalanx`); `Host.thread_in` runs a function in a thread
that entered the host's namespace (HTTP polls of a peer's 127.0.0.1 port). Needs root.
`Lab.close()` removes what the lab made; `sweep_stale()` removes namespaces of dead sessions.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from phalanx.tools.lab.delay_proxy import DelayProxies
from phalanx.tools.lab.forks import ForkedPopen, zygote
from phalanx.tools.lab.procs import alive, enter_netns

PREFIX = "phxlab"
SUBNET = "10.77.0"  # private; reachable only inside this lab's namespaces
# a subnet libp2p counts as public (it advertises circuits through relays there and punches holes between
# homes behind them); it too exists only inside the lab's namespaces, which have no route out
PUBLIC_LOOKING_SUBNET = "11.77.0"
LAN_BASE = "10.78"  # router n's LAN is 10.78.<n>.0/24: its own address .1, its homes .2 and up
UPLINK = "eth0"  # every host's link to the lab (a router's uplink, a home's link to its LAN)
LAN_DEV = "lan0"  # a router's LAN: a bridge whose ports are its homes' links
MAX_PUBLIC = 250  # public addresses (hosts and routers) on the lab subnet
MAX_ROUTERS = 250  # LAN subnets
MAX_HOMES_PER_ROUTER = 250  # addresses on one LAN
PUBLIC, ROUTER, HOME = "public", "router", "home"  # Host.kind
BRIDGE_NF_CALL_IPTABLES = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")  # br_netfilter present


def missing_requirements() -> Optional[str]:
    """Why this machine cannot host a lab (None when it can)."""
    if os.geteuid() != 0:
        return "network-namespace fault tests need root (ip netns, iptables, tc)"
    missing = [tool for tool in ("ip", "iptables", "tc") if shutil.which(tool) is None]
    if missing:
        return f"network-namespace fault tests need {', '.join(missing)} (apt-get install iproute2 iptables)"
    return None


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def sweep_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone (a session killed before its cleanup),
    and the processes left inside them."""
    removed = []
    for name in sh("ip", "netns", "list", check=False).stdout.split():
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not alive(int(parts[1])):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():  # peers it left running
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass(eq=False)  # hosts are compared by identity (a home and its router refer to each other)
class Host:
    """One network host: namespace `netns`, address `ip`, link `veth` on the far side (the lab
    bridge's port, or for a home its router's LAN port: see `link_ns`)."""

    lab: "Lab"
    index: int
    name: str
    netns: str
    ip: str
    veth: str
    procs: list[subprocess.Popen | ForkedPopen] = field(default_factory=list)
    kind: str = PUBLIC
    router: Optional["Host"] = field(default=None, repr=False)  # a home's router
    lan: Optional[str] = None  # a router's or a home's LAN subnet (CIDR)
    lan_ip: Optional[str] = None  # a router's address on its LAN: its homes' gateway
    symmetric: bool = False  # a router's NAT: a fresh random source port per connection
    homes: list["Host"] = field(default_factory=list, repr=False)  # a router's homes

    @property
    def link_ns(self) -> str:
        """The namespace holding the far end of this host's link."""
        return self.router.netns if self.router is not None else self.lab.bridge_ns

    @property
    def public_ip(self) -> str:
        """The address the lab's public hosts see this host's connections come from."""
        return self.router.ip if self.router is not None else self.ip

    @property
    def addresses(self) -> list[str]:
        """Every address of this host (a router's public one and its LAN one)."""
        return [self.ip] if self.lan_ip is None else [self.ip, self.lan_ip]

    @property
    def links(self) -> list[tuple[str, str]]:
        """(interface, subnet) of every lab subnet this host dials, and the interface it leaves by."""
        lab_subnet = (UPLINK, f"{self.lab.subnet}.0/24")
        if self.kind == ROUTER:
            return [lab_subnet, (LAN_DEV, self.lan)]
        if self.kind == HOME:
            return [lab_subnet, (UPLINK, self.lan)]  # all through its router, LAN neighbours directly
        return [lab_subnet]

    def exec_args(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh(*self.exec_args(list(args)), check=check)

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """Start `args` inside this host in a session of its own (its process group is its PID);
        the lab kills the group on close."""
        proc = subprocess.Popen(self.exec_args(args), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def fork_phalanx(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> "ForkedPopen":
        """`phalanx *argv` inside this host as a fork of this process's zygote (see `popen`), its stdout
        and stderr appended to `log`: the 5 CPU-seconds of a fresh interpreter's imports, saved."""
        with open(log, "ab") as out:  # the fork keeps its own descriptor
            proc = zygote().spawn(argv, env, out.fileno(), None, cwd=str(cwd), netns=self.netns)
        self.procs.append(proc)
        return proc

    def delay(self, one_way_s: Optional[float]) -> None:
        """`Lab.delay` of this host."""
        self.lab.delay(self.name, one_way_s)

    def thread_in(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            enter_netns(self.netns)
            target()

        thread = threading.Thread(target=run, name=f"{self.name}-{name}", daemon=True)
        thread.start()
        return thread


@dataclass(frozen=True, eq=False)
class Rule:
    """An iptables rule a fault added: where, and which hosts' `clear` removes it."""

    host: Host
    chain: str
    spec: tuple[str, ...]
    about: frozenset[str]


class Lab:
    """Hosts on one bridge, and homes behind routers on it. Use as a context manager or call
    `close()`; idempotent."""

    def __init__(self, names: list[str], tag: str = "s", *, subnet: str = SUBNET) -> None:
        """`subnet`: the first three octets of the public hosts' /24 (`PUBLIC_LOOKING_SUBNET` for what
        libp2p does on the internet)."""
        self.id = f"{PREFIX}-{os.getpid()}-{tag}"
        self.subnet = subnet
        self.bridge_ns = f"{self.id}-br"
        self.hosts: dict[str, Host] = {}  # public hosts, routers and homes
        self._rules: list[Rule] = []
        self._public = 0  # addresses given on the lab subnet (hosts and routers)
        self._routers = 0
        self._homes = 0
        self.delay_proxies: Optional[DelayProxies] = None  # made by the first `delay`
        self._closed = False
        try:
            self._build(names)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self, names: list[str]) -> None:
        if len(names) > MAX_PUBLIC:
            raise ValueError(f"a lab has at most {MAX_PUBLIC} hosts")
        sh("ip", "netns", "add", self.bridge_ns)
        sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for name in names:
            self._add_public(name, PUBLIC)

    def _register(self, host: Host) -> None:
        """Record `host` before its namespace exists: a failure halfway leaves it for `close`."""
        if host.name in self.hosts:
            raise ValueError(f"the lab already has a host called {host.name!r}")
        self.hosts[host.name] = host
        sh("ip", "netns", "add", host.netns)
        sh("ip", "-n", host.netns, "link", "set", "lo", "up")

    def _add_public(self, name: str, kind: str) -> Host:
        if self._public >= MAX_PUBLIC:
            raise ValueError(f"a lab has at most {MAX_PUBLIC} hosts and routers")
        self._public += 1
        i = self._public
        host = Host(self, i, name, f"{self.id}-{i}", f"{self.subnet}.{i}", f"v{i}", kind=kind)
        self._register(host)
        # both ends are made inside the lab's namespaces: no interface name in the machine's own
        peer = ["peer", "name", UPLINK, "netns", host.netns]
        sh("ip", "-n", self.bridge_ns, "link", "add", host.veth, "type", "veth", *peer)
        sh("ip", "-n", self.bridge_ns, "link", "set", host.veth, "master", "br0", "up")
        sh("ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", UPLINK)
        sh("ip", "-n", host.netns, "link", "set", UPLINK, "up")
        return host

    def add_router(self, name: str, *, symmetric: bool = False, stealth: bool = False) -> Host:
        """A home router: a lab host (public address, uplink `eth0`) with a LAN for homes behind it.
        It forwards and masquerades the LAN's connections out of its uplink (`--random-fully` when
        `symmetric`) and lets in from outside only what belongs to them: nobody can dial a home.
        Its own connections are not masqueraded (it is a host as well: its ports stay its own). A
        `stealth` router drops what nobody asked for instead of refusing it, as most home routers do:
        a refusal would kill the simultaneous open of a hole punch whose other half comes late."""
        if self._routers >= MAX_ROUTERS:
            raise ValueError(f"a lab has at most {MAX_ROUTERS} routers")
        self._routers += 1
        n = self._routers
        router = self._add_public(name, ROUTER)
        router.lan, router.lan_ip, router.symmetric = f"{LAN_BASE}.{n}.0/24", f"{LAN_BASE}.{n}.1", symmetric
        router.run("ip", "link", "add", LAN_DEV, "type", "bridge")
        router.run("ip", "addr", "add", f"{router.lan_ip}/24", "dev", LAN_DEV)
        router.run("ip", "link", "set", LAN_DEV, "up")
        router.run("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        if BRIDGE_NF_CALL_IPTABLES.exists():  # LAN neighbours talk through a switch, not the router's firewall
            router.run("sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=0")
        masquerade = ["-j", "MASQUERADE", *(["--random-fully"] if symmetric else [])]
        router.run("iptables", "-w", "-t", "nat", "-A", "POSTROUTING", "-s", router.lan, "-o", UPLINK, *masquerade)
        router.run("iptables", "-w", "-A", "FORWARD", "-i", LAN_DEV, "-o", UPLINK, "-j", "ACCEPT")
        established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        router.run("iptables", "-w", "-A", "FORWARD", "-i", UPLINK, "-o", LAN_DEV, *established)
        router.run("iptables", "-w", "-P", "FORWARD", "DROP")
        if stealth:
            router.run("iptables", "-w", "-A", "INPUT", "-i", UPLINK, "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
        self._refresh_delays()
        return router

    def add_home(
        self, name: str, *, symmetric: Optional[bool] = None, router: Optional[str | Host] = None, stealth: bool = False
    ) -> Host:
        """A home host behind a router: a new one called `<name>-router` (NAT `symmetric` or not),
        or `router` (a router's or a home's name, or the Host), whose NAT it shares. The home has an
        address on the router's LAN and its default route through the router."""
        if router is None:
            gateway = self.add_router(f"{name}-router", symmetric=bool(symmetric), stealth=stealth)
        else:
            gateway = self.router(router if isinstance(router, str) else router.name)
            if symmetric is not None and symmetric != gateway.symmetric:
                raise ValueError(f"router {gateway.name} has symmetric={gateway.symmetric}")
        if len(gateway.homes) >= MAX_HOMES_PER_ROUTER:
            raise ValueError(f"a router has at most {MAX_HOMES_PER_ROUTER} homes")
        self._homes += 1
        j = self._homes
        assert gateway.lan is not None and gateway.lan_ip is not None
        ip = f"{gateway.lan_ip.rsplit('.', 1)[0]}.{len(gateway.homes) + 2}"
        home = Host(self, j, name, f"{self.id}-h{j}", ip, f"h{j}", kind=HOME, router=gateway, lan=gateway.lan)
        self._register(home)
        gateway.homes.append(home)
        peer = ["peer", "name", UPLINK, "netns", home.netns]
        sh("ip", "-n", gateway.netns, "link", "add", home.veth, "type", "veth", *peer)
        sh("ip", "-n", gateway.netns, "link", "set", home.veth, "master", LAN_DEV, "up")
        home.run("ip", "addr", "add", f"{home.ip}/24", "dev", UPLINK)
        home.run("ip", "link", "set", UPLINK, "up")
        home.run("ip", "route", "add", "default", "via", gateway.lan_ip)
        self._refresh_delays()
        return home

    def router(self, name: str) -> Host:
        """The router `name`, or the router home `name` sits behind."""
        host = self.hosts[name]
        if host.kind == ROUTER:
            return host
        if host.router is None:
            raise ValueError(f"{name} is a public host: no router")
        return host.router

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _refresh_delays(self) -> None:
        """A host added while delays are on gets its proxy and rules, as every host has."""
        if self.delay_proxies is not None and self.delay_proxies.delays:
            name, one_way_s = next(iter(self.delay_proxies.delays.items()))
            self.delay_proxies.set(name, one_way_s)

    # ---- faults ---------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Partition `name` from everyone: its link goes down at the far end (no RST, no ICMP). A
        router's homes lose the outside and keep their LAN; a cut home loses its LAN too."""
        host = self.hosts[name]
        sh("ip", "-n", host.link_ns, "link", "set", host.veth, "down")

    def heal(self, name: str) -> None:
        host = self.hosts[name]
        sh("ip", "-n", host.link_ns, "link", "set", host.veth, "up")

    def _iptables(self, host: Host, chain: str, spec: list[str], about: tuple[str, ...]) -> None:
        """Add a fault's rule. In a router's FORWARD chain it goes first: before the NAT's accepts."""
        where = ["-I", chain, "1"] if chain == "FORWARD" else ["-A", chain]
        host.run("iptables", "-w", *where, *spec)
        self._rules.append(Rule(host, chain, tuple(spec), frozenset(about)))

    def _first_arrival(self, sender: Host, receiver: Host) -> Optional[tuple[Host, str, list[str]]]:
        """Where a packet from `sender` to `receiver` first arrives, and an iptables match for it
        there: a home's packets beyond its LAN are matched at its router (after it, they carry the
        router's address), packets to a home from beyond at its router too. None: nothing gets there."""
        if sender.kind == HOME:
            if receiver is sender.router:
                return receiver, "INPUT", ["-i", LAN_DEV, "-s", sender.ip]
            if receiver.router is sender.router:  # a neighbour on the LAN
                return receiver, "INPUT", ["-i", UPLINK, "-s", sender.ip]
            if receiver.kind == HOME:  # behind another router: it can only reach that router
                return None
            return sender.router, "FORWARD", ["-i", LAN_DEV, "-s", sender.ip, "-d", receiver.ip]
        if receiver.kind == HOME:
            if receiver.router is sender:
                return receiver, "INPUT", ["-i", UPLINK, "-s", sender.lan_ip]
            return receiver.router, "FORWARD", ["-i", UPLINK, "-s", sender.ip, "-d", receiver.ip]
        return receiver, "INPUT", ["-i", UPLINK, "-s", sender.ip]

    def split(self, side_a: list[str], side_b: list[str]) -> None:
        """Drop every packet between the two sides (each side still reaches itself). Packets are
        dropped where they first arrive, as a broken network does: a sender sees silence, not a
        local error. A router and its homes are separate hosts here: name the homes to split them."""
        for mine, theirs in ((side_a, side_b), (side_b, side_a)):
            for name in mine:
                for other in theirs:
                    arrival = self._first_arrival(self.hosts[name], self.hosts[other])
                    if arrival is not None:
                        host, chain, match = arrival
                        self._iptables(host, chain, [*match, "-j", "DROP"], (name, other))

    def block_port(self, name: str, port: int) -> None:
        """A firewall on `name`: TCP to `port` arriving there is dropped (the sender sees silence);
        at a router, from its LAN too. Loopback stays open."""
        host = self.hosts[name]
        for dev in [UPLINK, LAN_DEV] if host.kind == ROUTER else [UPLINK]:
            spec = ["-i", dev, "-p", "tcp", "--dport", str(port), "-j", "DROP"]
            self._iptables(host, "INPUT", spec, (name,))

    def loss(self, name: str, pct: float) -> None:
        """Drop `pct` % of the packets crossing `name`'s link in each direction, independently at
        random: on arrival at `name`, and where what `name` sent first arrives. A router's link is
        its uplink: what it forwards both ways is lossy, its LAN is not."""
        if not 0 < pct < 100:
            raise ValueError(f"loss pct must be in (0, 100), got {pct}")
        random_drop = ["-m", "statistic", "--mode", "random", "--probability", f"{pct / 100:.6f}", "-j", "DROP"]
        lossy = self.hosts[name]
        self._iptables(lossy, "INPUT", ["-i", UPLINK, *random_drop], (name,))
        if lossy.kind == ROUTER:
            self._iptables(lossy, "FORWARD", ["-i", UPLINK, *random_drop], (name,))
        for other in self.hosts.values():
            if other is lossy or other.router is lossy:  # a router's own LAN is not its link
                continue
            arrival = self._first_arrival(lossy, other)
            if arrival is not None:
                host, chain, match = arrival
                self._iptables(host, chain, [*match, *random_drop], (name,))

    def _tbf(self, netns: str, dev: str, mbit: Optional[float]) -> None:
        """Shape what leaves `dev` to `mbit` Mbit/s (None: unshaped)."""
        if mbit is None:
            sh("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            return
        if mbit <= 0:
            raise ValueError(f"a cap must be > 0 Mbit/s, got {mbit}")
        rate = f"{int(mbit * 1000)}kbit"
        burst = f"{max(16, int(mbit * 1000 / 8 / 100))}kb"  # ~10 ms of traffic, at least a few packets
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", "200ms"]
        sh("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)

    def cap(
        self, name: str, mbit: Optional[float] = None, *, up: Optional[float] = None, down: Optional[float] = None
    ) -> None:
        """Shape `name`'s link: `up` Mbit/s for what it sends, `down` for what it receives (`mbit`
        both ways where not given; a direction left None is unshaped). tc tbf shapes what leaves
        an interface, so `up` sits on the host's own end of its link (`eth0`) and `down` on the far
        end: the bridge's port for a public host or a router (whose uplink its homes share), the
        router's LAN port for a home (its own line: each home behind a router is capped alone)."""
        up = mbit if up is None else up
        down = mbit if down is None else down
        if up is None and down is None:
            raise ValueError("cap needs a rate: mbit, up or down")
        host = self.hosts[name]
        self._tbf(host.netns, UPLINK, up)
        self._tbf(host.link_ns, host.veth, down)

    def delay(self, name: str, one_way_s: Optional[float]) -> None:
        """Add `one_way_s` of latency each way to every TCP connection `name` takes part in (A to B
        sees d_A + d_B each way, the connect included); 0 keeps the proxy in the path without delay,
        None removes it. Transparent to the host's processes; see delay_proxy.py. A router's delay
        is its own connections' (what it forwards for its homes takes theirs, not its own)."""
        if self.delay_proxies is None:
            self.delay_proxies = DelayProxies(self)
        self.delay_proxies.set(name, one_way_s)

    def clear(self, name: Optional[str] = None) -> None:
        """Undo every fault on `name` (every host when None): link up, no rules, no shaping, no
        delay. A router's NAT stays: it is the lab's shape, not a fault."""
        for host in [self.hosts[name]] if name else list(self.hosts.values()):
            if self.delay_proxies is not None and host.name in self.delay_proxies.delays:
                self.delay_proxies.set(host.name, None)
            self.heal(host.name)
            for rule in [r for r in self._rules if host.name in r.about]:
                rule.host.run("iptables", "-w", "-D", rule.chain, *rule.spec, check=False)
                self._rules.remove(rule)
            self._tbf(host.netns, UPLINK, None)
            self._tbf(host.link_ns, host.veth, None)

    # ---- teardown -------------------------------------------------------------------------

    def kill_all(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def leftover_processes(self) -> list[int]:
        """PIDs of any process still inside one of the lab's namespaces."""
        pids = []
        for host in self.hosts.values():
            out = sh("ip", "netns", "pids", host.netns, check=False).stdout
            pids += [int(p) for p in out.split()]
        return pids

    def close(self) -> None:
        """Kill the lab's processes (and any stray one inside its namespaces), delete every namespace.
        Deleting a namespace removes its links, bridge, iptables rules and qdiscs with it."""
        if self._closed:
            return
        self._closed = True
        self.kill_all()
        for pid in self.leftover_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for host in self.hosts.values():
            sh("ip", "netns", "del", host.netns, check=False)
        sh("ip", "netns", "del", self.bridge_ns, check=False)

    def namespaces_left(self) -> list[str]:
        return [n for n in sh("ip", "netns", "list", check=False).stdout.split() if n.startswith(self.id + "-")]

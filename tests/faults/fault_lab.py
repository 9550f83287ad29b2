"""A lab of separate network hosts on one machine: each host a Linux network namespace with one
veth link to a bridge that lives in a namespace of its own, so nothing touches the machine's own
network and parallel sessions cannot collide (every name carries this process's PID).

Faults: `cut`/`heal` (the host's link down/up at the bridge), `split` (iptables DROP between two
sets of hosts), `block_port` (a firewall dropping TCP to one port), `loss` (iptables `statistic` drops, both directions; all drops on arrival), `cap` (tc tbf both ways),
`delay` (added TCP latency: a user-space proxy in each host, delay_proxy.py), `clear`. Processes
start inside a host with `ip netns exec`; `Host.thread_in` runs a function in a
thread that entered the host's namespace (HTTP polls of a peer's 127.0.0.1 port). Needs root.
`Lab.close()` removes what the lab made; `sweep_stale()` removes namespaces of dead sessions.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from delay_proxy import DelayProxies

PREFIX = "phxlab"
SUBNET = "10.77.0"  # private; reachable only inside this lab's namespaces
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone (a session killed before its cleanup),
    and the processes left inside them."""
    removed = []
    for name in sh("ip", "netns", "list", check=False).stdout.split():
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _alive(int(parts[1])):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():  # peers it left running
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(name: str) -> None:
    """Move the calling thread (only it) into namespace `name`."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


@dataclass
class Host:
    """One network host: namespace `netns`, address `ip`, link `veth` on the bridge side."""

    lab: "Lab"
    index: int
    name: str
    netns: str
    ip: str
    veth: str
    procs: list[subprocess.Popen] = field(default_factory=list)

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


class Lab:
    """Hosts on one bridge. Use as a context manager or call `close()`; idempotent."""

    def __init__(self, names: list[str], tag: str = "s") -> None:
        self.id = f"{PREFIX}-{os.getpid()}-{tag}"
        self.bridge_ns = f"{self.id}-br"
        self.hosts: dict[str, Host] = {}
        self._rules: list[tuple[Host, list[str]]] = []
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
        if len(names) > 250:
            raise ValueError("a lab has at most 250 hosts")
        sh("ip", "netns", "add", self.bridge_ns)
        sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, name in enumerate(names, start=1):
            host = Host(self, i, name, f"{self.id}-{i}", f"{SUBNET}.{i}", f"v{i}")
            self.hosts[name] = host
            sh("ip", "netns", "add", host.netns)
            # both ends are made inside the lab's namespaces: no interface name in the machine's own
            sh("ip", "-n", self.bridge_ns, "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            sh("ip", "-n", self.bridge_ns, "link", "set", host.veth, "master", "br0", "up")
            sh("ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            sh("ip", "-n", host.netns, "link", "set", "lo", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ---- faults ---------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Partition `name` from everyone: its link goes down at the bridge (no RST, no ICMP)."""
        sh("ip", "-n", self.bridge_ns, "link", "set", self.hosts[name].veth, "down")

    def heal(self, name: str) -> None:
        sh("ip", "-n", self.bridge_ns, "link", "set", self.hosts[name].veth, "up")

    def _iptables(self, host: Host, rule: list[str]) -> None:
        host.run("iptables", "-w", "-A", *rule)
        self._rules.append((host, rule))

    def split(self, side_a: list[str], side_b: list[str]) -> None:
        """Drop every packet between the two sides (each side still reaches itself). Packets are
        dropped on arrival, as a broken network does: a sender sees silence, not a local error."""
        for mine, theirs in ((side_a, side_b), (side_b, side_a)):
            for name in mine:
                for other in theirs:
                    self._iptables(self.hosts[name], ["INPUT", "-i", "eth0", "-s", self.hosts[other].ip, "-j", "DROP"])

    def block_port(self, name: str, port: int) -> None:
        """A firewall on `name`: TCP to `port` arriving there is dropped (the sender sees silence)."""
        self._iptables(self.hosts[name], ["INPUT", "-i", "eth0", "-p", "tcp", "--dport", str(port), "-j", "DROP"])

    def loss(self, name: str, pct: float) -> None:
        """Drop `pct` % of the packets on `name`'s link in each direction, independently at random:
        on arrival at `name`, and on arrival elsewhere of what `name` sent."""
        if not 0 < pct < 100:
            raise ValueError(f"loss pct must be in (0, 100), got {pct}")
        random_drop = ["-m", "statistic", "--mode", "random", "--probability", f"{pct / 100:.6f}", "-j", "DROP"]
        lossy = self.hosts[name]
        self._iptables(lossy, ["INPUT", "-i", "eth0", *random_drop])
        for other in self.hosts.values():
            if other is not lossy:
                self._iptables(other, ["INPUT", "-i", "eth0", "-s", lossy.ip, *random_drop])

    def cap(self, name: str, mbit: float) -> None:
        """Shape `name`'s link to `mbit` Mbit/s each way (tc tbf on both ends of its veth)."""
        host = self.hosts[name]
        rate = f"{int(mbit * 1000)}kbit"
        burst = f"{max(16, int(mbit * 1000 / 8 / 100))}kb"  # ~10 ms of traffic, at least a few packets
        host.run("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst, "latency", "200ms")
        sh("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "replace", "dev", host.veth, "root", "tbf", "rate", rate, "burst", burst, "latency", "200ms")

    def delay(self, name: str, one_way_s: Optional[float]) -> None:
        """Add `one_way_s` of latency each way to every TCP connection `name` takes part in (A to B
        sees d_A + d_B each way, the connect included); 0 keeps the proxy in the path without delay,
        None removes it. Transparent to the host's processes; see delay_proxy.py."""
        from delay_proxy import DelayProxies

        if self.delay_proxies is None:
            self.delay_proxies = DelayProxies(self)
        self.delay_proxies.set(name, one_way_s)

    def clear(self, name: Optional[str] = None) -> None:
        """Undo every fault on `name` (every host when None): link up, no rules, no shaping, no delay."""
        for host in [self.hosts[name]] if name else list(self.hosts.values()):
            if self.delay_proxies is not None and host.name in self.delay_proxies.delays:
                self.delay_proxies.set(host.name, None)
            self.heal(host.name)
            for rule_host, rule in [r for r in self._rules if r[0] is host or host.ip in r[1]]:
                rule_host.run("iptables", "-w", "-D", *rule, check=False)
                self._rules.remove((rule_host, rule))
            host.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            sh("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "del", "dev", host.veth, "root", check=False)

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

"""A peer asks its router to forward its port (UPnP, NAT-PMP) only when it listens beyond loopback. A
peer on loopback (a local swarm, the tests') once searched for a router anyway: SSDP multicast on the
machine's LAN and a NAT-PMP request to its gateway, packets off a machine that asked for none. Each peer
runs alone in a home of the lab (a default route through its router), whose outgoing packets beyond
loopback are counted."""

from __future__ import annotations

import os
import time

import pytest

from phalanx.peer.ports import maps_ports
from phalanx.tools.lab.hosts import Lab

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEARCH_S = 10.0  # after the peer trains: go-libp2p searches for a router as its host starts


def test_maps_ports_only_beyond_loopback():
    assert not maps_ports(["/ip4/127.0.0.1/tcp/0"])
    assert not maps_ports(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"])
    assert maps_ports(["/ip4/0.0.0.0/tcp/31337"])
    assert maps_ports(["/ip4/127.0.0.1/tcp/0", "/ip4/10.78.1.2/tcp/0"])
    assert maps_ports(["/dns4/example.org/tcp/31337"])


def _sent_off_loopback(home, listen: str, workdir) -> dict[str, int]:
    """Packets a lone peer listening on `listen` sent beyond loopback: all of them, and those to a router's
    port-mapping services (SSDP 1900, NAT-PMP 5351)."""
    rules = {"all": ["!", "-o", "lo"], "port mapping": ["-p", "udp", "-m", "multiport", "--dports", "1900,5351"]}
    for spec in rules.values():
        home.run("iptables", "-w", "-A", "OUTPUT", *spec)
    log = workdir / f"{listen.split('/')[2]}.log"
    argv = ["join", "--task", "digits-mlp", "--host-maddrs", listen, "--http-port", "0", "--steps", "100000"]
    proc = home.fork_phalanx(argv, {**os.environ, "PHALANX_TORCH_THREADS": "1"}, log, workdir)
    try:
        deadline = time.monotonic() + 120
        while "training digits-mlp" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(SEARCH_S)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    counters = home.run("iptables", "-w", "-L", "OUTPUT", "-v", "-x", "-n").stdout.splitlines()[2:]
    for spec in rules.values():
        home.run("iptables", "-w", "-D", "OUTPUT", *spec)
    return {name: int(line.split()[0]) for name, line in zip(rules, counters, strict=True)}


def test_a_peer_on_loopback_sends_nothing_off_it_and_one_on_its_lan_asks_its_router(lab_machine, tmp_path):
    lab = Lab(["pub"], tag="pm")
    try:
        home = lab.add_home("home")
        on_loopback = _sent_off_loopback(home, "/ip4/127.0.0.1/tcp/0", tmp_path)
        on_lan = _sent_off_loopback(home, f"/ip4/{home.ip}/tcp/0", tmp_path)
    finally:
        lab.close()
    print(f"packets beyond loopback: listening on loopback {on_loopback}, on the home's LAN {on_lan}")
    assert on_loopback == {"all": 0, "port mapping": 0}, on_loopback
    assert on_lan["port mapping"] > 0, on_lan  # the counting works: the same peer on its LAN asks the router

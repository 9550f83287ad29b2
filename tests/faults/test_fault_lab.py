"""The lab itself: hosts reach each other over the bridge only, each fault does what it says, and
closing leaves nothing behind."""

import socket
import threading
import time

import pytest

from phalanx.tools.lab.hosts import Lab, sh

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PORT = 40000


def serve_tcp(host, ready: threading.Event, stop: threading.Event) -> None:
    def run() -> None:
        with socket.create_server(("0.0.0.0", PORT)) as server:
            server.settimeout(0.2)
            ready.set()
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                conn.close()

    host.thread_in(run, "tcp-server")
    assert ready.wait(10)


def can_connect(host, ip: str) -> bool:
    result = {}

    def run() -> None:
        try:
            socket.create_connection((ip, PORT), timeout=1.0).close()
            result["ok"] = True
        except OSError:
            result["ok"] = False

    host.thread_in(run, "tcp-client").join(10)
    return result.get("ok", False)  # a client thread still blocked after 10 s did not connect


def reaches(host, ip: str, tries: int = 20) -> bool:
    """`host` connects to `ip` within `tries` attempts: a link just brought up (or a bridge port still
    learning) may refuse the first ones on a loaded machine; a cut link refuses them all."""
    for _ in range(tries):
        if can_connect(host, ip):
            return True
        time.sleep(0.25)
    return False


def send_datagrams(sender, ip: str, count: int) -> None:
    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(count):
                s.sendto(b"x", (ip, PORT + 1))

    sender.thread_in(send, "udp-tx").join(30)


def dropped_by_statistic_rule(host, chain: str) -> int:
    """Packets the lab's random-drop rule in `chain` dropped (iptables' own counter)."""
    out = host.run("iptables", "-w", "-L", chain, "-v", "-x", "-n").stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if "statistic" in line)


@pytest.fixture
def lab(lab_machine):
    with Lab(["a", "b", "c"], tag="unit") as lab:
        yield lab
    assert not lab.namespaces_left()


def test_hosts_reach_each_other_and_a_cut_host_reaches_nobody_until_healed(lab):
    stop = threading.Event()
    serve_tcp(lab["b"], threading.Event(), stop)
    try:
        assert reaches(lab["a"], lab["b"].ip)
        lab.cut("b")
        assert not can_connect(lab["a"], lab["b"].ip)
        assert not can_connect(lab["c"], lab["b"].ip)
        lab.heal("b")
        assert reaches(lab["a"], lab["b"].ip)
    finally:
        stop.set()


def test_a_split_drops_traffic_between_the_sides_only(lab):
    stop = threading.Event()
    serve_tcp(lab["b"], threading.Event(), stop)
    try:
        lab.split(["a"], ["b", "c"])
        assert not can_connect(lab["a"], lab["b"].ip)
        assert reaches(lab["c"], lab["b"].ip)
        lab.clear()
        assert reaches(lab["a"], lab["b"].ip)
    finally:
        stop.set()


def test_loss_drops_about_the_asked_share_and_clear_removes_it(lab):
    lab.loss("a", 20)
    send_datagrams(lab["a"], lab["b"].ip, 4000)
    dropped = dropped_by_statistic_rule(lab["b"], "INPUT")  # what a sent is dropped where it arrives
    assert 0.10 * 4000 < dropped < 0.30 * 4000  # 20 % ± 10 points: > 15 standard deviations
    lab.clear("a")
    assert not any("statistic" in lab[h].run("iptables", "-S").stdout for h in ("a", "b", "c"))


def test_cap_shapes_both_ends_of_the_link(lab):
    lab.cap("a", 10)
    assert "tbf" in lab["a"].run("tc", "qdisc", "show", "dev", "eth0").stdout
    assert "rate 10Mbit" in sh("ip", "netns", "exec", lab.bridge_ns, "tc", "qdisc", "show", "dev", lab["a"].veth).stdout
    lab.clear("a")
    assert "tbf" not in lab["a"].run("tc", "qdisc", "show", "dev", "eth0").stdout


def test_close_kills_processes_started_in_a_host_and_deletes_every_namespace(lab_machine):
    lab = Lab(["a"], tag="close")
    proc = lab["a"].popen(["sleep", "600"])
    deadline = time.monotonic() + 60  # `ip netns exec` enters the namespace after Popen returns
    while lab.leftover_processes() != [proc.pid] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lab.leftover_processes() == [proc.pid]
    lab.close()
    assert proc.poll() is not None
    assert not lab.namespaces_left()

"""`phalanx doctor` from a host of its own against a bootstrap on another: what passes on a healthy
network, and the row and fix for a firewalled data port and for an unreachable bootstrap."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.security.identity import Identity
from phalanx.tools.lab.hosts import Lab

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

P2P_PORT, DIRECT_PORT = 31337, 31338


def _doctor(lab: Lab, *args: str) -> dict:
    done = lab["me"].run(
        sys.executable, "-m", "phalanx", "doctor", "--host-maddrs", f"/ip4/{lab['me'].ip}/tcp/0",
        "--direct-port", str(DIRECT_PORT), "--json", *args, check=False,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    assert done.returncode == (0 if report["ok"] else 1)
    return {row["check"]: row for row in report["rows"]}


@pytest.fixture
def lab(lab_machine, tmp_path):
    with Lab(["boot", "me"], tag="dr") as lab:
        identity = tmp_path / "boot.id"
        peer_id = Identity.generate_ed25519(identity).peer_id
        log = open(tmp_path / "boot.log", "wb")
        lab["boot"].popen(
            [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", f"/ip4/{lab['boot'].ip}/tcp/{P2P_PORT}",
             "--identity-path", str(identity)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 120
        while "--initial-peers" not in Path(log.name).read_text():
            assert time.monotonic() < deadline, Path(log.name).read_text()[-2000:]
            time.sleep(0.2)
        lab.initial_peer = f"/ip4/{lab['boot'].ip}/tcp/{P2P_PORT}/p2p/{peer_id}"
        yield lab


def test_doctor_on_separate_hosts(lab):
    rows = _doctor(lab, "--initial-peers", lab.initial_peer)
    assert [r["check"] for r in rows.values() if r["status"] == "fail"] == []
    boot = "…" + lab.initial_peer[-8:]
    assert rows["direct data port from outside"]["detail"] == f"{boot} connected to --direct-port {DIRECT_PORT} at {lab['me'].ip}:{DIRECT_PORT}"

    lab.block_port("me", DIRECT_PORT)  # libp2p gets through; the data port does not
    rows = _doctor(lab, "--initial-peers", lab.initial_peer)
    assert [r["check"] for r in rows.values() if r["status"] == "fail"] == ["direct data port from outside"]
    row = rows["direct data port from outside"]
    assert row["detail"] == (
        f"{boot} could not connect to --direct-port {DIRECT_PORT} at {lab['me'].ip}:{DIRECT_PORT}: no answer within 3 s"
    )
    assert row["fix"].startswith(f"open TCP --direct-port {DIRECT_PORT} in this machine's firewall")
    assert "--no-direct" in row["fix"]

    lab.cut("boot")  # packets to the bootstrap vanish: no refusal, a timeout
    rows = _doctor(lab, "--initial-peers", lab.initial_peer)
    tcp = rows[f"initial peer {boot}: tcp"]
    assert tcp["status"] == "fail" and tcp["detail"].startswith(f"cannot connect to {lab['boot'].ip}:{P2P_PORT}")
    assert rows["initial peers"]["detail"] == "none of the 1 answered a DHT ping"
    assert rows["direct data port from outside"]["status"] == "skip"

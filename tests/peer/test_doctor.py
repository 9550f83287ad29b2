"""`phalanx doctor` and join's preflight: pure checks on crafted inputs, then the real CLI against a
live swarm on loopback (a bootstrap and one slowed trainer, shared by the module), a dead address,
an address without /p2p, a busy data port and a peer whose clock is off."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx.peer.config import PROTOCOL_VERSION, PeerConfig
from phalanx.peer.health.record import HealthRecord
from phalanx.peer.plan import make_plan
from phalanx.security.identity import (
    Identity,
    read_varint,
)
from phalanx.tools.doctor import autonat
from phalanx.tools.doctor.local import identity_row, multiaddr_row, port_rows, task_rows
from phalanx.tools.doctor.rows import exit_code
from phalanx.tools.doctor.swarm import CLOCK_FIX, clock_row, swarm_rows
from tests.peer.health.health_swarm import free_port, get_json, wait_until
from tests.procs import LOOPBACK, FileProc, spawn_to_files

PEER = "QmaDnkJn14L31L9kNtpb1q1BjmENLgXCn6hcG7FqP4Gcyn"
OTHER = "QmBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"


# ---- pure checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offsets, strict, status, words",
    [
        ({}, False, "skip", "SKIPPED: no peer answered a ping"),
        ({PEER: 2.0, OTHER: -0.5}, True, "pass", "peer …FqP4Gcyn is 2.0 s ahead of this machine (largest of 2)"),
        ({PEER: -60.0}, False, "warn", "peer …FqP4Gcyn is 60.0 s behind this machine"),
        ({PEER: 60.0}, True, "warn", "over 300 s, --verify and --admission runs refuse its statements"),
        ({PEER: 600.0}, False, "warn", "this run would refuse it with --verify or --admission"),
        ({PEER: 600.0, OTHER: 1.0}, True, "fail", "verified runs and certificates refuse anything over 300 s off"),
        ({OTHER: -301.0}, True, "fail", "is 301.0 s behind this machine"),
    ],
)
def test_clock_row_from_injected_offsets(offsets, strict, status, words):
    row = clock_row(offsets, strict=strict)
    assert (row.status, row.check) == (status, "clock")
    assert words in row.detail
    assert row.fix == ("" if status in ("pass", "skip") else CLOCK_FIX)


@pytest.mark.parametrize(
    "addr, detail, fix",
    [
        ("/ip4/127.0.0.1/tcp/31337", "has no /p2p/<peer id> part", "append /p2p/<the peer's ID>"),
        ("/ip4/127.0.0.1/tcp/31337/p2p/Qmnotapeerid", "not a multiaddr (", "use the form /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW…"),
        ("/ip4/300.0.0.1/tcp/1/p2p/" + PEER, "not a multiaddr", "use the form /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW…"),
        (f"/p2p/{PEER}", "names no host and port", f"use the form /ip4/1.2.3.4/tcp/31337/p2p/{PEER}"),
    ],
)
def test_malformed_initial_peer_addresses_fail_with_the_fix(addr, detail, fix):
    row = multiaddr_row(addr)
    assert row.status == "fail"
    assert row.detail.startswith(detail) and row.fix.startswith(fix)


@pytest.mark.parametrize(
    "addr, where",
    [("/ip4/127.0.0.1/tcp/31337", "127.0.0.1:31337"), ("/dns4/example.org/tcp/1", "example.org:1"), ("/ip4/1.2.3.4/udp/1/quic-v1", "1.2.3.4:1")],
)
def test_a_full_initial_peer_address_passes(addr, where):
    row = multiaddr_row(f"{addr}/p2p/{PEER}")
    assert (row.check, row.status) == ("initial peer …FqP4Gcyn: address", "pass")
    assert row.detail.endswith(f"peer …FqP4Gcyn at {where}")


def test_a_busy_direct_port_fails_and_names_the_flag():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        rows = port_rows(PeerConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], direct_port=port))
    direct = next(r for r in rows if r.check == "direct data port")
    assert direct.status == "fail"
    assert direct.detail == f"127.0.0.1:{port} is in use by another process"
    assert direct.fix.startswith("pick another --direct-port (0: any free port)")
    assert exit_code(rows) == 1


def test_identity_rows(tmp_path):
    garbage = tmp_path / "garbage.id"
    garbage.write_bytes(b"not a key")
    row = identity_row(PeerConfig(identity_path=garbage))
    assert row.status == "fail" and "cannot read a libp2p private key" in row.detail
    row = identity_row(PeerConfig(identity_path=tmp_path / "missing" / "me.id"))
    assert (row.status, row.detail) == ("fail", f"directory {str(tmp_path / 'missing')!r} does not exist")
    assert identity_row(PeerConfig(identity_path=tmp_path / "new.id")).status == "pass"


def test_task_without_its_data_fails_with_the_fix(tmp_path):
    rows = {r.check: r for r in task_rows(PeerConfig(task="mnist-cnn", data_dir=tmp_path))}
    assert rows["task"].status == "fail" and "train-images-idx3-ubyte" in rows["task"].detail
    assert rows["device"].status == "pass" and rows["checkpoint disk"].status == "pass"


@pytest.mark.parametrize(
    ("settings", "status", "text"),
    [
        ({"task": "tiny-gpt", "target_loss": 2.6}, "pass", "validation loss ≤ 2.6"),
        ({"target_accuracy": 0.9}, "pass", "test accuracy ≥ 0.9"),
        (
            {"task": "tiny-gpt", "target_accuracy": 0.5},
            "fail",
            "target: --target-accuracy 0.5: task tiny-gpt is judged by its validation loss (lower is better), not its "
            "test accuracy; use --target-loss",
        ),
    ],
)
def test_the_target_is_in_the_tasks_metric(settings, status, text):
    row = next(r for r in task_rows(PeerConfig(**settings)) if r.check == "target")
    assert row.status == status and (row.detail if status == "pass" else row.line()) == text


def test_checkpoint_disk_counts_the_kept_checkpoints(tmp_path):
    rows = {r.check: r for r in task_rows(PeerConfig(checkpoint_dir=tmp_path / "ckpt", checkpoint_keep=3))}
    assert rows["checkpoint disk"].status == "pass" and "MiB needed)" in rows["checkpoint disk"].detail


def test_a_missing_gpu_fails_the_device_row():
    import torch

    if torch.cuda.is_available():
        pytest.skip("SKIPPED: this machine has a CUDA GPU, so --device cuda is usable here")
    row = next(r for r in task_rows(PeerConfig(device="cuda")) if r.check == "device")
    assert (row.status, row.detail) == ("fail", "this machine has no CUDA GPU visible to torch")
    assert row.fix.startswith("--device cuda is not usable here: use --device cpu or auto")


def _hash(settings: PeerConfig) -> str:
    return make_plan(settings).run_hash.hex()


def _record(peer: str, **changes) -> HealthRecord:
    fields = dict(
        peer_id=peer, role="trainer", state="online", version="0.1.0", protocol=PROTOCOL_VERSION, run_id="phalanx",
        config_hash=_hash(PeerConfig()), published_at=0.0, started_at=0.0, addresses=[],
        reachability="direct", step=1, samples_per_s=1.0,
    )  # fmt: skip
    return HealthRecord(**{**fields, **changes})


def test_swarm_rows_compare_protocol_and_run_config():
    records = {PEER: _record(PEER), OTHER: _record(OTHER, role="bootstrap", config_hash="")}
    rows = {r.check: r for r in swarm_rows(records, PeerConfig(), _hash(PeerConfig()))}
    assert rows["protocol version"].status == rows["run config"].status == "pass"
    assert rows["run config"].detail.endswith("as all 1 trainers in view")
    changed = PeerConfig(lr=0.5)
    other = PROTOCOL_VERSION + 1
    rows = {r.check: r for r in swarm_rows({PEER: _record(PEER, protocol=other)}, changed, _hash(changed))}
    detail = rows["protocol version"].detail
    assert rows["protocol version"].status == "fail"
    assert f"speak protocol {other} (e.g. …FqP4Gcyn), this install {PROTOCOL_VERSION}" in detail
    assert rows["run config"].status == "fail" and rows["run config"].fix.startswith("peers group only with the same --task")


def test_autonat_messages_round_trip():
    framed = autonat.encode_dial(b"\x00\x24" + b"k" * 36, [b"\x04\x7f\x00\x00\x01\x06\x7a\x69"])
    length, pos = read_varint(framed, 0)
    assert pos + length == len(framed)
    top = dict(autonat._fields(framed[pos:]))
    assert top[1] == 0  # DIAL
    # what a hivemind p2pd answers a peer on loopback (observed on the wire)
    reply = autonat.decode_response(b";\x08\x01\x1a7\x08e\x123refusing to dial peer with blocked observed address")
    assert (reply.status, reply.text, reply.addr) == (autonat.E_DIAL_REFUSED, "refusing to dial peer with blocked observed address", None)


@pytest.mark.parametrize("framed", [b"", b"\x05\x08\x01", b"\x02\x08\x00", b"\x80\x80\x80", b"\x03\x08\x01\x1a"])
def test_malformed_autonat_responses_are_refused(framed):
    with pytest.raises(ValueError):
        autonat.decode_response(framed)


# ---- the real CLI ---------------------------------------------------------------------------

def doctor(*args: str, json_out: bool = True) -> tuple[int, dict | str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "doctor", *([] if "--host-maddrs" in args else ["--host-maddrs", LOOPBACK]), *args, *(["--json"] if json_out else [])],
        capture_output=True, text=True, timeout=240, start_new_session=True,
        env={**os.environ, "PHALANX_TORCH_THREADS": "1"},
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, (json.loads(done.stdout) if json_out else done.stdout), done.stderr


def by_check(report: dict) -> dict[str, dict]:
    return {row["check"]: row for row in report["rows"]}


@dataclass(frozen=True)
class LiveSwarm:
    initial_peers: str  # the bootstrap's --initial-peers value
    bootstrap_identity: Path


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A bootstrap and one trainer (slowed down: it trains alone for the whole module)."""
    workdir = tmp_path_factory.mktemp("doctor-swarm")
    procs: list[FileProc] = []
    try:
        boot = spawn_to_files("bootstrap", ["bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(workdir / "b.id")], workdir)
        procs.append(boot)
        line = wait_until(lambda: next((x for x in boot.stdout.read_text().splitlines() if x.startswith("--initial-peers ")), None), "the --initial-peers line", procs)
        initial_peers = line.split(maxsplit=1)[1]
        port = free_port()
        trainer = spawn_to_files("trainer", ["join", "--initial-peers", initial_peers, "--host-maddrs", LOOPBACK, "--http-port", str(port), "--slowdown", "const:0.5"], workdir, port)
        procs.append(trainer)
        # its HTTP server opens after its first health record is stored
        wait_until(lambda: get_json(trainer.url + "/api/v1/status")[1]["peer_id"], "the trainer's status", procs)
        yield LiveSwarm(initial_peers, workdir / "b.id")
    finally:
        for p in procs:
            p.terminate()
        for p in reversed(procs):
            p.stop()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_healthy_swarm_passes_every_row(swarm, tmp_path):
    Identity.generate_ed25519(tmp_path / "me.id")
    code, report, _ = doctor("--initial-peers", swarm.initial_peers, "--identity-path", str(tmp_path / "me.id"))
    assert code == 0 and report["ok"], report
    assert [r for r in report["rows"] if r["status"] != "pass"] == []
    rows = by_check(report)
    peer = "…" + swarm.initial_peers.rsplit("/p2p/", 1)[1][-8:]
    for stage in ("address", "tcp", "libp2p", "dht ping"):
        assert f"initial peer {peer}: {stage}" in rows
    assert rows["reachable from outside"]["detail"].startswith("local network:")
    direct = rows["direct data port from outside"]["detail"]  # the bootstrap dialed it back
    assert direct.startswith(f"{peer} connected to port ") and "(any free one, as --direct-port 0 picks) at 127.0.0.1:" in direct
    assert rows["run config"]["detail"].endswith("as all 1 trainers in view")
    assert rows["identity free"]["detail"].startswith("no live peer of the swarm runs as")
    assert rows["target"]["detail"] == "none: trains until --steps or stopped (judged by its test accuracy)"
    code, table, _ = doctor("--initial-peers", swarm.initial_peers, json_out=False)
    assert code == 0 and "19 checks, 0 failed" in table


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_identity_of_a_live_peer_fails_its_row(swarm):
    """The restart-after-kill-9 case: another process still runs as this identity file's peer."""
    code, report, _ = doctor("--initial-peers", swarm.initial_peers, "--identity-path", str(swarm.bootstrap_identity))
    assert code == 1
    failing = [r for r in report["rows"] if r["status"] != "pass"]
    assert [r["check"] for r in failing] == ["identity free"]
    assert failing[0]["detail"] == f"a live peer already runs as {swarm.initial_peers.rsplit('/p2p/', 1)[1]} (this file's ID)"
    assert failing[0]["fix"].startswith("stop that peer first (after a kill -9, its DHT process and p2pd may still run")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_other_run_flags_fail_the_run_config_row(swarm):
    code, report, _ = doctor("--initial-peers", swarm.initial_peers, "--lr", "0.5")
    assert code == 1
    failing = [r for r in report["rows"] if r["status"] != "pass"]
    assert [r["check"] for r in failing] == ["run config"]
    assert failing[0]["fix"].startswith("peers group only with the same --task")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_busy_data_port_fails_its_row(swarm):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, report, _ = doctor("--initial-peers", swarm.initial_peers, "--direct-port", str(port))
    assert code == 1
    outside = by_check(report)["direct data port from outside"]
    assert outside["detail"] == f"SKIPPED: cannot listen on --direct-port {port} (see the direct data port row)"
    failing = [r for r in report["rows"] if r["status"] not in ("pass", "skip")]
    assert failing == [
        {
            "check": "direct data port",
            "status": "fail",
            "detail": f"127.0.0.1:{port} is in use by another process",
            "fix": f"pick another --direct-port (0: any free port), or stop what holds it (ss -ltnp 'sport = :{port}')",
        }
    ]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_busy_libp2p_port_fails_the_daemon_row_and_checks_the_peers_anyway(swarm):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, report, _ = doctor("--initial-peers", swarm.initial_peers, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert code == 1
    rows = by_check(report)
    assert rows["libp2p port"]["detail"] == f"127.0.0.1:{port} is in use by another process"
    daemon = rows["p2p daemon"]
    assert daemon["status"] == "fail" and "address already in use" in daemon["detail"]
    assert daemon["fix"] == "another process holds the libp2p port: pick another --port / --host-maddrs (0: any free port)"
    assert rows["p2p daemon on a free port"]["status"] == "pass"
    assert [r["check"] for r in report["rows"] if r["status"] != "pass"] == ["libp2p port", "p2p daemon"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_dead_bootstrap_address_fails_tcp_and_skips_the_rest_loudly():
    port = free_port()  # nothing listens there once the probe socket closed
    code, report, _ = doctor("--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}")
    assert code == 1
    rows = by_check(report)
    tcp = rows["initial peer …FqP4Gcyn: tcp"]
    assert (tcp["status"], tcp["detail"]) == ("fail", f"cannot connect to 127.0.0.1:{port}: Connection refused")
    assert "copy the whole --initial-peers line that `phalanx bootstrap` printed" in tcp["fix"]
    assert rows["initial peer …FqP4Gcyn: libp2p"]["detail"] == "SKIPPED: no TCP connection"
    assert (rows["initial peers"]["status"], rows["initial peers"]["detail"]) == ("fail", "none of the 1 answered a DHT ping")
    assert rows["clock"]["status"] == rows["reachable from outside"]["status"] == "skip"
    assert rows["direct data port from outside"]["status"] == "skip"


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_address_without_peer_id_fails_its_row():
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}"
    code, report, _ = doctor("--initial-peers", addr)
    assert code == 1
    row = by_check(report)[f"initial peer {addr}: address"]
    assert (row["status"], row["detail"]) == ("fail", "has no /p2p/<peer id> part (libp2p cannot verify whom it reaches)")
    assert row["fix"] == "append /p2p/<the peer's ID>: copy the whole --initial-peers line that `phalanx bootstrap` printed"
    assert by_check(report)["initial peers"]["detail"] == "none of the 1 answered a DHT ping"


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_peer_with_a_skewed_clock(tmp_path):
    """A peer whose DHT answers with a clock 10 minutes ahead: a verified run's doctor fails the clock
    row (such a peer's statements would be refused; a plain run's warns, see the injected offsets)."""
    out, err = tmp_path / "skewed.out", tmp_path / "skewed.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        popen = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("skewed_peer.py")), "600", "bootstrap", "--host-maddrs", LOOPBACK],
            stdout=stdout, stderr=stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )  # fmt: skip
    proc = FileProc("skewed", popen, out, err)
    try:
        line = wait_until(lambda: next((x for x in out.read_text().splitlines() if x.startswith("--initial-peers ")), None), "the skewed peer's line", [proc])
        initial_peers = line.split(maxsplit=1)[1]
        code, report, _ = doctor("--initial-peers", initial_peers, "--verify")
        clock = by_check(report)["clock"]
        assert code == 1 and clock["status"] == "fail", report
        assert " s ahead of this machine (largest of 1); verified runs and certificates refuse anything over 300 s off" in clock["detail"]
        assert clock["fix"] == CLOCK_FIX
        assert [r["check"] for r in report["rows"] if r["status"] == "fail"] == ["clock"]
    finally:
        proc.stop()


# ---- join's preflight ------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["no_peer_id", "busy_direct_port"])
def test_join_stops_with_the_doctors_row(case):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        args, expected = {
            "no_peer_id": (
                ["--initial-peers", "/ip4/127.0.0.1/tcp/31337"],
                # refused at parse time, before the preflight (the same check guards health, monitor, bootstrap)
                "error: --initial-peers: '/ip4/127.0.0.1/tcp/31337' lacks the /p2p/<peer-id> part",
            ),
            "busy_direct_port": (
                ["--host-maddrs", LOOPBACK, "--direct-port", str(port)],
                f"error: direct data port: 127.0.0.1:{port} is in use by another process; pick another --direct-port",
            ),
        }[case]
        done = subprocess.run(
            [sys.executable, "-m", "phalanx", "join", *args], capture_output=True, text=True, timeout=240, start_new_session=True
        )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), done.stderr

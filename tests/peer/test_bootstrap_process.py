"""`phalanx bootstrap` as a real process: it must not outlive its DHT."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.procs import LOOPBACK, children, group_members, unix_socket_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_bootstrap_whose_dht_process_dies_exits_so_a_supervisor_restarts_it(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", LOOPBACK],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "log", "wb"), text=True, start_new_session=True,
    )  # fmt: skip
    sockets = set()
    try:
        for line in proc.stdout:
            if line.startswith("--initial-peers"):
                break
        sockets = unix_socket_files(proc.pid)
        dht_processes = children(proc.pid)
        assert dht_processes, "the bootstrap has no child process"
        for pid in dht_processes:
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(120) == 1
        assert "the DHT process died" in (tmp_path / "log").read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        while group_members(proc.pid):  # p2pd, which exits with its parent
            time.sleep(0.05)
        for leftover in sockets:  # p2pd leaves its socket file when its DHT process is killed
            leftover.unlink(missing_ok=True)


def test_a_trainer_started_before_its_bootstrap_waits_for_it_with_initial_peers_wait_s(tmp_path):
    """Peers started together (the launcher, compose) must not fail because the bootstrap is a moment late."""
    import socket

    from phalanx.security.identity import Identity

    boot_id = Identity.generate_ed25519(tmp_path / "boot.id")
    with socket.socket() as s:  # a port nobody listens on until the bootstrap takes it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "join.log"
    join = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "join", "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id.peer_id}",
         "--initial-peers-wait-s", "240", "--host-maddrs", LOOPBACK, "--steps", "1000000", "--events"],
        stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, start_new_session=True,
    )  # fmt: skip
    boot = None
    try:
        while "for an initial peer to accept connections" not in log.read_text():
            assert join.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        boot = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
             "--identity-path", str(tmp_path / "boot.id")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        for line in join.stdout:  # the trainer's first event comes once its DHT is up through the bootstrap
            if '"event": "started"' in line:
                break
        else:
            raise AssertionError(f"the trainer exited with {join.wait()}: {log.read_text()[-2000:]}")
    finally:
        for proc in (join, boot):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                while group_members(proc.pid):
                    time.sleep(0.05)


def test_sigterm_while_a_trainer_waits_for_its_initial_peers_stops_it_at_once(tmp_path):
    """`docker stop` or the launcher during a long --initial-peers-wait-s: nothing to save, so no waiting it out."""
    import socket

    from phalanx.security.identity import Identity

    absent = Identity.generate_ed25519(tmp_path / "absent.id")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "join.log"
    join = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "join", "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{absent.peer_id}",
         "--initial-peers-wait-s", "600", "--host-maddrs", LOOPBACK],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True,
    )  # fmt: skip
    try:
        while "for an initial peer to accept connections" not in log.read_text():
            assert join.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        join.send_signal(signal.SIGTERM)  # the main process only, as a supervisor sends it
        assert join.wait(timeout=100) == -signal.SIGTERM  # not the 600 s of the wait
        assert "SIGTERM before the peer was up: stopping now" in log.read_text()
        while group_members(join.pid):  # and nothing it started stays behind
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(join.pid, signal.SIGKILL)
        join.wait()


def test_a_sigkilled_bootstrap_and_trainer_leave_no_temporary_files(tmp_path, short_tmp):
    """A peer without --identity-path writes a throwaway key for p2pd to read at its start; it must be gone
    once the peer is up, so a kill -9 (which runs no cleanup) leaves nothing behind."""
    scratch = short_tmp  # the peers' temporary folders are made here, so the test can see them
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch), "PHALANX_TORCH_THREADS": "1"}
    boot = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", LOOPBACK],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "boot.log", "wb"), text=True, start_new_session=True, env=env,
    )  # fmt: skip
    procs = [boot]
    try:
        initial = next(line.strip() for line in boot.stdout if line.startswith("--initial-peers"))
        join = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "join", *initial.split(), "--host-maddrs", LOOPBACK, "--steps", "1000000",
             "--events"],
            stdout=subprocess.PIPE, stderr=open(tmp_path / "join.log", "wb"), text=True, start_new_session=True, env=env,
        )  # fmt: skip
        procs.append(join)
        assert any('"event": "started"' in line for line in join.stdout), (tmp_path / "join.log").read_text()[-3000:]
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            while group_members(proc.pid):  # its DHT process and p2pd, which exit with it
                time.sleep(0.05)
        # ours only: multiprocessing's and torch's shared-memory folders (pymp-*, torch-shm-*) are theirs to sweep
        assert [p.name for p in scratch.iterdir() if p.name.startswith("phalanx-")] == []
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

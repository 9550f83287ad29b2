"""A SIGKILLed peer's helper processes (DHT process, p2pd, torch's shared-memory manager) die with it,
so the same volunteer can start again right away."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import hivemind
import pytest

from tests.peer.trainer_procs import join_args
from tests.procs import LOOPBACK, descendants, spawn_events, unix_socket_files, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GONE_WITHIN_S = 60  # a generous bound on the wait, not a timing goal: the watch polls every 0.5 s

ORPHAN = textwrap.dedent(
    """
    import os, sys, time
    from phalanx.peer.lifeline import exit_with_parent
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        exit_with_parent(parent, lambda: open(sys.argv[1], "w").write("cleaned up"), poll_s=0.05)
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
    """
)


def _names(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    return names


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_child_runs_its_cleanup_and_exits_when_its_parent_is_killed(tmp_path):
    marker = tmp_path / "marker"
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(marker)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child = int(parent.stdout.readline())
        assert descendants(parent.pid) == [child]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert wait_gone([child], GONE_WITHIN_S) == []
        assert marker.read_text() == "cleaned up"
    finally:
        _kill_session(parent.pid)


@pytest.fixture
def bootstrap():
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    yield [str(m) for m in dht.get_visible_maddrs()]
    dht.shutdown()


def test_a_sigkilled_trainer_leaves_no_process_and_restarts_under_its_identity(bootstrap, tmp_path):
    args = join_args(bootstrap, tmp_path, "a", "--steps", "1000000", "--eval-every", "1000000")
    first = spawn_events(args, tmp_path / "first.log")
    again = None
    try:
        first.next_event("step", where=lambda e: e["step"] >= 5)
        helpers = descendants(first.popen.pid)
        names = _names(helpers)
        assert "p2pd" in names and len(helpers) >= 2, names  # the DHT process and its p2pd at least
        daemon_sockets = [s for s in unix_socket_files(first.popen.pid) if s.name.startswith("hivemind-p2pd-")]
        assert daemon_sockets
        os.kill(first.popen.pid, signal.SIGKILL)  # the main process only, as the OOM killer does
        first.popen.wait()
        left = wait_gone(helpers, GONE_WITHIN_S)
        assert not left, f"{_names(left)} outlived the trainer's main process"
        assert not [s for s in daemon_sockets if s.exists()], "the dead trainer's p2pd left its socket file"
        assert "is gone; exiting with it" in first.tail(20000)
        # The bootstrap still knows the identity's peer ID; nothing answers for it any more.
        again = spawn_events(args, tmp_path / "again.log")
        again.next_event("step", where=lambda e: e["step"] >= 5)
        assert "already taken" not in again.tail(20000)
    finally:
        for proc in (first, again):
            if proc is not None:
                proc.kill()


def test_a_sigkilled_bootstrap_leaves_no_process(tmp_path):
    cmd = [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(tmp_path / "b.id")]
    log = open(tmp_path / "log", "wb")
    procs = []
    try:
        for _ in range(2):  # the second run takes the first one's identity
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
            procs.append(proc)
            for line in proc.stdout:
                if line.startswith("--initial-peers"):
                    break
            else:
                raise AssertionError(f"the bootstrap exited early:\n{(tmp_path / 'log').read_text()[-3000:]}")
            helpers = descendants(proc.pid)
            assert "p2pd" in _names(helpers), _names(helpers)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            left = wait_gone(helpers, GONE_WITHIN_S)
            assert not left, f"{_names(left)} outlived the bootstrap's main process"
    finally:
        for proc in procs:
            _kill_session(proc.pid)
            proc.wait()
        log.close()

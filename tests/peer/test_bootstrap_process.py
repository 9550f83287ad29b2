"""`phalanx bootstrap` as a real process: it must not outlive its DHT."""

import os
import signal
import subprocess
import sys
import time

import pytest
from trainer_procs import LOOPBACK, children, group_members, unix_socket_files

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

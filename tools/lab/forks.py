"""Peers (and scripts) forked from one zygote per process, for the lab and the tests: a fresh `python -m
phalanx` spends about 5 CPU-seconds importing torch and hivemind before it does anything, and a lab swarm
starts five or more peers on a 2-core machine. The zygote is the launcher's
(`phalanx.tools.launcher.zygote`); this is its client for code without an event loop, with what the
callers use of `subprocess.Popen`. A fork can run inside a lab host's network namespace (`netns=`)."""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

from phalanx.tools.launcher.zygote import command as zygote_command
from phalanx.tools.launcher.zygote import control_pair

READY_S = 120.0  # for the zygote's imports, on a loaded machine


class ForkedPopen:
    """A peer or script forked by the zygote."""

    def __init__(self, pid: int, zygote: "ForkServer", stdout=None) -> None:
        self.pid, self.stdout, self._zygote = pid, stdout, zygote

    @property
    def returncode(self) -> Optional[int]:
        return self._zygote.exit_code(self.pid)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(["phalanx"], timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One zygote process, started here and closed at exit: closing its control socket makes it stop every
    child still running."""

    def __init__(self) -> None:
        self._control, theirs = control_pair()
        self.log = Path(tempfile.gettempdir()) / f"phalanx-zygote-{os.getpid()}.log"
        with open(self.log, "wb") as log:
            self._process = subprocess.Popen(zygote_command(theirs.fileno()), stdout=subprocess.PIPE, stderr=log, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._ready = threading.Event()
        self._pids: queue.Queue[int] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._lock = threading.Lock()  # one request at a time: pids come back in request order
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set()
            elif "pid" in message:
                self._pids.put(message["pid"])
            elif "exited" in message:
                with self._changed:
                    self._exits[message["exited"]] = message["code"]
                    self._changed.notify_all()
        self._ready.set()  # gone: spawn says so instead of waiting, and so do the waits
        self._process.wait()
        with self._changed:
            self._changed.notify_all()

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def exit_code(self, pid: int) -> Optional[int]:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._process.poll() is not None, timeout)
            return self._exits.get(pid)

    def spawn(
        self, argv: list[str], env: dict[str, str], stdout_fd: int, log: Optional[Path], stdout=None, **options: str
    ) -> ForkedPopen:
        """Fork `phalanx *argv` with `env` as its whole environment, stdout on `stdout_fd`, stderr into `log`
        (None: into stdout). `options`: the zygote's optional fields (`script`, `cwd`, `netns`)."""
        if not (self._ready.wait(READY_S) and self.running):
            raise RuntimeError(f"the zygote process is gone: {self.log.read_text()[-2000:]}")
        request = json.dumps({"argv": argv, "env": env, "log": None if log is None else str(log), **options}).encode()
        with self._lock:
            socket.send_fds(self._control, [request], [stdout_fd])
            pid = self._pids.get(timeout=60)
        return ForkedPopen(pid, self, stdout)

    def close(self) -> None:
        self._control.close()
        try:
            self._process.wait(60)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self.log.unlink(missing_ok=True)


_server: Optional[ForkServer] = None
_server_lock = threading.Lock()


def zygote() -> ForkServer:
    """This process's zygote, started at the first call (again if it died), closed at exit."""
    global _server
    with _server_lock:
        if _server is None or not _server.running:
            _server = ForkServer()
            atexit.register(_server.close)
        return _server

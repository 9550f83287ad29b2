"""Processes that tests start and stop, shared by every folder: `phalanx` peers and helper scripts, each
in a session of its own and stopped with its whole process group (its DHT process and p2pd daemon too),
and the process table read from /proc.

Two kinds of peer process: an `EventProc` prints JSON events (`--events`) that a thread reads from its
stdout into a queue; a `FileProc` writes stdout and stderr to files and may serve HTTP on a port. Both
are forks of one zygote per test session (phalanx.tools.lab.forks), which has imported torch and
hivemind once: a fresh `python -m phalanx` spends about 5 CPU-seconds on that, and most tests start
several peers on 2 cores. A fork runs the same CLI `main` in a session of its own."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from phalanx.tools.lab.forks import ForkedPopen, zygote
from phalanx.tools.lab.procs import alive, descendants, processes  # noqa: F401 (helpers of the tests too)

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
PEER_ENV = {"PYTHONUNBUFFERED": "1", "PHALANX_TORCH_THREADS": "1"}


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a helper script run by its path: the repository first on PYTHONPATH, so the
    script imports `tests.…` helpers as the tests do."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def signal_group(pgid: int, sig: int) -> None:
    """Signal process group `pgid`; nothing if it is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# ---- the process table --------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The process IDs whose parent is `pid`."""
    return [p for p, _, ppid, _ in processes() if ppid == pid]


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a zombie is gone, only not yet reaped)."""
    return [p for p, state, _, pgrp in processes() if pgrp == pgid and state != "Z"]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Poll until none of `pids` is alive (zombies count as gone); returns those still alive at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        running = {p for p, state, _, _ in processes() if state != "Z"}
        left = [p for p in pids if p in running]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def unix_socket_files(pgid: int) -> set[Path]:
    """The files of the unix sockets that the processes of group `pgid` hold (p2pd's, its clients')."""
    inodes = set()
    for pid in group_members(pgid):
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    files = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            files.add(Path(fields[7]))
    return files


# ---- a peer whose stdout is JSON events ---------------------------------------------------------


@dataclass
class EventProc:
    popen: subprocess.Popen | ForkedPopen
    log: Path
    events: queue.Queue[dict] = field(default_factory=queue.Queue)
    seen: list = field(default_factory=list)

    def next_event(self, kind: str, timeout: float = 240.0, where=lambda e: True) -> dict:
        """Block until an event of `kind` that satisfies `where` arrives (timeout: the process is stuck)."""
        while True:
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {kind!r} event within {timeout} s; log:\n{self.tail()}") from None
            self.seen.append(event)
            if event.get("event") == kind and where(event):
                return event
            if event.get("event") == "exit":
                raise AssertionError(f"process exited before a {kind!r} event; log:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else ""

    def send(self, sig=signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the process group; returns the main process's exit code once the whole group is gone."""
        self.send(sig)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGUSR1)  # a trainer logs its tasks' and threads' stacks
            time.sleep(2)
            self.kill()
            raise AssertionError(f"no exit within {timeout} s of {sig!r}; log:\n{self.tail(20000)}") from None
        deadline = time.monotonic() + timeout
        while (left := group_members(self.popen.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)  # the DHT process and p2pd, which got the signal too
        self.kill()
        assert not left, f"processes {left} of the group outlived {sig!r} by {timeout} s"
        return code

    def kill(self) -> None:
        signal_group(self.popen.pid, signal.SIGKILL)  # the DHT process and p2pd too
        self.popen.wait()


def spawn_events(args: list[str], log: Path) -> EventProc:
    """`phalanx *args` (pass `--events`): its JSON events into `.events`, its stderr into `log`."""
    read_end, write_end = os.pipe()
    try:
        popen = zygote().spawn(list(args), {**os.environ, **PEER_ENV}, write_end, log, os.fdopen(read_end, "rb"))
    finally:
        os.close(write_end)  # the fork holds its own copy: EOF once it and its helpers exit
    proc = EventProc(popen, log)

    def pump() -> None:
        with popen.stdout:
            for line in popen.stdout:
                try:
                    proc.events.put(json.loads(line))
                except ValueError:
                    pass
        proc.events.put({"event": "exit"})

    threading.Thread(target=pump, daemon=True).start()
    return proc


# ---- a peer with its output in files (and maybe an HTTP port) -----------------------------------


@dataclass
class FileProc:
    name: str
    popen: subprocess.Popen | ForkedPopen
    stdout: Path
    stderr: Path
    http_port: Optional[int] = None
    peer_id: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def logs(self) -> str:
        return f"--- {self.name} stderr ---\n" + (self.stderr.read_text()[-3000:] if self.stderr.exists() else "")

    def terminate(self) -> None:
        signal_group(self.popen.pid, signal.SIGTERM)

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            signal_group(self.popen.pid, sig)  # the whole group: its DHT process and p2pd too
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        signal_group(self.popen.pid, signal.SIGKILL)  # leftovers of the group after a clean exit


def spawn_to_files(
    name: str,
    args: list[str],
    workdir: Path,
    http_port: Optional[int] = None,
    *,
    command: Sequence[str] = ("-m", "phalanx"),
) -> FileProc:
    """`python *command *args`, forked from the zygote: `phalanx` unless `command` names a script (and its
    own arguments) that runs it its own way; output in workdir/NAME.out and workdir/NAME.err."""
    out, err = workdir / f"{name}.out", workdir / f"{name}.err"
    script = {} if tuple(command) == ("-m", "phalanx") else {"script": command[0]}
    argv = [*command[1:], *args] if script else list(args)
    with open(out, "wb") as stdout:  # the child keeps its own descriptor
        popen = zygote().spawn(argv, {**os.environ, **PEER_ENV}, stdout.fileno(), err, **script)
    return FileProc(name, popen, out, err, http_port)


# ---- user scripts ------------------------------------------------------------------------------


def start_script(args: list[str], log: Path, cwd: Optional[Path] = None, fresh: bool = False) -> subprocess.Popen | ForkedPopen:
    """A user's Python script (`args` after the interpreter) in a session of its own, output to `log`;
    it can import `tests.…` helpers. A fork of the zygote (torch and hivemind imported once), or with
    `fresh` an interpreter of its own: what a user runs, for the examples' own tests."""
    env = script_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if not fresh:
        with log.open("wb") as out:  # the fork keeps its own descriptor
            return zygote().spawn(args[1:], env, out.fileno(), None, script=args[0], cwd=None if cwd is None else str(cwd))
    return subprocess.Popen(
        [sys.executable, *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )


def wait_scripts(procs: list[subprocess.Popen | ForkedPopen], logs: list[Path], timeout: float = 400) -> None:
    """Each script exits 0 and leaves no process of its group behind (its DHT process, p2pd); killed otherwise."""
    try:
        for p, log in zip(procs, logs, strict=True):
            assert p.wait(timeout) == 0, log.read_text()[-3000:]
        for p in procs:
            assert not group_members(p.pid), f"processes {group_members(p.pid)} outlived their script"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

"""Start real `phalanx` processes on loopback and read their JSON events (helpers for tests)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass
class Proc:
    popen: subprocess.Popen
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
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # the DHT process and p2pd too
        except ProcessLookupError:
            pass
        self.popen.wait()


def spawn(args: list[str], log: Path) -> Proc:
    out = open(log, "wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "phalanx", *args],
        stdout=subprocess.PIPE,
        stderr=out,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PHALANX_TORCH_THREADS": "1"},
        start_new_session=True,
    )
    proc = Proc(popen, log)

    def pump() -> None:
        for line in popen.stdout:
            try:
                proc.events.put(json.loads(line))
            except ValueError:
                pass
        proc.events.put({"event": "exit"})
        out.close()

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _processes():
    """(pid, state, parent pid, process group) of every process, from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # exited meanwhile
        yield int(stat.parent.name), state, int(ppid), int(pgrp)


def children(pid: int) -> list[int]:
    """The process IDs whose parent is `pid`."""
    return [p for p, _, ppid, _ in _processes() if ppid == pid]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, whatever its session (torch's shared-memory manager has its own)."""
    table = [(p, state, ppid) for p, state, ppid, _ in _processes()]
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, state, ppid in table if ppid in frontier and state != "Z"]
        found += below
        frontier = below
    return found


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Poll until none of `pids` is alive (zombies count as gone); returns those still alive at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {p for p, state, _, _ in _processes() if state != "Z"}
        left = [p for p in pids if p in alive]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a zombie is gone, only not yet reaped)."""
    return [p for p, state, _, pgrp in _processes() if pgrp == pgid and state != "Z"]


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


def join_args(initial_peers: list[str], tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "join", "--initial-peers", *initial_peers, "--host-maddrs", LOOPBACK,
        "--identity-path", str(tmp / f"{name}.id"), "--events", *extra,
    ]  # fmt: skip


def start_script(args: list[str], log: Path, cwd: Optional[Path] = None) -> subprocess.Popen:
    """A user's Python script (`args` after the interpreter) in a session of its own, output to `log`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )


def wait_scripts(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 400) -> None:
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


def load_example(name: str):
    """examples/<name>.py as a module (the tests' user scripts reuse its model and data)."""
    import importlib.util

    path = Path(__file__).parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""Helpers for the health tests: real `phalanx` processes on loopback, each stopped with its process
group (DHT process and p2pd daemon included), and HTTP reads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
WAIT_S = 180.0  # generous: a slow CI machine, not a performance check


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(url: str) -> tuple[int, Any]:
    status, body = http_get(url)
    return status, json.loads(body)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
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
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.popen.pid, sig)  # the whole group: its DHT process and p2pd too
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # leftovers of the group after a clean exit
        except ProcessLookupError:
            pass


def spawn(name: str, args: list[str], workdir: Path, http_port: Optional[int] = None) -> Proc:
    out, err = workdir / f"{name}.out", workdir / f"{name}.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:  # the child keeps its own descriptors
        popen = subprocess.Popen(
            [sys.executable, "-m", "phalanx", *args],
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PHALANX_TORCH_THREADS": "1"},
            start_new_session=True,
        )
    return Proc(name, popen, out, err, http_port)


def wait_until(predicate, what: str, procs: list[Proc], timeout_s: float = WAIT_S, every_s: float = 0.5):
    """Poll `predicate` until it returns something truthy; fail with the processes' logs if it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p in procs:
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited with {p.popen.returncode} while waiting for {what}\n{p.logs()}")
        try:
            value = predicate()
        except (OSError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}\n" + "\n".join(p.logs() for p in procs))
        time.sleep(every_s)


@dataclass
class Swarm:
    workdir: Path
    initial_peers: list[str]
    bootstrap: Proc
    trainers: list[Proc]
    monitor: Proc
    procs: list[Proc] = field(default_factory=list)

    @property
    def peer_ids(self) -> set[str]:
        return {self.bootstrap.peer_id, *(t.peer_id for t in self.trainers)}

"""Helpers for the health tests: waiting on real `phalanx` processes on loopback (tests.procs starts
them), and HTTP reads."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.procs import FileProc

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


def wait_until(predicate, what: str, procs: list[FileProc], timeout_s: float = WAIT_S, every_s: float = 0.5):
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
    bootstrap: FileProc
    trainers: list[FileProc]
    monitor: FileProc
    procs: list[FileProc] = field(default_factory=list)

    @property
    def peer_ids(self) -> set[str]:
        return {self.bootstrap.peer_id, *(t.peer_id for t in self.trainers)}

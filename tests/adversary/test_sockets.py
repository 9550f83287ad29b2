"""Raw sockets against a live trainer's direct data port (docs/threat-model.md, "Outsiders").

Before the port was capped, 5,000 connections left 2,643 open in the trainer (file descriptors 29 →
2,675), each silent one for 60 s. Now it holds at most its caps, and training goes on meanwhile."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest

from phalanx.protocol.transport import MAX_DIRECT_SERVED, MAX_PENDING_HELLOS
from tests.adversary.live_swarm import open_live_swarm
from tests.peer.health.health_swarm import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CONNECTIONS = 5000
BATCH = 100  # the listen backlog is 128: a bigger burst is dropped by the kernel before the trainer sees it
ROUNDS = 20  # rounds every trainer completes while the connections are held


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_thousands_of_connections_leave_a_trainers_descriptors_capped_and_training_going(tmp_path):
    with open_live_swarm(tmp_path, trainers=2) as swarm:
        victim = swarm.trainers[0]
        host, port = swarm.status(victim)["direct_addresses"][0].rsplit(":", 1)
        before = _fds(victim.popen.pid)
        rounds = {t.name: swarm.status(t)["rounds"]["ok"] for t in swarm.trainers}
        held: list[socket.socket] = []
        most = before
        try:
            while len(held) < CONNECTIONS:
                for _ in range(BATCH):
                    s = socket.socket()
                    s.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        s.connect((host, int(port)))
                    held.append(s)
                most = max(most, _fds(victim.popen.pid))

            def trained() -> bool:
                nonlocal most
                most = max(most, _fds(victim.popen.pid))
                return all(swarm.status(t)["rounds"]["ok"] >= rounds[t.name] + ROUNDS for t in swarm.trainers)

            wait_until(trained, f"{ROUNDS} rounds of every trainer while {CONNECTIONS} connections are held", swarm.procs)
            refused = swarm.status(victim)["transport"]["direct_refused"]
        finally:
            for s in held:
                s.close()
        # its own connections besides: p2pd's, the other trainer's kept direct connections (a handful)
        assert most - before <= MAX_PENDING_HELLOS + 16, f"{before} descriptors before, {most} while flooded"
        assert MAX_PENDING_HELLOS + MAX_DIRECT_SERVED < 1024  # the documented bound stays under a default ulimit
        assert refused > 0

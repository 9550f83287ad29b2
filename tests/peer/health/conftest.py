"""A small live swarm for the health tests: a bootstrap, two trainers and a monitor as real `phalanx`
processes on loopback, each with its HTTP server on a free port, stopped at the end of the module."""

import pytest

from tests.peer.health.health_swarm import Swarm, free_port, get_json, http_get, wait_until
from tests.procs import LOOPBACK, FileProc, spawn_to_files


@pytest.fixture(scope="module")
def live_swarm(tmp_path_factory):
    """Bootstrap + 2 trainers (each ready: a round completed) + monitor, all logging JSON."""
    workdir = tmp_path_factory.mktemp("health-swarm")
    procs: list[FileProc] = []
    try:
        port = free_port()
        boot = spawn_to_files(
            "bootstrap",
            [
                "--log-format",
                "json",
                "bootstrap",
                "--host-maddrs",
                LOOPBACK,
                "--identity-path",
                str(workdir / "bootstrap.id"),
                "--http-port",
                str(port),
            ],
            workdir,
            port,
        )
        procs.append(boot)
        line = wait_until(
            lambda: next((x for x in boot.stdout.read_text().splitlines() if x.startswith("--initial-peers ")), None),
            "the bootstrap's --initial-peers line",
            procs,
        )
        initial_peers = line.split(maxsplit=1)[1].split(",")
        trainers = []
        for name in ("trainer-a", "trainer-b"):
            port = free_port()
            t = spawn_to_files(
                name,
                [
                    "--log-format",
                    "json",
                    "join",
                    "--initial-peers",
                    ",".join(initial_peers),
                    "--host-maddrs",
                    LOOPBACK,
                    "--identity-path",
                    str(workdir / f"{name}.id"),
                    "--http-port",
                    str(port),
                    "--wait-for-peers",
                    "2",
                    "--eval-every",
                    "10",
                ],  # fmt: skip
                workdir,
                port,
            )
            procs.append(t)
            trainers.append(t)
        port = free_port()
        monitor = spawn_to_files(
            "monitor",
            [
                "--log-format",
                "json",
                "monitor",
                "--initial-peers",
                ",".join(initial_peers),
                "--host-maddrs",
                LOOPBACK,
                "--http-port",
                str(port),
                "--poll-s",
                "1",
            ],
            workdir,
            port,
        )
        procs.append(monitor)
        for p in (boot, *trainers):
            p.peer_id = wait_until(
                lambda p=p: get_json(p.url + "/api/v1/status")[1]["peer_id"], f"{p.name}'s status", procs
            )
        for t in trainers:  # ready = connected, a round completed, legal
            wait_until(lambda t=t: http_get(t.url + "/readyz")[0] == 200, f"{t.name} ready", procs)
        yield Swarm(workdir, initial_peers, boot, trainers, monitor, procs)
    finally:
        for p in procs:  # all at once: trainers that lose their partner mid-round must not wait for each other's stop
            p.terminate()
        for p in reversed(procs):
            p.stop()

"""A swarm becomes one swarm again after losing its bootstrap: real processes on loopback.

The bootstrap is SIGKILLed (its whole process group) and restarted on the same identity and port
knowing nobody; the trainers re-dial it, so it re-learns them, and a newcomer joining through it
trains with them. Durations are printed (pytest -s), not asserted: the checks are what each peer sees.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # health_swarm

from health_swarm import Proc, free_port, get_json, spawn, wait_until  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _bootstrap(workdir: Path, port: int, http_port: int, name: str) -> Proc:
    args = ["--log-format", "json", "bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
            "--identity-path", str(workdir / "bootstrap.id"), "--http-port", str(http_port)]  # fmt: skip
    return spawn(name, args, workdir, http_port)


def _trainer(workdir: Path, name: str, initial_peers: list[str]) -> Proc:
    port = free_port()
    args = ["--log-format", "json", "join", "--initial-peers", ",".join(initial_peers), "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0", "--identity-path", str(workdir / f"{name}.id"), "--http-port", str(port),
            "--wait-for-peers", "2", "--eval-every", "1000"]  # fmt: skip
    return spawn(name, args, workdir, port)


def _trainers_seen(proc: Proc) -> set[str]:
    records = get_json(proc.url + "/api/v1/status")[1]["health_records"]
    return {p for p, r in records.items() if r["role"] == "trainer" and r["state"] != "offline"}


def _last_group(proc: Proc) -> set[str]:
    last = get_json(proc.url + "/api/v1/status")[1]["last_round"]
    return set(last["members"]) if last else set()


def test_a_restarted_bootstrap_relearns_the_trainers_and_a_newcomer_through_it_joins_them(tmp_path):
    procs: list[Proc] = []
    try:
        port, http_port = free_port(), free_port()
        boot = _bootstrap(tmp_path, port, http_port, "bootstrap")
        procs.append(boot)
        boot_id = wait_until(lambda: get_json(boot.url + "/api/v1/status")[1]["peer_id"], "bootstrap up", procs)
        initial_peers = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"]
        trainers = [_trainer(tmp_path, name, initial_peers) for name in ("trainer-a", "trainer-b")]
        procs += trainers
        ids = {t.name: wait_until(lambda t=t: get_json(t.url + "/api/v1/status")[1]["peer_id"], t.name, procs)
               for t in trainers}  # fmt: skip
        wait_until(lambda: all(_last_group(t) == set(ids.values()) for t in trainers), "a round of both", procs)
        wait_until(lambda: _trainers_seen(boot) == set(ids.values()), "the bootstrap sees both trainers", procs)

        boot.popen.send_signal(signal.SIGKILL)  # then the rest of its group, as a crash or OOM kill leaves it
        boot.stop()
        procs.remove(boot)
        time.sleep(20)  # longer than every record's TTL: the trainers' routing tables dropped the bootstrap
        restarted = time.monotonic()
        boot = _bootstrap(tmp_path, port, http_port, "bootstrap-restarted")  # knows no peer at all
        procs.append(boot)
        wait_until(lambda: get_json(boot.url + "/api/v1/status")[1]["peer_id"] == boot_id, "bootstrap back", procs)
        up = time.monotonic()
        wait_until(lambda: _trainers_seen(boot) == set(ids.values()), "the restarted bootstrap sees both", procs)
        relearned_s = time.monotonic() - up

        newcomer = _trainer(tmp_path, "newcomer", initial_peers)  # knows the bootstrap only
        procs.append(newcomer)
        new_id = wait_until(lambda: get_json(newcomer.url + "/api/v1/status")[1]["peer_id"], "newcomer", procs)
        newcomer_up = time.monotonic()
        everyone = {*ids.values(), new_id}
        wait_until(lambda: _last_group(newcomer) == everyone, "a round of the newcomer with both trainers", procs)
        newcomer_s = time.monotonic() - newcomer_up
        for t in trainers:
            wait_until(lambda t=t: _last_group(t) == everyone, f"{t.name} trains with the newcomer", procs)
        wait_until(lambda: _trainers_seen(boot) == everyone, "the bootstrap lists every trainer", procs)
        print(f"restarted bootstrap (up after {up - restarted:.1f} s) saw both trainers {relearned_s:.1f} s after it was "
              f"up; the newcomer's first round with them came {newcomer_s:.1f} s after its HTTP was up")  # fmt: skip
    finally:
        for p in procs:
            p.terminate()
        for p in reversed(procs):
            p.stop()

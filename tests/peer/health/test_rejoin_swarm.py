"""A swarm becomes one swarm again after losing its bootstrap: real processes on loopback.

The bootstrap is SIGKILLed (its whole process group) and restarted on the same identity and port
knowing nobody; the trainers re-dial it, so it re-learns them, and a newcomer joining through it
trains with them. A trainer frozen (SIGSTOP) until the others dropped it answers 503 on waking and
is ready again once it trained with them. Durations are printed (pytest -s), not asserted.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.peer.health.health_swarm import free_port, get_json, http_get, wait_until
from tests.procs import FileProc, spawn_to_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _bootstrap(workdir: Path, port: int, http_port: int, name: str) -> FileProc:
    args = ["--log-format", "json", "bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
            "--identity-path", str(workdir / "bootstrap.id"), "--http-port", str(http_port)]  # fmt: skip
    return spawn_to_files(name, args, workdir, http_port)


def _trainer(workdir: Path, name: str, initial_peers: list[str]) -> FileProc:
    port = free_port()
    args = ["--log-format", "json", "join", "--initial-peers", ",".join(initial_peers), "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0", "--identity-path", str(workdir / f"{name}.id"), "--http-port", str(port),
            "--wait-for-peers", "2", "--eval-every", "1000"]  # fmt: skip
    return spawn_to_files(name, args, workdir, port)


def _trainers_seen(proc: FileProc) -> set[str]:
    records = get_json(proc.url + "/api/v1/status")[1]["health_records"]
    return {p for p, r in records.items() if r["role"] == "trainer" and r["state"] != "offline"}


def _last_group(proc: FileProc) -> set[str]:
    last = get_json(proc.url + "/api/v1/status")[1]["last_round"]
    return set(last["members"]) if last else set()


def test_a_restarted_bootstrap_relearns_the_trainers_and_a_newcomer_through_it_joins_them(tmp_path):
    procs: list[FileProc] = []
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


def test_a_trainer_frozen_long_enough_to_be_dropped_is_unready_then_rejoins_the_others(tmp_path):
    procs: list[FileProc] = []
    try:
        port, http_port = free_port(), free_port()
        boot = _bootstrap(tmp_path, port, http_port, "bootstrap")
        procs.append(boot)
        boot_id = wait_until(lambda: get_json(boot.url + "/api/v1/status")[1]["peer_id"], "bootstrap up", procs)
        initial_peers = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"]
        trainers = [_trainer(tmp_path, name, initial_peers) for name in ("trainer-a", "trainer-b", "trainer-c")]
        procs += trainers
        ids = {t.name: wait_until(lambda t=t: get_json(t.url + "/api/v1/status")[1]["peer_id"], t.name, procs)
               for t in trainers}  # fmt: skip
        everyone = set(ids.values())
        wait_until(lambda: all(_last_group(t) == everyone for t in trainers), "a round of all three", procs)
        frozen = trainers[2]
        wait_until(lambda: http_get(frozen.url + "/readyz")[0] == 200, "the trainer to freeze is ready", procs)

        frozen.popen.send_signal(signal.SIGSTOP)  # the main process only: its DHT process keeps answering
        stopped = time.time()
        try:
            others = set(ids.values()) - {ids[frozen.name]}
            wait_until(lambda: all(_last_group(t) == others for t in trainers[:2]), "the others train on", procs)
            time.sleep(20)  # long enough for its records to expire everywhere
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(http_get, frozen.url + "/readyz", 60.0)  # answered once it wakes up
                time.sleep(1)
                frozen.popen.send_signal(signal.SIGCONT)
                woke = time.monotonic()
                status, body = pending.result()
        finally:
            frozen.popen.send_signal(signal.SIGCONT)
        assert status == 503, body  # its own record is stale: it does not claim readiness on waking
        wait_until(
            lambda: _last_round_after(frozen, stopped) == everyone, "the woken trainer trains with the others", procs
        )
        wait_until(lambda: http_get(frozen.url + "/readyz")[0] == 200, "the woken trainer is ready again", procs)
        print(f"woken trainer ready again {time.monotonic() - woke:.1f} s after SIGCONT")
    finally:
        for p in procs:
            p.popen.send_signal(signal.SIGCONT)
            p.terminate()
        for p in reversed(procs):
            p.stop()


def _last_round_after(proc: FileProc, t: float) -> set[str]:
    last = get_json(proc.url + "/api/v1/status")[1]["last_round"]
    return set(last["members"]) if last and last["finished_at"] > t else set()

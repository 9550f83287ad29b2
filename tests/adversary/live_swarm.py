"""A live swarm to attack: a bootstrap and trainers as real `phalanx` processes on loopback (public, or
private with an owner's certificates), possibly with a patched trainer among them; an attacker's own DHT
node; and the checks that the swarm did not notice: every trainer still sees every other, is ready, and
trains in one group."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import hivemind

from phalanx.security.admission import generate_owner_key, issue, load_owner_private
from phalanx.security.identity import Identity
from tests.peer.health.health_swarm import free_port, get_json, http_get, wait_until
from tests.procs import LOOPBACK, FileProc, spawn_to_files

REREADS = 4  # membership reads every trainer makes after an attack before it is judged (one every 2 s)


@dataclass
class LiveSwarm:
    workdir: Path
    initial_peers: list[str]
    bootstrap: FileProc
    trainers: list[FileProc]  # the honest ones
    run_key: str  # phalanx.<run id>.<config hash prefix>: what an outsider reads off /api/v1/status
    run_id: str
    attacker: Optional[FileProc] = None  # a patched trainer, if any

    @property
    def procs(self) -> list[FileProc]:
        return [self.bootstrap, *self.trainers, *([self.attacker] if self.attacker is not None else [])]

    def events(self, trainer: FileProc, kind: str) -> list[dict]:
        """The trainer's `--events` of `kind` so far."""
        lines = trainer.stdout.read_text().splitlines()
        return [e for e in map(_json_or_none, lines) if e is not None and e.get("event") == kind]

    def status(self, trainer: FileProc) -> dict:
        return get_json(trainer.url + "/api/v1/status")[1]

    def reads(self) -> dict[str, int]:
        return {t.name: self.status(t)["membership_reads"]["refreshes"] for t in self.trainers}

    def assert_whole(self) -> None:
        """Every trainer sees all trainers (and no one else), is ready and reports no split."""
        ids = {t.peer_id for t in self.trainers}
        for t in self.trainers:
            s = self.status(t)
            assert set(s["membership"]) == ids, f"{t.name} sees {sorted(s['membership'])}, not the {len(ids)} trainers"
            assert s["peers_seen"] == len(ids), f"{t.name}: peers_seen {s['peers_seen']}"
            assert s["ready"], f"{t.name} not ready: {s['not_ready_because']}"
            assert not [p for p in s["swarm"]["problems"] if "split" in p], f"{t.name}: {s['swarm']['problems']}"

    def hold_whole(self, rereads: int = REREADS) -> None:
        """Check `assert_whole` at every poll until each trainer re-read the membership `rereads` times,
        then that the trainers still train together (each completes another round with all of them)."""
        start, rounds = self.reads(), {t.name: self.status(t)["rounds"]["ok"] for t in self.trainers}

        def done() -> bool:
            self.assert_whole()
            return all(n >= start[name] + rereads for name, n in self.reads().items())

        wait_until(done, f"{rereads} membership reads after the attack", self.procs)

        def trained_together() -> bool:
            self.assert_whole()
            statuses = {t.name: self.status(t) for t in self.trainers}
            return all(
                s["rounds"]["ok"] > rounds[name] and s["rounds"]["last_group_size"] == len(self.trainers)
                for name, s in statuses.items()
            )

        wait_until(trained_together, "a round of all trainers after the attack", self.procs)


@contextlib.contextmanager
def open_live_swarm(
    workdir: Path,
    trainers: int = 3,
    *,
    private: bool = False,
    args: tuple[str, ...] = (),
    attacker: Optional[list[str]] = None,
    attacker_args: tuple[str, ...] = (),
) -> Iterator[LiveSwarm]:
    """Bootstrap + `trainers` honest trainers (digits-mlp, sync, `args` added), each ready; with `private`,
    each holds the owner's certificate and refuses peers without one. `attacker`: the command line of one
    more trainer that runs instead of `python -m phalanx` (a patched joiner), started with the others and
    given the same flags and `attacker_args`."""
    procs: list[FileProc] = []
    try:
        port = free_port()
        boot = spawn_to_files(
            "bootstrap",
            ["--log-format", "json", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(workdir / "bootstrap.id"), "--http-port", str(port)],
            workdir, port,
        )  # fmt: skip
        procs.append(boot)
        line = wait_until(
            lambda: next((x for x in boot.stdout.read_text().splitlines() if x.startswith("--initial-peers ")), None),
            "the bootstrap's --initial-peers line",
            procs,
        )
        initial_peers = line.split(maxsplit=1)[1].split(",")
        private_flags: list[str] = []
        if private:
            generate_owner_key(workdir / "owner.key", workdir / "owner.pub")
            private_flags = ["--admission", str(workdir / "owner.pub")]
        started, bad = [], None
        everyone = trainers + (attacker is not None)
        for i in range(everyone):
            name, port = f"trainer-{i}" if i < trainers else "attacker", free_port()
            identity = workdir / f"{name}.id"
            flags = [*private_flags, *args]
            # made here so the attacker's id is known even if it is banned before its status is read
            peer_id = Identity.generate_ed25519(identity).peer_id
            if private:
                (workdir / f"{name}.cert").write_bytes(issue(load_owner_private(workdir / "owner.key"), peer_id, "phalanx", 3600))
                flags += ["--certificate", str(workdir / f"{name}.cert")]
            join = [
                "--log-format", "json", "join", "--initial-peers", ",".join(initial_peers), "--host-maddrs", LOOPBACK,
                "--identity-path", str(identity), "--http-port", str(port), "--wait-for-peers", str(everyone),
                "--eval-every", "50", "--events", *flags,
            ]  # fmt: skip
            if i < trainers:
                started.append(spawn_to_files(name, join, workdir, port))
                procs.append(started[-1])
            else:
                bad = spawn_to_files(name, [*join, *attacker_args], workdir, port, command=attacker)
                procs.append(bad)
            procs[-1].peer_id = peer_id
        honest = [boot, *started]  # a patched trainer may be banned, and stop, before the others are ready
        boot.peer_id = wait_until(lambda: get_json(boot.url + "/api/v1/status")[1]["peer_id"], "the bootstrap's status", honest)
        for t in started:
            wait_until(lambda t=t: http_get(t.url + "/readyz")[0] == 200, f"{t.name} ready", honest)
            assert get_json(t.url + "/api/v1/status")[1]["peer_id"] == t.peer_id, f"{t.name} runs under another identity"
        status = get_json(started[0].url + "/api/v1/status")[1]
        run_key = f"phalanx.{status['run_id']}.{status['config_hash'][:16]}"
        swarm = LiveSwarm(workdir, initial_peers, boot, started, run_key, status["run_id"], bad)
        if bad is None:
            swarm.hold_whole(rereads=1)
        yield swarm
    finally:
        for p in procs:
            p.terminate()
        for p in reversed(procs):
            p.stop()


@contextlib.contextmanager
def open_attacker(initial_peers: list[str], identity: Optional[Path] = None) -> Iterator[hivemind.DHT]:
    """An outsider's DHT node: no validator, stores whatever it is told to, wherever it likes."""
    kwargs = {"identity_path": str(identity), "check_if_identity_free": False} if identity is not None else {}
    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=[LOOPBACK], start=True, **kwargs)
    try:
        yield dht
    finally:
        dht.shutdown()


def _json_or_none(line: str) -> Optional[dict]:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")
